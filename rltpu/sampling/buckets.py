"""How a group of prompts is split into prefill calls: shared by the continuous engine and the
planner's model of it (``rltpu.plan.continuous``), so both count the same calls. No JAX here."""

from __future__ import annotations

from functools import lru_cache

# a prefill call's fixed cost, in prompt rows: the weights are read once per call (about one 32-token
# row's compute on the 25M model on XLA:CPU), plus the dispatch
PREFILL_CALL_ROWS = 2


def split_rows(n: int, buckets: tuple[int, ...], call_rows: int = PREFILL_CALL_ROWS) -> tuple[int, ...]:
    """The row buckets of the calls that prefill ``n`` prompts: the fewest padded rows, counting
    ``call_rows`` more per call. Why: padding a group up to the next bucket wasted up to 3/4 of a
    prefill (23 prompts at buckets 1/4/16/64 ran as one call of 64); they now run as 16 + 4 + 4."""
    return _split(n, tuple(sorted(set(buckets))), call_rows)


@lru_cache(maxsize=4096)
def _split(n: int, buckets: tuple[int, ...], call_rows: int) -> tuple[int, ...]:
    if n <= 0:
        return ()
    best: list[tuple[int, int, tuple[int, ...]]] = [(0, 0, ())]  # per k: (cost, calls, buckets)
    for k in range(1, n + 1):
        options = []
        for b in buckets:
            rest = best[max(k - b, 0)]
            options.append((b + call_rows + rest[0], 1 + rest[1], (b,) + rest[2]))
        best.append(min(options))
    return best[n][2]
