"""The continuous-batching sampler (issue 17): exact against the static engine, the trainer and
transformers; one prefill per prompt; tokens independent of slots, chunks and preemption; a row
never mixes weight versions; counters by hand; nothing compiles after precompile.

The engines share test_sampler's tiny model (init_std 0.2: argmax well posed). Fewer slots than
rows and 2-token pages make every run refill slots and cross page boundaries.
"""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

from rltpu.config import SamplerConfig
from rltpu.models import jax_llama
from rltpu.sampling.common import matmul_params, prefill_flops
from test_sampler import EOS, MCFG, PAD, T, V, _check_logprob_parity, _engine, _state, _torch_model

BACKEND_COMPILES = [0]


def _on_duration(event: str, _secs: float, **_kw) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        BACKEND_COMPILES[0] += 1


jax.monitoring.register_event_duration_secs_listener(_on_duration)

PROMPTS = [[3, 4, 5], [6, 7], [2, 9, 3, 4, 5, 6, 7], [8], [4, 5, 6, 7, 8], [9, 9, 2]]
CONT = dict(engine="continuous", slots=4, decode_chunk=3, kv_page_size=2, kv_pages=40, max_new_tokens=T,
            batch_buckets=(4,), prompt_buckets=(8,))


def _cfg(**kw) -> SamplerConfig:
    return SamplerConfig(**(dict(group_size=2) | CONT | kw))


def _ready(cfg: SamplerConfig, sd=None, version: int = 0):
    eng = _engine(cfg, sd)
    eng.set_params(jax_llama.params_from_torch(_state() if sd is None else sd), version)
    return eng


def _static(prompts, G, seed, temperature):
    """The static engine's rows for the same prompts, one call per 2 prompts (its bucket is 4 rows)."""
    eng = _ready(SamplerConfig(group_size=2, temperature=temperature, max_new_tokens=T, batch_buckets=(4,),
                               prompt_buckets=(8,), engine="static"))
    outs = [eng.generate(prompts[i:i + 4 // G], G, seed) for i in range(0, len(prompts), 4 // G)]
    return {k: np.concatenate([o[k] for o in outs]) for k in ("tokens", "logprobs", "lengths")}


@pytest.fixture(scope="module")
def greedy():
    eng = _ready(_cfg(temperature=0.0), version=7)
    eng.precompile()
    return eng


def test_greedy_equals_the_static_engine_and_nothing_compiles_after_precompile(greedy):
    eng = greedy
    n_programs = len(eng.continuous.cells())
    assert eng.stats.compiles == n_programs  # prefill (1, 2 prompts) + decode views (1, 3 pages)
    b0 = BACKEND_COMPILES[0]
    out = eng.generate(PROMPTS, 2, seed=0)
    assert BACKEND_COMPILES[0] == b0 and out["compiles"] == 0 and eng.stats.compiles == n_programs
    ref = _static(PROMPTS, 2, 0, 0.0)
    np.testing.assert_array_equal(out["tokens"], ref["tokens"])
    np.testing.assert_array_equal(out["lengths"], ref["lengths"])
    assert np.abs(out["logprobs"] - ref["logprobs"]).max() <= 1e-5
    assert out["version"] == 7 and out["versions"].tolist() == [7] * 12
    assert out["chunks"] > 1 and (out["lengths"] < T).any() and (out["lengths"] == T).any()  # slots refilled
    # the output contract of the static engine: left-padded prompts in the smallest bucket
    assert out["prompt"].shape == (12, 8) and out["prompt"][5].tolist() == [0, 2, 9, 3, 4, 5, 6, 7]
    assert out["prompt_mask"][3].tolist() == [0] * 6 + [1, 1]


def test_counters_by_hand(greedy):
    eng = greedy
    cs = eng.continuous
    out = eng.generate(PROMPTS, 2, seed=0)
    useful = int(out["lengths"].sum())
    assert out["new_tokens"] == useful
    assert out["slot_steps"] == 4 * out["decode_steps"]
    # every active slot-step draws one kept token: no preemption here, so busy == useful
    assert out["preemptions"] == 0 and out["busy_slot_steps"] == useful
    assert out["occupancy"] == pytest.approx(useful / (4 * out["decode_steps"]))
    # a chunk runs at most decode_chunk steps
    assert out["decode_steps"] <= 3 * out["chunks"]
    # KV pool: pages x 2 (K, V) x layers x kv heads x page size x head dim x 4 bytes; dense = the
    # static engine's cache for the same 4 rows: 4 x (8 + 6) tokens
    page = 2 * MCFG.num_hidden_layers * MCFG.num_key_value_heads * 2 * MCFG.head_dim * 4
    assert out["kv_pool_bytes"] == cs.n_pages * page and out["kv_dense_bytes"] == 4 * (8 + T) // 2 * page
    assert out["kv_peak_used_bytes"] <= out["kv_pool_bytes"] - page  # the null page is never handed out


def test_one_prefill_per_prompt_cuts_prefill_flops_by_g_minus_1_over_g():
    G = 4
    eng = _ready(_cfg(temperature=1.0, group_size=G))
    prompts = PROMPTS[:4]
    out = eng.generate(prompts, G, seed=1)
    lens = [len(p) for p in prompts]
    assert out["prefill_tokens"] == sum(lens)
    n_mm = matmul_params(eng.param_structs, MCFG.tie_word_embeddings)
    # by hand: 2 x matmul weights per token + 4 x layers x q_dim x (keys seen, 1..len)
    q_dim = MCFG.num_attention_heads * MCFG.head_dim
    hand = sum(2 * n_mm * n + 4 * MCFG.num_hidden_layers * q_dim * n * (n + 1) / 2 for n in lens)
    assert out["prefill_flops"] == pytest.approx(hand) == prefill_flops(MCFG, n_mm, lens)
    static = _ready(SamplerConfig(group_size=G, temperature=1.0, max_new_tokens=T, batch_buckets=(4,),
                                  prompt_buckets=(8,), engine="static"))
    ref = [static.generate([p], G, seed=1) for p in prompts]  # each row prefills its own copy
    assert sum(r["prefill_tokens"] for r in ref) == G * sum(lens)
    drop = 1 - out["prefill_flops"] / sum(r["prefill_flops"] for r in ref)
    assert drop == pytest.approx((G - 1) / G)


def test_tokens_do_not_depend_on_slots_chunks_or_preemption():
    """Each row draws from its own stream (seed, row, position): a different slot count, chunk
    length, page size or a pool so small that rows are preempted and recomputed gives the same rows."""
    eng = _ready(_cfg(temperature=1.0))
    base = eng.generate(PROMPTS, 2, seed=5)
    assert base["preemptions"] == 0
    for kw in (dict(slots=2, decode_chunk=1), dict(slots=8, decode_chunk=5, kv_page_size=4),
               dict(slots=4, kv_pages=4 + 3 + 1)):  # one row's 4 prompt + 3 generated pages, + 1 spare
        out = _ready(_cfg(temperature=1.0, **kw)).generate(PROMPTS, 2, seed=5)
        np.testing.assert_array_equal(out["tokens"], base["tokens"], err_msg=str(kw))
        np.testing.assert_array_equal(out["lengths"], base["lengths"])
        assert np.abs(out["logprobs"] - base["logprobs"]).max() <= 1e-5
        if "kv_pages" in kw:
            assert out["preemptions"] > 0 and out["kv_peak_used_bytes"] <= out["kv_pool_bytes"]
            assert out["prefill_tokens"] > base["prefill_tokens"]  # some prompts were prefilled again
    with pytest.raises(ValueError, match="sampler.kv_pages=5 cannot hold one row"):
        _ready(_cfg(kv_pages=5)).continuous
    other = eng.generate(PROMPTS, 2, seed=6)
    assert not np.array_equal(other["tokens"], base["tokens"])
    assert not np.array_equal(base["tokens"][0], base["tokens"][1])  # G samples are independent draws


def test_logprobs_equal_the_trainers():
    eng = _ready(_cfg(temperature=1.0))
    model = _torch_model(_state())
    for seed in range(2):
        _check_logprob_parity(model, eng.generate(PROMPTS, 2, seed), 1.0)


def test_a_weight_swap_between_chunks_never_mixes_versions():
    """set_params landing mid-call (between chunks) takes effect at the next call: every row of
    the running call is drawn by the version it started with."""
    old, new = _state(0), _state(1)
    ref = _ready(_cfg(temperature=0.0), old, version=1).generate(PROMPTS, 2, seed=0)
    eng = _ready(_cfg(temperature=0.0), old, version=1)
    cs = eng.continuous
    real_prefill = cs._prefill
    swaps = []

    def prefill_then_swap(*args, **kw):  # runs at every chunk boundary
        if len(swaps) == 1:
            eng.set_params(jax_llama.params_from_torch(new), 2)
        swaps.append(eng.version)
        return real_prefill(*args, **kw)

    cs._prefill = prefill_then_swap
    out = eng.generate(PROMPTS, 2, seed=0)
    assert len(swaps) > 2 and swaps[-1] == 2  # the swap landed while the call still had chunks to run
    np.testing.assert_array_equal(out["tokens"], ref["tokens"])
    assert out["version"] == 1 and set(out["versions"].tolist()) == {1}
    after = eng.generate(PROMPTS, 2, seed=0)
    fresh = _ready(_cfg(temperature=0.0), new, version=2).generate(PROMPTS, 2, seed=0)
    assert after["version"] == 2 and np.array_equal(after["tokens"], fresh["tokens"])
    assert not np.array_equal(after["tokens"], out["tokens"])


def test_eos_and_max_new_tokens_per_call():
    eng = _ready(_cfg(temperature=1.0, new_token_buckets=(3, T), max_new_tokens=3))
    eng.precompile()
    out = eng.generate(PROMPTS, 2, seed=2)
    assert out["tokens"].shape == (12, 3) and (out["lengths"] <= 3).all()
    longer = eng.generate(PROMPTS, 2, seed=2, max_new_tokens=T)
    assert longer["tokens"].shape == (12, T)
    for r in range(12):  # the same stream: the short call is a prefix of the long one
        n = out["lengths"][r]
        assert out["tokens"][r, :n].tolist() == longer["tokens"][r, :n].tolist()
        eos = np.flatnonzero(longer["tokens"][r] == EOS)
        assert longer["lengths"][r] == (eos[0] + 1 if len(eos) else T)
        assert (longer["tokens"][r, longer["lengths"][r]:] == PAD).all()
    assert out["compiles"] == longer["compiles"] == 0 and eng.stats.compiles == len(eng.continuous.cells())


def test_config_refuses_microbatches_with_the_continuous_engine():
    with pytest.raises(ValueError, match="set sampler.engine=static or sampler.microbatch_rows=0"):
        SamplerConfig(engine="continuous", microbatch_rows=8)
    assert SamplerConfig(engine="static", microbatch_rows=8).microbatch_rows == 8


def _chi2_crit(df: int, z: float = 3.09) -> float:
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("top_p, top_k", [(0.7, 0), (1.0, 4)])
def test_truncated_sampling_matches_the_truncated_softmax(top_p, top_k):
    """First tokens of 2048 rows (each its own stream) follow the truncated softmax (chi-square)."""
    from test_sampler_features import _next_token_probs

    temperature, prompt, G = 0.8, [3, 9, 4], 256
    eng = _ready(_cfg(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=1, slots=256,
                      group_size=G, batch_buckets=(256,), prompt_buckets=(4,)))
    tokens = np.concatenate([eng.generate([prompt], G, seed=s)["tokens"][:, 0] for s in range(8)])
    p = _next_token_probs(prompt, temperature)
    order = np.argsort(-p)
    keep = order[:top_k] if top_k else order[: int(np.sum(np.cumsum(p[order]) - p[order] < top_p))]
    assert 1 < len(keep) < V - 2
    q = np.zeros(V)
    q[keep] = p[keep] / p[keep].sum()
    counts = np.bincount(tokens, minlength=V)
    assert counts[q == 0].sum() == 0, "sampled a token outside the truncated support"
    expected = len(tokens) * q[keep]
    assert float(((counts[keep] - expected) ** 2 / expected).sum()) < _chi2_crit(len(keep) - 1)
    p_keep = p[keep] / p.sum()  # the untruncated softmax would be rejected
    untruncated = float(((counts[keep] - len(tokens) * p_keep) ** 2 / (len(tokens) * p_keep)).sum())
    assert untruncated > _chi2_crit(len(keep) - 1)


def test_greedy_equals_transformers_generate_across_a_sliding_window(tmp_path):
    """A transformers-written Qwen2 whose later layers slide (window 8): prompt + 24 greedy tokens
    cross the window and several pages; continuous rows equal ``generate(do_sample=False)``."""
    pytest.importorskip("transformers")
    import torch
    from transformers import AutoModelForCausalLM

    from rltpu.config import ModelConfig
    from rltpu.models.hf.load import load_jax_params
    from rltpu.models.hf.tiny import write_tiny_checkpoint
    from rltpu.models.spec import param_shapes
    from rltpu.sampling.engine import SamplerEngine

    ckpt = write_tiny_checkpoint(tmp_path / "q", "qwen2", sliding_window=8, with_tokenizer=False, vocab_size=96, seed=2)
    cfg = ModelConfig(path=str(ckpt))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (5, 9, 12)]
    hf = AutoModelForCausalLM.from_pretrained(ckpt, torch_dtype=torch.float32).eval()
    ref = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=24,
                       do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    scfg = SamplerConfig(engine="continuous", temperature=0, max_new_tokens=24, batch_buckets=(2,),
                         prompt_buckets=(16,), kv_page_size=4, decode_chunk=5)
    eng = SamplerEngine(cfg, scfg, cfg.vocab_size, 0, cfg.vocab_size + 7,
                        {k: (s, cfg.dtype) for k, s in param_shapes(cfg).items()})
    eng.set_params(load_jax_params(cfg), 0)
    g = eng.generate(prompts, 1, seed=0)
    assert [g["tokens"][i, :g["lengths"][i]].tolist() for i in range(3)] == ref


_TP_CHILD = r"""
import json, os, sys
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, sys.argv[1])
import jax
import numpy as np
from rltpu.config import SamplerConfig
from rltpu.models import jax_llama
from rltpu.sampling.engine import SamplerEngine
from test_sampler import MCFG, V, PAD, EOS, _shapes, _state
from test_sampler_continuous import CONT, PROMPTS
res = {}
for k in (1, 2, 4):
    cfg = SamplerConfig(**(dict(group_size=2, temperature=0.0) | CONT))
    eng = SamplerEngine(MCFG, cfg, V, PAD, EOS, _shapes(_state()), devices=k if k > 1 else None)
    eng.precompile()
    n = eng.stats.compiles
    eng.set_params(jax_llama.params_from_torch(_state()), 0)
    out = eng.generate(PROMPTS, 2, seed=0)
    pool = eng.continuous._state["k"][0]
    res[k] = {"tokens": out["tokens"].tolist(), "logprobs": out["logprobs"].tolist(),
              "compiles_after_precompile": eng.stats.compiles - n, "programs": n,
              "pool_shard_shapes": sorted({tuple(s.data.shape) for s in pool.addressable_shards}),
              "pool_shape": list(pool.shape)}
print(json.dumps(res))
"""


def test_tensor_parallel_engine_gives_the_unsharded_tokens():
    """SamplerEngine(devices=k): the continuous programs compile for the mesh, the KV pool is split
    by kv heads (one of the 2 per device; at k = 4 each kv head sits on the 2 devices whose q heads
    read it), and greedy rows equal the unsharded engine's."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    proc = subprocess.run([sys.executable, "-c", _TP_CHILD, str(tests)], cwd=tests.parent, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    one = res["1"]
    pages, kv, hd, ps = one["pool_shape"]  # the K pool: [pages, kv heads, head_dim, page]
    assert ps == CONT["kv_page_size"] and hd == MCFG.head_dim
    assert kv == MCFG.num_key_value_heads == 2 and one["compiles_after_precompile"] == 0
    for k in ("2", "4"):
        assert res[k]["tokens"] == one["tokens"], k
        assert np.abs(np.array(res[k]["logprobs"]) - np.array(one["logprobs"])).max() <= 1e-5, k
        assert res[k]["compiles_after_precompile"] == 0 and res[k]["programs"] == one["programs"]
        assert res[k]["pool_shard_shapes"] == [[pages, 1, hd, ps]], k


def test_static_and_continuous_draw_the_same_rows_at_temperature_1():
    """Both engines key row r's token t by (seed, r, t): the same request gives the same rows on
    either (issue 30), so the engine can pick one per request without changing what is sampled."""
    cont = _ready(_cfg(temperature=1.0)).generate(PROMPTS, 2, seed=11)
    ref = _static(PROMPTS, 2, 11, 1.0)  # 4-row static calls: rows 0..3 of each call, seeds per call
    one = _ready(SamplerConfig(group_size=2, temperature=1.0, max_new_tokens=T, batch_buckets=(12,),
                               prompt_buckets=(8,), engine="static")).generate(PROMPTS, 2, seed=11)
    np.testing.assert_array_equal(cont["tokens"], one["tokens"])
    np.testing.assert_array_equal(cont["lengths"], one["lengths"])
    assert np.abs(cont["logprobs"] - one["logprobs"]).max() <= 1e-5
    assert not np.array_equal(ref["tokens"], one["tokens"])  # rows are keyed by their index in the call


def test_a_request_with_no_reachable_stop_token_runs_as_one_static_program():
    """Stop ids outside the vocabulary: every row runs max_new_tokens, so the continuous engine
    hands the request to the static program (precompiled with its grid): same rows, no compile."""
    from test_sampler import _shapes
    from rltpu.sampling.engine import SamplerEngine

    cfg = _cfg(temperature=1.0, batch_buckets=(4, 12), slots=4)
    eng = SamplerEngine(MCFG, cfg, V, PAD, V, _shapes(_state()))  # EOS id = V: never sampled
    eng.set_params(jax_llama.params_from_torch(_state()), 0)
    eng.precompile()
    n = eng.stats.compiles
    assert n == len(eng.continuous.cells()) + 2  # + the static cells (4 and 12 rows) x 1 prompt bucket
    whole = eng.generate(PROMPTS, 2, seed=3)
    assert whole["engine"] == "static" and whole["compiles"] == 0 and eng.stats.compiles == n
    assert (whole["lengths"] == T).all()
    rest = eng.generate(PROMPTS * 2, 2, seed=3)  # 24 rows: more than a bucket, so continuous slots
    assert rest["engine"] == "continuous" and rest["compiles"] == 0 and (rest["lengths"] == T).all()
    np.testing.assert_array_equal(rest["tokens"][:12], whole["tokens"])


def test_only_decode_programs_on_xla_cpu_get_the_individual_dot_option(monkeypatch):
    """XLA_CPU_DECODE_OPTIONS go to the decode-chunk programs of an XLA:CPU engine only: prefill
    keeps XLA's defaults, and a chip's compiler is never handed an XLA:CPU flag. (A name this
    jaxlib did not know would fail every decode compile in this file.)"""
    from rltpu.sampling import continuous

    eng = _ready(_cfg())
    c = eng.continuous
    assert c.xla_cpu
    assert c.compiler_options(("decode", 4)) == continuous.XLA_CPU_DECODE_OPTIONS
    assert c.compiler_options(("prefill", 1, 8)) is None
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert _engine(_cfg()).continuous.compiler_options(("decode", 4)) is None
