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


# -- packing: several rows per line -----------------------------------------------------------------
# A micro-batch's rows padded to its widest one waste the columns shorter rows leave empty (a prompt
# of 8 tokens beside one of 32, a completion that stopped at 20 of 64). Packing lays the rows' real
# spans end to end in lines no wider than the longest row; the attention mask carries a segment id
# per row (``rltpu.models.torch_llama.attention_allowed``: a token sees only its own row) and every
# per-token array moves with its token, so each row's logprobs, loss and gradients are the unpacked
# ones (to fp32 rounding) for fewer computed positions.


def pack_lines(lengths: np.ndarray, width: int) -> list[list[int]]:
    """First-fit decreasing: indices into ``lengths`` per line, each line's total <= ``width``."""
    lines: list[list[int]] = []
    room: list[int] = []
    for i in np.argsort(-np.asarray(lengths), kind="stable"):
        n = int(lengths[i])
        j = next((j for j, r in enumerate(room) if n <= r), None)
        if j is None:
            lines.append([int(i)])
            room.append(width - n)
        else:
            lines[j].append(int(i))
            room[j] -= n
    return lines


def packable(batch: dict, agg_mode: str) -> bool:
    """Packing keeps the loss when it is a sum over tokens: not for per-row means
    (``seq-mean-token-mean``), per-row (1-D) inputs, or a row whose first real token is scored
    (its predecessor in a line is another row's last token)."""
    if agg_mode == "seq-mean-token-mean":
        return False
    if any(isinstance(v, np.ndarray) and v.ndim == 1 for v in batch.values()):
        return False
    mask = np.asarray(batch["attention_mask"])
    first, _ = row_spans(mask)
    return not np.asarray(batch["loss_mask"])[np.arange(len(mask)), first].any()


def pack_batch(batch: dict, rows: np.ndarray, seq_bucket: int = 1, line_bucket: bool = False):
    """The micro-batch of ``rows`` as packed lines: ``(arrays, (src_row, src_col))``.

    2-D arrays become (lines, width): each row's real span ``[first, last)`` copied end to end, 0
    elsewhere; ``attention_mask`` holds the row's segment id (1, 2, ... within a line) where the row
    had a real token. ``src_row`` / ``src_col`` (lines, width) name the original position of every
    slot (-1: empty), for scattering per-token results back (:func:`scatter_packed`).
    ``seq_bucket`` rounds the width up, ``line_bucket`` the line count to a power of two (an XLA
    device then sees few shapes; on CPU neither is needed). Scalars are kept."""
    mask = np.asarray(batch["attention_mask"])
    L = mask.shape[1]
    rows = np.asarray(rows)
    first, last = row_spans(mask[rows])
    lengths = last - first
    width = _bucket(int(lengths.max()), seq_bucket, L)
    lines = pack_lines(lengths, width)
    n = len(lines)
    if line_bucket:
        n = min(len(rows), 1 << (n - 1).bit_length())
    src_row = np.full((n, width), -1, np.int64)
    src_col = np.full((n, width), -1, np.int64)
    seg = np.zeros((n, width), np.int64)
    for li, members in enumerate(lines):
        c = 0
        for s, i in enumerate(members, start=1):
            k = int(lengths[i])
            src_row[li, c:c + k] = rows[i]
            src_col[li, c:c + k] = np.arange(first[i], last[i])
            seg[li, c:c + k] = s
            c += k
    valid = src_row >= 0
    out = {}
    for key, v in batch.items():
        if isinstance(v, np.ndarray) and v.ndim == 2:
            a = np.zeros((n, width), v.dtype)
            a[valid] = v[src_row[valid], src_col[valid]]
            out[key] = a
        else:
            out[key] = v
    out["attention_mask"] = (seg * (out["attention_mask"] != 0)).astype(mask.dtype)
    return out, (src_row, src_col)


def scatter_packed(out: np.ndarray, vals: np.ndarray, src: tuple[np.ndarray, np.ndarray]) -> None:
    """Write per-token results of a packed micro-batch (lines, width - 1) for tokens 1..width-1 of
    each line back into the (R, L) layout ``out``. A row's first token has no prediction of its own
    in a line (its predecessor is another row's) and is left as it was, like the unpacked pass
    leaves column ``lo``."""
    src_row, src_col = src
    r, c = src_row[:, 1:], src_col[:, 1:]
    own = (r >= 0) & (r == src_row[:, :-1])  # the token before is the same row's
    out[r[own], c[own]] = vals[own]


def packed_padding(micro: list[dict], attention_mask: np.ndarray) -> float:
    """Padded / computed token slots over built micro-batches (packed or not)."""
    computed = sum(m["tokens"].shape[0] * m["tokens"].shape[1] for m in micro)
    return 1.0 - float((np.asarray(attention_mask) > 0).sum()) / max(computed, 1)
