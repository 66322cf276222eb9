"""Job checkpoints from the driver's side: what goes in the metadata, where, and which one to load.

Every trainer rank writes its own shards of the model, optimizer and critic (``learner.checkpoint``:
tmp -> rename by rank 0, sha256 of every file); the driver adds what only it knows: step, weight
version, data cursor, prompts in flight. On resume the driver picks the newest checkpoint that
verifies and every rank reads only what overlaps its shards, whatever trainer count wrote it.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from rltpu.config import ConfigError, RunConfig

log = logging.getLogger("rltpu")


class Checkpoints:
    """``source``: the checkpoint ``--resume PATH`` named: the first load reads it, and a trainer restart
    before this run saved one of its own goes back to it (not to step 0)."""

    def __init__(self, ray, groups, cfg: RunConfig, run_dir: Path, source: Path | None = None):
        self.ray, self.groups, self.cfg = ray, groups, cfg
        self.dir = run_dir / "checkpoint"
        self.source = Path(source) if source is not None else None
        self._first_load = True
        self.last_saved = time.monotonic()  # every_minutes counts from the start, then from each save

    def due(self, step: int, now: float | None = None) -> bool:
        """A periodic checkpoint after ``step``: ``every_steps`` divides it, or ``every_minutes`` have
        passed since the last checkpoint (or the start), whichever comes first; 0 turns either off."""
        c = self.cfg.checkpoint
        now = time.monotonic() if now is None else now
        return bool((c.every_steps and step % c.every_steps == 0)
                    or (c.every_minutes and now - self.last_saved >= c.every_minutes * 60))

    def save(self, step: int, version: int, data_state: dict, in_flight_prompts: list[str]) -> str:
        """``data_state`` is the cursor a resume restarts from: before any rollout still in flight
        (async), so a resume draws those prompts again."""
        meta = {"step": step, "weight_version": version, "data": data_state, "seed": self.cfg.seed,
                "config": self.cfg.to_dict(), "in_flight_prompts": in_flight_prompts,
                # sampler randomness is a pure function of (seed, step, sampler rank): nothing else to save
                "sampler_seed_rule": "seed * 1000003 + step * 131 + sampler_rank"}
        if self.cfg.checkpoint.hf_export:  # learner.checkpoint.save_engine: each rank writes its share of hf/
            meta["hf_export"] = True
        t0 = time.monotonic()
        out = self._get([t.save_checkpoint.remote(str(self.dir), meta) for t in self.groups.trainers],
                        "checkpointing", "the checkpoint save")[0]
        self.last_saved = time.monotonic()
        log.debug("rltpu: checkpoint of step %d in %s (%.2f s)", step, out, self.last_saved - t0)
        return out

    def _get(self, refs, phase: str, what: str):
        """Bounded like every wait on the step path: the phase's deadline + the heartbeat timeout
        (the watchdog fences first when health is on; with it off, a hung save still ends)."""
        from rltpu.observe.health import bounded_get

        h = self.cfg.health
        return bounded_get(self.ray, refs, phase, h.deadlines, what, slack_s=h.heartbeat_timeout_s)

    def load_latest(self, required: bool = True) -> tuple[Path, dict] | None:
        """The newest checkpoint whose files verify (a corrupt one is skipped with a warning and moved
        aside, so the next save's rotation keeps the valid one), loaded into every trainer; its path
        and metadata, or None when there is none and none is required."""
        from learner.checkpoint import latest_valid

        warn = lambda m: log.warning("rltpu: warning: %s", m)  # noqa: E731
        first, self._first_load = self._first_load, False
        path = latest_valid(self.dir, max(self.cfg.checkpoint.keep_last, 2), warn, set_aside=True)
        if self.source is not None and (first or path is None):
            path = self.source  # verified by the CLI before Ray started (named_checkpoint)
        if path is None:
            if required:
                raise ConfigError(f"--resume: no valid checkpoint in {self.dir}[.prev*]; run without --resume")
            return None
        meta = self._get([t.load_checkpoint.remote(str(path)) for t in self.groups.trainers], "loading",
                         f"loading {path}")[0]
        return path, meta


def named_checkpoint(path: str | Path, run_dir: Path) -> Path:
    """``--resume PATH``: the checkpoint directory to start from, checked before Ray starts (one line
    naming what is wrong): one that verifies, and either one of ``run_dir``'s own (``checkpoint.prev``...)
    or another run's when ``run_dir`` holds no run yet."""
    from rltpu.models.hf.shards import verify_checkpoint

    p = Path(path)
    if not (p / "trainer_state.json").is_file():
        raise ConfigError(f"--resume {path}: not a checkpoint directory (no trainer_state.json); name one like "
                          f"{Path(run_dir) / 'checkpoint.prev'}, or pass --resume alone for the newest")
    try:
        verify_checkpoint(p)
    except ValueError as err:
        raise ConfigError(f"--resume {path}: {err}; name another checkpoint") from None
    if _position(p, run_dir) is None:
        from rltpu.control.rundir import used_by

        what = used_by(run_dir)
        if what:
            raise ConfigError(f"--resume {path}: not a checkpoint of run_dir {run_dir}, which already holds a run "
                              f"({what}); continue from it in a new run_dir (run_dir=...)")
    return p.resolve()


def _position(p: Path, run_dir: Path) -> int | None:
    from learner.checkpoint import history

    chain = history(Path(run_dir) / "checkpoint", 101)
    return next((i for i, c in enumerate(chain) if c.exists() and c.resolve() == Path(p).resolve()), None)


def set_aside_newer(p: Path, run_dir: Path) -> None:
    """After ``--resume PATH`` named an older checkpoint of ``run_dir`` (and the run dir is claimed): the
    newer ones move aside as ``<name>.superseded``, so neither a trainer restart nor the next rotation
    picks the steps the resume abandons."""
    import shutil

    from learner.checkpoint import history

    here = _position(p, run_dir)
    for newer in history(Path(run_dir) / "checkpoint", 101)[:here or 0]:
        if newer.exists():
            aside = newer.with_name(newer.name + ".superseded")
            shutil.rmtree(aside, ignore_errors=True)
            newer.rename(aside)
            log.warning("rltpu: --resume %s: the newer %s moved aside to %s", p, newer.name, aside.name)
