"""One rule-reward worker: a CPU-only process (no chips) that runs ``task.reward_fn``.

The driver's ``RewardPool`` (``rltpu/control/rewards.py``) owns a few of these, hands each a chunk
of completions per sampler shard, kills (``ray.kill``) and replaces one that hangs or dies. Calls
inside run on ``DeadlineRunner`` threads, each under ``task.reward_timeout_s``; a chunk answers with
one ``(value, kind, detail)`` per row, so a failing call never fails the chunk (and, for ``task.rewards``,
each ok row's per-term values).
"""

from __future__ import annotations

import functools
import os


class RewardFnWorker:
    def __init__(self, rank: int, fn_path: str, kwargs: dict, timeout_s: float, concurrency: int):
        from rltpu.data.rewards import WEIGHTED_SUM, DeadlineRunner, finite_terms, load_reward_fn, weighted_terms

        self.rank = rank
        fn = load_reward_fn(fn_path, kwargs)  # imports every term (a bad one fails the worker's start)
        # task.rewards: each term's value comes back beside the sum (the step logs every term's mean)
        self.terms = fn_path == WEIGHTED_SUM and "terms" in kwargs
        if self.terms:
            fn = functools.partial(weighted_terms, terms=kwargs["terms"])
        self.runner = DeadlineRunner(fn, timeout_s, concurrency, check=finite_terms if self.terms else None)

    def ping(self) -> int:
        return os.getpid()

    def score(self, texts: list[str], examples: list[dict]) -> dict:
        """``kinds[i]`` is ``ok`` or a failure kind; ``abandoned``: calls past their deadline still
        running on detached threads (the pool replaces a worker whose count keeps growing)."""
        out = self.runner.run(list(zip(texts, examples)))
        res = {"kinds": [k for _, k, _ in out], "details": [d for _, _, d in out], "abandoned": self.runner.abandoned}
        if not self.terms:
            return res | {"values": [v for v, _, _ in out]}
        return res | {"values": [v and v[0] for v, _, _ in out], "terms": [v and v[1] for v, _, _ in out]}
