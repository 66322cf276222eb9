"""Peak host memory while 2 FSDP2 trainer ranks load a ~500M-parameter HF checkpoint.

    python benchmarks/load_memory.py [--dtype float32|bfloat16] [--dir /tmp/rltpu-load-memory] [--keep]

Writes a Qwen2-0.5B-shaped checkpoint (hidden 896, 24 layers, vocab 151936, tied, q/k/v bias:
494M parameters) as safetensors shards with an index, streamed tensor by tensor with random
values, then spawns 2 gloo ranks that each build ``TrainerEngine`` from ``model.path`` (meta
build -> ``fully_shard`` -> each rank reads only its rows). The parent samples every rank's
VmRSS from /proc every 5 ms; each rank also reports its RSS before loading and its
``ru_maxrss``. One JSON document on stdout; the claim is ``peak_rss_sum / checkpoint_bytes``
< 1.5 (the rank processes' whole resident memory, interpreter and torch included).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import shutil
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

QWEN2_05B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu", "hidden_size": 896,
    "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
    "vocab_size": 151936, "use_sliding_window": False, "sliding_window": None, "max_window_layers": 21,
    "bos_token_id": None, "eos_token_id": 151645,
}
SHARD_BYTES = 500 * 2**20


def vm_rss(pid: int | str = "self") -> int:
    """Resident set size in bytes (anonymous + file-backed pages) from /proc."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def write_checkpoint(out: Path, dtype: str) -> int:
    """Random weights for QWEN2_05B in shards of ~500 MB + index; returns the bytes of tensor data."""
    import torch

    from rltpu.config import ModelConfig
    from rltpu.models.hf.weights import write_safetensors
    from rltpu.models.spec import param_shapes

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(dict(QWEN2_05B, dtype=dtype), indent=1))
    cfg = ModelConfig(path=str(out))
    shapes = param_shapes(cfg)
    itemsize = 4 if dtype == "float32" else 2
    shards, cur, size = [], [], 0
    for name, shape in shapes.items():
        nbytes = itemsize * int(torch.tensor(shape).prod())
        if cur and size + nbytes > SHARD_BYTES:
            shards.append(cur)
            cur, size = [], 0
        cur.append((name, tuple(shape), dtype))
        size += nbytes
    shards.append(cur)
    gen = torch.Generator().manual_seed(0)

    def rand(name: str):
        shape = shapes[name]
        if len(shape) == 1:
            return torch.ones(shape) + 0.01 * torch.randn(shape, generator=gen)
        return torch.randn(shape, generator=gen) * 0.02

    weight_map, total = {}, 0
    for i, spec in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(out / fname, spec, rand, metadata={"format": "pt"})
        weight_map.update({name: fname for name, _, _ in spec})
        total += sum(itemsize * int(torch.tensor(s).prod()) for _, s, _ in spec)
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return total


def _rank(rank: int, world: int, port: int, path: str, q) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from learner.trainer import TrainerEngine
    from rltpu.config import ModelConfig, TrainerConfig

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    mesh = init_device_mesh("cpu", (world,))
    cfg = ModelConfig(path=path)
    dist.barrier()
    before = vm_rss()
    t0 = time.perf_counter()
    eng = TrainerEngine(cfg, TrainerConfig(), cfg.vocab_size, 0, mesh=mesh)
    load_s = time.perf_counter() - t0
    local = sum(p.to_local().numel() * p.element_size() for p in eng.model.parameters())
    dist.barrier()
    q.put((rank, {"rss_before_load": before, "rss_after_load": vm_rss(), "load_s": round(load_s, 2),
                  "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "local_param_bytes": local}))
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--dir", default="/tmp/rltpu-load-memory")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint (reused by the next run)")
    args = ap.parse_args()
    out = Path(args.dir) / args.dtype
    t0 = time.perf_counter()
    if (out / "model.safetensors.index.json").is_file():
        ckpt_bytes = json.loads((out / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
    else:
        ckpt_bytes = write_checkpoint(out, args.dtype)
    write_s = time.perf_counter() - t0

    from procs import spawn_ranks

    peak = {"sum": 0}
    stop = threading.Event()

    def monitor():
        while not stop.is_set():
            total = 0
            for child in multiprocessing.active_children():
                try:
                    total += vm_rss(child.pid)
                except (FileNotFoundError, ProcessLookupError):
                    pass
            peak["sum"] = max(peak["sum"], total)
            time.sleep(0.005)

    th = threading.Thread(target=monitor, daemon=True)
    th.start()
    t1 = time.perf_counter()
    reports = spawn_ranks(_rank, 2, (str(out),), timeout_s=900, what="load_memory")
    stop.set()
    th.join()
    n_params = ckpt_bytes // (4 if args.dtype == "float32" else 2)
    result = {
        "checkpoint": {"dtype": args.dtype, "params": n_params, "bytes": ckpt_bytes,
                       "shards": len(list(out.glob("*.safetensors"))), "write_s": round(write_s, 1)},
        "ranks": 2,
        "peak_rss_sum_bytes": peak["sum"],
        "peak_rss_sum_over_checkpoint": round(peak["sum"] / ckpt_bytes, 3),
        "ru_maxrss_sum_over_checkpoint": round(sum(r["ru_maxrss"] for r in reports.values()) / ckpt_bytes, 3),
        "rss_before_load_sum_bytes": sum(r["rss_before_load"] for r in reports.values()),
        "load_increase_over_checkpoint": round(
            (peak["sum"] - sum(r["rss_before_load"] for r in reports.values())) / ckpt_bytes, 3),
        "local_param_bytes": [reports[r]["local_param_bytes"] for r in (0, 1)],
        "load_s": [reports[r]["load_s"] for r in (0, 1)],
        "wall_s": round(time.perf_counter() - t1, 1),
        "under_1_5x": peak["sum"] < 1.5 * ckpt_bytes,
    }
    print(json.dumps(result, indent=1))
    if not args.keep:
        shutil.rmtree(out, ignore_errors=True)
    return 0 if result["under_1_5x"] else 1


if __name__ == "__main__":
    sys.exit(main())
