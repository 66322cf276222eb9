"""Peak host memory per trainer rank while saving and resuming a checkpoint: sharded vs full gather.

    python benchmarks/checkpoint.py [--layers 24] [--ranks 2] [--impl gather,sharded] [--dir /tmp/rltpu-ckpt-bench]

A Qwen2-0.5B-shaped policy (hidden 896, vocab 151936, tied, q/k/v bias; ``--layers`` of its 24
decoder layers, random weights written locally as an HF directory by ``load_memory.write_checkpoint``)
is built on ``--ranks`` gloo FSDP2 ranks from that directory (each rank streams its rows), takes
one GRPO step (so AdamW has its state), and saves; fresh ranks then build the policy and resume.
Per rank and phase: ``base`` = RSS of the process with torch and its process group up but no
model, ``shard`` = the bytes of this rank's model + optimizer shards, ``idle`` = RSS just before the
save / load, ``peak`` = VmHWM over the save / load (reset with /proc/self/clear_refs). The claim
(issue 16): ``peak <= base + 1.5 * shard`` on every rank, for ``sharded``.

- ``gather`` (before: rltpu up to 9fcaf98's parent): rank 0 gathers the full model and optimizer
  (``full_state_dict``, CPU offload) and writes ``model.safetensors`` + ``optimizer.safetensors``;
  every rank reads both full files on resume (``learner.checkpoint`` still loads that layout).
- ``sharded`` (now): ``TrainerEngine.save_checkpoint`` / ``load_checkpoint``, each rank its own shards;
  then ``rltpu export`` of it in one process (peak against the largest tensor and the model).

One JSON document on stdout. Each impl costs two spawns of ``--ranks`` processes.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import os
import shutil
import sys
import time
from datetime import timedelta
from pathlib import Path

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")  # no TorchTPU/libtpu probe in the ranks on CPU
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import load_memory  # noqa: E402  (the Qwen2-0.5B shape and its checkpoint writer)


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _settle() -> int:
    """Free what the step left in the allocator's arenas, then the RSS and a fresh high-water mark."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    return _status("VmRSS")


def _shard_bytes(eng) -> int:
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    n = sum(local(p).numel() * p.element_size() for p in eng.model.parameters())
    for st in eng.optimizer.state.values():
        n += sum(local(v).numel() * v.element_size() for v in st.values() if hasattr(v, "numel"))
    return n


def _gather_save(eng, directory: Path, rank: int) -> None:
    """What rltpu did before sharded checkpoints: the full state on rank 0, two safetensors files."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_model_state_dict, get_optimizer_state_dict)

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd = get_model_state_dict(eng.model, options=opts)
    osd = get_optimizer_state_dict(eng.model, eng.optimizer, options=opts)
    if rank != 0:
        return
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in msd.items()}, directory / "model.safetensors")
    save_file({f"state.{p}.{k}": v.contiguous() for p, st in osd["state"].items() for k, v in st.items()},
              directory / "optimizer.safetensors")
    (directory / "trainer_state.json").write_text(json.dumps(
        {"trainer_step": eng.step, "scheduler": eng.scheduler.state_dict(), "sha256": {},
         "optimizer_param_groups": osd["param_groups"], "extra_param_groups": {}}))


def _rank(rank: int, world: int, port: int, hf_dir: str, ckpt: str, impl: str, phase: str, q) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import numpy as np
    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from learner.trainer import TrainerEngine
    from rltpu.config import ModelConfig, RunConfig, TrainerConfig
    from rltpu.control.batch import build_train_batch, split_by_rank

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=1800))
    mesh = init_device_mesh("cpu", (world,))
    base = _settle()
    cfg = ModelConfig(path=hf_dir)
    t0 = time.perf_counter()
    eng = TrainerEngine(cfg, TrainerConfig(kl_coef=0.0), cfg.vocab_size, 0, mesh=mesh)
    out = {"base": base, "build_s": round(time.perf_counter() - t0, 1)}
    if phase == "save":
        rng = np.random.default_rng(0)
        R, P, T = 2 * world, 4, 4  # a tiny step: it only has to give AdamW its state
        gen = {"prompt": rng.integers(3, 1000, (R, P)).astype(np.int32), "prompt_mask": np.ones((R, P), np.int32),
               "tokens": rng.integers(3, 1000, (R, T)).astype(np.int32),
               "logprobs": -rng.uniform(0.5, 3, (R, T)).astype(np.float32), "lengths": np.full(R, T, np.int32)}
        batch = build_train_batch(gen, rng.uniform(0, 1, R).astype(np.float32), 2, True)
        t0 = time.perf_counter()
        eng.train_step(split_by_rank(batch, world)[rank])
        eng.optimizer.zero_grad(set_to_none=True)
        out["step_s"] = round(time.perf_counter() - t0, 1)
    dist.barrier()
    out["idle"] = _settle()
    t0 = time.perf_counter()
    if phase == "save":
        if impl == "gather":
            _gather_save(eng, Path(ckpt), rank)
        else:  # the run config (model.path left out: the export writes a character tokenizer)
            run = RunConfig.model_validate({"model": {"path": hf_dir}}).to_dict()
            run["model"].pop("path")
            eng.save_checkpoint(Path(ckpt), {"step": 1, "config": run})
    else:
        eng.load_checkpoint(Path(ckpt))
    out["seconds"] = round(time.perf_counter() - t0, 2)
    out["peak"] = _status("VmHWM")
    out["shard"] = _shard_bytes(eng)
    dist.barrier()
    q.put((rank, out))
    dist.destroy_process_group()


def _export(rank: int, world: int, port: int, ckpt: str, out: str, q) -> None:
    """``rltpu export`` of the sharded checkpoint in one process: its peak against the largest tensor."""
    import torch  # noqa: F401  (the runtime the export runs with, in the base figure)

    from rltpu.models.hf.export import export_checkpoint
    from rltpu.models.hf.shards import ShardedPart

    part = ShardedPart(ckpt, "model")
    largest = max(math.prod(part.shape(n)) * 4 for n in part.names())
    base = _settle()
    t0 = time.perf_counter()
    export_checkpoint(ckpt, out)
    q.put((rank, {"base_mb": round(base / 2**20), "peak_mb": round(_status("VmHWM") / 2**20),
                  "largest_tensor_mb": round(largest / 2**20), "seconds": round(time.perf_counter() - t0, 1),
                  "model_mb": round(sum(f.stat().st_size for f in Path(out).glob("*.safetensors")) / 2**20)}))


def _figures(reports: dict) -> list[dict]:
    rows = []
    for rank in sorted(reports):
        r = reports[rank]
        rows.append({"rank": rank, "base_mb": round(r["base"] / 2**20), "shard_mb": round(r["shard"] / 2**20),
                     "idle_mb": round(r["idle"] / 2**20), "peak_mb": round(r["peak"] / 2**20),
                     "peak_over_base_in_shards": round((r["peak"] - r["base"]) / r["shard"], 3),
                     "extra_over_idle_in_shards": round((r["peak"] - r["idle"]) / r["shard"], 3),
                     "seconds": r["seconds"], "build_s": r["build_s"], "step_s": r.get("step_s")})
    return rows


def main() -> int:
    from procs import spawn_ranks

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24, help="decoder layers of the 24 in Qwen2-0.5B")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--impl", default="gather,sharded")
    ap.add_argument("--dir", default="/tmp/rltpu-ckpt-bench")
    ap.add_argument("--keep", action="store_true", help="keep the files (the HF directory is reused)")
    args = ap.parse_args()
    root = Path(args.dir)
    hf_dir = root / f"qwen2-0.5b-{args.layers}l"
    load_memory.QWEN2_05B = dict(load_memory.QWEN2_05B, num_hidden_layers=args.layers)
    if not (hf_dir / "model.safetensors.index.json").is_file():
        load_memory.write_checkpoint(hf_dir, "float32")
    params = json.loads((hf_dir / "model.safetensors.index.json").read_text())["metadata"]["total_size"] // 4
    result = {"model": {"shape": "Qwen2-0.5B", "layers": args.layers, "params": params, "dtype": "float32"},
              "ranks": args.ranks, "claim": "peak <= base + 1.5 * shard on every rank (sharded)"}
    ok = True
    for impl in args.impl.split(","):
        ckpt = root / f"checkpoint-{impl}"
        shutil.rmtree(ckpt, ignore_errors=True)
        res = {}
        for phase in ("save", "resume"):
            t0 = time.perf_counter()
            reports = spawn_ranks(_rank, args.ranks, (str(hf_dir), str(ckpt), impl, phase), 1800, f"{impl} {phase}")
            res[phase] = {"wall_s": round(time.perf_counter() - t0, 1), "per_rank": _figures(reports)}
        res["files"] = sorted(p.name for p in ckpt.iterdir())
        if impl == "sharded":
            res["export"] = spawn_ranks(_export, 1, (str(ckpt), str(root / "exported")), 1800, "export")[0]
            shutil.rmtree(root / "exported", ignore_errors=True)
        res["within_1_5x"] = all(r["peak_over_base_in_shards"] <= 1.5 for ph in ("save", "resume")
                                 for r in res[ph]["per_rank"])
        result["before" if impl == "gather" else "after"] = res
        if impl == "sharded":
            ok = ok and res["within_1_5x"]
        if not args.keep:
            shutil.rmtree(ckpt, ignore_errors=True)
    if not args.keep:
        shutil.rmtree(hf_dir, ignore_errors=True)
    print(json.dumps(result, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
