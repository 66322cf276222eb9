"""Job checkpoints from the driver's side: what goes in the metadata, where, and which one to load.

Every trainer rank writes its own shards of the model, optimizer and critic (``learner.checkpoint``:
tmp -> rename by rank 0, sha256 of every file); the driver adds what only it knows: step, weight
version, data cursor, prompts in flight. On resume the driver picks the newest checkpoint that
verifies and every rank reads only what overlaps its shards, whatever trainer count wrote it.
"""

from __future__ import annotations

import sys
from pathlib import Path

from rltpu.config import ConfigError, RunConfig


class Checkpoints:
    def __init__(self, ray, groups, cfg: RunConfig, run_dir: Path):
        self.ray, self.groups, self.cfg = ray, groups, cfg
        self.dir = run_dir / "checkpoint"

    def save(self, step: int, version: int, data_state: dict, in_flight_prompts: list[str]) -> str:
        """``data_state`` is the cursor a resume restarts from: before any rollout still in flight
        (async), so a resume draws those prompts again."""
        meta = {"step": step, "weight_version": version, "data": data_state, "seed": self.cfg.seed,
                "config": self.cfg.to_dict(), "in_flight_prompts": in_flight_prompts,
                # sampler randomness is a pure function of (seed, step, sampler rank): nothing else to save
                "sampler_seed_rule": "seed * 1000003 + step * 131 + sampler_rank"}
        return self._get([t.save_checkpoint.remote(str(self.dir), meta) for t in self.groups.trainers],
                         "checkpointing", "the checkpoint save")[0]

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

        warn = lambda m: print(f"rltpu: warning: {m}", file=sys.stderr, flush=True)  # noqa: E731
        path = latest_valid(self.dir, max(self.cfg.checkpoint.keep_last, 2), warn, set_aside=True)
        if path is None:
            if required:
                raise ConfigError(f"--resume: no valid checkpoint in {self.dir}[.prev*]; run without --resume")
            return None
        meta = self._get([t.load_checkpoint.remote(str(path)) for t in self.groups.trainers], "loading",
                         f"loading {path}")[0]
        return path, meta
