"""Multi-turn environments (rltpu.data.envs): the episode layout, what the trainer trains on, the bundled
examples' rules, and config errors. Engine-level (no Ray): ``run_episodes`` drives the real JAX
sampler engine turn by turn and the real trainer engine recomputes the logprobs."""

from __future__ import annotations

import numpy as np
import pytest

from learner.trainer import TrainerEngine
from rltpu.config import ConfigError, ModelConfig, RunConfig, SamplerConfig, TrainerConfig
from rltpu.control.batch import build_train_batch, merge_generations, split_by_rank
from rltpu.data.char_tokenizer import CharTokenizer
from rltpu.data.synthetic import TASK_ALPHABET, make_example
from rltpu.data.envs.base import Renderer, load_env_class
from rltpu.data.envs.calculator import Calculator, evaluate
from rltpu.data.envs.episodes import deadline_call, direct_call, run_episodes
from rltpu.data.envs.guess import GuessNumber
from rltpu.models import jax_llama
from rltpu.sampling.engine import SamplerEngine

TOK = CharTokenizer(TASK_ALPHABET["calc"])
V = TOK.vocab_size
MCFG = ModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=64, init_std=0.2)
SCFG = SamplerConfig(group_size=2, max_new_tokens=4, batch_buckets=(8,), prompt_buckets=(8, 32), slots=8,
                     decode_chunk=4, kv_page_size=4)


class Chatty:
    """Answers every turn with the same observation, never done: every episode runs max_turns turns
    (a random model's completions would end a calculator episode early)."""

    def reset(self, example):
        return example["prompt"]

    def step(self, messages, completion):
        return "12=", 0.25, False


def _fake_generate(script: dict[int, list[int]], version_of_call: list[int]):
    """A generate whose completions are scripted per call (by row), version = call number."""
    calls = []

    def generate(prompts, n, seed):
        k = len(calls)
        calls.append((prompts, n))
        rows = len(prompts) * n
        comps = [script[k][r % len(script[k])] for r in range(rows)] if isinstance(script[k][0], list) else [script[k]] * rows
        T = max(map(len, comps))
        tokens = np.zeros((rows, T), np.int32)
        for r, c in enumerate(comps):
            tokens[r, :len(c)] = c
        P = max(map(len, prompts))
        prompt = np.zeros((rows, P), np.int32)
        pmask = np.zeros((rows, P), np.int32)
        for r in range(rows):
            p = prompts[r // n]
            prompt[r, P - len(p):], pmask[r, P - len(p):] = p, 1
        return {"prompt": prompt, "prompt_mask": pmask, "tokens": tokens,
                "logprobs": -np.arange(1, T + 1, dtype=np.float32)[None].repeat(rows, 0) * 0.1,
                "lengths": np.array([len(c) for c in comps]), "version": version_of_call[k], "seconds": 1.0}

    return generate, calls


def test_layout_by_hand_calculator_episode():
    """Call, tool result, answer: positions, masks, logprobs and per-turn versions by hand."""
    ex = {"id": 0, "prompt": "12*34=", "expression": "12*34", "answer": "408"}
    call = TOK.encode("<12*34", add_bos=False) + [TOK.eos_id]  # 7 tokens
    answer = TOK.encode("408", add_bos=False) + [TOK.eos_id]  # 4 tokens
    generate, calls = _fake_generate({0: call, 1: answer}, [5, 6])
    out = run_episodes(generate, [Calculator(), Calculator()], Renderer(TOK), [ex], 2, 0, max_turns=3, max_tokens=20,
                       max_context=32, call=direct_call)
    obs = TOK.encode("408=", add_bos=False)  # the tool's result
    # turn 0: one shared prompt, G=2; turn 1: each row's own history as its prompt
    assert calls[0] == ([TOK.encode("12*34=")], 2)
    assert calls[1][1] == 1 and calls[1][0][0] == TOK.encode("12*34=") + call + obs
    want = call + obs + answer
    n = len(want)
    np.testing.assert_array_equal(out["lengths"], [n, n])
    np.testing.assert_array_equal(out["tokens"][0, :n], want)
    assert (out["tokens"][:, n:] == TOK.pad_id).all()
    mask = [1] * len(call) + [0] * len(obs) + [1] * len(answer)
    np.testing.assert_array_equal(out["policy_mask"][0, :n], mask)
    assert (out["policy_mask"][:, n:] == 0).all()
    lp = np.concatenate([-np.arange(1, 8) * 0.1, np.zeros(len(obs)), -np.arange(1, 5) * 0.1]).astype(np.float32)
    np.testing.assert_allclose(out["logprobs"][0, :n], lp, rtol=0, atol=1e-7)
    np.testing.assert_array_equal(out["token_versions"][0, :n], [5] * 7 + [-1] * len(obs) + [6] * 4)
    np.testing.assert_array_equal(out["versions"], [5, 5])  # the oldest version a row holds
    np.testing.assert_array_equal(out["turns"], [2, 2])
    np.testing.assert_allclose(out["rewards"], [1.0, 1.0], rtol=1e-6)  # 0.2 x call + 0.8 x answer
    assert out["seconds"] == 2.0  # accounting summed over the turns


def test_turn_credit_layout_and_advantages_by_hand():
    """``env.credit: turn``: each policy token knows its turn, each turn its return-to-go, and the
    advantages are group-relative per turn: the call's reward does not reach the answer's tokens."""
    import torch

    from learner.losses import turn_advantages

    ex = {"id": 0, "prompt": "12*34=", "expression": "12*34", "answer": "408"}
    call = TOK.encode("<12*34", add_bos=False) + [TOK.eos_id]  # 7 tokens, a right call: 0.2
    bad = TOK.encode("<12*3", add_bos=False) + [TOK.eos_id]  # a wrong call: 0.2 x (0.25 + 0.75 x 3/5), ends
    answers = [TOK.encode("408", add_bos=False) + [TOK.eos_id], TOK.encode("4", add_bos=False) + [TOK.eos_id]]
    generate, _ = _fake_generate({0: [call, call, call, bad], 1: [answers[0], answers[1], answers[0]]}, [0, 0])
    out = run_episodes(generate, [Calculator() for _ in range(4)], Renderer(TOK), [ex], 4, 0, 3, 20, 32, direct_call)
    obs = 4  # '408='
    np.testing.assert_array_equal(out["turns"], [2, 2, 2, 1])
    np.testing.assert_array_equal(out["token_turns"][0, :7 + obs + 4], [0] * 7 + [-1] * obs + [1] * 4)
    np.testing.assert_array_equal(out["token_turns"][3, :7], [0] * 6 + [-1])  # 6 tokens, then padding
    wrong = 0.2 * (0.25 + 0.75 * 3 / 5)  # 3 of its digits in place (not the operator: a digit is missing)
    want = np.array([[1.0, 0.8], [0.2 + 0.8 / 3, 0.8 / 3], [1.0, 0.8], [wrong, 0.0]], np.float32)
    np.testing.assert_allclose(out["turn_returns"], np.pad(want, ((0, 0), (0, 1))), rtol=1e-6)  # max_turns=3
    np.testing.assert_allclose(out["rewards"], want[:, 0], rtol=1e-6)  # the episode's return is turn 0's
    # by hand: turn 0 over all four rows, turn 1 over the three that played it (sample std)
    g0, g1 = want[:, 0], want[:3, 1]
    a0 = (g0 - g0.mean()) / (g0.std(ddof=1) + 1e-6)
    a1 = (g1 - g1.mean()) / (g1.std(ddof=1) + 1e-6)
    gen = merge_generations([out], TOK.pad_id)
    batch = build_train_batch(gen, out["rewards"], 4, turn_credit=True)
    P = gen["prompt"].shape[1]
    adv = batch["advantages"][:, P:]
    for r in range(3):
        np.testing.assert_allclose(adv[r, :7], a0[r], rtol=1e-5)
        np.testing.assert_allclose(adv[r, 7 + obs:7 + obs + (4 if r != 1 else 2)], a1[r], rtol=1e-5)
        assert (adv[r, 7:7 + obs] == 0).all()
    np.testing.assert_allclose(adv[3, :6], a0[3], rtol=1e-5)
    assert (adv[3, 6:] == 0).all()
    # rows 0 and 2 answered alike after alike calls: the same advantage, whatever the call earned
    assert adv[0, 7 + obs] == adv[2, 7 + obs] > 0 > adv[1, 7 + obs]
    # one row alone at a turn, or a group all equal: no signal
    alone = turn_advantages(torch.tensor([[1.0, 0.5], [0.0, 0.0]]), torch.tensor([2, 1]),
                            torch.tensor([[0, 1], [0, -1]]), torch.ones(2, 2), 2)
    assert alone[0, 1] == 0 and alone[0, 0] > 0 > alone[1, 0]
    with pytest.raises(ValueError, match="no turn_returns"):
        build_train_batch({k: v for k, v in gen.items() if k != "turn_returns"}, out["rewards"], 4, turn_credit=True)


def test_lookup_tool_by_hand():
    """The lookup example: a call ('<' alone) gets the key's code and the call's share; the answer is
    graded against that code; anything else ends the episode at 0. Codes are uniform over their digits
    (so a policy cannot guess them), and the synthetic examples' answers are the tool's codes."""
    from collections import Counter

    from rltpu.data.envs.lookup import Lookup, code

    ex = make_example("lookup", 3, 0, 3, 3)
    assert ex["prompt"] == f"?{ex['key']}=" and len(ex["key"]) == 3 and ex["answer"] == code(ex["key"])
    env = Lookup()
    assert env.reset(ex) == ex["prompt"]
    obs, r, done = env.step([], "<")
    assert (obs, r, done) == (f"{ex['answer']}=", 0.2, False)
    wrong = ex["answer"][0] + ("0" if ex["answer"][1] != "0" else "1") + ex["answer"][2]
    assert env.step([], wrong) == (None, pytest.approx(0.8 * 2 / 3), True)
    env.reset(ex)
    assert env.step([], "<<") == (None, 0.0, True) and env.value is None  # not a call
    env.reset(ex)
    env.step([], "<")
    assert env.step([], ex["answer"]) == (None, pytest.approx(0.8), True)
    # the tool's table: deterministic, differs per table, each digit about uniform over 3000 keys
    assert code("574") == code("574") != code("574", table=1)
    counts = Counter(d for k in range(3000) for d in code(str(k)))
    assert set(counts) == set("0123456789") and max(counts.values()) < 1.15 * 900 and min(counts.values()) > 0.85 * 900
    with pytest.raises(ValueError, match="digits"):
        Lookup(digits=0)
    # without the tool's turn (max_turns=1), a call is all an episode can earn: at most its share
    tok = CharTokenizer(TASK_ALPHABET["lookup"])
    for first in ("<", ex["answer"], "<" + ex["answer"]):
        comp = tok.encode(first, add_bos=False) + [tok.eos_id]
        generate, _ = _fake_generate({0: comp}, [0])
        out = run_episodes(generate, [Lookup(), Lookup()], Renderer(tok), [ex], 2, 0, 1, 10, 16, direct_call)
        assert (out["rewards"] <= 0.2 + 1e-6).all() and (out["turns"] == 1).all()


def test_environment_tokens_carry_zero_loss_weight():
    """The trainer's batch masks observations out of the loss and the advantages, and its
    gradients do not change whatever those positions' advantages and old logprobs say."""
    ex = {"id": 0, "prompt": "12*34=", "expression": "12*34", "answer": "408"}
    call = TOK.encode("<12*34", add_bos=False) + [TOK.eos_id]
    answers = [TOK.encode("408", add_bos=False) + [TOK.eos_id], TOK.encode("4", add_bos=False) + [TOK.eos_id]]
    generate, _ = _fake_generate({0: call, 1: answers}, [0, 0])
    out = run_episodes(generate, [Calculator(), Calculator()], Renderer(TOK), [ex], 2, 0, 3, 20, 32, direct_call)
    gen = merge_generations([out], TOK.pad_id)
    batch = split_by_rank(build_train_batch(gen, out["rewards"], 2), 1)[0]  # + the global token counts
    P = gen["prompt"].shape[1]
    env = np.zeros_like(batch["loss_mask"], bool)
    env[:, P:] = (gen["policy_mask"] == 0) & (np.arange(gen["tokens"].shape[1])[None] < gen["lengths"][:, None])
    assert env.sum() == 2 * 4  # '408=' in both rows
    assert (batch["loss_mask"][env] == 0).all() and (batch["advantages"][env] == 0).all()
    assert (batch["attention_mask"][env] == 1).all()  # seen by the policy, not scored
    np.testing.assert_array_equal(batch["loss_mask"][:, P:], gen["policy_mask"])
    assert batch["advantages"][0, P] > 0 > batch["advantages"][1, P]  # the better answer is pushed up
    trainer = TrainerEngine(MCFG, TrainerConfig(lr=1e-3), V, seed=0)
    g0 = trainer.grads(batch)
    poisoned = dict(batch, advantages=np.where(env, 1e3, batch["advantages"]).astype(np.float32),
                    old_logprobs=np.where(env, -7.0, batch["old_logprobs"]).astype(np.float32))
    g1 = trainer.grads(poisoned)
    # equal up to float summation order (old logprobs enter the masked ratio's arithmetic: ~1e-8)
    assert max(float((g0[k] - g1[k]).abs().max()) for k in g0) <= 1e-7
    # and the mask is what protects them: a change on the policy's tokens moves the gradients
    hit = dict(batch, advantages=np.where(batch["loss_mask"] > 0, batch["advantages"] + 1.0, 0).astype(np.float32))
    assert max(float((g0[k] - g2).abs().max()) for k, g2 in trainer.grads(hit).items()) > 1e-3


def test_multi_turn_logprobs_equal_the_trainers_recomputation():
    """The real continuous engine plays 3-turn episodes (observations between turns, a weight
    version per turn); the trainer's logprobs of every policy token match the sampler's (<= 1e-4)."""
    trainer = TrainerEngine(MCFG, TrainerConfig(), V, seed=0)
    sd = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    engine = SamplerEngine(MCFG, SCFG, V, TOK.pad_id, TOK.eos_id,
                           {k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in sd.items()})
    params = jax_llama.params_from_torch(sd)
    turn = [0]

    def generate(prompts, n, seed):  # a weight push between turns (same weights, next version)
        engine.set_params(params, 10 + turn[0])
        turn[0] += 1
        return engine.generate(prompts, n, seed)

    exs = [make_example("calc", i, 0, 2, 2) for i in range(3)]
    out = run_episodes(generate, [Chatty() for _ in range(6)], Renderer(TOK), exs, 2, 7, max_turns=3, max_tokens=24,
                       max_context=32, call=direct_call)
    assert (out["turns"] == 3).all()
    pm = out["policy_mask"].astype(bool)
    assert (~pm & (np.arange(24)[None] < out["lengths"][:, None])).sum() == 6 * 2 * 3  # '12=' twice per row
    assert set(np.unique(out["token_versions"][pm])) == {10, 11, 12}
    assert (out["token_versions"][~pm] == -1).all()
    batch = build_train_batch(merge_generations([out], TOK.pad_id), out["rewards"], 2)
    want = trainer.logprobs(batch)
    P = out["prompt"].shape[1]
    got = batch["old_logprobs"]
    m = batch["loss_mask"] > 0
    assert m[:, :P].sum() == 0 and m.sum() == pm.sum()
    assert np.abs(got[m] - want[m]).max() <= 1e-4
    assert (got[m] < 0).all()


def test_failed_environment_calls_end_the_episode_with_the_default_and_a_kind():
    class Flaky(Chatty):
        def __init__(self, how):
            self.how = how

        def step(self, messages, completion):
            if self.how == "raise":
                raise KeyError("boom")
            if self.how == "nan":
                return "1=", float("nan"), False
            if self.how == "sleep":
                import time
                time.sleep(5)
            return "1=", 0.5, True

    ex = {"id": 3, "prompt": "1*2="}
    generate, _ = _fake_generate({0: [TOK.eos_id]}, [0])
    envs = [Flaky(h) for h in ("raise", "nan", "sleep", "ok")]
    out = run_episodes(generate, envs, Renderer(TOK), [ex], 4, 0, 2, 8, 32, deadline_call(0.5, 8), default=-1.0)
    assert out["reward_kinds"] == ["error", "nonfinite", "timeout", "ok"]
    np.testing.assert_array_equal(out["rewards"], [-1.0, -1.0, -1.0, 0.5])
    assert "KeyError" in out["reward_details"][0] and out["turns"].tolist() == [1, 1, 1, 1]


def test_calculator_rules():
    assert evaluate("12*34") == 408 and evaluate("7") == 7
    assert evaluate("1+2") is None and evaluate("12**3") is None and evaluate("") is None and evaluate("9" * 20) is None
    ex = {"prompt": "12*34=", "expression": "12*34", "answer": "408"}
    env = Calculator()
    env.reset(ex)
    assert env.step([], "408") == (None, 0.0, True)  # an answer without a call scores nothing
    env.reset(ex)
    obs, r, done = env.step([], "<12*35")  # a wrong call ends the episode: no answer could score after it
    assert (obs, done) == (None, True) and r == pytest.approx(0.2 * (0.25 + 0.75 * 3 / 5))  # '*' not counted yet
    env.reset(ex)
    assert env.step([], "<12*3499")[1] == pytest.approx(0.2 * (0.25 + 0.75 * 5 / 7))  # extra characters cost credit
    env.reset(ex)
    assert env.step([], "<12<34")[1] == pytest.approx(0.2 * 0.75 * 4 / 5)  # a second '<': no share for the call
    env.reset(ex)
    assert env.step([], "<*****")[1] == pytest.approx(0.2 * 0.25)  # the operator alone earns nothing
    env.reset(ex)
    obs, r, done = env.step([], "<34*12")  # the same product: the answer counts
    assert (obs, done) == ("408=", False) and r == pytest.approx(0.2 * 0.25)
    assert env.step([], "408") == (None, pytest.approx(0.8), True)
    env.reset(ex)
    obs, r, done = env.step([], "<12*34")
    assert (obs, done) == ("408=", False) and r == pytest.approx(0.2)
    obs, r, done = env.step([], "400")
    assert obs is None and done and r == pytest.approx(0.8 * 2 / 3)  # '4', '0' of '408' in place


def test_guess_rules():
    env = GuessNumber()
    env.reset({"prompt": "?", "secret": 3})
    assert env.step([], "5") == ("<", 0.0, False)
    assert env.step([], "1") == (">", 0.0, False)
    assert env.step([], "x") == ("!", 0.0, False) and env.step([], "12") == ("!", 0.0, False)
    assert env.step([], "3") == (None, 1.0, True)


def test_chat_template_observation_is_the_template_markup(tmp_path):
    """With a chat template, an observation is exactly what the template writes after the policy's
    stop token (<|im_end|>) up to the next assistant header."""
    pytest.importorskip("transformers")
    from rltpu.data.chat_example import make_tiny_tokenizer
    from rltpu.data.hf_tokenizer import HFTokenizer

    tok = HFTokenizer(make_tiny_tokenizer(tmp_path, ["tool result 408", "user assistant"] * 4))
    text = tok.decode(Renderer(tok).observation("408"), stop_at_eos=False)
    assert text == "\n<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("over, msg", [
    ({"env": {"path": "no_such_module:Env"}}, "cannot import module"),
    ({"env": {"path": "rltpu.data.envs.guess:Nope"}}, "has no 'Nope'"),
    ({"env": {"path": "rltpu.data.envs.calculator:evaluate"}}, "no reset or step"),
])
def test_bad_environment_paths_are_one_line_errors(over, msg):
    cfg = RunConfig.model_validate({"task": {"name": "guess"}} | over)
    with pytest.raises(ConfigError, match=msg) as err:
        load_env_class(cfg.env.path)
    assert "\n" not in str(err.value)


def test_config_refusals():
    with pytest.raises(ValueError, match="max_turns"):
        RunConfig.model_validate({"task": {"name": "guess"}, "env": {"path": "rltpu.data.envs.guess:GuessNumber",
                                                                    "max_turns": 0}})
    with pytest.raises(ValueError, match="played through an environment"):
        RunConfig.model_validate({"task": {"name": "calc"}})
    guess = {"task": {"name": "guess"}, "env": {"path": "rltpu.data.envs.guess:GuessNumber", "credit": "turn"}}
    assert RunConfig.model_validate(guess).env.credit == "turn"
    with pytest.raises(ValueError, match="env.credit=turn works with trainer.algorithm grpo or drgrpo"):
        RunConfig.model_validate(guess | {"trainer": {"algorithm": "rloo"}})
    with pytest.raises(ValueError, match="does not combine with trainer.kl_in_reward"):
        RunConfig.model_validate(guess | {"trainer": {"kl_in_reward": True, "kl_coef": 0.01}})
    with pytest.raises(ValueError, match="credit"):
        RunConfig.model_validate(guess | {"env": {"path": "rltpu.data.envs.guess:GuessNumber", "credit": "token"}})
    from rltpu.control.controller import check_algorithm  # a value model is the estimator's declaration

    with pytest.raises(ValueError, match="env with trainer.algorithm=ppo is not supported"):
        check_algorithm(RunConfig.model_validate({"task": {"name": "guess"},
                                                  "env": {"path": "rltpu.data.envs.guess:GuessNumber"},
                                                  "trainer": {"algorithm": "ppo"}, "critic": {}}))


@pytest.mark.parametrize("args, msg", [
    (["configs/env_guess.yaml", "env.path=nope.mod:Env"], "cannot import module 'nope.mod'"),
    (["configs/env_guess.yaml", "env.max_turns=0"], "env.max_turns"),
    (["configs/quickstart.yaml", "task.name=calc"], "played through an environment"),
])
def test_cli_env_errors_are_one_line_exit_2_before_ray(args, msg, tmp_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "rltpu.cli", "train", *args, f"run_dir={tmp_path / 'run'}"],
                          capture_output=True, text=True, timeout=120)
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("rltpu:")]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1 and msg in lines[0]
    assert not (tmp_path / "run").exists()  # refused before anything started


def test_env_pool_replaces_a_dead_worker_and_keeps_live_ones():
    """``EnvPool.replace_dead`` pings every worker; one whose ping fails is killed and respawned
    with the next incarnation, the others are kept (a fake Ray: the same calls the pool makes)."""
    from rltpu.control.environments import EnvPool

    class Ref:
        def __init__(self, ok):
            self.ok = ok

    class Handle:
        def __init__(self, rank, inc, alive=True):
            self.rank, self.inc, self.alive = rank, inc, alive
            self.ping = type("M", (), {"remote": lambda _s: Ref(self.alive)})()

    class FakeRay:
        killed = []

        def wait(self, refs, num_returns, timeout):
            return refs, []

        def get(self, ref, timeout=None):
            if not ref.ok:
                raise RuntimeError("ActorDiedError")
            return 1

        def kill(self, h, no_restart=True):
            self.killed.append((h.rank, h.inc))

    class Pool(EnvPool):
        def _spawn(self, rank):
            return Handle(rank, self.incarnation[rank])

    pool = Pool(FakeRay(), RunConfig(), 3)
    pool.start()
    assert pool.replace_dead() is False and pool.replaced == 0
    pool.handles[1].alive = False
    keep = pool.handles[0], pool.handles[2]
    assert pool.replace_dead() is True
    assert FakeRay.killed == [(1, 0)] and pool.handles[1].inc == 1 and pool.replaced == 1
    assert (pool.handles[0], pool.handles[2]) == keep


def test_a_failed_reset_or_a_too_long_prompt_fails_its_row_only():
    class Picky(Chatty):
        def reset(self, example):
            if example["id"] == 1:
                raise ValueError("no such task")
            return "1" * (40 if example["id"] == 2 else 3)

        def step(self, messages, completion):
            return None, 0.5, True

    exs = [{"id": i} for i in range(3)]
    generate, calls = _fake_generate({0: [TOK.eos_id]}, [4])
    out = run_episodes(generate, [Picky() for _ in range(6)], Renderer(TOK), exs, 2, 0, 2, 8, 32, direct_call)
    assert out["reward_kinds"] == ["ok", "ok", "error", "error", "error", "error"]
    assert "ValueError: no such task" in out["reward_details"][2] and "41 tokens" in out["reward_details"][4]
    assert calls[0][0] == [TOK.encode("111")] * 2 and calls[0][1] == 1  # only the playable rows sample
    np.testing.assert_array_equal(out["rewards"], [0.5, 0.5, 0, 0, 0, 0])
    assert (out["prompt_mask"].sum(1) >= 1).all() and (out["lengths"][2:] == 0).all()


def test_eval_plays_episodes_of_the_held_out_examples(tmp_path):
    """With env, evaluation hands the examples (not prompt ids) to the samplers' episode path and
    scores each row by its return."""
    from rltpu.config import EvalConfig
    from rltpu.control.evaluation import Evaluator

    held = tmp_path / "held.jsonl"
    held.write_text('{"prompt": "?", "secret": 3}\n{"prompt": "?", "secret": 7}\n')
    tok = CharTokenizer(TASK_ALPHABET["guess"])
    ev = Evaluator(EvalConfig(dataset=str(held), samples=2, k=1), SamplerConfig(), tok, seed=0, episodes=True)
    seen = []

    def generate(inputs, n, greedy, seed):
        seen.append((inputs, n, greedy))
        return {"rewards": np.array([1.0, 0.0][:len(inputs)] * n if greedy else [1.0, 1.0, 0.0, 1.0])}

    out = ev.run(generate, lambda gen, exs: (gen["rewards"], 0), step=1)
    assert [s[0][0]["secret"] for s in seen] == [3, 3] and [s[1:] for s in seen] == [(1, True), (2, False)]
    assert out["eval/accuracy"] == 0.5 and out["eval/mean@k"] == 0.75 and out["eval/pass@k"] == 0.75
