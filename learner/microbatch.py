"""Micro-batches from a token budget, grouped by length, with padding columns cut.

A rank's rows arrive in one fixed-shape layout (R, P+T): left-padded prompts, right-padded
completions. Training on it as one pass wastes compute on padding and can exceed memory. Here
rows are sorted by real length, cut into micro-batches whose padded size (rows x width) fits
``micro_batch_tokens``, and each micro-batch keeps only the columns some row uses (width rounded
up to ``seq_bucket`` so an XLA device sees a few shapes, not one per step). Losses use global
counts (``learner.losses.LossScale``), so the micro-batch losses simply add up: gradient
accumulation needs no rescaling.
"""

from __future__ import annotations

import math

import numpy as np


def row_spans(attention_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """First and one-past-last real column of every row."""
    real = attention_mask > 0
    first = np.argmax(real, axis=1)
    last = real.shape[1] - np.argmax(real[:, ::-1], axis=1)
    return first, last


def plan_microbatches(attention_mask: np.ndarray, token_budget: int, seq_bucket: int = 16,
                      group_by_length: bool = True, min_count: int = 1) -> list[tuple[np.ndarray, int, int]]:
    """``[(row indices, col_start, col_end)]`` covering every row once.

    The count is the smallest that keeps each micro-batch's padded size within ``token_budget``
    (greedy over rows sorted by length), at least ``min_count`` (FSDP ranks must run the same
    number of passes: callers pass the max over ranks). ``token_budget=0`` means one micro-batch.
    """
    R, L = attention_mask.shape
    first, last = row_spans(attention_mask)
    order = np.argsort(last - first, kind="stable") if group_by_length else np.arange(R)
    count = 1
    if token_budget > 0:
        count, rows, width = 1, 0, 0
        for r in order:  # greedy: start a new micro-batch when this row would overflow the budget
            w = _bucket(int(last[r] - first[r]), seq_bucket, L)
            if rows and (rows + 1) * max(width, w) > token_budget:
                count, rows, width = count + 1, 0, 0
            rows, width = rows + 1, max(width, w)
    count = min(max(count, min_count), R)
    out = []
    for chunk in np.array_split(order, count):
        lo, hi = int(first[chunk].min()), int(last[chunk].max())
        w = _bucket(hi - lo, seq_bucket, L)
        lo = max(0, min(lo, hi - w))  # widen to the bucket on the left (prompt side), within the layout
        out.append((np.sort(chunk), lo, min(L, lo + w)))
    return out


def _bucket(width: int, seq_bucket: int, full: int) -> int:
    return min(full, max(seq_bucket, int(math.ceil(width / seq_bucket)) * seq_bucket))


def slice_batch(batch: dict, rows: np.ndarray, lo: int, hi: int) -> dict:
    """The rows and columns of one micro-batch; per-row arrays (R,) by rows only; scalars kept."""
    out = {}
    for k, v in batch.items():
        if isinstance(v, np.ndarray) and v.ndim == 2:
            out[k] = v[rows, lo:hi]
        elif isinstance(v, np.ndarray) and v.ndim == 1:
            out[k] = v[rows]
        else:
            out[k] = v
    return out


def padding_fraction(plan: list[tuple[np.ndarray, int, int]], attention_mask: np.ndarray) -> float:
    """Padded / computed token slots over the plan's micro-batches."""
    computed = sum(len(rows) * (hi - lo) for rows, lo, hi in plan)
    return 1.0 - float((attention_mask > 0).sum()) / max(computed, 1)
