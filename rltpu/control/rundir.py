"""One run per run directory (issue 34).

A fresh ``rltpu train`` in a directory that already holds a run (a ledger with lines, or any
``checkpoint*`` directory) would append to the old ledger and metrics, rotate the old run's
checkpoint, and a trainer restart before the new run's first checkpoint would load the old run's
weights. So that is refused in one line unless ``--resume`` (continue it) or ``--new-run`` (move
the old run's files into ``previous-<UTC time>/`` inside the directory, then start at step 0).

Two processes never use one directory at once: ``claim`` takes an exclusive ``flock`` on
``<run_dir>/rltpu.lock`` for the life of the process (the kernel drops it when the process ends,
however it ends, so a killed run never leaves a stale lock).
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

from rltpu.config import ConfigError

LOCK = "rltpu.lock"
KEEP = ("jax_cache", LOCK)  # reusable across runs: the compile cache; and the lock itself
_held: list[int] = []  # lock fds kept open until the process ends


def used_by(run_dir: Path) -> str | None:
    """What shows that a run already used ``run_dir`` (a short phrase), or None."""
    run_dir = Path(run_dir)
    ledger = run_dir / "ledger.jsonl"
    if ledger.is_file() and ledger.stat().st_size > 0:
        return "a ledger.jsonl with trained steps"
    ckpts = sorted(p.name for p in run_dir.glob("checkpoint*") if p.is_dir()) if run_dir.is_dir() else []
    if ckpts:
        return f"{ckpts[0]}/"
    return None


def check_fresh(run_dir: Path, resume: bool, new_run: bool) -> None:
    """Before anything is built: a plain ``rltpu train`` in a used directory is refused in one line."""
    if resume and new_run:
        raise ConfigError("--resume and --new-run contradict each other: --resume continues the run in run_dir, "
                          "--new-run starts over; pass one")
    if resume or new_run:
        return
    what = used_by(run_dir)
    if what:
        raise ConfigError(f"run_dir {run_dir} already holds a run ({what}); continue it with --resume, start over "
                          f"with --new-run (the old run's files move to {run_dir}/previous-<time>/), or pick "
                          f"another run_dir")


def claim(run_dir: Path, resume: bool, new_run: bool) -> Path | None:
    """Create ``run_dir``, take its lock (refused in one line while another process holds it), check
    again under the lock, and with ``new_run`` move the old run aside. Returns where it went."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise ConfigError(f"run_dir {run_dir} is in use by another rltpu train (pid {holder}); wait for it to end, "
                          f"or pick another run_dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _held.append(fd)
    check_fresh(run_dir, resume, new_run)  # again, now that no other run can start here
    return archive(run_dir) if new_run and not resume else None


def archive(run_dir: Path) -> Path | None:
    """Move everything of the previous run (not the compile cache, the lock or earlier archives)
    into ``previous-<UTC time>/``; None when there was nothing to move."""
    items = [p for p in Path(run_dir).iterdir() if p.name not in KEEP and not p.name.startswith("previous-")]
    if not items:
        return None
    dest = Path(run_dir) / time.strftime("previous-%Y%m%dT%H%M%SZ", time.gmtime())
    n = 1
    while dest.exists():
        n += 1
        dest = dest.with_name(f"{dest.name.split('.')[0]}.{n}")
    dest.mkdir()
    for p in items:
        p.rename(dest / p.name)
    return dest


def release() -> None:
    """Drop the locks this process holds (tests; a CLI run keeps its lock until it exits)."""
    while _held:
        os.close(_held.pop())
