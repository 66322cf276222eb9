"""Trainer memory per rank and weight-sync bytes per step, full-parameter vs LoRA (issue 20, acceptance 3).

    python benchmarks/lora_memory.py [--layers 24] [--ranks 2] [--rank 8] [--dir /tmp/rltpu-lora-bench]

A Qwen2-0.5B-shaped policy (random weights written locally as an HF directory by
``load_memory.write_checkpoint``; ``--layers`` of its 24 decoder layers) is built on ``--ranks`` gloo
FSDP2 ranks, each streaming its rows, once with every parameter trained and once with
``trainer.lora`` (rank ``--rank``, all seven projections), and takes one GRPO step on a small batch.
Per rank, measured on the live engine: local bytes of parameters (base / adapters), of gradients
(before ``zero_grad``) and of AdamW states; RSS after the step and its peak (VmHWM, reset before the
build). Sync bytes per step: what every trainer's ``send_shards`` puts on the wire for a sync after
the first (``plan_stream`` over the full spec vs the adapter spec; the first LoRA sync moves the full
spec once). One JSON document on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import load_memory  # noqa: E402  (the Qwen2-0.5B shape and its checkpoint writer)
from checkpoint import _status  # noqa: E402  (VmRSS / VmHWM of this process, as benchmarks/checkpoint.py reads them)


def _rank(rank: int, world: int, port: int, hf_dir: str, lora_rank: int, q) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from learner.trainer import TrainerEngine
    from rltpu.config import LoraConfig, ModelConfig, TrainerConfig
    from rltpu.control.batch import build_train_batch, split_by_rank

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=1800))
    mesh = init_device_mesh("cpu", (world,))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base_rss = _status("VmRSS")
    cfg = ModelConfig(path=hf_dir)
    lora = LoraConfig(rank=lora_rank, alpha=2 * lora_rank) if lora_rank else None
    eng = TrainerEngine(cfg, TrainerConfig(kl_coef=0.0, lora=lora), cfg.vocab_size, 0, mesh=mesh)
    rng = np.random.default_rng(0)
    R, P, T = 2 * world, 8, 8
    gen = {"prompt": rng.integers(3, 1000, (R, P)).astype(np.int32), "prompt_mask": np.ones((R, P), np.int32),
           "tokens": rng.integers(3, 1000, (R, T)).astype(np.int32),
           "logprobs": -rng.uniform(0.5, 3, (R, T)).astype(np.float32), "lengths": np.full(R, T, np.int32)}
    batch = split_by_rank(build_train_batch(gen, rng.uniform(0, 1, R).astype(np.float32), 2, True), world)[rank]
    # grads stay alive for the count: run the step's pieces (grads + update) through train_step, then count
    t0 = time.perf_counter()
    eng.train_step(batch)
    step_s = time.perf_counter() - t0
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    from rltpu.models.spec import is_adapter

    out = {"base_rss": base_rss, "step_s": round(step_s, 1), "param_base_bytes": 0, "param_adapter_bytes": 0,
           "grad_bytes": 0, "adam_bytes": 0}
    for name, p in eng.model.named_parameters():
        t = local(p)
        out["param_adapter_bytes" if is_adapter(name) else "param_base_bytes"] += t.numel() * t.element_size()
        if p.grad is not None:  # train_step leaves the last gradients in place (zeroed at the next step)
            g = local(p.grad)
            out["grad_bytes"] += g.numel() * g.element_size()
    for st in eng.optimizer.state.values():
        out["adam_bytes"] += sum(local(v).numel() * v.element_size() for v in st.values()
                                 if hasattr(v, "numel") and v.dim() > 0)
    out["rss_after_step"] = _status("VmRSS")
    out["peak_rss"] = _status("VmHWM")
    out["trained_state_bytes"] = out["param_adapter_bytes"] + out["grad_bytes"] + out["adam_bytes"]
    q.put((rank, out))
    dist.destroy_process_group()


def sync_bytes(cfg, vocab: int, lora, world: int, bucket_mb: float = 16, first: bool = False) -> int:
    """Bytes all trainer streams send in one sync (``plan_stream``, exactly what ``send_shards`` sends);
    with LoRA the adapters, or (``first``) the base and the adapters."""
    from rltpu.sync.collective import adapter_spec, param_spec, plan_stream

    spec = param_spec(cfg, vocab, lora)
    spec = adapter_spec(spec) if lora is not None and not first else spec
    return sum(m.nbytes for r in range(world) for m in plan_stream(spec, world, r, int(bucket_mb * 2**20)))


def main() -> int:
    from procs import spawn_ranks

    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rank", type=int, default=8, help="LoRA rank")
    ap.add_argument("--dir", default="/tmp/rltpu-lora-bench")
    args = ap.parse_args()
    root = Path(args.dir)
    hf_dir = root / f"qwen2-0.5b-{args.layers}l"
    load_memory.QWEN2_05B = dict(load_memory.QWEN2_05B, num_hidden_layers=args.layers)
    if not (hf_dir / "config.json").is_file():
        load_memory.write_checkpoint(hf_dir, "float32")
    from rltpu.config import LoraConfig, ModelConfig

    cfg = ModelConfig(path=str(hf_dir))
    lora = LoraConfig(rank=args.rank, alpha=2 * args.rank)
    from rltpu.models.spec import lora_shapes, param_shapes

    result = {"model": {"shape": "Qwen2-0.5B", "layers": args.layers, "dtype": "float32",
                        "params": sum(int(__import__("math").prod(s)) for s in param_shapes(cfg).values()),
                        "lora_params": sum(int(__import__("math").prod(s)) for s in lora_shapes(cfg, lora).values())},
              "ranks": args.ranks, "lora_rank": args.rank, "runs": {}}
    for name, r in (("lora", args.rank), ("full", 0)):
        out = spawn_ranks(_rank, args.ranks, (str(hf_dir), r), 3600, name)
        result["runs"][name] = {"per_rank": out, "sync_bytes_per_step": sync_bytes(cfg, cfg.vocab_size,
                                                                                    lora if r else None, args.ranks)}
        print(json.dumps({name: result["runs"][name]}), file=sys.stderr, flush=True)  # each run as it lands
    result["runs"]["lora"]["first_sync_bytes"] = sync_bytes(cfg, cfg.vocab_size, lora, args.ranks, first=True)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
