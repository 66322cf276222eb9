"""Weight sync throughput: the sharded, routed sync beside a raw flat broadcast and the old path.

    python benchmarks/weight_sync.py [--sizes 10,100,500] [--samplers 1,2,4] [--bucket-mb 16] [--repeats 3]

Spawns 2 trainer ranks and max(--samplers) sampler processes once (gloo on 127.0.0.1, no Ray),
then for every model size (millions of parameters) and sampler count measures, in the same run
and over the same backend:

* ``sharded``: ``rltpu.sync.collective`` (each trainer sends its own dim-0 shards in double-buffered
  buckets, samplers assemble full tensors in a staging arena and verify checksums);
* ``raw``: one ``broadcast`` of a single flat buffer of the same byte size from trainer 0 to the
  samplers (the wire's ceiling for a one-source broadcast);
* ``gather``: the previous design: all-gather full tensors on the trainers, then trainer 0 packs
  and broadcasts flat buckets serially.

Seconds are the median over ``--repeats`` (barrier to barrier, timed on trainer 0); GB/s is model
bytes (one copy, wire dtype) per second. ``trainer_peak_extra_bytes``: max over the trainer ranks
of VmHWM - VmRSS across one sharded sync (peak reset through /proc/self/clear_refs first).
Sizes >= 300M run in bfloat16 (params and wire) to stay inside 24 GiB with 6 processes; the
first repeat of every sharded sync is checked tensor by tensor against the sent values.
One JSON document on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

M = 2  # trainer ranks
TIMEOUT_S = 300.0


def synthetic_spec(millions: int, dtype: str) -> list:
    """A Llama-shaped parameter list of about ``millions`` x 1e6 parameters (untied head)."""
    h, inter, vocab = (256, 688, 8000) if millions < 50 else (768, 2048, 32000) if millions < 300 else (1024, 2816, 32000)
    per_layer = 4 * h * h + 3 * h * inter + 2 * h
    layers = max(1, round((millions * 1e6 - 2 * vocab * h - h) / per_layer))
    spec = [("model.embed_tokens.weight", (vocab, h), dtype)]
    for i in range(layers):
        p = f"model.layers.{i}."
        spec += [(p + "input_layernorm.weight", (h,), dtype)]
        spec += [(p + f"self_attn.{x}_proj.weight", (h, h), dtype) for x in "qkvo"]
        spec += [(p + "post_attention_layernorm.weight", (h,), dtype)]
        spec += [(p + "mlp.gate_proj.weight", (inter, h), dtype), (p + "mlp.up_proj.weight", (inter, h), dtype),
                 (p + "mlp.down_proj.weight", (h, inter), dtype)]
    return spec + [("model.norm.weight", (h,), dtype), ("lm_head.weight", (vocab, h), dtype)]


def _full(i: int, shape, dtype):
    import torch

    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(shape, generator=g).to(dtype)


def _reset_peak() -> None:
    """VmHWM := VmRSS (Linux clear_refs 5), so VmHWM afterwards is the peak of what follows."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _vm(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _worker(rank: int, world: int, port: int, sizes, counts, bucket_bytes, repeats, q) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch
    from torch.distributed import PrefixStore, ProcessGroupGloo

    from rltpu.sync.collective import (
        SyncFabric,
        host_store,
        plan_route,
        receive_staged,
        send_shards,
        shard_rows,
    )

    torch.set_num_threads(1)
    host = "127.0.0.1"
    if rank == 0:
        host_store(host, port, TIMEOUT_S)
    import torch.distributed as dist

    store = dist.TCPStore(host, port, None, False, timedelta(seconds=TIMEOUT_S))
    dev = ProcessGroupGloo.create_device(hostname=host)

    def group(name, members):
        opts = ProcessGroupGloo._Options()
        opts._devices, opts._timeout = [dev], timedelta(seconds=TIMEOUT_S)
        return ProcessGroupGloo(PrefixStore(name, store), members.index(rank), len(members), opts)

    tgroup = group("bench/trainers", [0, 1]) if rank < M else None
    rows, gen = [], 0
    for millions in sizes:
        dtype = "bfloat16" if millions >= 300 else "float32"
        tdt = getattr(torch, dtype)
        spec = synthetic_spec(millions, dtype)
        nbytes = sum(int(torch.Size(s).numel()) * tdt.itemsize for _, s, _ in spec)
        shards = {}
        if rank < M:
            for i, (n, s, _d) in enumerate(spec):
                shards[n] = _full(i, s, tdt)[slice(*shard_rows(s[0], M, rank))].clone()
        for n_s in counts:
            gen += 1
            members = list(range(M + n_s))
            if rank not in members:
                continue
            route = plan_route([0] * M, [0] * n_s)
            fab = SyncFabric(host, port, gen, rank, route, TIMEOUT_S)
            raw_g = group(f"bench/raw/{gen}", [0, *range(M, M + n_s)]) if rank == 0 or rank >= M else None
            ctl = fab.pg("ctl")

            def barrier(ctl=ctl):
                ctl.allreduce([torch.zeros(1)]).wait()

            times = {"sharded": [], "raw": [], "gather": []}
            peak, verified = 0, None
            for rep in range(repeats):
                # sharded sync
                barrier()
                if rank < M:
                    _reset_peak()
                    rss0 = _vm("VmRSS")
                t0 = time.perf_counter()
                if rank < M:
                    send_shards(fab, shards, spec, rep, bucket_bytes)
                    peak = max(peak, _vm("VmHWM") - rss0)
                else:
                    out, _ = receive_staged(fab, spec, rep, bucket_bytes)
                    if rep == 0:
                        verified = all(torch.equal(out[n], _full(i, s, tdt)) for i, (n, s, _d) in enumerate(spec))
                    del out
                barrier()
                times["sharded"].append(time.perf_counter() - t0)
                # raw flat broadcast, same byte count
                flat = torch.empty(nbytes, dtype=torch.uint8) if raw_g is not None else None
                barrier()
                t0 = time.perf_counter()
                if raw_g is not None:
                    raw_g.broadcast(flat, 0).wait()
                barrier()
                times["raw"].append(time.perf_counter() - t0)
                del flat
                # gather on the trainers, then trainer 0 broadcasts serial buckets
                barrier()
                t0 = time.perf_counter()
                _gather_then_broadcast(rank, spec, shards, tgroup, raw_g, bucket_bytes, tdt)
                barrier()
                times["gather"].append(time.perf_counter() - t0)
            peaks = [torch.tensor([peak], dtype=torch.int64)]
            ctl.allreduce(peaks, dist.ReduceOp.MAX).wait()
            ok = torch.tensor([0 if verified is None else int(not verified)], dtype=torch.int64)
            ctl.allreduce([ok], dist.ReduceOp.MAX).wait()
            fab.close()
            if rank == 0:
                med = {k: statistics.median(v) for k, v in times.items()}
                rows.append({
                    "params_millions": round(sum(int(torch.Size(s).numel()) for _, s, _ in spec) / 1e6, 1),
                    "dtype": dtype, "model_bytes": nbytes, "samplers": n_s, "trainers": M,
                    "bucket_bytes": bucket_bytes,
                    **{f"{k}_s": round(v, 4) for k, v in med.items()},
                    **{f"{k}_GBps": round(nbytes / v / 1e9, 3) for k, v in med.items()},
                    "sharded_vs_raw": round(med["raw"] / med["sharded"], 3),
                    "sharded_vs_gather": round(med["gather"] / med["sharded"], 3),
                    "trainer_peak_extra_bytes": int(peaks[0]),
                    "trainer_peak_extra_buckets": round(int(peaks[0]) / bucket_bytes, 2),
                    "received_exact": not bool(ok[0]),
                })
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        del shards
    q.put((rank, rows))


def _gather_then_broadcast(rank, spec, shards, tgroup, raw_g, bucket_bytes, tdt) -> None:
    """The pre-issue-5 path: full tensors on every trainer, trainer 0 packs and sends serially."""
    import torch

    full = {}
    if rank < M:
        for n, s, _d in spec:
            c = -(-s[0] // M)
            parts = [torch.empty((c, *s[1:]), dtype=tdt) for _ in range(M)]
            mine = torch.zeros((c, *s[1:]), dtype=tdt)
            mine[: shards[n].shape[0]] = shards[n]
            tgroup.allgather([parts], [mine]).wait()
            full[n] = torch.cat(parts)[: s[0]]
    if raw_g is None:
        return
    numel = bucket_bytes // tdt.itemsize
    batch, used = [], 0
    names = [(n, int(torch.Size(s).numel())) for n, s, _ in spec]

    def flush(batch, used):
        flat = torch.empty(used, dtype=tdt)
        if rank == 0:
            off = 0
            for n, k in batch:
                flat[off:off + k].copy_(full[n].reshape(-1))
                off += k
        raw_g.broadcast(flat, 0).wait()

    for n, k in names:
        if batch and used + k > numel:
            flush(batch, used)
            batch, used = [], 0
        batch.append((n, k))
        used += k
    if batch:
        flush(batch, used)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="10,100,500", help="model sizes in millions of parameters")
    ap.add_argument("--samplers", default="1,2,4")
    ap.add_argument("--bucket-mb", type=float, default=16.0)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    sizes = [int(x) for x in a.sizes.split(",")]
    counts = [int(x) for x in a.samplers.split(",")]
    from procs import spawn_ranks

    t0 = time.time()
    world = M + max(counts)
    out = spawn_ranks(_worker, world, (sizes, counts, int(a.bucket_mb * 2**20), a.repeats), 3600, "weight_sync bench")
    print(json.dumps({"command": "python benchmarks/weight_sync.py " + " ".join(sys.argv[1:]), "backend": "gloo",
                      "host": "127.0.0.1 (all processes on one machine)", "cpus": os.cpu_count(),
                      "wall_s": round(time.time() - t0, 1), "rows": out[0]}, indent=1))


if __name__ == "__main__":
    main()
