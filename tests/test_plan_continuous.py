"""The planner's continuous-engine model (issue 30): the slot grid and paged KV pool it sizes are the
ones ``ContinuousSampler`` builds, the waves it counts are the ones a real call runs, and its bytes,
waves and tokens/s match numbers worked out by hand."""

from __future__ import annotations

import math
import os
from pathlib import Path

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import pytest  # noqa: E402
import yaml  # noqa: E402

from rltpu.config import ModelConfig, SamplerConfig, load_config  # noqa: E402
from rltpu.plan import costmodel as cm  # noqa: E402
from rltpu.plan.continuous import EngineGrid, flops, serve  # noqa: E402
from rltpu.plan.hardware import GiB  # noqa: E402
from rltpu.plan.planner import make_plan  # noqa: E402
from rltpu.plan.writer import placed_config  # noqa: E402
from test_plan import FAKE_BENCH, QUICKSTART  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
V8B = ROOT / "configs" / "plan_llama8b_v6e_4x4.yaml"
TINY = ModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=64)
VOCAB = 16


def _engine(scfg: SamplerConfig, eos: int):
    from rltpu.models.jax_llama import params_from_torch
    from rltpu.models.spec import param_shapes
    from rltpu.models.torch_llama import init_state_dict
    from rltpu.sampling.engine import SamplerEngine

    shapes = {k: (v, "float32") for k, v in param_shapes(TINY, VOCAB).items()}
    eng = SamplerEngine(TINY, scfg, VOCAB, 0, eos, shapes)
    eng.set_params(params_from_torch(init_state_dict(TINY, VOCAB, 0)), 0)
    return eng


@pytest.mark.parametrize("kw", [
    dict(slots=8, batch_buckets=(8,), max_new_tokens=6, kv_page_size=2, decode_chunk=4, group_size=2),
    dict(batch_buckets=(16, 64), max_new_tokens=12, prompt_buckets=(8, 16), group_size=4),  # auto slots and pool
    dict(slots=48, batch_buckets=(4, 16, 64), max_new_tokens=40, kv_page_size=16, kv_pages=300, group_size=8,
         prompt_buckets=(20,), decode_chunk=8),
    dict(batch_buckets=(64,), max_new_tokens=40, decode_chunk=8, group_size=4),  # one bucket: the slot floor
])
def test_grid_is_the_one_the_engine_builds(kw):
    """Slots, page size, pool pages (auto and explicit), prefill and slot buckets, the attention block,
    the block table's width and the pool's bytes: the planner's count equals ``ContinuousSampler``'s own."""
    scfg = SamplerConfig(engine="continuous", prompt_buckets=kw.pop("prompt_buckets", (8,)), **kw)
    real = _engine(scfg, 2).continuous
    g = EngineGrid.from_config(scfg)
    assert (g.slots, g.chunk, g.page_size, g.prompt_pages, g.gen_pages, g.pages) == \
        (real.S, real.C, real.ps, real.MP, real.MG, real.n_pages)
    assert (g.prefill_rows, g.prefill_lens, g.slot_buckets, g.block_pages) == \
        (real.prefill_rows, real.prefill_lens, real.slot_buckets, real.BP)
    assert real.TW == -(-(g.prompt_pages + g.gen_pages) // g.block_pages) * g.block_pages
    shape = cm.ModelShape.from_config(TINY, VOCAB)
    assert g.pool_bytes(shape.kv_bytes_per_token) == real.pool_bytes()
    # by hand: one page is K and V of every layer for page_size tokens: 2 x 2 layers x 2 kv heads x 8 x 4 B
    assert real.page_bytes() == 2 * 2 * 2 * 8 * 4 * g.page_size


def test_slot_buckets_by_hand():
    """One batch bucket and a request of several chunks: powers of two down to max(8, slots/32); a request
    done in one chunk, or batch buckets that already go lower, add nothing."""
    from rltpu.sampling.buckets import slot_buckets

    assert slot_buckets(256, (256,), 200, 8) == (8, 16, 32, 64, 128, 256)
    assert slot_buckets(512, (512,), 64, 8) == (16, 32, 64, 128, 256, 512)
    assert slot_buckets(512, (512,), 8, 8) == (512,)  # the quickstart's shape: one chunk, one program
    assert slot_buckets(256, (8, 64, 256), 200, 8) == (8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
    assert slot_buckets(64, (16, 64), 12, 8) == (8, 16, 24, 32, 48, 64)


def test_one_batch_bucket_long_tail_shrinks_its_slots():
    """32 rows on one batch bucket (32 slots), EOS drawable, up to 24 tokens in chunks of 4: once rows
    finish, chunks run at 8 or 16 slots, so the call's slot-steps fall below 32 per decode step (before
    the floor every chunk ran all 32 slots: slot_steps == 32 x decode_steps)."""
    scfg = SamplerConfig(engine="continuous", batch_buckets=(32,), max_new_tokens=24, decode_chunk=4, group_size=2,
                         prompt_buckets=(8,), temperature=1.0)
    eng = _engine(scfg, eos=1)
    assert eng.continuous.slot_buckets == (8, 16, 32)
    out = eng.continuous.generate([[2 + i % 9, 3, 4] for i in range(16)], 2, seed=0)
    lengths = list(out["lengths"])
    assert min(lengths) < 24 and out["decode_steps"] == max(lengths)  # some rows stop early, one runs longest
    assert sum(lengths) <= out["slot_steps"] < 32 * out["decode_steps"], (out["slot_steps"], out["decode_steps"])


def test_waves_are_what_a_call_runs():
    """20 rows of one length (no stop token can be drawn) on 8 slots: 3 waves (8, 8, 4 rows), each 6
    decode steps in chunks of 4 (4 + 2), the last wave's 4 rows in the 8-slot bucket; 10 prompts
    prefilled 4 at a time (4, 4, 2 padded to 4). The planner's counts equal the engine's counters. (The
    pool has room for 8 rows even when each prompt fills its 8-token bucket: the planner counts a prompt's
    pages by its bucket, the engine by its real length, so a pool the planner calls full may not be.)"""
    scfg = SamplerConfig(engine="continuous", slots=8, batch_buckets=(8,), max_new_tokens=6, kv_page_size=2,
                         decode_chunk=4, group_size=2, prompt_buckets=(8,), kv_pages=64)
    eng = _engine(scfg, eos=VOCAB)  # EOS outside the vocabulary: every row runs 6 tokens
    prompts = [[1 + (i % 7), 3, 4 + (i % 5)] for i in range(10)]
    out = eng.continuous.generate(prompts, 2, seed=0)
    assert list(out["lengths"]) == [6] * 20
    v = serve(EngineGrid.from_config(scfg), rows=20, mean_new=6, max_new=6)
    assert (v.concurrent, v.waves, v.decode_steps, v.chunks) == (8, 3, 18, 6)
    assert (v.slot_bucket, v.slot_steps, v.prefill_calls, v.prefill_prompts) == (8, 144, 3, 12)
    assert v.pool_rows == 64 // (4 / 2 + 3) == 12
    assert out["decode_steps"] == v.decode_steps and out["chunks"] == v.chunks
    assert out["slot_steps"] == v.slot_steps and out["preemptions"] == 0
    assert out["prefill_calls"] == v.prefill_calls and out["prefill_slots"] == v.prefill_prompts * 8


def test_serve_by_hand():
    """Long tail: 1,024 rows, mean 804 of at most 3,840 tokens, 128 slots, 16-token pages, a 256-token prompt
    bucket, 32 samples per prompt. The pool feeds (pages - 1) // (16 / 32 + ceil(804 / 16)) rows."""
    scfg = SamplerConfig(engine="continuous", slots=128, batch_buckets=(64, 256, 1024), max_new_tokens=3840,
                         prompt_buckets=(256,), group_size=32)
    g = EngineGrid.from_config(scfg)
    assert g.page_size == 16 and (g.prompt_pages, g.gen_pages) == (16, 240)
    auto = max(math.ceil(0.4 * 128 * 4096 / 16), 128 * 1 + 4 * 16, 16 + 240)  # 13,108
    assert g.pages == auto + 1 == 13_109
    v = serve(g, 1024, 804, 3840)
    assert v.pool_rows == 13_108 // (0.5 + 51) == 254
    assert (v.concurrent, v.waves) == (128, 8)
    assert v.decode_steps == 7 * 804 + 3840 == 9468
    assert v.chunks == math.ceil(9468 / 8) and v.slot_steps == 128 * 9468
    assert (v.prefill_calls, v.prefill_prompts) == (8, 32)  # 4 prompts (128 rows / 32) per wave, 8 waves
    # a pool of 1,000 pages feeds 1000 // 51.5 = 19 rows: 128 slots do not help, 54 waves
    small = serve(EngineGrid.from_config(scfg.model_copy(update={"kv_pages": 1000})), 1024, 804, 3840)
    assert (small.pool_rows, small.concurrent, small.waves) == (19, 19, 54)


def test_8b_on_v6e_16_ranks_runnable_candidates_with_tokens_per_chip():
    """Issue 30: the dense cache of every row put the 8B GRPO workload out of a v6e-16 (a 1,024-row
    sampler over 4 chips: 1,024 x 4,096 tokens x 128 KiB / 4 = 128 GiB per chip); the continuous
    engine's pool and waves fit, and the plan ranks runnable candidates by tokens/s/chip."""
    cfg = load_config(V8B)
    static = make_plan(load_config(V8B, ["sampler.engine=static"]))
    mine = static.as_configured
    assert not mine.feasible and mine.memory["sampler"]["kv_cache"] == pytest.approx(1024 * 4096 * 128 * 1024 / 4)
    plan = make_plan(cfg)
    win = plan.winner
    assert win is not None and win.runnable and win.feasible
    good = [c for c in plan.candidates if c.feasible and c.runnable]
    assert len(good) >= 5 and plan.candidates[: len(good)] == good
    rates = [c.phases.tokens_per_s_per_chip for c in good]
    assert rates == sorted(rates, reverse=True)  # ranked fastest first = most tokens/s per chip
    tokens = 2048 * (256 + 804)
    for c in good:
        assert c.phases.tokens_per_s_per_chip == pytest.approx(tokens / c.phases.step / 16)
    # the configured placement (2 samplers x 4 chips, 128 slots) by hand: bytes per sampler chip
    c = plan.as_configured
    assert c.feasible and c.slots == 128 and c.kv_pages == 13_108
    kv = 2 * 32 * 8 * 128 * 2 / 4  # K and V, 32 layers, 8 kv heads x 128, bf16; split over 4 chips by kv heads
    s = c.memory["sampler"]
    assert s["kv_pool"] == pytest.approx(13_109 * 16 * kv)
    assert s["decode_history"] == pytest.approx(128 * (8 + 32) * kv)  # the chunk's keys + one 32-token block
    assert s["logits"] == pytest.approx((2 * 128 + 4) * 128256 * 4)
    # its sample phase by hand: weights once per step, every slot's attended history once per step (16
    # prompt pages + half of 240 generated pages = 136 pages of 16 tokens, whole 2-page blocks: 2,176
    # tokens) and the chunk's 8 keys, at 70% of 1,638 GB/s; prefill at 50% of 4 x 918 TFLOP/s
    m = plan.model
    D, slot_steps = 9468, 128 * 9468
    streamed = D * cm.sampler_weight_bytes(m, 4) + slot_steps * (2176 + 8) * kv
    f_dec = slot_steps * (2 * m.matmul_params + 4 * (2176 + 8) * 4096 * 32)
    f_pre = 2 * m.matmul_params * 32 * 256 + 4 * 32 * 256 * 256 * 4096 * 32
    d = c.phases.detail["sample"]
    assert d["decode"] == pytest.approx(max(streamed / (1638e9 * 0.7), f_dec / (4 * 918e12 * 0.5)))
    assert d["prefill"] == pytest.approx(f_pre / (4 * 918e12 * 0.5))
    e = c.phases.detail["engine"]
    assert (e["waves"], e["decode_steps"], e["concurrent_rows"]) == (8, 9468, 128)


def test_slots_are_halved_until_the_sampler_fits_and_written(tmp_path):
    """A candidate the configured 128 slots do not fit (one chip per sampler: 14.96 GiB of weights and the
    whole pool and history on it) gets half the slots, then half again, and --write-config writes them."""
    cfg = load_config(V8B)
    plan = make_plan(cfg)
    one = next(c for c in plan.candidates if c.mode == "disaggregated" and c.chips_per_sampler == 1
               and c.sampler_chips == 8 and c.feasible)
    assert one.slots < 128 and 128 % one.slots == 0
    g = EngineGrid.from_config(cfg.sampler, slots=one.slots)
    assert one.kv_pages == g.pages - 1
    assert sum(one.memory["sampler"].values()) <= one.capacity
    twice = EngineGrid.from_config(cfg.sampler, slots=one.slots * 2)
    mem2 = cm.sampler_memory(plan.model, plan.workload, 1, 256, twice)
    assert sum(mem2.values()) + 0.5 * GiB > one.capacity  # the next size up does not fit
    plan.candidates = [one] + [c for c in plan.candidates if c is not one]  # as if it had won
    data = placed_config(plan)
    assert data["sampler"]["slots"] == one.slots
    out = tmp_path / "placed.yaml"
    out.write_text(yaml.safe_dump(data))
    assert load_config(out).sampler.slots == one.slots


def test_cpu_continuous_sample_seconds_by_hand():
    """The quickstart (continuous engine, 512 rows per sampler on 512 slots, 4 new tokens) on the cpu
    entry: one admission + one chunk (fixed, measured per host-loop iteration) + the prefill of 32
    prompts and 512 x 4 slot-steps at the probe's marginal rate + a Ray fan-out + the driver's rows."""
    bench = dict(FAKE_BENCH, jax_continuous_fit={"fixed_s": {"128": 0.003, "512": 0.009},
                                                 "flops": {"128": 25e9, "512": 35e9}})
    cfg = load_config(QUICKSTART)
    plan = make_plan(cfg, "cpu", bench)
    c = plan.as_configured
    m = plan.model
    g = EngineGrid.from_config(cfg.sampler)
    assert (g.slots, g.page_size, g.prompt_pages, g.gen_pages, g.chunk) == (512, 4, 2, 1, 8)
    N, H, L = m.matmul_params, 128, 2
    f_pre = 2 * N * 32 * 8 + 4 * 32 * 8 * 8 * H * L
    f_dec = 512 * 4 * (2 * N + 4 * (12 + 8) * H * L)
    assert flops(m, g, 32, 512 * 4) == pytest.approx((f_pre, f_dec))
    assert c.phases.sample == pytest.approx(0.003 + (f_pre + f_dec) / 25e9 + 2e-3 + 1024 * 20e-6)
    assert c.phases.detail["engine"]["waves"] == 1


def test_mean_response_len_above_the_limit_is_a_one_line_error():
    from rltpu.config import ConfigError

    with pytest.raises(ConfigError, match="planner.mean_response_len=5 exceeds the 4 new tokens"):
        make_plan(load_config(QUICKSTART, ["planner.mean_response_len=5"]), "cpu", FAKE_BENCH)


def test_prefill_lengths_by_hand():
    """Prompt buckets in whole pages, plus the powers of two pages from 16 tokens up to the largest
    (the engine's own ``prefill_lens``: ``test_grid_is_the_one_the_engine_builds``)."""
    def lens(**kw):
        return EngineGrid.from_config(SamplerConfig(engine="continuous", **kw)).prefill_lens

    assert lens(prompt_buckets=(20,), max_new_tokens=40, kv_page_size=16) == (16, 32)
    assert lens(prompt_buckets=(64,), max_new_tokens=64, kv_page_size=16) == (16, 32, 64)
    assert lens(prompt_buckets=(8, 40), max_new_tokens=64, kv_page_size=16) == (16, 32, 48)
    assert lens(prompt_buckets=(8,), max_new_tokens=4) == (8,)  # 4-token pages: nothing below 16 tokens


def test_prefill_calls_split_a_group_with_the_least_padding_by_hand():
    """A group of prompts runs as calls of the row buckets that pad least, each call counted as
    PREFILL_CALL_ROWS (2) more rows: 23 prompts at buckets 1/4/16/64 cost 16+4+4 + 3 x 2 = 30, not one
    call of 64 + 2 = 66 (the engine padded so before); 7 cost 4+4 + 4 = 12 (16 + 2 = 18, 4+1+1+1
    + 8 = 15); 3 run as one call of 4. The engine and the planner use this one function."""
    from rltpu.sampling.buckets import split_rows

    b = (1, 4, 16, 64)
    assert split_rows(23, b) == (4, 4, 16)
    assert split_rows(7, b) == (4, 4)
    assert split_rows(3, b) == (4,)
    assert split_rows(64, b) == (64,)
    assert split_rows(0, b) == ()
    assert split_rows(23, b, call_rows=100) == (64,)  # calls dear: one padded call
    # more than the largest bucket: 4+64+64 + 6 = 138 ties 1+1+64+64 + 8 (fewer calls win), < 192 + 6
    assert split_rows(130, b) == (4, 64, 64)
