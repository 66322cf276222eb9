"""Sharded checkpoints (``learner/checkpoint.py``): each rank writes and reads only its shards, a
resume on another trainer count takes the uninterrupted run's next step, nothing on disk is a
pickle, and a save killed halfway leaves the previous checkpoint loadable.

The reference is one process training two steps without a break; the resumes must reproduce its
second step (loss sums, grad norm, weights) to 1e-5, in both directions: 1 rank -> 2 and 2 -> 1.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import struct
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from learner.checkpoint import latest_valid, load_checkpoint, verify_checkpoint
from learner.trainer import TrainerEngine
from rltpu.control.batch import split_by_rank
from procs import join_gloo, spawn_ranks
from test_trainer_fsdp import MCFG, SEED, TCFG, TEMPERATURE, V, _global, _params, synthetic_batch

torch.set_num_threads(1)
META = {"step": 1, "weight_version": 1}
SUMS = ("pg_sum", "kl_sum", "entropy_sum", "tokens")


def _engine(mesh=None) -> TrainerEngine:
    return TrainerEngine(MCFG, TCFG, V, SEED, TEMPERATURE, mesh=mesh)


def _no_pickle(ckpt: Path) -> list[str]:
    """Every file parses as JSON or as safetensors (8-byte length + JSON header, then raw bytes)."""
    from safetensors.torch import load_file

    names = []
    for f in sorted(ckpt.iterdir()):
        raw = f.read_bytes()
        assert raw[:1] != b"\x80", f  # pickle's protocol marker
        if f.suffix == ".json":
            json.loads(raw)
        else:
            assert f.suffix == ".safetensors", f
            (n,) = struct.unpack("<Q", raw[:8])
            json.loads(raw[8:8 + n])
            load_file(f)
        names.append(f.name)
    return names


def _reshard_worker(rank: int, world: int, port: int, tmp: str, q) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    try:
        join_gloo(rank, world, port)
        mesh = init_device_mesh("cpu", (world,))
        # 1 -> 2: the single process's step-1 checkpoint onto this 2-rank mesh, then step 2, saved by
        # both ranks for the parent to resume alone (2 -> 1)
        eng = _engine(mesh)
        meta = eng.load_checkpoint(Path(tmp) / "one" / "checkpoint")
        stats = eng.train_step(split_by_rank(synthetic_batch(2), world)[rank])
        resumed = {"step": eng.step, "meta_step": meta["step"], "stats": stats, "params": _params(eng)}
        eng.save_checkpoint(Path(tmp) / "two" / "checkpoint", dict(META, step=2))
        q.put((rank, resumed))
    except Exception as e:  # noqa: BLE001 - reported to the parent
        q.put((rank, {"error": f"{type(e).__name__}: {e}"}))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _same_step(got_stats: list[dict], got_params: dict, want_stats: dict, want_params: dict) -> None:
    for key in SUMS:
        assert sum(s[key] for s in got_stats) == pytest.approx(want_stats[key], rel=1e-5, abs=1e-6), key
    for s in got_stats:
        assert s["grad_norm"] == pytest.approx(want_stats["grad_norm"], rel=1e-5)
        assert s["lr"] == pytest.approx(want_stats["lr"], rel=1e-12)
    for name, p in want_params.items():
        np.testing.assert_allclose(got_params[name], p, rtol=1e-5, atol=1e-6, err_msg=name)


def test_resume_on_another_trainer_count_takes_the_uninterrupted_step(tmp_path):
    ref = _engine()  # the uninterrupted run: steps 1, 2, 3 in one process
    ref.train_step(_global(synthetic_batch(1)))
    ref.save_checkpoint(tmp_path / "one" / "checkpoint", META)
    want = ref.train_step(_global(synthetic_batch(2)))
    want_params = _params(ref)
    want3 = ref.train_step(_global(synthetic_batch(3)))
    want3_params = _params(ref)

    res = spawn_ranks(_reshard_worker, 2, (str(tmp_path),), 120, "reshard")
    for rank, r in res.items():
        assert "error" not in r, f"rank {rank}: {r['error']}"
    # 1 -> 2
    assert [res[r]["step"] for r in (0, 1)] == [2, 2] and res[0]["meta_step"] == 1
    _same_step([res[0]["stats"], res[1]["stats"]], res[0]["params"], want, want_params)

    # 2 -> 1: each rank wrote only its own rows (embed_tokens: 17 rows as 9 + 8), no pickle anywhere
    two = tmp_path / "two" / "checkpoint"
    assert _no_pickle(two) == sorted(
        [f"{part}{suffix}" for part in ("model", "optimizer")
         for suffix in (".index.json", "-rank00000.safetensors", "-rank00001.safetensors")] + ["trainer_state.json"])
    index = json.loads((two / "model.index.json").read_text())
    chunks = index["tensors"]["model.embed_tokens.weight"]["chunks"]
    assert [(c["file"], c["offsets"], c["sizes"]) for c in chunks] == [
        ("model-rank00000.safetensors", [0, 0], [9, 32]), ("model-rank00001.safetensors", [9, 0], [8, 32])]
    assert verify_checkpoint(two)["layout"] == {"format": "sharded", "parts": ["model", "optimizer"], "world": 2}
    alone = _engine()
    assert alone.load_checkpoint(two)["trainer_step"] == 2
    for name, p in res[0]["params"].items():  # the 2-rank weights, bit for bit
        np.testing.assert_array_equal(_params(alone)[name], p, err_msg=name)
    _same_step([alone.train_step(_global(synthetic_batch(3)))], _params(alone), want3, want3_params)


def test_resume_without_the_optimizer_state_differs(tmp_path):
    """Control for the comparison above: same weights, fresh AdamW state -> another step."""
    ref = _engine()
    ref.train_step(_global(synthetic_batch(1)))
    fresh = _engine()
    fresh.model.load_state_dict(ref.model.state_dict())
    ref.train_step(_global(synthetic_batch(2))), fresh.train_step(_global(synthetic_batch(2)))
    a, b = _params(ref), _params(fresh)
    assert any(not np.allclose(a[k], b[k], rtol=1e-5, atol=1e-6) for k in a)


def _killed_saver(tmp: str, q) -> None:
    """Save step 1, then start saving step 2 and block once its first shard file is on disk."""
    import learner.checkpoint as ck

    torch.set_num_threads(1)
    eng = _engine()
    eng.train_step(_global(synthetic_batch(1)))
    eng.save_checkpoint(Path(tmp) / "checkpoint", META, keep=2)
    eng.train_step(_global(synthetic_batch(2)))
    write = ck.write_chunks

    def write_then_block(path, tensors, metadata=None):
        digest = write(path, tensors, metadata)
        q.put(str(path))
        time.sleep(600)
        return digest

    ck.write_chunks = write_then_block
    eng.save_checkpoint(Path(tmp) / "checkpoint", dict(META, step=2), keep=2)


def test_sigkill_during_a_save_leaves_the_previous_checkpoint(tmp_path):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_killed_saver, args=(str(tmp_path), q), daemon=True)
    proc.start()
    try:
        written = q.get(timeout=120)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
    assert Path(written).parent.name == "checkpoint.tmp" and Path(written).is_file()
    ck = tmp_path / "checkpoint"
    assert latest_valid(ck) == ck and verify_checkpoint(ck)["step"] == 1
    ref = _engine()
    ref.train_step(_global(synthetic_batch(1)))
    loaded = _engine()
    loaded.load_checkpoint(ck)
    for name, p in _params(ref).items():
        np.testing.assert_array_equal(_params(loaded)[name], p, err_msg=name)

    # the next save clears the half-written tmp; a crash between its renames (the newest already
    # moved to .prev, tmp not yet in place) leaves .prev, which the save after keeps until it lands
    loaded.save_checkpoint(ck, dict(META, step=2), keep=2)
    assert not ck.with_name("checkpoint.tmp").exists() and verify_checkpoint(ck)["step"] == 2
    ck.with_name("checkpoint.prev").rename(tmp_path / "gone")
    ck.rename(ck.with_name("checkpoint.prev"))
    assert latest_valid(ck) == ck.with_name("checkpoint.prev")
    loaded.save_checkpoint(ck, dict(META, step=3), keep=2)
    assert [verify_checkpoint(p)["step"] for p in (ck, ck.with_name("checkpoint.prev"))] == [3, 2]


def test_checkpoint_of_the_full_file_layout_still_loads(tmp_path):
    """A checkpoint written before sharding (``model.safetensors`` + ``optimizer.safetensors``, rank 0's
    full state): it loads, and the next step equals the uninterrupted run's."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    ref = _engine()
    ref.train_step(_global(synthetic_batch(1)))
    old = tmp_path / "checkpoint"
    old.mkdir()
    save_file({k: v.contiguous() for k, v in ref.model.state_dict().items()}, old / "model.safetensors")
    osd = get_optimizer_state_dict(ref.model, ref.optimizer)
    save_file({f"state.{p}.{k}": v for p, st in osd["state"].items() for k, v in st.items()},
              old / "optimizer.safetensors")
    (old / "trainer_state.json").write_text(json.dumps(
        dict(META, trainer_step=1, scheduler=ref.scheduler.state_dict(), optimizer_param_groups=osd["param_groups"],
             extra_param_groups={}, sha256={f.name: hashlib.sha256(f.read_bytes()).hexdigest()  # as the old writer
                                             for f in sorted(old.glob("*.safetensors"))})))
    loaded = _engine()
    loaded.load_checkpoint(old)
    want, got = ref.train_step(_global(synthetic_batch(2))), loaded.train_step(_global(synthetic_batch(2)))
    _same_step([got], _params(loaded), want, _params(ref))
    model_sd, optim_sd, _ = load_checkpoint(old)
    assert set(model_sd) == set(_params(ref)) and set(optim_sd["state"]) == set(model_sd)


def _tp_worker(rank: int, world: int, port: int, tmp: str, q) -> None:
    import torch.distributed as dist

    from learner.fsdp import trainer_mesh
    from rltpu.chips.runtime import mesh_groups
    from test_trainer_tp import MCFG as TP_MCFG, TCFG as TP_TCFG, TP

    try:
        join_gloo(rank, world, port)
        mesh = trainer_mesh(dist.group.WORLD, "cpu", tp=TP, groups=mesh_groups(world, TP, rank))
        shard = lambda seed: split_by_rank(synthetic_batch(seed), world // TP)[rank // TP]  # noqa: E731
        eng = TrainerEngine(TP_MCFG, TP_TCFG, V, SEED, TEMPERATURE, mesh=mesh)
        eng.load_checkpoint(Path(tmp) / "one" / "checkpoint")
        stats = eng.train_step(shard(2))
        resumed = {"stats": stats, "params": {k: v.numpy() for k, v in eng.full_state_dict().items()}}
        eng.save_checkpoint(Path(tmp) / "tp" / "checkpoint", dict(META, step=2))
        q.put((rank, resumed))
    except Exception as e:  # noqa: BLE001 - reported to the parent
        q.put((rank, {"error": f"{type(e).__name__}: {e}"}))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_fsdp_x_tp_mesh_resumes_from_one_process_and_back(tmp_path):
    """2 x 2 ("dp", "tp") ranks resume a single process's checkpoint, and one process resumes theirs
    (q/k/v split by rows and o_proj by columns across TP, then FSDP over dp): the next step is the
    uninterrupted one's."""
    from test_trainer_tp import MCFG as TP_MCFG, PARAM_ATOL, TCFG as TP_TCFG, TP

    ref = TrainerEngine(TP_MCFG, TP_TCFG, V, SEED, TEMPERATURE)
    ref.train_step(_global(synthetic_batch(1)))
    ref.save_checkpoint(tmp_path / "one" / "checkpoint", META)
    want = ref.train_step(_global(synthetic_batch(2)))
    want_params = _params(ref)
    want3 = ref.train_step(_global(synthetic_batch(3)))

    res = spawn_ranks(_tp_worker, 4, (str(tmp_path),), 180, "tp checkpoint")
    for rank, r in res.items():
        assert "error" not in r, f"rank {rank}: {r['error']}"
    # a TP group shares one batch shard: the loss sums of one rank per TP group add up to the whole
    got = [res[r]["stats"] for r in range(0, 4, TP)]
    assert sum(s["pg_sum"] for s in got) == pytest.approx(want["pg_sum"], rel=1e-5, abs=1e-6)
    assert got[0]["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
    for name, p in want_params.items():
        np.testing.assert_allclose(res[0]["params"][name], p, rtol=1e-5, atol=PARAM_ATOL, err_msg=name)

    tp_ck = tmp_path / "tp" / "checkpoint"
    _no_pickle(tp_ck)
    chunks = json.loads((tp_ck / "model.index.json").read_text())["tensors"]["model.layers.0.self_attn.o_proj.weight"]["chunks"]
    assert sorted(tuple(c["offsets"]) for c in chunks) == [(0, 0), (0, 16), (16, 0), (16, 16)]  # columns x rows
    alone = TrainerEngine(TP_MCFG, TP_TCFG, V, SEED, TEMPERATURE)
    alone.load_checkpoint(tp_ck)
    for name, p in res[0]["params"].items():  # the mesh's weights, bit for bit
        np.testing.assert_array_equal(_params(alone)[name], p, err_msg=name)
    got = alone.train_step(_global(synthetic_batch(3)))
    assert got["pg_sum"] == pytest.approx(want3["pg_sum"], rel=1e-5, abs=1e-6)
    assert got["grad_norm"] == pytest.approx(want3["grad_norm"], rel=1e-5)
