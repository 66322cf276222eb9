"""How a group of prompts is split into prefill calls, and which slot counts the decode chunks run at:
shared by the continuous engine and the planner's model of it (``rltpu.plan.continuous``), so both
count the same calls and programs. No JAX here."""

from __future__ import annotations

from functools import lru_cache

# a prefill call's fixed cost, in prompt rows: the weights are read once per call (about one 32-token
# row's compute on the 25M model on XLA:CPU), plus the dispatch
PREFILL_CALL_ROWS = 2
# the fewest slots a decode chunk shrinks to, as a fraction of the grid (and never below SLOT_FLOOR), when
# the batch buckets give no smaller size: the tail of a long-tail request then runs on about its own rows
SLOT_FLOOR, SLOT_FLOOR_FRACTION = 8, 32


def slot_buckets(slots: int, batch_buckets: tuple[int, ...], new_tokens: int, chunk: int) -> tuple[int, ...]:
    """The slot counts decode chunks compile for: the batch buckets below ``slots``, ``slots``, the powers
    of two and the 1.5x steps between them down to the smallest batch bucket and, when a request spans
    several chunks (``new_tokens > chunk``), the powers of two below it down to
    ``max(SLOT_FLOOR, slots // SLOT_FLOOR_FRACTION)``. Why the floor: with one batch bucket (most configs)
    the grid had one size, so every chunk of a long tail ran all slots to the last row (25M, 256 rows of up
    to 200 tokens: 51,200 slot-steps for 17,878 tokens). Powers of two only, to add few programs (a chip
    compiles each for tens of seconds); requests done within one chunk never shrink and compile no more."""
    lo = min(min(batch_buckets), slots)
    steps = {m << k for k in range(slots.bit_length()) for m in (1, 3)}
    out = {b for b in batch_buckets if b < slots} | {slots} | {b for b in steps if lo < b < slots}
    if new_tokens > chunk:
        floor = max(SLOT_FLOOR, slots // SLOT_FLOOR_FRACTION)
        out |= {1 << k for k in range(slots.bit_length()) if floor <= 1 << k < lo}
    return tuple(sorted(out))


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
