"""Continuous batching over a fixed slot grid with a paged KV cache: the sampler for long-tail rollouts.

Why: a static batch decodes until its longest row stops, so with long-tail completion lengths most
of its slot-steps are idle; each of a prompt's G samples prefills the same prompt again; and a dense
``[rows, kv, P+T, hd]`` cache reserves the worst case for every row. Here:

* **one prefill per prompt**: its K/V go to pages that all of its G samples read (never copied);
* **a fixed grid of S decode slots**: between decode chunks (``decode_chunk`` steps in one compiled
  ``while_loop``) the host admits waiting samples into the slots that finished, so slots stay busy
  until the queue is empty;
* **a paged KV pool** per layer (V ``[pages, kv_heads, page_size, head_dim]``, K transposed
  ``[pages, kv_heads, head_dim, page_size]`` as in the static cache) plus a block table per
  slot (prompt pages, then its own generated pages); pages are handed out as rows grow and returned
  when they stop, so memory follows live tokens. If the pool runs dry, the most recently admitted
  row is preempted (its pages freed) and later recomputed from its prompt.

The compiled shapes are a fixed grid: prefill programs (prompts per call x prefill length) and
decode-chunk programs (one per slot bucket; attention loops over as many history blocks as the
longest row in the chunk needs). ``precompile`` builds them all; nothing compiles in steady state. Tokens depend only on (seed, row, position), never on
slot, chunk or preemption: row r draws token t with ``fold_in(fold_in(key(seed), r), t)``.

Weight versions: a call snapshots ``(params, version)`` when it starts and uses that snapshot for
all of its chunks, so a ``set_params`` landing between chunks takes effect at the next call; a row
never mixes versions (``versions`` per row is the call's version).

Page 0 is a null page: unused block-table entries point at it, and the writes of idle slots land
there; its contents are never read unmasked.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from rltpu.models import jax_llama
from rltpu.sampling.buckets import slot_buckets, split_rows
from rltpu.sampling.common import matmul_params, pick_bucket, prefill_flops, token_chooser

_F32 = jnp.float32
AUTO_POOL_FRACTION = 0.4  # kv_pages=0: pages for 40% of the dense cache of the slot grid
ATTN_BLOCK_TOKENS = 32  # history tokens one step of the decode attention loop reads per slot (plan/continuous.py too)
# XLA:CPU's YNNPACK fusions for a decode chunk: each dot its own library call instead of fused with
# its neighbours. On the 25M long tail b64 of benchmarks/sampler.py --vs-vllm (one 2-core VM):
# +7% tokens/s (separate runs, 2026-12-03e) and +4% (two engines in one process, calls interleaved,
# median of 4, 2026-12-03f). The static engine's program was mixed with it (+8% and -17% in two
# runs), so only these programs take it
XLA_CPU_DECODE_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}
PREFILL_MIN_TOKENS = 16  # no prefill length below this but a prompt bucket's: it saves too little to pay for its programs


def _pow2_at_most(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def _softmax_merge(m, l, acc, scores, weighted_values):
    """One block of an online softmax: fold ``scores`` (..., k) into the running max ``m``, sum ``l``
    and value accumulator ``acc``; ``weighted_values(p)`` is the block's values weighted by ``p``."""
    m_new = jnp.maximum(m, scores.max(-1))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(scores - m_new[..., None])
    return m_new, l * alpha + p.sum(-1), acc * alpha[..., None] + weighted_values(p)


class _Row:
    """A sample in a decode slot: its row, generated pages, tokens so far, admission order, the
    slot it sat in after the last chunk (-1: admitted, not yet run) and whether it was preempted."""

    __slots__ = ("row", "order", "pages", "glen", "slot", "gone")

    def __init__(self, row: int, order: int):
        self.row, self.order, self.pages, self.glen, self.slot, self.gone = row, order, [], 0, -1, False


class ContinuousSampler:
    """Continuous batching for one ``SamplerEngine`` (``engine``): shares its weights, version,
    sampling config, compile counters and (with k devices) mesh."""

    def __init__(self, engine):
        e, cfg = engine, engine.cfg
        self.e, self.mcfg, self.cfg = e, e.mcfg, cfg
        self.S = cfg.slots or max(cfg.batch_buckets)
        self.C = cfg.decode_chunk
        self.T = max(cfg.new_tokens_grid)
        self.ps = min(cfg.kv_page_size, _pow2_at_most(self.T))  # a short-answer grid gets small pages
        self.MP = math.ceil(max(cfg.prompt_buckets) / self.ps)  # prompt pages per slot, at most
        self.MG = math.ceil(self.T / self.ps)  # generated pages per slot, at most
        self.dense_tokens = self.S * (max(cfg.prompt_buckets) + self.T)  # the static engine's cache, same rows
        G = max(cfg.group_size, 1)
        self.prefill_rows = tuple(sorted({1, *(4 ** i for i in range(8) if 4 ** i < math.ceil(self.S / G)),
                                          math.ceil(self.S / G)}))
        # prefill lengths: the prompt buckets in whole pages, and the powers of two pages from
        # PREFILL_MIN_TOKENS up to the largest, so a prompt pays for about its own pages and not the
        # bucket above it (8-32 token prompts at bucket 32: 10% more tokens/s on the 25M long tail)
        # while a short-prompt grid (the quickstart's 8) compiles nothing more; plan/continuous.py mirrors it
        top = self._plen(max(cfg.prompt_buckets))
        self.prefill_lens = tuple(sorted({self._plen(b) for b in cfg.prompt_buckets}
                                         | {self.ps << k for k in range(top.bit_length())
                                            if PREFILL_MIN_TOKENS <= self.ps << k < top}))
        first = math.ceil(min(self.C, self.T) / self.ps)  # pages a slot needs for its first chunk
        auto = max(math.ceil(AUTO_POOL_FRACTION * self.dense_tokens / self.ps),
                   self.S * first + math.ceil(self.S / G) * self.MP,  # a full grid admits at once
                   self.MP + self.MG)
        self.n_pages = (cfg.kv_pages or auto) + 1  # + the null page
        if self.n_pages - 1 < self.MP + self.MG:
            raise ValueError(f"sampler.kv_pages={cfg.kv_pages} cannot hold one row ({self.MP} prompt + {self.MG} "
                             f"generated pages of {self.ps} tokens); raise sampler.kv_pages or set it to 0 (auto)")
        # attention reads the pool in blocks of BP pages, as many blocks as the longest history in the
        # chunk needs (a loop bound passed at run time): cost follows live tokens and one program per
        # slot bucket serves every history length
        self.BP = max(1, min(ATTN_BLOCK_TOKENS // self.ps, self.MP + self.MG))  # no wider than a whole history
        self.TW = math.ceil((self.MP + self.MG) / self.BP) * self.BP  # block-table width, whole blocks
        # slots a chunk computes: the smallest bucket (rltpu.sampling.buckets.slot_buckets) that holds the
        # busy rows, so a small request or the tail of a large one pays for about its own rows only (the
        # 1.5x steps cut padded slot-steps by about 15% on a long tail for 1.7x programs, each cheap now
        # that one program serves every history length)
        self.slot_buckets = slot_buckets(self.S, tuple(cfg.batch_buckets), self.T, self.C)
        self.NW = math.ceil((self.ps - 1 + self.C) / self.ps)  # pages one chunk's new tokens can span
        self.H = self.S + max(self.prefill_rows)  # prompt-logit rows (handles)
        self.choose = token_chooser(cfg)
        self.stop = tuple(e.stop_ids)
        self.xla_cpu = e.xla_cpu  # the engine's decision: XLA:CPU-only gathers and compiler options
        self._compiled: dict = {}
        self._compile_lock = threading.Lock()
        self._state = None
        self.totals = dict(calls=0, prefill_tokens=0, prefill_flops=0.0, decode_steps=0, slot_steps=0,
                           busy_slot_steps=0, useful_tokens=0, preemptions=0)
        if e.mesh is not None:
            from jax.sharding import NamedSharding, PartitionSpec

            self._pool_sharding = NamedSharding(e.mesh, PartitionSpec(None, "tp", None, None))  # by kv heads

    # -- sizes ---------------------------------------------------------------------------------
    def page_bytes(self) -> int:
        """K + V bytes of one page, all layers."""
        m = self.mcfg
        return 2 * m.num_hidden_layers * m.num_key_value_heads * self.ps * m.head_dim * jnp.dtype(self.e.dtype).itemsize

    def pool_bytes(self) -> int:
        return self.n_pages * self.page_bytes()

    def dense_bytes(self) -> int:
        """What a dense ``[S, kv, P_max + T, hd]`` cache (the static engine with S rows) holds."""
        return self.dense_tokens * self.page_bytes() // self.ps

    # -- device state --------------------------------------------------------------------------
    def _state_structs(self) -> dict:
        m, S, V = self.mcfg, self.S, self.e.vocab_size
        kv, hd, ps = m.num_key_value_heads, m.head_dim, self.ps
        kpage = jax.ShapeDtypeStruct((self.n_pages, kv, hd, ps), self.e.dtype)  # K transposed: see _history_attend
        vpage = jax.ShapeDtypeStruct((self.n_pages, kv, ps, hd), self.e.dtype)
        i32 = jnp.int32
        vec = jax.ShapeDtypeStruct((S,), i32)
        return {
            "k": tuple(kpage for _ in range(m.num_hidden_layers)), "v": tuple(vpage for _ in range(m.num_hidden_layers)),
            "plog": jax.ShapeDtypeStruct((self.H, V), _F32),  # last-prompt-token logits per prefilled prompt
            "logits": jax.ShapeDtypeStruct((S, V), _F32),  # next-token logits per slot
            "glen": vec, "plen": vec, "limit": vec, "row": vec,
            "active": jax.ShapeDtypeStruct((S,), jnp.bool_),
            "tokens": jax.ShapeDtypeStruct((S, self.T), i32), "logprobs": jax.ShapeDtypeStruct((S, self.T), _F32),
            "steps": jax.ShapeDtypeStruct((), i32), "busy": jax.ShapeDtypeStruct((), i32),
        }

    def _state_shardings(self):
        if self.e.mesh is None:
            return None
        rep = self.e._replicated
        return {k: (tuple(self._pool_sharding for _ in v) if k in ("k", "v") else rep)
                for k, v in self._state_structs().items()}

    def _init_state(self) -> dict:
        """Zeroed state, built on the host and put (no XLA program runs, so nothing compiles)."""
        st = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), self._state_structs())
        sh = self._state_shardings()
        return jax.device_put(st) if sh is None else jax.device_put(st, sh)

    # -- the model over pages --------------------------------------------------------------------
    def _layer_masks(self, allowed, qpos, kpos):
        """{window: mask}: the sliding-window layers also hide keys ``>= w`` positions back."""
        out = {None: allowed}
        for i in range(self.mcfg.num_hidden_layers):
            w = self.mcfg.layer_window(i)
            if w not in out:
                out[w] = allowed & ((qpos[..., :, None] - kpos[..., None, :]) < w)
        return out

    def _prefill_fn(self):
        mcfg, ps, dtype = self.mcfg, self.ps, self.e.dtype

        def prefill(params, state, tokens, lens, pages, handles):
            # tokens (n, L) left-aligned, lens (n,), pages (n, L / ps) (0: the null page), handles (n,)
            n, L = tokens.shape
            pos = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (n, L))
            x = params["model.embed_tokens.weight"][tokens]  # (n, L, H)
            cos, sin = jax_llama.rope_cos_sin(pos, mcfg.head_dim, mcfg.rope_theta, x.dtype, mcfg.rope_scaling)
            idx = jnp.arange(L)
            allowed = (idx[None, :] <= idx[:, None])[None] & (idx[None, None, :] < lens[:, None, None])  # (n, L, L)
            eye = jnp.eye(L, dtype=bool)[None]
            masks = self._layer_masks(allowed, pos, pos)
            ks, vs = list(state["k"]), list(state["v"])
            for i in range(mcfg.num_hidden_layers):
                h = jax_llama.rms_norm(x, params[f"model.layers.{i}.input_layernorm.weight"], mcfg.rms_norm_eps)
                q, k, v = jax_llama._qkv(params, mcfg, i, h, cos, sin)  # k, v (n, L, kv, hd)

                def paged(a, order):  # (n, L, kv, hd) -> (n, L/ps, ...) in the pool's order
                    return a.reshape(n, L // ps, ps, *a.shape[2:]).transpose(order).astype(dtype)

                ks[i] = ks[i].at[pages].set(paged(k, (0, 1, 3, 4, 2)))  # (n, L/ps, kv, hd, ps)
                vs[i] = vs[i].at[pages].set(paged(v, (0, 1, 3, 2, 4)))  # (n, L/ps, kv, ps, hd)
                k, v = k.astype(dtype).astype(x.dtype), v.astype(dtype).astype(x.dtype)
                att = jax_llama._attend(q, k, v, masks[mcfg.layer_window(i)] | eye)
                x = x + jax_llama._out_proj(params, mcfg, i, att)
                x = jax_llama._mlp_block(params, mcfg, i, x)
            last = x[jnp.arange(n), lens - 1][:, None]  # (n, 1, H): only the last real token's logits
            logits = jax_llama._logits(params, mcfg, last)[:, 0]
            return state | {"k": tuple(ks), "v": tuple(vs), "plog": state["plog"].at[handles].set(logits, mode="drop")}

        return prefill

    def _history_attend(self, qg, kpool, vpool, hist, nblk, plen, g0, qpos, window):
        """Online-softmax attention of one query per slot over its history in the pool, ``nblk``
        blocks of BP pages read straight from their pages (no copy of the history per chunk).
        qg (s, kv, rep, hd) fp32; hist (s, TW) pages (prompt pages, then generated ones); a token
        counts if it is a prompt token (< plen) or generated before the chunk (< g0). Returns the
        running (max, sum, acc) that ``_decode_forward`` finishes with the chunk's recent keys."""
        s, nkv, rep, hd = qg.shape
        ps, BP, MP = self.ps, self.BP, self.MP
        jb = jnp.arange(BP * ps, dtype=jnp.int32)

        def body(b, carry):
            m, l, acc = carry
            tbl = lax.dynamic_slice_in_dim(hist, b * BP, BP, axis=1)  # (s, BP)
            # whole pages, on XLA:CPU gathered as rows of a 2-D view (copied 1.5x faster there than
            # the same gather over the 4-D pool; a chip keeps the plain gather, not measured there),
            # then one dot per (slot, page, kv head): the pages stay batch-major and K is stored
            # [hd, ps], so neither operand is transposed or repacked
            kb, vb = ((pool.reshape(pool.shape[0], -1)[tbl].reshape(*tbl.shape, *pool.shape[1:]) if self.xla_cpu
                       else pool[tbl]).astype(_F32) for pool in (kpool, vpool))  # (s, BP, kv, hd, ps), (s, BP, kv, ps, hd)
            qb = jnp.broadcast_to(qg[:, None], (s, BP, nkv, rep, hd))
            sc = jnp.einsum("bpgrd,bpgdt->bpgrt", qb, kb).transpose(0, 2, 3, 1, 4).reshape(s, nkv, rep, BP * ps)
            sc = sc * hd**-0.5
            jj = b * (BP * ps) + jb
            gg = jj - MP * ps
            ok = jnp.where(jj < MP * ps, jj[None] < plen[:, None], gg[None] < g0[:, None])  # (s, BP*ps)
            if window is not None:
                kpos = jnp.where(jj[None] < MP * ps, jj[None], plen[:, None] + gg[None])
                ok = ok & ((qpos[:, None] - kpos) < window)
            sc = jnp.where(ok[:, None, None, :], sc, jnp.finfo(_F32).min)
            return _softmax_merge(m, l, acc, sc, lambda pr: jnp.einsum(
                "bpgrt,bpgtd->bpgrd", pr.reshape(s, nkv, rep, BP, ps).transpose(0, 3, 1, 2, 4), vb).sum(1))

        init = (jnp.full((s, nkv, rep), -jnp.inf, _F32), jnp.zeros((s, nkv, rep), _F32),
                jnp.zeros((s, nkv, rep, hd), _F32))
        return lax.fori_loop(0, nblk, body, init)

    def _decode_forward(self, params, kpools, vpools, hist, nblk, rk, rv, i, tok, glen, plen, g0):
        """One token per slot. Keys: the slot's history in the pool (pages ``hist`` (s, TW), read
        ``nblk`` blocks deep; see ``_history_attend``) and the tokens this chunk fed so far
        (``rk`` (s, kv, hd, C) / ``rv`` (s, kv, C, hd), written here at step ``i``, all slots alike). tok, glen
        (index of tok among the generated tokens), plen, g0 (glen at the chunk's start) (s,).
        Returns (logits (s, V), rk, rv)."""
        mcfg, C = self.mcfg, self.C
        s = tok.shape[0]
        qpos = plen + glen  # (s,)
        x = params["model.embed_tokens.weight"][tok[:, None]]  # (s, 1, H)
        cos, sin = jax_llama.rope_cos_sin(qpos[:, None], mcfg.head_dim, mcfg.rope_theta, x.dtype, mcfg.rope_scaling)
        j = jnp.arange(C, dtype=jnp.int32)
        recent_ok = jnp.broadcast_to(j <= i, (s, C))
        recent_pos = (plen + g0)[:, None] + j[None]
        rk, rv = list(rk), list(rv)
        nh, nkv, hd = mcfg.num_attention_heads, mcfg.num_key_value_heads, mcfg.head_dim
        zero = jnp.zeros((), jnp.int32)
        for li in range(mcfg.num_hidden_layers):
            window = mcfg.layer_window(li)
            h = jax_llama.rms_norm(x, params[f"model.layers.{li}.input_layernorm.weight"], mcfg.rms_norm_eps)
            q, k, v = jax_llama._qkv(params, mcfg, li, h, cos, sin)  # q (s, 1, nh, hd); k, v (s, 1, kv, hd)
            start = (zero, zero, zero, i)
            rk[li] = lax.dynamic_update_slice(rk[li], k.transpose(0, 2, 3, 1).astype(rk[li].dtype), start)
            rv[li] = lax.dynamic_update_slice(rv[li], jnp.swapaxes(v, 1, 2).astype(rv[li].dtype), (zero, zero, i, zero))
            qg = q.reshape(s, nkv, nh // nkv, hd).astype(_F32)
            m, l, acc = self._history_attend(qg, kpools[li], vpools[li], hist, nblk, plen, g0, qpos, window)
            # the chunk's own keys: one more block of the same online softmax
            ok = recent_ok if window is None else recent_ok & ((qpos[:, None] - recent_pos) < window)
            sr = jnp.einsum("bgrd,bgds->bgrs", qg, rk[li].astype(_F32)) * hd**-0.5
            sr = jnp.where(ok[:, None, None, :], sr, jnp.finfo(_F32).min)
            m, l, acc = _softmax_merge(m, l, acc, sr,
                                       lambda pr: jnp.einsum("bgrs,bgsd->bgrd", pr, rv[li].astype(_F32)))
            att = (acc / l[..., None]).astype(x.dtype).reshape(s, 1, nh * hd)
            x = x + jax_llama._out_proj(params, mcfg, li, att)
            x = jax_llama._mlp_block(params, mcfg, li, x)
        return jax_llama._logits(params, mcfg, x)[:, 0], tuple(rk), tuple(rv)

    _PER_SLOT = ("logits", "glen", "plen", "limit", "row", "active", "tokens", "logprobs")

    def _chunk_fn(self):
        T, C, pad, ps = self.T, self.C, self.e.pad_id, self.ps
        stop = jnp.asarray(self.stop, jnp.int32)
        choose = self.choose
        mcfg = self.mcfg

        def chunk(params, state, src, hist, wpages, admit, key, nblk):
            # src (s,): slot j of this chunk carries on the row of slot src[j] (compaction);
            # hist (s, TW) pages to read (MP prompt entries, then generated before the chunk); nblk:
            # blocks of BP entries the longest history needs; wpages (s, NW) the pages this chunk's
            # tokens go to (from page g0 // ps on); admit: "reset" (s,) slots to reinitialise
            # (admitted, or not carrying a row), "on" (s,) admitted, "handle" / "plen" / "limit" /
            # "row" (s,) for the admitted ones; key: the call's PRNG key
            s = src.shape[0]
            on, reset = admit["on"], admit["reset"]
            cur = {k: state[k][src] for k in self._PER_SLOT}
            cur["logits"] = jnp.where(on[:, None], state["plog"][jnp.minimum(admit["handle"], self.H - 1)],
                                      cur["logits"])
            for k in ("plen", "limit", "row"):
                cur[k] = jnp.where(on, admit[k], cur[k])
            cur["glen"] = jnp.where(reset, 0, cur["glen"])
            cur["active"] = jnp.where(reset, on, cur["active"])
            cur["tokens"] = jnp.where(reset[:, None], pad, cur["tokens"])
            cur["logprobs"] = jnp.where(reset[:, None], 0.0, cur["logprobs"])
            row_keys = jax.vmap(jax.random.fold_in, (None, 0))(key, cur["row"])  # (s, 2)
            rows = jnp.arange(s)
            g0, plen = cur["glen"], cur["plen"]
            kshape = (s, mcfg.num_key_value_heads, mcfg.head_dim, C)  # K transposed, like the pool
            vshape = (s, mcfg.num_key_value_heads, C, mcfg.head_dim)
            kzeros = tuple(jnp.zeros(kshape, state["k"][0].dtype) for _ in range(mcfg.num_hidden_layers))
            vzeros = tuple(jnp.zeros(vshape, state["v"][0].dtype) for _ in range(mcfg.num_hidden_layers))

            def cond(c):
                return (c["i"] < C) & jnp.any(c["active"])

            def body(c):
                u = jax.vmap(lambda k, t: jax.random.uniform(jax.random.fold_in(k, t), (), _F32))(row_keys, c["glen"])
                tok, lp = choose(c["logits"], u[:, None])
                act = c["active"]
                at = jnp.where(act, c["glen"], T)  # idle slots write nowhere
                tokens = c["tokens"].at[rows, at].set(tok, mode="drop")
                logprobs = c["logprobs"].at[rows, at].set(lp, mode="drop")
                glen = c["glen"] + act
                go = act & ~jnp.isin(tok, stop) & (glen < c["limit"])  # still running: feed tok back
                logits, rk, rv = self._decode_forward(params, state["k"], state["v"], hist, nblk, c["rk"], c["rv"],
                                                      c["i"], tok, c["glen"], plen, g0)
                return c | dict(i=c["i"] + 1, logits=logits, rk=rk, rv=rv, tokens=tokens, logprobs=logprobs,
                                glen=glen, active=go, fed=c["fed"] + go, steps=c["steps"] + 1,
                                busy=c["busy"] + jnp.sum(act, dtype=jnp.int32))

            init = {k: cur[k] for k in ("logits", "glen", "active", "tokens", "logprobs")} | dict(
                i=jnp.int32(0), rk=kzeros, rv=vzeros, fed=jnp.zeros((s,), jnp.int32), steps=state["steps"],
                busy=state["busy"], limit=cur["limit"])
            out = lax.while_loop(cond, body, init)
            # the fed tokens' K/V into their pages, once per chunk (the rest into the null page)
            g = g0[:, None] + jnp.arange(C, dtype=jnp.int32)[None]  # (s, C) generated index of step j
            col = jnp.clip(g // ps - (g0 // ps)[:, None], 0, wpages.shape[1] - 1)
            page = jnp.where(jnp.arange(C)[None] < out["fed"][:, None], jnp.take_along_axis(wpages, col, axis=1), 0)
            off = g % ps
            ks = tuple(pool.at[page, :, :, off].set(r.transpose(0, 3, 1, 2)) for pool, r in zip(state["k"], out["rk"]))
            vs = tuple(pool.at[page, :, off].set(jnp.swapaxes(r, 1, 2)) for pool, r in zip(state["v"], out["rv"]))
            new = dict(state, k=ks, v=vs, steps=out["steps"], busy=out["busy"])
            cur |= {k: out[k] for k in ("logits", "glen", "active", "tokens", "logprobs")}
            for k in self._PER_SLOT:
                new[k] = state[k].at[:s].set(cur[k])
            return new

        return chunk

    # -- compilation ---------------------------------------------------------------------------
    def _compile(self, cell, log: tuple, fn, args):
        """AOT-compile ``fn`` for ``args`` as grid cell ``cell``; counted in the engine's stats."""
        e = self.e
        t0, hits0 = e._compile_mark()
        if e.mesh is None:
            jitted = jax.jit(fn, donate_argnums=(1,))
        else:  # weights in their shardings, the pool split by kv heads, the rest replicated
            r, sh = e._replicated, self._state_shardings()
            ins = (e.param_shardings, sh) + tuple(jax.tree.map(lambda _: r, a) for a in args[2:])
            jitted = jax.jit(fn, donate_argnums=(1,), in_shardings=ins, out_shardings=sh)
        compiled = jitted.lower(*args).compile(compiler_options=self.compiler_options(cell))
        with self._compile_lock:
            self._compiled[cell] = compiled
            e._compile_done(log, t0, hits0)

    def compiler_options(self, cell: tuple) -> dict | None:
        """XLA options for ``cell``'s program: ``XLA_CPU_DECODE_OPTIONS`` for a decode chunk on
        XLA:CPU (an XLA:CPU flag; a chip's compiler gets nothing), none otherwise."""
        return dict(XLA_CPU_DECODE_OPTIONS) if cell[0] == "decode" and self.xla_cpu else None

    def _prefill_args(self, n: int, L: int):
        i32 = jnp.int32
        return (self.e.program_structs, self._state_structs(), jax.ShapeDtypeStruct((n, L), i32),
                jax.ShapeDtypeStruct((n,), i32), jax.ShapeDtypeStruct((n, L // self.ps), i32),
                jax.ShapeDtypeStruct((n,), i32))

    def _chunk_args(self, n: int):
        i32 = jnp.int32
        vec = jax.ShapeDtypeStruct((n,), i32)
        flag = jax.ShapeDtypeStruct((n,), jnp.bool_)
        admit = {"on": flag, "reset": flag, "handle": vec, "plen": vec, "limit": vec, "row": vec}
        return (self.e.program_structs, self._state_structs(), vec, jax.ShapeDtypeStruct((n, self.TW), i32),
                jax.ShapeDtypeStruct((n, self.NW), i32), admit, jax.ShapeDtypeStruct((2,), jnp.uint32),
                jax.ShapeDtypeStruct((), i32))

    def _plen(self, bucket: int) -> int:
        return math.ceil(bucket / self.ps) * self.ps

    def cells(self) -> list[tuple]:
        """Every program of the grid: ("prefill", prompts, length) and ("decode", slots)."""
        out = [("prefill", n, L) for n in self.prefill_rows for L in self.prefill_lens]
        return out + [("decode", n) for n in self.slot_buckets]

    def ensure(self, cell: tuple) -> None:
        """Build ``cell`` if missing (counted as a compile: after ``precompile`` it never is)."""
        if cell in self._compiled:
            return
        if cell[0] == "prefill":  # logged as ("prefill:n", length, 0)
            self._compile(cell, (f"prefill:{cell[1]}", cell[2], 0), self._prefill_fn(),
                          self._prefill_args(cell[1], cell[2]))
        else:  # logged as ("decode:slots", tokens a slot's history may hold, steps per chunk)
            n = cell[1]
            self._compile(cell, (f"decode:{n}", (self.MP + self.MG) * self.ps, self.C), self._chunk_fn(),
                          self._chunk_args(n))

    def programs(self) -> list:
        """The compiled prefill and decode-chunk executables."""
        return list(self._compiled.values())

    def precompile(self) -> None:
        """Build every cell, two at a time: XLA compiles with the GIL released, single-threaded,
        so a second core halves the wait (the grid has one decode program per slot bucket x view)."""
        todo = [cell for cell in self.cells() if cell not in self._compiled]
        workers = min(2, os.cpu_count() or 1, len(todo))
        if workers > 1:
            with ThreadPoolExecutor(workers) as pool:
                list(pool.map(self.ensure, todo))
        for cell in todo:
            self.ensure(cell)
        if self._state is None:
            self._state = self._init_state()
        jax.random.PRNGKey(0)  # the host-side key program every call runs (jit-cached from here on)

    # -- the host loop -----------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], G: int, seed: int, max_new_tokens: int | None = None) -> dict:
        """Same contract as ``SamplerEngine.generate`` (rows prompt-major, tokens (R, N) padded after
        the stop token, logprobs, lengths, version), plus the counters of this call."""
        e, cfg, S, ps = self.e, self.cfg, self.S, self.ps
        if e.params is None:
            raise RuntimeError("sampler has no weights yet: call set_params (weight sync) first")
        params, version = e.params, e.version  # the snapshot every chunk of this call uses
        t_call = time.perf_counter()
        compiles0, compile_s0 = e.stats.compiles, e.stats.compile_seconds
        prompts, truncated = e.fit_prompts(prompts)
        n_new = max_new_tokens or cfg.max_new_tokens
        pick_bucket(n_new, cfg.new_tokens_grid, "max_new_tokens")
        R = len(prompts) * G
        lens = [len(p) for p in prompts]
        plen_out = pick_bucket(max(lens), cfg.prompt_buckets, "prompt length")
        key = np.asarray(jax.random.PRNGKey(seed))  # its program was built by precompile
        if self._state is None:
            self._state = self._init_state()
        state, self._state = self._state, None  # donated to each program; restored at the end

        out_tok = np.full((R, n_new), e.pad_id, np.int32)
        out_lp = np.zeros((R, n_new), np.float32)
        out_len = np.zeros(R, np.int32)
        queue = deque(range(R))
        free_pages = list(range(self.n_pages - 1, 0, -1))
        free_handles = list(range(self.H - 1, -1, -1))
        prompt_pages: dict[int, list[int]] = {}
        prompt_handle: dict[int, int] = {}
        prompt_left = [G] * len(prompts)
        busy: list[_Row] = []  # rows in slots, in slot order (a chunk compacts them to slots 0..n-1)
        admitted = 0
        c = dict(prefill_tokens=0, prefill_flops=0.0, prefill_slots=0, prefill_calls=0, chunks=0,
                 preemptions=0, prompt_evictions=0, live_token_sum=0, used_page_sum=0, peak_pages=0, samples=0,
                 slot_steps=0)
        steps0, busy0 = (int(x) for x in jax.device_get((state["steps"], state["busy"])))
        steps_prev = steps0
        n_mm = matmul_params(e.param_structs, self.mcfg.tie_word_embeddings)
        program_s = 0.0
        first = math.ceil(min(self.C, n_new) / ps)  # pages a row needs for its first chunk

        def evict_unread(also: int = -1) -> None:
            """Free the pages of prompts no busy row reads (they are prefilled again if needed)."""
            reading = {r.row // G for r in busy if not r.gone} | {also}
            for q in [q for q in prompt_pages if q not in reading]:
                free_pages.extend(prompt_pages.pop(q))
                free_handles.append(prompt_handle.pop(q))
                c["prompt_evictions"] += 1

        while queue or busy:
            # 1. admit waiting samples while slots and pages last (a new prompt needs its pages)
            to_prefill: list[int] = []
            while queue and len(busy) < S:
                r = queue[0]
                p = r // G
                need = first + (0 if p in prompt_pages else math.ceil(lens[p] / ps))
                if need > len(free_pages):
                    evict_unread(p)
                    need = first + (0 if p in prompt_pages else math.ceil(lens[p] / ps))
                if need > len(free_pages) or (p not in prompt_pages and not free_handles):
                    break
                queue.popleft()
                if p not in prompt_pages:
                    prompt_pages[p] = [free_pages.pop() for _ in range(math.ceil(lens[p] / ps))]
                    prompt_handle[p] = free_handles.pop()
                    to_prefill.append(p)
                busy.append(_Row(r, admitted))
                admitted += 1
            t0 = time.perf_counter()
            state = self._prefill(params, state, prompts, to_prefill, prompt_pages, prompt_handle, c, n_mm)
            program_s += time.perf_counter() - t0
            # 2. pages for the next chunk, oldest rows first; preempt the youngest while the pool is short
            for row in sorted(busy, key=lambda x: x.order):
                if row.gone:
                    continue
                want = math.ceil(min(row.glen + self.C, n_new) / ps)
                while len(row.pages) < want:
                    if not free_pages:
                        evict_unread()
                        if free_pages:
                            continue
                        victim = max((x for x in busy if not x.gone), key=lambda x: x.order)
                        queue.appendleft(victim.row)
                        free_pages.extend(victim.pages)
                        victim.pages, victim.gone = [], True
                        c["preemptions"] += 1
                        if victim is row:
                            break
                        continue
                    row.pages.append(free_pages.pop())
            busy = [x for x in busy if not x.gone]
            if not busy:
                if queue:
                    raise RuntimeError("continuous sampler admitted nothing with every slot free (pool too small)")
                break
            # 3. the smallest slot bucket that holds the busy rows; attention reads as many blocks
            # of the block table as the longest history needs
            n = len(busy)
            sb = pick_bucket(n, self.slot_buckets, "busy slots")
            nblk = math.ceil((self.MP + max(math.ceil(x.glen / ps) for x in busy)) / self.BP)
            src = np.zeros(sb, np.int32)
            admit = {"on": np.zeros(sb, bool), "reset": np.ones(sb, bool), "handle": np.zeros(sb, np.int32),
                     "plen": np.zeros(sb, np.int32), "limit": np.full(sb, n_new, np.int32),
                     "row": np.zeros(sb, np.int32)}
            hist = np.zeros((sb, self.TW), np.int32)
            wpages = np.zeros((sb, self.NW), np.int32)
            live = 0
            for j, x in enumerate(busy):
                p = x.row // G
                if x.slot < 0:
                    admit["on"][j] = True
                    admit["handle"][j], admit["plen"][j], admit["row"][j] = prompt_handle[p], lens[p], x.row
                else:
                    src[j], admit["reset"][j] = x.slot, False
                pp = prompt_pages[p]
                hist[j, :len(pp)] = pp
                k = math.ceil(x.glen / ps)
                hist[j, self.MP:self.MP + k] = x.pages[:k]
                seg = x.pages[x.glen // ps:x.glen // ps + self.NW]
                wpages[j, :len(seg)] = seg
                live += x.glen
            live += sum(lens[p] for p in prompt_pages)
            used = self.n_pages - 1 - len(free_pages)
            c["live_token_sum"] += live
            c["used_page_sum"] += used
            c["peak_pages"] = max(c["peak_pages"], used)
            c["samples"] += 1
            # 4. one decode chunk
            self.ensure(("decode", sb))
            t0 = time.perf_counter()
            args = (src, hist, wpages, admit, key, np.int32(nblk))
            if e.mesh is not None:
                args = jax.device_put(args, e._replicated)
            state = self._compiled[("decode", sb)](params, state, *args)
            active, glen, steps_now = jax.device_get((state["active"], state["glen"], state["steps"]))
            c["chunks"] += 1
            c["slot_steps"] += (int(steps_now) - steps_prev) * sb
            steps_prev = int(steps_now)
            # 5. rows that stopped: collect, free their pages; the rest now sit in slots 0..n-1
            done = [j for j in range(n) if not active[j]]
            if done:
                toks, lps = jax.device_get((state["tokens"], state["logprobs"]))
            program_s += time.perf_counter() - t0
            for j, x in enumerate(busy):
                x.slot, x.glen = j, int(glen[j])
            for j in done:
                x = busy[j]
                r, m = x.row, x.glen
                out_tok[r, :m], out_lp[r, :m], out_len[r] = toks[j, :m], lps[j, :m], m
                free_pages.extend(x.pages)
                p = r // G
                prompt_left[p] -= 1
                if prompt_left[p] == 0:
                    free_pages.extend(prompt_pages.pop(p))
                    free_handles.append(prompt_handle.pop(p))
            busy = [x for j, x in enumerate(busy) if active[j]]
        self._state = state
        steps1, busy1 = (int(x) for x in jax.device_get((state["steps"], state["busy"])))
        steps, busy_steps = steps1 - steps0, busy1 - busy0
        useful = int(out_len.sum())
        prompt = np.full((R, plen_out), e.pad_id, np.int32)
        mask = np.zeros((R, plen_out), np.int32)
        for i, p in enumerate(prompts):
            prompt[i * G:(i + 1) * G, plen_out - len(p):] = p
            mask[i * G:(i + 1) * G, plen_out - len(p):] = 1
        compile_s = e.stats.compile_seconds - compile_s0
        samples = max(c["samples"], 1)
        live_mean = c["live_token_sum"] / samples
        t = self.totals
        for k, v in (("calls", 1), ("prefill_tokens", c["prefill_tokens"]), ("prefill_flops", c["prefill_flops"]),
                     ("decode_steps", steps), ("slot_steps", c["slot_steps"]), ("busy_slot_steps", busy_steps),
                     ("useful_tokens", useful), ("preemptions", c["preemptions"])):
            t[k] += v
        return {
            "prompt": prompt, "prompt_mask": mask, "tokens": out_tok, "logprobs": out_lp, "lengths": out_len,
            "version": version, "versions": np.full(R, version, np.int64), "truncated_prompts": truncated,
            "engine": "continuous", "new_tokens": useful, "decode_steps": steps, "bucket": (S, plen_out, self.T),
            "compiles": e.stats.compiles - compiles0, "compile_seconds": compile_s,
            # token slots: prefill rows x length, decode slots x steps; padded = not a real token
            "padded_slots": c["prefill_slots"] - c["prefill_tokens"] + c["slot_steps"] - useful,
            "total_slots": c["prefill_slots"] + c["slot_steps"],
            "seconds": program_s, "program_seconds": program_s,
            "host_seconds": time.perf_counter() - t_call - program_s - compile_s,
            # issue 17 counters
            "slots": S, "decode_chunk": self.C, "chunks": c["chunks"], "slot_steps": c["slot_steps"],
            "busy_slot_steps": busy_steps, "occupancy": busy_steps / max(c["slot_steps"], 1),
            "slot_steps_per_token": c["slot_steps"] / max(useful, 1), "preemptions": c["preemptions"],
            "prompt_evictions": c["prompt_evictions"], "prefill_tokens": c["prefill_tokens"],
            "prefill_flops": c["prefill_flops"],
            "prefill_calls": c["prefill_calls"], "prefill_slots": c["prefill_slots"],
            "kv_page_size": ps, "kv_pages": self.n_pages, "kv_pool_bytes": self.pool_bytes(),
            "kv_dense_bytes": self.dense_bytes(), "kv_peak_used_bytes": c["peak_pages"] * self.page_bytes(),
            "kv_live_tokens_mean": live_mean,
            "kv_pool_bytes_per_live_token": self.pool_bytes() / max(live_mean, 1e-9),
            "kv_used_bytes_per_live_token": c["used_page_sum"] / samples * self.page_bytes() / max(live_mean, 1e-9),
        }

    def _prefill(self, params, state, prompts, todo, pages, handles, c, n_mm):
        """Prefill the prompts ``todo`` (indices) into their pages, grouped by prefill length and
        split into calls of the prefill row buckets (``buckets.split_rows``)."""
        by_len: dict[int, list[int]] = {}
        for p in todo:
            L = pick_bucket(len(prompts[p]), self.prefill_lens, "prompt length")
            by_len.setdefault(L, []).append(p)
        for L, group in by_len.items():
            for n in split_rows(len(group), self.prefill_rows):  # calls of the row buckets, least padding
                part, group = group[:n], group[n:]
                tokens = np.full((n, L), self.e.pad_id, np.int32)
                lens = np.ones(n, np.int32)
                tbl = np.zeros((n, L // self.ps), np.int32)
                hnd = np.full(n, self.H, np.int32)  # padding rows: dropped
                for i, p in enumerate(part):
                    tokens[i, :len(prompts[p])] = prompts[p]
                    lens[i] = len(prompts[p])
                    tbl[i, :len(pages[p])] = pages[p]
                    hnd[i] = handles[p]
                self.ensure(("prefill", n, L))
                args = (tokens, lens, tbl, hnd)
                if self.e.mesh is not None:
                    args = jax.device_put(args, self.e._replicated)
                state = self._compiled[("prefill", n, L)](params, state, *args)
                real = [len(prompts[p]) for p in part]
                c["prefill_tokens"] += sum(real)
                c["prefill_flops"] += prefill_flops(self.mcfg, n_mm, real)
                c["prefill_slots"] += n * L
                c["prefill_calls"] += 1
        return state
