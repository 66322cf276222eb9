"""Run a function in N spawned processes (one per rank) and collect each rank's report.

Shared by the multi-process tests (weight sync, FSDP2); a rank that hangs is killed and fails
the test instead of hanging the suite.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

# End-to-end runs whose claim is a mechanism (a signal, a resume, a ledger), not learning: 16 prompts x 4
# samples a step instead of the quickstart's 64 x 16. MECHANICS also puts one sampler and one trainer on
# one chip each (2 actor processes instead of 4: about a third less CPU per run, measured by hand);
# SMALL_BATCH keeps the quickstart's 2 + 2 actors for claims about several ranks.
MECHANICS_PROMPTS = 16
SMALL_BATCH = (f"trainer.prompts_per_step={MECHANICS_PROMPTS}", "sampler.group_size=4", "sampler.batch_buckets=[32]")
MECHANICS = ("placement.sampler_chips=1", "placement.trainer_chips=1", f"trainer.prompts_per_step={MECHANICS_PROMPTS}",
             "sampler.group_size=4", "sampler.batch_buckets=[64]")


def join_gloo(rank: int, world: int, port: int, timeout_s: float = 60.0) -> None:
    """Inside a spawned rank: one CPU thread, gloo on loopback, join the ``world``-rank group on ``port``."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))


_RANKS_CTX = []


def _rank_context():
    """A forkserver that imported torch, JAX and numpy once (and started no thread, no JAX backend): each
    rank forks from it instead of a fresh interpreter importing them again, about 2-3 s of CPU per rank."""
    if not _RANKS_CTX:
        import multiprocessing as mp

        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["numpy", "torch", "torch.distributed", "jax", "pytest", "procs"])
        _RANKS_CTX.append(ctx)
    return _RANKS_CTX[0]


def _in_env(env: dict, target, *args) -> None:
    """A rank sees the environment of the test that started it (the forkserver keeps the one it began with)."""
    os.environ.clear()
    os.environ.update(env)
    target(*args)


def spawn_ranks(target, world: int, args: tuple, timeout_s: float, what: str = "") -> dict[int, object]:
    """Start ``target(rank, world, port, *args, q)`` per rank; each puts ``(rank, report)`` on ``q``."""
    from rltpu.sync.stores import free_port

    ctx = _rank_context()
    q = ctx.Queue()
    port = free_port()
    env = dict(os.environ)
    procs = [ctx.Process(target=_in_env, args=(env, target, r, world, port, *args, q), daemon=True)
             for r in range(world)]
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


@contextlib.contextmanager
def ray_head(tag: str, env: dict, tpu_chips: int = 4):
    """A Ray head (``ray start --head --block``) on 127.0.0.1 with ``tpu_chips`` emulated TPU chips
    labelled as one host of one slice; yields its address. Shared by a module's runs so each pays
    for its actors and compiles but not a cluster start."""
    from rltpu.sync.stores import free_port

    port = free_port()
    temp = Path("/tmp") / f"rltpu-{tag}-{os.getpid()}"
    head = subprocess.Popen(
        [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", f"--port={port}",
         "--node-ip-address=127.0.0.1", "--num-cpus=2", f'--resources={{"TPU": {tpu_chips}}}',
         "--labels=ray.io/tpu-worker-id=0,ray.io/tpu-slice-name=rltpu-emu-slice-0",
         f"--temp-dir={temp}", "--disable-usage-stats", "--include-dashboard=false"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 120
    while True:  # the GCS port accepting connections = the head is up
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert head.poll() is None and time.time() < deadline, "ray head did not start"
            time.sleep(0.5)
    time.sleep(2)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        os.killpg(head.pid, signal.SIGTERM)  # --block: the head takes its raylet and workers down with it
        try:  # idle, it is down in ~4 s; after runs a graceful stop of their workers took ~35 s: not waited for
            head.wait(timeout=3)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait(timeout=30)
