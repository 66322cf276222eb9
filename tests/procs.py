"""Run a function in N spawned processes (one per rank) and collect each rank's report.

Shared by the multi-process tests (weight sync, FSDP2); a rank that hangs is killed and fails
the test instead of hanging the suite.
"""

from __future__ import annotations

import queue
import time


def spawn_ranks(target, world: int, args: tuple, timeout_s: float, what: str = "") -> dict[int, object]:
    """Start ``target(rank, world, port, *args, q)`` per rank; each puts ``(rank, report)`` on ``q``."""
    import torch.multiprocessing as mp

    from rltpu.runtime import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, q), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    out, deadline = {}, time.monotonic() + timeout_s
    try:
        while len(out) < world:
            try:
                rank, report = q.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                break
            out[rank] = report
        for p in procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
    finally:
        hung = [i for i, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    assert not hung, f"{what}: ranks {hung} still running after {timeout_s}s (reports: {sorted(out)})"
    assert sorted(out) == list(range(world)), f"{what}: no report from some rank: {sorted(out)}"
    assert [p.exitcode for p in procs] == [0] * world, f"{what}: exit codes {[p.exitcode for p in procs]}"
    return out
