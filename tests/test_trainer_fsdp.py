"""The trainer engine: FSDP2 over 2 gloo ranks gives the single-process gradients and update,
and a sharded safetensors + JSON checkpoint resumes bit-for-bit.
"""

from __future__ import annotations

import json
import os
import struct
from datetime import timedelta

import numpy as np
import pytest
import torch

from learner.checkpoint import load_checkpoint
from learner.trainer import TrainerEngine
from rltpu.config import ModelConfig, TrainerConfig
from rltpu.control.batch import build_train_batch, split_by_rank
from procs import spawn_ranks

torch.set_num_threads(1)

V, PAD, EOS = 17, 0, 1
G, P, T = 4, 5, 6
SEED = 0
TEMPERATURE = 0.8
MCFG = ModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=64, init_std=0.2)
# two PPO epochs: the second sees a moved policy (ratio != 1, clipping, a non-zero KL gradient through
# the reference model); the grad clip is tiny so clipping (a global norm under FSDP) is active
TCFG = TrainerConfig(lr=1e-2, grad_clip=0.05, warmup_steps=6, kl_coef=0.1, entropy_coef=0.01, ppo_epochs=2,
                     weight_decay=0.01)
JOIN_TIMEOUT_S = 120.0


def synthetic_batch(seed: int = 0) -> dict:
    """2 prompts x G=4 rows; rank 0's rows (prompt 0) are short, rank 1's long: uneven token counts."""
    rng = np.random.default_rng(seed)
    R = 2 * G
    plens = [3] * G + [5] * G
    lengths = np.array([1, 2, 3, 2, 6, 5, 6, 4], np.int32)
    prompt = np.full((R, P), PAD, np.int32)
    pmask = np.zeros((R, P), np.int32)
    for r, n in enumerate(plens):
        prompt[r, P - n:] = rng.integers(2, V, n)
        pmask[r, P - n:] = 1
    tokens = rng.integers(2, V, (R, T)).astype(np.int32)
    live = np.arange(T)[None, :] < lengths[:, None]
    tokens[~live] = PAD
    tokens[np.arange(R), lengths - 1] = np.where(lengths < T, EOS, tokens[np.arange(R), lengths - 1])
    logprobs = (-rng.uniform(0.5, 4.0, (R, T)) * live).astype(np.float32)
    gen = {"prompt": prompt, "prompt_mask": pmask, "tokens": tokens, "logprobs": logprobs, "lengths": lengths}
    rewards = rng.uniform(0, 1, R).astype(np.float32)
    return build_train_batch(gen, rewards, G, scale_rewards=True)


def _global(batch: dict) -> dict:
    return split_by_rank(batch, 1)[0]


def _params(engine: TrainerEngine) -> dict[str, np.ndarray]:
    return {k: v.detach().clone().numpy() for k, v in engine.full_state_dict().items()}


# ---------------------------------------------------------------------------------------------
# FSDP2 over 2 ranks == one process


def _fsdp_worker(rank: int, world: int, port: int, batch: dict, tcfg, q) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        mesh = init_device_mesh("cpu", (world,))
        eng = TrainerEngine(MCFG, tcfg, V, SEED, TEMPERATURE, mesh=mesh)
        emb = eng.model.model.embed_tokens.weight
        sharding = (type(emb).__name__, tuple(emb.to_local().shape) if hasattr(emb, "to_local") else None)
        shard = split_by_rank(batch, world)[rank]
        grads = {k: v.numpy() for k, v in eng.grads(shard).items()}
        stats = eng.train_step(shard)
        params = _params(eng)
        q.put((rank, {"grads": grads, "stats": stats, "params": params, "sharding": sharding}))
    except Exception as e:  # noqa: BLE001 - reported to the parent
        q.put((rank, {"error": f"{type(e).__name__}: {e}"}))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _spawn(world: int, batch: dict, tcfg=TCFG) -> dict[int, dict]:
    out = spawn_ranks(_fsdp_worker, world, (batch, tcfg), JOIN_TIMEOUT_S, "fsdp")
    for rank, res in out.items():
        assert "error" not in res, f"rank {rank}: {res['error']}"
    return out


def test_fsdp_two_ranks_match_single_process_grads_and_step():
    batch = synthetic_batch()
    shards = split_by_rank(batch, 2)
    tokens = [float(s["loss_mask"].sum()) for s in shards]
    assert tokens[0] != tokens[1]  # uneven: the global-token normalizer matters

    single = TrainerEngine(MCFG, TCFG, V, SEED, TEMPERATURE)
    want_grads = {k: v.numpy() for k, v in single.grads(_global(batch)).items()}
    init = _params(single)
    want_stats = single.train_step(_global(batch))
    want_params = _params(single)
    assert want_stats["grad_norm"] > TCFG.grad_clip  # clipping is part of what is compared

    res = _spawn(2, batch)
    for rank in (0, 1):
        r = res[rank]
        # really sharded: embed_tokens (17 rows) is a DTensor holding 9 or 8 rows on this rank
        assert r["sharding"] == ("DTensor", (9 - rank, MCFG.hidden_size))
        assert list(r["grads"]) == list(want_grads)
        for name, g in want_grads.items():
            assert np.abs(g).max() > 0, name
            np.testing.assert_allclose(r["grads"][name], g, rtol=1e-5, atol=1e-6, err_msg=name)
        for name, p in want_params.items():
            assert not np.array_equal(p, init[name]), name  # the step moved every tensor
            np.testing.assert_allclose(r["params"][name], p, rtol=1e-5, atol=1e-6, err_msg=name)
        assert r["stats"]["grad_norm"] == pytest.approx(want_stats["grad_norm"], rel=1e-5)
        assert r["stats"]["lr"] == want_stats["lr"]
    # per-rank sums add up to the single-process sums
    for key in ("tokens", "pg_sum", "entropy_sum", "clipped"):
        total = res[0]["stats"][key] + res[1]["stats"][key]
        assert total == pytest.approx(want_stats[key], rel=1e-5, abs=1e-6), key
    assert [res[r]["stats"]["tokens"] for r in (0, 1)] == tokens


def test_fsdp_two_ranks_match_single_process_with_lora():
    """LoRA under FSDP2 (frozen sharded base, trainable adapters): the adapters' gradients and update
    over 2 ranks equal one process's; the base does not move and has no gradient."""
    from rltpu.config import LoraConfig

    tcfg = TCFG.model_copy(update={"lora": LoraConfig(rank=4, alpha=8.0), "kl_coef": 0.0, "ppo_epochs": 1})
    batch = synthetic_batch(1)
    single = TrainerEngine(MCFG, tcfg, V, SEED, TEMPERATURE)
    init = _params(single)
    want_grads = {k: v.numpy() for k, v in single.grads(_global(batch)).items()}
    want_stats = single.train_step(_global(batch))
    want_params = _params(single)
    adapters = [k for k in init if ".lora_" in k]
    assert sorted(want_grads) == sorted(adapters) and adapters
    assert any(np.abs(g).max() > 0 for k, g in want_grads.items() if "lora_B" in k)  # B = 0: only B moves first
    res = _spawn(2, batch, tcfg)
    for rank in (0, 1):
        r = res[rank]
        assert sorted(r["grads"]) == sorted(adapters)
        for name, g in want_grads.items():
            np.testing.assert_allclose(r["grads"][name], g, rtol=1e-5, atol=1e-7, err_msg=name)
        for name, p in want_params.items():
            np.testing.assert_allclose(r["params"][name], p, rtol=1e-5, atol=1e-7, err_msg=name)
            if ".lora_" not in name:
                assert np.array_equal(p, init[name]), name  # the base is frozen
        assert r["stats"]["grad_norm"] == pytest.approx(want_stats["grad_norm"], rel=1e-5)


# ---------------------------------------------------------------------------------------------
# checkpoints


def test_checkpoint_round_trip_resumes_exactly(tmp_path):
    batch = _global(synthetic_batch(1))
    a = TrainerEngine(MCFG, TCFG, V, SEED, TEMPERATURE)
    a.train_step(batch)
    ckpt = a.save_checkpoint(tmp_path / "checkpoint", {"weight_version": 1})

    # nothing left behind by the atomic write (no pickle: tests/test_checkpoint_sharded.py)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint"]
    meta_on_disk = json.loads((ckpt / "trainer_state.json").read_text())
    assert meta_on_disk["trainer_step"] == 1 and set(meta_on_disk["sha256"]) == {
        "model.index.json", "model-rank00000.safetensors", "optimizer.index.json", "optimizer-rank00000.safetensors"}
    for name in ("model-rank00000.safetensors", "optimizer-rank00000.safetensors"):
        raw = (ckpt / name).read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8:8 + n])
        assert all(v["dtype"] == "F32" for k, v in header.items() if k != "__metadata__")

    b = TrainerEngine(MCFG, TCFG, V, SEED, TEMPERATURE)  # a fresh process would build this
    before = _params(b)
    assert any(not np.array_equal(before[k], v) for k, v in _params(a).items())
    meta = b.load_checkpoint(ckpt)
    assert meta["trainer_step"] == 1 and meta["weight_version"] == 1
    assert b.step == a.step == 1
    for k, v in _params(a).items():
        np.testing.assert_array_equal(_params(b)[k], v, err_msg=k)

    sa, sb = a.train_step(batch), b.train_step(batch)
    sa.pop("seconds"), sb.pop("seconds")
    assert sa == sb
    # 2 train steps x 2 PPO epochs = 4 scheduler steps into a 6-step warm-up: the restored schedule
    assert sa["lr"] == pytest.approx(TCFG.lr * 5 / 6) and a.step == b.step == 2
    pa, pb = _params(a), _params(b)
    for k in pa:
        np.testing.assert_array_equal(pb[k], pa[k], err_msg=k)
    sta, stb = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    assert sta.keys() == stb.keys() and len(sta) == len(pa)
    for ka, va in sta.items():
        vb = stb[ka]
        for f in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(va[f], vb[f]), (ka, f)


def test_checkpoint_resume_needs_the_optimizer_state(tmp_path):
    """Control for the round trip above: a fresh optimizer (same weights) takes a different step."""
    batch = _global(synthetic_batch(1))
    a = TrainerEngine(MCFG, TCFG, V, SEED, TEMPERATURE)
    a.train_step(batch)
    c = TrainerEngine(MCFG, TCFG, V, SEED, TEMPERATURE)
    c.model.load_state_dict(a.model.state_dict())
    a.train_step(batch), c.train_step(batch)
    pa, pc = _params(a), _params(c)
    assert any(not np.allclose(pa[k], pc[k], atol=1e-7) for k in pa)


def test_corrupt_checkpoint_is_refused(tmp_path):
    a = TrainerEngine(MCFG, TCFG, V, SEED, TEMPERATURE)
    a.train_step(_global(synthetic_batch(2)))
    ckpt = a.save_checkpoint(tmp_path / "ck", {})
    load_checkpoint(ckpt)  # intact: loads
    path = ckpt / "model-rank00000.safetensors"
    raw = bytearray(path.read_bytes())
    for i in (-4, -3, -2, -1):  # inside the last tensor's data: still a parseable safetensors file
        raw[i] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="sha256"):
        load_checkpoint(ckpt)


def test_fsdp_micro_batches_and_activation_checkpointing_match_one_pass():
    """Ranks with different lengths plan different micro-batch counts; they agree on the max (else
    FSDP's collectives would not pair up) and the accumulated gradients equal one pass. Logprobs are
    chunked by 3 tokens (checkpointed LM head inside the FSDP root's forward) against unchunked."""
    batch = synthetic_batch()
    tcfg = TCFG.model_copy(update={"micro_batch_tokens": 24, "seq_bucket": 2, "activation_checkpointing": True,
                                   "logprob_chunk_tokens": 3})
    assert TCFG.logprob_chunk_tokens > batch["tokens"].size  # the reference: one chunk
    want = {k: v.numpy() for k, v in TrainerEngine(MCFG, TCFG, V, SEED, TEMPERATURE).grads(_global(batch)).items()}
    res = _spawn(2, batch, tcfg)
    counts = {res[r]["stats"]["micro_batches"] for r in (0, 1)}
    assert len(counts) == 1 and counts.pop() > 1
    for rank in (0, 1):
        for name, g in want.items():
            np.testing.assert_allclose(res[rank]["grads"][name], g, rtol=1e-5, atol=1e-6, err_msg=name)
