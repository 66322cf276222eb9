"""The continuous engine as the planner counts it: its slot grid, its paged KV pool, and the waves a
request is served in.

Why: ``sampler.engine: continuous`` (the default, ``rltpu/sampling/continuous.py``) does not hold a
dense ``rows x (prompt + new)`` KV cache. It keeps S decode slots and a pool of KV pages sized from
S; rows beyond S (or beyond what the pool holds) wait in a queue and are admitted as slots free, so
a request of R rows is served in about ceil(R / S) waves. Memory follows the slot grid, time follows
the waves. ``EngineGrid.from_config`` repeats ``ContinuousSampler.__init__``'s sizing rules (page
size, pool pages, prefill row buckets, slot buckets, attention block) without importing JAX;
``tests/test_plan_continuous.py`` checks them against a real ``ContinuousSampler``.

Counts (R rows of one sampler, G samples per prompt, mean generated length l, longest T):
    concurrent rows  c = min(S, R, rows the pool feeds: pages / (prompt pages / G + ceil(l / ps)))
    waves            W = ceil(R / c)
    decode steps     D = (W - 1) * l + T     (a wave's slots refill as rows stop; the last waits for its longest)
    chunks           ceil(D / decode_chunk)  (the host admits rows between chunks); W * ceil(T / decode_chunk)
                     when every row runs T (a wave's rows stop together, in a short last chunk)
    slot-steps       b * D                   (b: the smallest slot bucket >= c; every chunk computes all of it)
    prefill          R / G prompts, once each, c / G per wave, split into calls of the prefill row
                     buckets with the least padding (``rltpu.sampling.buckets.split_rows``)
    history read     per slot per step, the blocks (``block_pages`` pages) the chunk's longest row needs,
                     read straight from the pool: modelled as the prompt pages plus half the longest
                     completion (the longest row of a wave grows from 0 to T), in whole blocks
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rltpu.sampling.buckets import slot_buckets, split_rows

AUTO_POOL_FRACTION = 0.4  # sampler.kv_pages=0: pages for 40% of the slot grid's dense cache (the engine's rule)
ATTN_BLOCK_TOKENS = 32  # the engine's attention block (rltpu/sampling/continuous.py)
PREFILL_MIN_TOKENS = 16  # the engine's shortest extra prefill length (rltpu/sampling/continuous.py)


def _pow2_at_most(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


@dataclass(frozen=True)
class EngineGrid:
    """The compiled grid and pool of one continuous sampler (``ContinuousSampler``'s attributes)."""
    slots: int  # S
    chunk: int  # C, decode steps per compiled call
    page_size: int  # ps, tokens per page
    prompt_pages: int  # MP, pages of the largest prompt bucket
    gen_pages: int  # MG, pages of the longest completion
    pages: int  # the pool, with the null page
    prefill_rows: tuple[int, ...]  # prompts per prefill call (buckets)
    prefill_lens: tuple[int, ...]  # prompt tokens per prefill call (whole pages)
    slot_buckets: tuple[int, ...]
    block_pages: int  # pages one step of the decode attention loop reads per slot
    group: int

    @classmethod
    def from_config(cls, scfg, slots: int | None = None) -> "EngineGrid":
        """``scfg`` a ``SamplerConfig``; ``slots`` overrides ``sampler.slots`` (the planner's choice)."""
        S = slots or scfg.slots or max(scfg.batch_buckets)
        T = max(scfg.new_tokens_grid)
        P = max(scfg.prompt_buckets)
        C = scfg.decode_chunk
        ps = min(scfg.kv_page_size, _pow2_at_most(T))
        MP, MG = math.ceil(P / ps), math.ceil(T / ps)
        G = max(scfg.group_size, 1)
        per = math.ceil(S / G)
        prefill_rows = tuple(sorted({1, *(4 ** i for i in range(8) if 4 ** i < per), per}))
        first = math.ceil(min(C, T) / ps)
        auto = max(math.ceil(AUTO_POOL_FRACTION * S * (P + T) / ps), S * first + per * MP, MP + MG)
        pages = (scfg.kv_pages or auto) + 1
        buckets = slot_buckets(S, tuple(scfg.batch_buckets), T, C)
        block = max(1, min(ATTN_BLOCK_TOKENS // ps, MP + MG))
        top = ps * MP  # the largest prompt bucket in whole pages; below it, the powers of two pages
        lens = tuple(sorted({ps * math.ceil(b / ps) for b in scfg.prompt_buckets}
                            | {ps << k for k in range(top.bit_length()) if PREFILL_MIN_TOKENS <= ps << k < top}))
        return cls(S, C, ps, MP, MG, pages, prefill_rows, lens, buckets, block, G)

    @property
    def pool_tokens(self) -> int:
        """Tokens the pool holds, without the null page."""
        return (self.pages - 1) * self.page_size

    @property
    def attended_tokens(self) -> int:
        """History tokens a slot's attention reads per decode step, as modelled in the module docstring."""
        pages = self.prompt_pages + math.ceil(self.gen_pages / 2)
        return math.ceil(pages / self.block_pages) * self.block_pages * self.page_size

    def pool_bytes(self, kv_bytes_per_token: float) -> float:
        """The pool per layer, K and V (``page_size x head_dim`` per kv head and page): every page, null included."""
        return self.pages * self.page_size * kv_bytes_per_token

    def history_bytes(self, kv_bytes_per_token: float) -> float:
        """Live while the decode loop runs: the chunk's own new keys (S x C, every layer) and one
        attention block read from the pool per slot (counted for every layer: an upper bound)."""
        return self.slots * (self.chunk + self.block_pages * self.page_size) * kv_bytes_per_token


@dataclass(frozen=True)
class Waves:
    """How one sampler serves ``rows`` rows on an ``EngineGrid``."""
    rows: int
    prompts: int
    concurrent: int  # rows decoding at once
    waves: int
    decode_steps: float
    chunks: int
    slot_bucket: int  # slots a chunk computes: the smallest slot bucket that holds the concurrent rows
    slot_steps: float  # slots computed x steps
    prefill_calls: int
    prefill_prompts: int  # padded to the prefill row buckets (``buckets.split_rows``)
    pool_rows: int  # rows the pool feeds at their mean length (the slots may be more)


def serve(g: EngineGrid, rows: int, mean_new: float, max_new: int) -> Waves:
    """The counts of the module docstring. ``mean_new`` (l) <= ``max_new`` (T)."""
    prompts = math.ceil(rows / g.group)
    per_row_pages = g.prompt_pages / g.group + math.ceil(mean_new / g.page_size)
    pool_rows = max(1, int((g.pages - 1) // per_row_pages))
    c = max(1, min(g.slots, rows, pool_rows))
    waves = math.ceil(rows / c)
    sb = next(b for b in g.slot_buckets if b >= c)
    steps = (waves - 1) * mean_new + max_new
    # prompts are prefilled as their first sample is admitted: about one call of c / G prompts per wave
    per_call = max(1, min(math.ceil(c / g.group), prompts))
    full, last = divmod(prompts, per_call)
    split, tail = split_rows(per_call, g.prefill_rows), split_rows(last, g.prefill_rows)
    calls = full * len(split) + len(tail)
    padded = full * sum(split) + sum(tail)
    # rows of one length finish together: each wave ends on a short chunk; otherwise slots refill every chunk
    chunks = waves * math.ceil(max_new / g.chunk) if mean_new >= max_new else math.ceil(steps / g.chunk)
    return Waves(rows=rows, prompts=prompts, concurrent=c, waves=waves, decode_steps=steps,
                 chunks=chunks, slot_bucket=sb, slot_steps=sb * steps, prefill_calls=calls,
                 prefill_prompts=padded, pool_rows=pool_rows)


def flops(m, g: EngineGrid, prefill_prompts: float, slot_steps: float) -> tuple[float, float]:
    """(prefill, decode) FLOPs of a continuous sampler (``m`` a ``ModelShape``): its prefill calls
    (``prefill_prompts`` padded to the prefill row buckets, the prompt bucket padded to pages) and
    every computed slot-step, each attending over ``attended_tokens`` plus the chunk's own keys.
    The cost model (prediction) and the micro-benchmark's probe (fit, from the engine's own counters)
    both count with this."""
    P, H, L = g.prompt_pages * g.page_size, m.hidden, m.layers
    prefill = 2 * m.matmul_params * prefill_prompts * P + 4 * prefill_prompts * P * P * H * L
    decode = slot_steps * (2 * m.matmul_params + 4 * (g.attended_tokens + g.chunk) * H * L)
    return prefill, decode
