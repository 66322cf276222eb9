"""The compiled JAX sampler (no Ray): bucket grid, seeds, logprob parity with the torch trainer
model, temperature/top-p sampling, early exit on EOS, errors and padding accounting.

Every engine here shares one tiny model; compiles are the expensive part on CPU (seconds each),
so the grid engine is module-scoped and reused by every test that samples at temperature 1.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch

from rltpu.config import ModelConfig, SamplerConfig
from rltpu.models import jax_llama
from rltpu.models.torch_llama import LlamaForCausalLM, init_state_dict
from rltpu.control.batch import build_train_batch
from rltpu.sampling.engine import SamplerEngine

torch.set_num_threads(1)
torch.set_float32_matmul_precision("highest")

V, PAD, EOS = 17, 0, 1
T = 6  # max_new_tokens
# init_std 0.2 (not 0.02): logits spread well beyond fp32 noise, so argmax / nucleus are well posed
MCFG = ModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=64, init_std=0.2)
GRID = SamplerConfig(engine="static", group_size=2, max_new_tokens=T, batch_buckets=(2, 4), prompt_buckets=(4, 8))
SEED = 0


def _state(seed: int = SEED) -> dict[str, torch.Tensor]:
    return init_state_dict(MCFG, V, seed)


def _shapes(sd) -> dict:
    return {k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in sd.items()}


def _engine(cfg: SamplerConfig, sd=None) -> SamplerEngine:
    sd = _state() if sd is None else sd
    return SamplerEngine(MCFG, cfg, V, PAD, EOS, _shapes(sd))


def _torch_model(sd) -> LlamaForCausalLM:
    m = LlamaForCausalLM(MCFG, V)
    m.load_state_dict(sd)
    return m.eval()


def _eos_state(eos_weight: float, pad_dim0: float = 100.0) -> dict[str, torch.Tensor]:
    """A "bias" through the embeddings: hidden dim 0 of every token is +100 (pad's is ``pad_dim0``)
    and only the EOS row of lm_head reads dim 0, so the EOS logit is ~ +-5.6 * eos_weight."""
    sd = {k: v.clone() for k, v in _state().items()}
    sd["model.embed_tokens.weight"][:, 0] = 100.0
    sd["model.embed_tokens.weight"][PAD, 0] = pad_dim0
    sd["lm_head.weight"][:, 0] = 0.0
    sd["lm_head.weight"][EOS, 0] = eos_weight
    return sd


@pytest.fixture(scope="module")
def grid():
    eng = _engine(GRID)
    before = eng.stats.compiles
    log = eng.precompile()
    eng.set_params(jax_llama.params_from_torch(_state()), version=3)
    return eng, before, log


# ---------------------------------------------------------------------------------------------
# compilation


def test_precompile_compiles_the_grid_once_and_generation_never_recompiles(grid):
    eng, before, log = grid
    assert before == 0
    assert eng.stats.compiles == len(GRID.batch_buckets) * len(GRID.prompt_buckets) == 4
    assert sorted((r, p, t) for r, p, t, _s, _hit in log) == [(2, 4, T), (2, 8, T), (4, 4, T), (4, 8, T)]
    assert eng.precompile() == log and eng.stats.compiles == 4  # idempotent
    # (prompts, n_per_prompt) -> expected bucket; different lengths and row counts inside each bucket
    cases = [
        ([[5]], 1, (2, 4)),
        ([[5, 6, 7, 8]], 2, (2, 4)),
        ([[5, 6], [7, 8, 9]], 1, (2, 4)),
        ([[5, 6, 7, 8, 9]], 2, (2, 8)),
        ([[5, 6, 7]] * 3, 1, (4, 4)),
        ([[5, 6], [7]], 2, (4, 4)),
        ([[2] * 8, [3] * 6, [4] * 5], 1, (4, 8)),
        ([[2] * 7, [3] * 8], 2, (4, 8)),
    ]
    for seed, (prompts, n, bucket) in enumerate(cases):
        out = eng.generate(prompts, n, seed)
        assert out["bucket"] == (*bucket, T)
        assert out["compiles"] == 0
        assert out["tokens"].shape == (len(prompts) * n, T)
        assert out["prompt"].shape == (len(prompts) * n, bucket[1])
        assert out["version"] == 3
    assert eng.stats.compiles == 4


# ---------------------------------------------------------------------------------------------
# seeds


def test_same_seed_same_tokens_different_seed_different_tokens(grid):
    eng, _, _ = grid
    prompts = [[3, 4, 5], [6, 7]]
    a, b, c = (eng.generate(prompts, 2, s) for s in (11, 11, 12))
    np.testing.assert_array_equal(a["tokens"], b["tokens"])
    np.testing.assert_array_equal(a["logprobs"], b["logprobs"])
    np.testing.assert_array_equal(a["lengths"], b["lengths"])
    assert not np.array_equal(a["tokens"], c["tokens"])
    # the G samples of one prompt are independent draws, not copies
    assert not np.array_equal(a["tokens"][0], a["tokens"][1])


# ---------------------------------------------------------------------------------------------
# logprobs are what the trainer computes


def _trainer_logprobs(model, gen: dict, temperature: float) -> tuple[np.ndarray, dict]:
    """The trainer's token logprobs of the completion, over the batch ``build_train_batch`` makes."""
    batch = build_train_batch(gen, np.zeros(len(gen["lengths"]), np.float32), 1, scale_rewards=False)
    with torch.no_grad():
        logits = model(*(torch.as_tensor(batch[k]) for k in ("tokens", "position_ids", "attention_mask")))
    logp = torch.log_softmax(logits[:, :-1] / temperature, -1)
    tok = torch.as_tensor(batch["tokens"][:, 1:])
    lp = logp.gather(-1, tok[..., None])[..., 0].numpy()
    P = gen["prompt"].shape[1]
    return lp[:, P - 1:P - 1 + T], batch


def _check_logprob_parity(model, out: dict, temperature: float) -> None:
    lengths, tokens, logprobs = out["lengths"], out["tokens"], out["logprobs"]
    want, batch = _trainer_logprobs(model, out, temperature)
    real = np.arange(T)[None, :] < lengths[:, None]
    assert np.abs(logprobs - want)[real].max() <= 1e-4
    assert (logprobs[real] < 0).all()
    # lengths count up to and including the first EOS, or T without one
    for r in range(len(lengths)):
        eos_at = np.flatnonzero(tokens[r] == EOS)
        assert lengths[r] == (eos_at[0] + 1 if len(eos_at) else T)
    # after EOS: pad tokens with logprob exactly 0, outside the trainer's loss mask
    assert (tokens[~real] == PAD).all()
    assert (logprobs[~real] == 0.0).all()
    np.testing.assert_array_equal(batch["loss_mask"][:, -T:], real.astype(np.float32))


def test_logprobs_equal_torch_trainer_logprobs_and_pad_after_eos(grid):
    eng, _, _ = grid
    model = _torch_model(_state())
    ended_early = 0
    for seed, prompts in enumerate([[[3, 4, 5], [6, 7]], [[2, 9, 3, 4, 5, 6, 7], [8]], [[4], [5], [6], [7]]]):
        n = 4 // len(prompts)
        out = eng.generate(prompts, n, seed)
        _check_logprob_parity(model, out, GRID.temperature)
        ended_early += int((out["lengths"] < T).sum())
    assert ended_early > 0  # the EOS / padding branch was exercised


# ---------------------------------------------------------------------------------------------
# temperature ~ 0 is greedy decoding


def _torch_greedy(model, prompt: list[int]) -> list[int]:
    seq, out, gaps = list(prompt), [], []
    for _ in range(T):
        with torch.no_grad():
            logits = model(torch.tensor([seq]))[0, -1]
        top2 = torch.topk(logits, 2).values
        gaps.append(float(top2[0] - top2[1]))
        tok = int(logits.argmax())
        out.append(tok)
        seq.append(tok)
        if tok == EOS:
            break
    return out, min(gaps)


@pytest.mark.parametrize("knobs", [{"temperature": 1e-4}, {"temperature": 0.0}, {"temperature": 1.0, "top_k": 1}])
def test_greedy_settings_are_torch_argmax_decoding(knobs):
    """Temperature 0 is greedy by definition; a tiny temperature and top-k=1 must agree with it."""
    cfg = SamplerConfig(engine="static", group_size=2, max_new_tokens=T, batch_buckets=(4,), prompt_buckets=(4,),
                        **knobs)
    eng = _engine(cfg)
    sd = _state()
    eng.set_params(jax_llama.params_from_torch(sd), 0)
    model = _torch_model(sd)
    prompts = [[3, 4, 5], [6, 7], [9], [2, 8, 10, 12]]
    out = eng.generate(prompts, 1, seed=5)
    for r, p in enumerate(prompts):
        want, gap = _torch_greedy(model, p)
        assert gap > 1e-3, "reference argmax is ambiguous; pick another seed"
        assert out["lengths"][r] == len(want)
        assert out["tokens"][r, :len(want)].tolist() == want
        assert (out["tokens"][r, len(want):] == PAD).all()
    # every other seed gives the same (greedy) tokens
    np.testing.assert_array_equal(eng.generate(prompts, 1, seed=6)["tokens"], out["tokens"])


# ---------------------------------------------------------------------------------------------
# early exit and padding accounting


def test_early_exit_when_every_row_emits_eos(grid):
    eng, _, _ = grid
    eng.set_params(jax_llama.params_from_torch(_eos_state(50.0)), version=4)
    try:
        out = eng.generate([[3, 4, 5], [6, 7]], 2, seed=0)  # bucket (4, 4), 4 real rows
        assert out["bucket"] == (4, 4, T)
        assert (out["tokens"][:, 0] == EOS).all() and (out["tokens"][:, 1:] == PAD).all()
        assert out["lengths"].tolist() == [1, 1, 1, 1]
        assert (out["logprobs"][:, 1:] == 0).all() and np.allclose(out["logprobs"][:, 0], 0.0, atol=1e-6)
        # one decode step, not T: decode slots = rows * steps = 4 * 1
        assert out["total_slots"] == 4 * 4 + 4 * 1
        assert out["new_tokens"] == 4
        assert out["padded_slots"] == (4 * 4 - (3 + 3 + 2 + 2)) + (4 * 1 - 4)
        assert out["compiles"] == 0
    finally:
        eng.set_params(jax_llama.params_from_torch(_state()), version=3)


def test_padding_rows_of_a_bucket_do_not_hold_the_loop_open(grid):
    """3 real rows in a 4-row bucket. The real rows emit EOS at once; the padding row (an all-pad
    prompt, whose embedding pushes EOS down) would keep sampling: it must not delay the exit."""
    eng, _, _ = grid
    eng.set_params(jax_llama.params_from_torch(_eos_state(50.0, pad_dim0=-100.0)), version=5)
    try:
        out = eng.generate([[3, 4, 5], [6, 7], [8]], 1, seed=0)
        assert out["bucket"] == (4, 4, T)
        assert out["lengths"].tolist() == [1, 1, 1]
        assert out["total_slots"] == 4 * 4 + 4 * 1  # one decode step
        # prefill: 16 slots, 6 real; decode: 4 slots, 3 real tokens
        assert out["padded_slots"] == (16 - 6) + (4 - 3)
    finally:
        eng.set_params(jax_llama.params_from_torch(_state()), version=3)


def test_padding_accounting_without_eos(grid):
    eng, _, _ = grid
    eng.set_params(jax_llama.params_from_torch(_eos_state(-50.0)), version=6)  # EOS never sampled
    try:
        out = eng.generate([[3, 4, 5], [6, 7], [8, 9, 10, 11, 12]], 1, seed=1)  # 3 rows -> bucket (4, 8)
        assert out["bucket"] == (4, 8, T)
        assert out["lengths"].tolist() == [T, T, T]
        assert (out["tokens"] != EOS).all()
        assert out["new_tokens"] == 3 * T
        assert out["total_slots"] == 4 * 8 + 4 * T
        assert out["padded_slots"] == (4 * 8 - (3 + 2 + 5)) + (4 * T - 3 * T)
        # left padding: prompt right-aligned, mask marks the real tokens
        assert out["prompt"][1].tolist() == [PAD] * 6 + [6, 7]
        assert out["prompt_mask"][2].tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
    finally:
        eng.set_params(jax_llama.params_from_torch(_state()), version=3)


# ---------------------------------------------------------------------------------------------
# errors


def test_errors_name_the_bucket_and_require_weights(grid):
    eng, _, _ = grid
    with pytest.raises(ValueError, match=r"prompt length=9 exceeds the largest bucket 8"):
        eng.generate([[2] * 9], 1, seed=0)
    with pytest.raises(ValueError, match=r"rows=6 exceeds the largest bucket 4"):
        eng.generate([[2, 3]] * 3, 2, seed=0)
    assert eng.stats.compiles == 4
    fresh = _engine(GRID)
    with pytest.raises(RuntimeError, match="set_params"):
        fresh.generate([[2, 3]], 1, seed=0)
    assert fresh.stats.compiles == 0
    bad = dict(jax_llama.params_from_torch(_state()))
    bad["model.norm.weight"] = bad["model.norm.weight"][:-1]
    with pytest.raises(ValueError, match="model.norm.weight"):
        fresh.set_params(bad, 1)
    del bad["lm_head.weight"]
    with pytest.raises(ValueError, match="lack"):
        fresh.set_params(bad, 1)
    assert fresh.params is None


# ---------------------------------------------------------------------------------------------
# top-p


def test_top_p_samples_only_inside_the_nucleus():
    temperature, top_p = 0.7, 0.5
    cfg = SamplerConfig(engine="static", group_size=2, temperature=temperature, top_p=top_p, max_new_tokens=T,
                        batch_buckets=(4,), prompt_buckets=(4,))
    eng = _engine(cfg)
    sd = _state()
    eng.set_params(jax_llama.params_from_torch(sd), 0)
    model = _torch_model(sd)
    checked, outside_mass = 0, []
    for seed in range(6):
        out = eng.generate([[3, 4, 5], [6, 7]], 2, seed)
        # logprobs stay those of softmax(logits / temperature), before truncation
        _check_logprob_parity(model, out, temperature)
        P = out["prompt"].shape[1]
        batch = build_train_batch(out, np.zeros(4, np.float32), 1, scale_rewards=False)
        with torch.no_grad():
            logits = model(*(torch.as_tensor(batch[k]) for k in ("tokens", "position_ids", "attention_mask")))
        probs = torch.softmax(logits / temperature, -1).numpy()
        for r in range(4):
            for t in range(int(out["lengths"][r])):
                p = probs[r, P - 1 + t]
                order = np.argsort(-p)
                before = np.cumsum(p[order]) - p[order]  # mass strictly above each token
                nucleus = set(order[before < top_p + 1e-5].tolist())
                assert int(out["tokens"][r, t]) in nucleus
                outside_mass.append(1.0 - p[order][before < top_p].sum())
                checked += 1
    # without truncation, P(all samples inside) = prod(1 - outside_mass): make sure that is tiny
    assert checked >= 40
    assert np.sum(np.log1p(-np.minimum(outside_mass, 1 - 1e-9))) < np.log(1e-3)


def test_the_packed_layout_is_decided_by_backend_mesh_adapters_and_the_caller(monkeypatch):
    """Packed (``jax_llama.pack_params``) only on an unsharded XLA:CPU engine without adapters whose
    caller allows it: a chip's engine keeps the trainer's names (no second copy of the weights in HBM)."""
    cfg = SamplerConfig(batch_buckets=(4,), prompt_buckets=(8,), max_new_tokens=4)
    eng = _engine(cfg)
    assert eng.packed and "model.layers.0.self_attn.qkv_proj.weight_t" in eng.program_structs
    assert not SamplerEngine(MCFG, cfg, V, PAD, EOS, _shapes(_state()), pack=False).packed
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    chip = _engine(cfg)
    assert not chip.packed and chip.program_structs is chip.param_structs
