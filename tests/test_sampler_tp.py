"""Sampler tensor parallelism (issue 16, acceptance 1) on emulated host devices.

A Qwen2 checkpoint with GQA written by ``transformers`` (8 q heads, 2 kv heads) sampled greedily
for 64 tokens by the unsharded engine and by engines over k = 2 and 4 devices: the tokens are
identical, the logprobs within 1e-5, each device holds 1/k of the split weights plus the listed
replicated ones, and generation compiles nothing after precompile. k = 2 splits the kv heads
(one per device); k = 4 has fewer kv heads than devices, so each kv head sits on the 2 devices
whose q heads read it. The engines run in a child process (``sampler_tp_child.py``): the host
device count is fixed when JAX starts, and this process already started it with one device.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rltpu.config import ModelConfig
from rltpu.sampling import tp

ROOT = Path(__file__).resolve().parents[1]
REPLICATED = {"model.norm.weight"} | {f"model.layers.{i}.{n}" for i in range(2)
                                      for n in ("input_layernorm.weight", "post_attention_layernorm.weight")}
KV = {f"model.layers.{i}.self_attn.{p}_proj.{w}" for i in range(2) for p in "kv" for w in ("weight", "bias")}


def _cfg(**kw) -> ModelConfig:
    base = dict(architecture="qwen2", hidden_size=64, intermediate_size=128, num_attention_heads=8,
                num_key_value_heads=2, attention_bias=True, vocab_size=512)
    return ModelConfig(**(base | kw))


def test_layout_rules_and_refusals():
    """Which tensors split k ways, which follow the kv heads, which are replicated; one-line refusals."""
    from jax.sharding import PartitionSpec as P

    cfg = _cfg()
    two, four = tp.plan(cfg, 512, 2), tp.plan(cfg, 512, 4)
    assert two.mesh_shape == (2, 1) and four.mesh_shape == (2, 2)  # 2 kv heads: 2 ways, then replicas
    assert tp.param_spec("model.layers.0.self_attn.q_proj.weight", 2, four) == P(tp.ALL, None)
    assert tp.param_spec("model.layers.0.self_attn.k_proj.bias", 1, four) == P(tp.TP)
    assert tp.param_spec("model.layers.0.self_attn.o_proj.weight", 2, four) == P(None, tp.ALL)
    assert tp.param_spec("model.layers.0.mlp.down_proj.weight", 2, four) == P(None, tp.ALL)
    assert tp.param_spec("lm_head.weight", 2, four) == P(tp.ALL, None)
    assert tp.param_spec("model.layers.0.self_attn.o_proj.bias", 1, four) == P()
    assert tp.kind("model.layers.0.self_attn.k_proj.weight", 2, two) == "split"
    assert tp.kind("model.layers.0.self_attn.k_proj.weight", 2, four) == "kv"
    assert not tp.plan(cfg, 510, 4).vocab_sharded  # an odd vocabulary is replicated, not refused
    with pytest.raises(ValueError, match="num_attention_heads=14 divisible by 4"):
        tp.plan(_cfg(hidden_size=56, num_attention_heads=14), 512, 4)  # Qwen2-0.5B's 14 heads
    with pytest.raises(ValueError, match="intermediate_size=132 divisible by 8"):
        tp.plan(_cfg(intermediate_size=132), 512, 8)


def test_tp_engine_matches_unsharded_on_a_qwen2_checkpoint(tmp_path):
    pytest.importorskip("transformers")
    from rltpu.models.hf.tiny import write_tiny_checkpoint

    ckpt = write_tiny_checkpoint(tmp_path / "qwen2", arch="qwen2", num_heads=8, num_kv_heads=2, hidden_size=64,
                                 intermediate_size=128, with_tokenizer=False, vocab_size=512, seed=3)
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "sampler_tp_child.py"), str(ckpt), "2", "4"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    ref = res["1"]
    assert ref["lengths"] == [64] * 3 and ref["compiles_total"] == 1
    for k in ("2", "4"):
        r = res[k]
        assert r["tokens"] == ref["tokens"], k  # greedy: identical over all 64 tokens of every row
        assert np.abs(np.array(r["logprobs"]) - np.array(ref["logprobs"])).max() <= 1e-5, k
        # the uncached forward weight sync verifies with runs on the sharded weights too
        assert np.abs(np.array(r["probe_logits"]) - np.array(ref["probe_logits"])).max() <= 1e-4, k
        # 0 compiles after precompile: the engine's count, and no XLA compile at all on a repeat call
        assert r["compiles_after_precompile"] == r["compiles_total"] == 1 and r["generate_compiles"] == 0, r
        assert r["backend_compiles_second_call"] == 0, r
        # weight sync's delivery paths (into the shardings / placed by set_params) give the same
        assert r["resync_equal"] == {"device_put_params": True, "torch_to_jax": True}, r["resync_equal"]
        # weight bytes per device: 1/k of the split tensors, 1/2 of the k/v projections (2 kv heads),
        # the replicated ones whole; the replicated ones are exactly the RMSNorm weights
        assert set(r["kinds"]["replicated"]) == REPLICATED, r["kinds"]["replicated"]
        assert set(r["kinds"].get("kv", [])) == (KV if k == "4" else set())
        exp = r["expected"]
        assert r["device_bytes"] == [exp["split"] + exp["kv"] + exp["replicated"]] * int(k), (r["device_bytes"], exp)
        split_total = r["total_bytes"] - exp["replicated"] - exp["kv"] * 2
        assert exp["split"] * int(k) == split_total
        # KV cache split by kv heads: each device's buffers hold 2 / g heads (g = 2 at k = 2 and 4)
        assert r["cache_spec"] == [None, "tp", None, None] and r["cache_shapes"] == ["f32[4,1,80,8]"], r
        # GSPMD reduces activations and never gathers a weight: the all-reduces carry at most one
        # prefill activation (rows 4 x prompt 16 x hidden 64) -- o_proj and down_proj of 2 layers in
        # prefill and decode, and the embedding lookup -- and the only all-gathers are the per-row
        # argmax candidates of the vocabulary-split logits (4 rows x k); a k_proj shard is 512 elements
        big, n = r["max_collective_elements"], r["collectives"]
        assert n["all-reduce"] >= 2 * 2 * 2 + 2 and big["all-reduce"] <= 4 * 16 * 64, (n, big)
        assert big["all-gather"] <= 4 * int(k) and not big["all-to-all"] and not big["collective-permute"], (n, big)
