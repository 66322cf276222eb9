"""Trainer throughput: FSDP2 ranks vs one plain process, against this machine's GEMM peak.

    .venv/bin/python benchmarks/trainer.py [--rows 16] [--len 128] [--steps 4] [--ranks 2] [--out FILE]

Model: the ~20M-parameter Llama of benchmarks/sampler.py (hidden 512, intermediate 1376, 6 layers,
8 heads / 4 KV heads, vocab 8192, tied embeddings). One GRPO ``train_step`` (forward, loss,
backward, grad clip, AdamW) on a fixed random batch of ``rows`` x ``len`` tokens per rank (first
quarter prompt, rest completion):

  single  one process, all CPUs as torch threads, the whole batch (``ranks`` x ``rows`` rows)
  fsdp    ``ranks`` gloo processes (``rltpu.learner`` TrainerEngine with a DeviceMesh), one pinned
          CPU and one thread each, ``rows`` rows per rank

Reported: median step seconds, tokens/s (all computed positions), model FLOP/s per step
(6 x params x tokens for the matmuls, including the tied LM head, + 12 x layers x len x hidden per
token for attention scores) and its fraction of a 2048^3 fp32 ``torch.mm`` timed in the same
process with the same threads (the practical peak), and the FSDP overhead ratio: FSDP seconds
per token / single-process seconds per token. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from rltpu.config import ModelConfig, TrainerConfig  # noqa: E402

MCFG = ModelConfig(hidden_size=512, intermediate_size=1376, num_hidden_layers=6, num_attention_heads=8,
                   num_key_value_heads=4, max_position_embeddings=512, tie_word_embeddings=True, vocab_size=8192)
V = 8192


def model_flops_per_token(cfg: ModelConfig, L: int) -> float:
    from rltpu.models.spec import param_shapes

    n = sum(int(np.prod(s)) for k, s in param_shapes(cfg, V).items() if not k.endswith("norm.weight"))
    # embed_tokens is tied: as the LM head it is a matmul, as the input lookup it is not (counted once)
    attn = 12 * cfg.num_hidden_layers * L * cfg.hidden_size  # QK^T and PV, forward + backward, full TxT
    return 6.0 * n + attn


def make_batch(rows: int, L: int, seed: int) -> dict:
    from rltpu.control.batch import build_train_batch, split_by_rank

    rng = np.random.default_rng(seed)
    P, T = L // 4, L - L // 4
    gen = {"prompt": rng.integers(3, V, (rows, P)).astype(np.int32), "prompt_mask": np.ones((rows, P), np.int32),
           "tokens": rng.integers(3, V, (rows, T)).astype(np.int32),
           "logprobs": -rng.uniform(5, 10, (rows, T)).astype(np.float32), "lengths": np.full(rows, T, np.int32)}
    rewards = rng.uniform(0, 1, rows).astype(np.float32)
    return build_train_batch(gen, rewards, group_size=rows // 2 if rows >= 4 else rows)


def gemm_gflops(n: int = 2048, reps: int = 4) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = min(_timed(lambda: torch.mm(a, b)) for _ in range(reps))
    return 2.0 * n**3 / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_engine(batch: dict, steps: int, tcfg: TrainerConfig, mesh=None) -> list[float]:
    from learner.trainer import TrainerEngine

    eng = TrainerEngine(MCFG, tcfg, V, seed=0, mesh=mesh)
    eng.train_step(batch)  # warm-up (allocator, first-touch)
    return [eng.train_step(batch)["seconds"] for _ in range(steps)]


def _rank(rank: int, world: int, port: int, args, q) -> None:
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from rltpu.control.batch import split_by_rank

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=600))
        mesh = init_device_mesh("cpu", (world,))
        batch = split_by_rank(make_batch(args.rows * world, args.len, 0), world)[rank]
        peak = gemm_gflops()
        dist.barrier()
        secs = run_engine(batch, args.steps, tcfg(args), mesh)
        q.put((rank, {"seconds": secs, "gemm_gflops": peak}))
    except Exception as e:  # noqa: BLE001 - reported to the parent
        q.put((rank, {"error": f"{type(e).__name__}: {e}"}))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def tcfg(args) -> TrainerConfig:
    return TrainerConfig(lr=1e-4, micro_batch_tokens=args.micro_batch_tokens, mixed_precision=args.precision,
                         activation_checkpointing=args.ac)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=16, help="rows per rank")
    ap.add_argument("--len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--micro-batch-tokens", type=int, default=0)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--ac", action="store_true", help="activation checkpointing")
    ap.add_argument("--out")
    args = ap.parse_args()
    from rltpu.control.batch import split_by_rank
    from rltpu.models.spec import param_shapes

    fpt = model_flops_per_token(MCFG, args.len)
    ncpu = len(os.sched_getaffinity(0))

    # single process: every CPU, the whole batch
    torch.set_num_threads(ncpu)
    batch = split_by_rank(make_batch(args.rows * args.ranks, args.len, 0), 1)[0]
    peak1 = gemm_gflops()
    s_single = statistics.median(run_engine(batch, args.steps, tcfg(args)))
    tok_single = args.rows * args.ranks * args.len

    # FSDP ranks
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank, args=(r, args.ranks, port, args, q)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    res = dict(q.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    errors = {r: v["error"] for r, v in res.items() if "error" in v}
    if errors:
        raise SystemExit(f"fsdp ranks failed: {errors}")
    s_fsdp = statistics.median(max(res[r]["seconds"][i] for r in res) for i in range(args.steps))
    tok_fsdp = args.rows * args.ranks * args.len
    peak_rank = statistics.median(res[r]["gemm_gflops"] for r in res)
    rank_gflops = fpt * args.rows * args.len / s_fsdp / 1e9
    doc = {
        "model": {"params": sum(int(np.prod(s)) for s in param_shapes(MCFG, V).values()),
                  "hidden": MCFG.hidden_size, "layers": MCFG.num_hidden_layers, "vocab": V},
        "workload": {"rows_per_rank": args.rows, "len": args.len, "ranks": args.ranks, "steps": args.steps,
                     "micro_batch_tokens": args.micro_batch_tokens, "precision": args.precision, "ac": args.ac},
        "cpus": ncpu, "model_flops_per_token": fpt,
        "single": {"threads": ncpu, "step_s": round(s_single, 4), "tokens_per_s": round(tok_single / s_single, 1),
                   "gflops": round(fpt * tok_single / s_single / 1e9, 2), "gemm_peak_gflops": round(peak1, 2),
                   "frac_of_peak": round(fpt * tok_single / s_single / 1e9 / peak1, 3)},
        "fsdp": {"threads_per_rank": 1, "step_s": round(s_fsdp, 4), "tokens_per_s": round(tok_fsdp / s_fsdp, 1),
                 "gflops_per_rank": round(rank_gflops, 2), "gemm_peak_gflops_per_rank": round(peak_rank, 2),
                 "frac_of_peak": round(rank_gflops / peak_rank, 3)},
        "fsdp_overhead_ratio": round((s_fsdp / tok_fsdp) / (s_single / tok_single), 3),
    }
    text = json.dumps(doc, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
