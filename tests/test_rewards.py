"""Reward workers and evaluation without Ray: deadlines, defaults and counters against injected
failures, kill-and-replace of a hung or dead worker, the failure-fraction stop, pass@k by hand, and
a greedy evaluation that gives the same figures twice on fixed weights.

The pool is driven through an in-process stand-in for ``RayRewardWorkers`` whose workers are the
real ``actors.reward_fn_worker.RewardFnWorker`` objects, so the actor's code runs too.
"""

from __future__ import annotations

import concurrent.futures as cf
import math
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from actors.reward_fn_worker import RewardFnWorker
from rltpu.config import ConfigError, TaskConfig, load_config
from rltpu.control.evaluation import eval_metrics, pass_at_k
from rltpu.control.rewards import RewardFailureError, RewardPool
from rltpu.data.rewards import DeadlineRunner
from rltpu.observe.health import HealthError

# wall-clock bounds of about one deadline (0.4 s + 1 s): run alone, after the parallel part (make test)
pytestmark = pytest.mark.serial
SLEEP_S = 1.5


def faulty(completion: str, example: dict) -> float:
    """By example id: 0 mod 10 sleeps past any deadline used here, 1 raises, 2 returns NaN, else the
    answer's exact match."""
    i = example["id"]
    if i % 10 == 0:
        time.sleep(SLEEP_S)
        return 1.0
    if i % 10 == 1:
        raise KeyError("answer")
    if i % 10 == 2:
        return math.nan
    return float(completion == example["answer"])


class LocalWorkers:
    """``RayRewardWorkers``' five methods in this process: futures for refs, a flag for ray.kill."""

    def __init__(self, fn_path: str = "tests.test_rewards:faulty"):
        self.fn_path = fn_path
        self.executor = cf.ThreadPoolExecutor(16)
        self.spawned: list = []
        self.killed: list = []
        self.hang_next = self.die_next = 0  # the next N calls hang (never answer) / fail as a dead process

    def spawn(self, slot, incarnation):
        h = SimpleNamespace(slot=slot, incarnation=incarnation, killed=threading.Event(),
                            worker=RewardFnWorker(slot, self.fn_path, {}, task.reward_timeout_s,
                                                task.reward_concurrency))
        self.spawned.append(h)
        return h

    def call(self, h, texts, examples):
        if self.hang_next:
            self.hang_next -= 1
            return self.executor.submit(h.killed.wait, 60)  # answers only once killed (never read then)
        if self.die_next:
            self.die_next -= 1
            return self.executor.submit(lambda: (_ for _ in ()).throw(RuntimeError("The actor died unexpectedly")))
        return self.executor.submit(h.worker.score, texts, examples)

    def wait(self, refs, timeout):
        done, _ = cf.wait(refs, timeout=timeout, return_when=cf.ALL_COMPLETED)
        return list(done)

    def get(self, ref):
        return ref.result(timeout=0)

    def kill(self, h):
        self.killed.append(h)
        h.killed.set()


task = TaskConfig(reward_fn="tests.test_rewards:faulty", reward_workers=2, reward_timeout_s=0.4,
                  reward_concurrency=16, reward_default=-1.0, reward_max_failure_frac=0.5)
# time bounds below leave ~1 s for a loaded 2-core machine; the serial alternative they rule out is
# one deadline per hang (6 hangs: 2.4 s)


def _rows(ids):
    exs = [{"id": i, "answer": "7"} for i in ids]
    return ["7" if i % 3 else "x" for i in ids], exs


def _expected(ids, texts):
    kinds = ["timeout" if i % 10 == 0 else "error" if i % 10 == 1 else "nonfinite" if i % 10 == 2 else "ok"
             for i in ids]
    values = [-1.0 if k != "ok" else float(t == "7") for k, t in zip(kinds, texts)]
    return kinds, values


def test_deadline_runner_overlaps_hangs_and_reports_each_failure_kind():
    runner = DeadlineRunner(faulty, timeout_s=0.4, concurrency=32)
    ids = list(range(60))  # 6 hang, 6 raise, 6 NaN
    texts, exs = _rows(ids)
    t0 = time.monotonic()
    out = runner.run(list(zip(texts, exs)))
    wall = time.monotonic() - t0
    kinds, values = _expected(ids, texts)
    assert [k for _, k, _ in out] == kinds
    assert [v for v, k, _ in out if k == "ok"] == [v for v, k in zip(values, kinds) if k == "ok"]
    assert out[1][2] == "KeyError: 'answer'" and out[2][2] == "returned nan"
    assert wall < 0.4 + 1.0, wall  # six hangs overlapped: one deadline, not six
    assert runner.abandoned == 6  # still sleeping on detached threads
    time.sleep(SLEEP_S)
    assert runner.abandoned == 0  # they finished and left; their late results were dropped


def test_pool_defaults_and_counts_exactly_what_was_injected():
    lines = []
    pool = RewardPool(task, LocalWorkers(), log=lines.append, grace_s=1.0, startup_s=0)
    pool.start()
    pool.begin_step(3)
    ids = list(range(100, 160))
    texts, exs = _rows(ids)
    a, b = pool.submit(texts[:30], exs[:30]), pool.submit(texts[30:], exs[30:])  # two sampler shards
    t0 = time.monotonic()
    got = np.concatenate([pool.collect(a), pool.collect(b)])
    assert time.monotonic() - t0 < 0.4 + 1.0  # the driver waits about one deadline, not one per hang
    kinds, values = _expected(ids, texts)
    np.testing.assert_array_equal(got, np.array(values, np.float32))
    pool.check()  # 18 of 60 failed: under the 0.5 limit
    m = pool.step_metrics()
    assert (m["reward_calls"], m["reward_timeouts"], m["reward_errors"]) == (60, 6, 12)
    assert m["reward_workers_replaced"] == 0
    # one line per failure kind for the step, each naming the function and example ids
    assert len(lines) == 3, lines
    timeout_line = next(ln for ln in lines if "timed out" in ln)
    assert "step 3" in timeout_line and "tests.test_rewards:faulty" in timeout_line
    assert "example ids 100, 110, 120, 130, 140, ..." in timeout_line and "task.reward_default=-1" in timeout_line
    assert pool.health()["reward_timeouts"] == 6


def test_a_hung_worker_is_killed_and_replaced_and_a_dead_one_retried():
    workers, lines = LocalWorkers(), []
    pool = RewardPool(task, workers, log=lines.append, grace_s=1.0, startup_s=0)
    pool.start()
    pool.begin_step(1)
    ids = [3, 4, 5, 6, 7, 8]  # no injected failures in the function itself
    texts, exs = _rows(ids)
    workers.hang_next = 1  # the first chunk's worker never answers
    t0 = time.monotonic()
    got = pool.collect(pool.submit(texts, exs))
    waited = time.monotonic() - t0
    assert 0.4 + 1.0 <= waited < 0.4 + 1.0 + 1.0, waited  # its deadline: the calls' plus the grace
    assert list(got[:3]) == [-1.0] * 3 and list(got[3:]) == [float(t == "7") for t in texts[3:]]
    assert workers.killed == [workers.spawned[0]] and len(workers.spawned) == 3  # killed, replaced
    assert pool.handles[0] is workers.spawned[2]
    workers.die_next = 1  # a process that dies: replaced, its rows sent again, nothing lost
    got = pool.collect(pool.submit(texts, exs))
    assert list(got) == [float(t == "7") for t in texts]
    m = pool.step_metrics()
    assert m["reward_workers_replaced"] == 2 and m["reward_timeouts"] == 3 and m["reward_errors"] == 0
    assert sum("replaced" in ln for ln in lines) == 2


def test_more_failures_than_the_limit_stop_the_job_in_one_line_naming_the_function():
    strict = task.model_copy(update={"reward_max_failure_frac": 0.1})
    pool = RewardPool(strict, LocalWorkers(), log=lambda line: None, grace_s=1.0, startup_s=0)
    pool.start()
    pool.begin_step(5)
    ids = [11, 21, 31, 4, 5, 6, 7, 8, 9, 13]  # 3 raise of 10: over 10%
    texts, exs = _rows(ids)
    pool.collect(pool.submit(texts, exs))
    with pytest.raises(RewardFailureError) as err:
        pool.check()
    msg = str(err.value)
    assert isinstance(err.value, HealthError) and "\n" not in msg  # the CLI's health stop: one line, exit 3
    assert msg.startswith("task.reward_fn tests.test_rewards:faulty failed on 3 of 10 calls at step 5 "
                          "(3 raised; first: KeyError: 'answer' on example id=11)"), msg
    assert "task.reward_max_failure_frac=0.1" in msg
    pool.begin_step(6)  # a new step starts from zero
    pool.check()


def test_reward_config_errors_are_one_line():
    with pytest.raises(ConfigError, match="'task.reward_timeout_s' has bad value 0"):
        load_config(None, ["task.reward_timeout_s=0"])
    with pytest.raises(ConfigError, match="k=5 is larger than samples=4"):
        load_config(None, ["eval.dataset=held.jsonl", "eval.k=5"])


def test_pass_at_k_is_the_unbiased_estimator_by_hand():
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(10, 3, 4) == pytest.approx(1 - 35 / 210)  # 1 - C(7,4)/C(10,4)
    assert pass_at_k(4, 0, 2) == 0.0 and pass_at_k(4, 3, 2) == 1.0 and pass_at_k(4, 1, 1) == 0.25
    greedy = np.array([1.0, 0.0, 1.0])
    sampled = np.array([[0.0, 0.5, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])  # 0, 1, 4 correct
    m = eval_metrics(greedy, sampled, k=2, threshold=1.0)
    assert m["eval/accuracy"] == pytest.approx(2 / 3)
    assert m["eval/pass@k"] == pytest.approx((0 + (1 - 3 / 6) + 1) / 3)  # middle: 1 - C(3,2)/C(4,2)
    assert m["eval/mean@k"] == pytest.approx((0 + 0.25 + 1) / 3)
    assert m["eval/k"] == 2 and m["eval/samples"] == 4


def test_greedy_evaluation_on_fixed_weights_is_deterministic(tmp_path):
    """The engine's eval path (``greedy=True``: a temperature-0 twin sharing its weights) through
    ``Evaluator``: the same figures and tokens twice, whatever seed, and no compile counted on the
    training engine."""
    import jax.numpy as jnp

    from rltpu.config import EvalConfig, ModelConfig, SamplerConfig
    from rltpu.control.batch import merge_generations
    from rltpu.control.evaluation import Evaluator
    from rltpu.data.char_tokenizer import CharTokenizer
    from rltpu.data.rewards import partial_credit
    from rltpu.models.torch_llama import init_state_dict
    from rltpu.sampling.engine import SamplerEngine

    held = tmp_path / "held.jsonl"
    held.write_text("".join(f'{{"id": "eval-{i}", "prompt": "c{d}=", "answer": "{d}"}}\n'
                            for i, d in enumerate(["12", "345", "67", "890", "1", "2468"])))
    tok = CharTokenizer()
    mcfg = ModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, max_position_embeddings=32, init_std=0.2)
    scfg = SamplerConfig(engine="static", group_size=2, temperature=1.0, max_new_tokens=4, batch_buckets=(8,),
                         prompt_buckets=(8,), precompile=False, compile_cache=False)
    sd = init_state_dict(mcfg, tok.vocab_size, 0)
    eng = SamplerEngine(mcfg, scfg, tok.vocab_size, tok.pad_id, tok.eos_id,
                        {k: (tuple(v.shape), "float32") for k, v in sd.items()})
    eng.set_params({k: jnp.asarray(v.numpy()) for k, v in sd.items()}, 7)
    ev = Evaluator(EvalConfig(dataset=str(held), every_steps=1, samples=0), scfg, tok, seed=0)
    seen = []

    def generate(prompts, n, greedy, seed):
        out = eng.generate(prompts, n, seed + len(seen), greedy=greedy)  # a different seed each call
        seen.append(out["tokens"].copy())
        return merge_generations([out], tok.pad_id)

    def score(gen, examples):
        texts = [tok.decode(gen["tokens"][r, :gen["lengths"][r]]) for r in range(len(examples))]
        return np.array([partial_credit(t, e) for t, e in zip(texts, examples)]), 0

    first, second = ev.run(generate, score, 1), ev.run(generate, score, 2)
    assert {k: v for k, v in first.items() if k != "eval/seconds"} == \
           {k: v for k, v in second.items() if k != "eval/seconds"}
    np.testing.assert_array_equal(seen[0], seen[1])
    assert eng.greedy_twin().version == 7 and eng.greedy_twin().cfg.temperature == 0.0
    assert eng.stats.compiles == 0  # the twin's programs are its own
    assert eng.stats.compiles == 0  # the twin compiled its own program
    assert not ev.due(2, last=True)  # the end of a run already evaluated at that step: not twice
