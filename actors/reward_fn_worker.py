"""One rule-reward worker: a CPU-only process (no chips) that runs ``task.reward_fn``.

The driver's ``RewardPool`` (``rltpu/control/rewards.py``) owns a few of these, hands each a chunk
of completions per sampler shard, kills (``ray.kill``) and replaces one that hangs or dies. Calls
inside run on ``DeadlineRunner`` threads, each under ``task.reward_timeout_s``; a chunk answers with
one ``(value, kind, detail)`` per row, so a failing call never fails the chunk.
"""

from __future__ import annotations

import os


class RewardFnWorker:
    def __init__(self, rank: int, fn_path: str, kwargs: dict, timeout_s: float, concurrency: int):
        from rltpu.data.rewards import DeadlineRunner, load_reward_fn

        self.rank = rank
        self.runner = DeadlineRunner(load_reward_fn(fn_path, kwargs), timeout_s, concurrency)

    def ping(self) -> int:
        return os.getpid()

    def score(self, texts: list[str], examples: list[dict]) -> dict:
        """``kinds[i]`` is ``ok`` or a failure kind; ``abandoned``: calls past their deadline still
        running on detached threads (the pool replaces a worker whose count keeps growing)."""
        out = self.runner.run(list(zip(texts, examples)))
        return {"values": [v for v, _, _ in out], "kinds": [k for _, k, _ in out],
                "details": [d for _, _, d in out], "abandoned": self.runner.abandoned}
