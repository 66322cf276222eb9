"""Continuous batching over a fixed slot grid with a paged KV cache: the sampler for long-tail rollouts.

Why: a static batch decodes until its longest row stops, so with long-tail completion lengths most
of its slot-steps are idle; each of a prompt's G samples prefills the same prompt again; and a dense
``[rows, kv, P+T, hd]`` cache reserves the worst case for every row. Here:

* **one prefill per prompt**: its K/V go to pages that all of its G samples read (never copied);
* **a fixed grid of S decode slots**: between decode chunks (``decode_chunk`` steps in one compiled
  ``while_loop``) the host admits waiting samples into the slots that finished, so slots stay busy
  until the queue is empty;
* **a paged KV pool** ``[pages, kv_heads, page_size, head_dim]`` per layer plus a block table per
  slot (prompt pages, then its own generated pages); pages are handed out as rows grow and returned
  when they stop, so memory follows live tokens. If the pool runs dry, the most recently admitted
  row is preempted (its pages freed) and later recomputed from its prompt.

The compiled shapes are a fixed grid: prefill programs (prompts per call x prompt bucket) and
decode-chunk programs (one per view width: generated pages a slot may read). ``precompile`` builds
them all; nothing compiles in steady state. Tokens depend only on (seed, row, position), never on
slot, chunk or preemption: row r draws token t with ``fold_in(fold_in(key(seed), r), t)``.

Weight versions: a call snapshots ``(params, version)`` when it starts and uses that snapshot for
all of its chunks, so a ``set_params`` landing between chunks takes effect at the next call; a row
never mixes versions (``versions`` per row is the call's version).

Page 0 is a null page: unused block-table entries point at it, and the writes of idle slots land
there; its contents are never read unmasked.
"""

from __future__ import annotations

import math
import time
from collections import deque

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from rltpu.models import jax_llama
from rltpu.sampling.common import matmul_params, pick_bucket, prefill_flops, token_chooser

_F32 = jnp.float32
AUTO_POOL_FRACTION = 0.4  # kv_pages=0: pages for 40% of the dense cache of the slot grid


def _pow2_at_most(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


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
        first = math.ceil(min(self.C, self.T) / self.ps)  # pages a slot needs for its first chunk
        auto = max(math.ceil(AUTO_POOL_FRACTION * self.dense_tokens / self.ps),
                   self.S * first + math.ceil(self.S / G) * self.MP,  # a full grid admits at once
                   self.MP + self.MG)
        self.n_pages = (cfg.kv_pages or auto) + 1  # + the null page
        if self.n_pages - 1 < self.MP + self.MG:
            raise ValueError(f"sampler.kv_pages={cfg.kv_pages} cannot hold one row ({self.MP} prompt + {self.MG} "
                             f"generated pages of {self.ps} tokens); raise sampler.kv_pages or set it to 0 (auto)")
        self.views = tuple(sorted({max(1, self.MG >> i) for i in range(4)}))  # generated pages a chunk reads
        self.H = self.S + max(self.prefill_rows)  # prompt-logit rows (handles)
        self.choose = token_chooser(cfg)
        self.stop = tuple(e.stop_ids)
        self._compiled: dict = {}
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
        page = jax.ShapeDtypeStruct((self.n_pages, m.num_key_value_heads, self.ps, m.head_dim), self.e.dtype)
        i32 = jnp.int32
        vec = jax.ShapeDtypeStruct((S,), i32)
        return {
            "k": tuple(page for _ in range(m.num_hidden_layers)), "v": tuple(page for _ in range(m.num_hidden_layers)),
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

                def paged(a):  # (n, L, kv, hd) -> (n, L/ps, kv, ps, hd)
                    return a.reshape(n, L // ps, ps, *a.shape[2:]).swapaxes(2, 3).astype(dtype)

                ks[i] = ks[i].at[pages].set(paged(k))
                vs[i] = vs[i].at[pages].set(paged(v))
                k, v = k.astype(dtype).astype(x.dtype), v.astype(dtype).astype(x.dtype)
                att = jax_llama._attend(q, k, v, masks[mcfg.layer_window(i)] | eye)
                x = x + jax_llama._out_proj(params, mcfg, i, att)
                x = jax_llama._mlp_block(params, mcfg, i, x)
            last = x[jnp.arange(n), lens - 1][:, None]  # (n, 1, H): only the last real token's logits
            logits = jax_llama._logits(params, mcfg, last)[:, 0]
            return state | {"k": tuple(ks), "v": tuple(vs), "plog": state["plog"].at[handles].set(logits, mode="drop")}

        return prefill

    def _decode_forward(self, params, ks, vs, tok, glen, plen, write, table):
        """One token per slot against the pages. tok, glen (index of tok among the generated
        tokens), plen (S,); write (S,) bool: store this token's K/V (else into the null page);
        table (S, MP + W) pages. Returns (logits (S, V), ks, vs)."""
        mcfg, ps, MP = self.mcfg, self.ps, self.MP
        S, W = table.shape
        qpos = plen + glen  # (S,)
        x = params["model.embed_tokens.weight"][tok[:, None]]  # (S, 1, H)
        cos, sin = jax_llama.rope_cos_sin(qpos[:, None], mcfg.head_dim, mcfg.rope_theta, x.dtype, mcfg.rope_scaling)
        col = jnp.minimum(MP + glen // ps, W - 1)
        page = jnp.where(write, jnp.take_along_axis(table, col[:, None], axis=1)[:, 0], 0)
        off = glen % ps
        j = jnp.arange(W * ps)
        in_prompt = (j < MP * ps)[None]
        g = (j - MP * ps)[None]
        allowed = jnp.where(in_prompt, j[None] < plen[:, None], g <= glen[:, None])  # (S, W * ps)
        kpos = jnp.where(in_prompt, j[None], plen[:, None] + g)
        masks = self._layer_masks(allowed[:, None], qpos[:, None], kpos)
        ks, vs = list(ks), list(vs)
        nh, nkv, hd = mcfg.num_attention_heads, mcfg.num_key_value_heads, mcfg.head_dim
        for i in range(mcfg.num_hidden_layers):
            h = jax_llama.rms_norm(x, params[f"model.layers.{i}.input_layernorm.weight"], mcfg.rms_norm_eps)
            q, k, v = jax_llama._qkv(params, mcfg, i, h, cos, sin)  # q (S, 1, nh, hd); k, v (S, 1, kv, hd)
            ks[i] = ks[i].at[page, :, off].set(k[:, 0].astype(ks[i].dtype))
            vs[i] = vs[i].at[page, :, off].set(v[:, 0].astype(vs[i].dtype))
            kk = ks[i][table].astype(x.dtype)  # (S, W, kv, ps, hd): the slot's pages, gathered
            vv = vs[i][table].astype(x.dtype)
            qg = q.reshape(S, nkv, nh // nkv, hd).astype(_F32)
            scores = jnp.einsum("bgrd,bwgpd->bgrwp", qg, kk.astype(_F32)).reshape(S, nkv, nh // nkv, W * ps)
            scores = scores * hd**-0.5
            scores = jnp.where(masks[mcfg.layer_window(i)][:, :, None, :].reshape(S, 1, 1, W * ps), scores,
                               jnp.finfo(_F32).min)
            probs = jax.nn.softmax(scores, axis=-1).astype(vv.dtype).reshape(S, nkv, nh // nkv, W, ps)
            att = jnp.einsum("bgrwp,bwgpd->bgrd", probs, vv).reshape(S, 1, nh * hd)
            x = x + jax_llama._out_proj(params, mcfg, i, att)
            x = jax_llama._mlp_block(params, mcfg, i, x)
        return jax_llama._logits(params, mcfg, x)[:, 0], tuple(ks), tuple(vs)

    def _chunk_fn(self):
        S, T, C, pad = self.S, self.T, self.C, self.e.pad_id
        stop = jnp.asarray(self.stop, jnp.int32)
        choose = self.choose

        def chunk(params, state, table, admit, key):
            # admit: "reset" (S,) slots to reinitialise (admitted or preempted), "on" (S,) admitted,
            # "handle" / "plen" / "limit" / "row" (S,) for the admitted ones; key: the call's PRNG key
            on, reset = admit["on"], admit["reset"]
            st = dict(state)
            st["logits"] = jnp.where(on[:, None], state["plog"][jnp.minimum(admit["handle"], self.H - 1)],
                                     state["logits"])
            for k in ("plen", "limit", "row"):
                st[k] = jnp.where(on, admit[k], state[k])
            st["glen"] = jnp.where(reset, 0, state["glen"])
            st["active"] = jnp.where(reset, on, state["active"])
            st["tokens"] = jnp.where(reset[:, None], pad, state["tokens"])
            st["logprobs"] = jnp.where(reset[:, None], 0.0, state["logprobs"])
            row_keys = jax.vmap(jax.random.fold_in, (None, 0))(key, st["row"])  # (S, 2)
            rows = jnp.arange(S)

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
                logits, ks, vs = self._decode_forward(params, c["k"], c["v"], tok, c["glen"], c["plen"], go, table)
                return c | dict(i=c["i"] + 1, logits=logits, k=ks, v=vs, tokens=tokens, logprobs=logprobs,
                                glen=glen, active=go, steps=c["steps"] + 1,
                                busy=c["busy"] + jnp.sum(act, dtype=jnp.int32))

            out = lax.while_loop(cond, body, st | {"i": jnp.int32(0)})
            out.pop("i")
            return out

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
        self._compiled[cell] = jitted.lower(*args).compile()
        e._compile_done(log, t0, hits0)

    def _prefill_args(self, n: int, L: int):
        i32 = jnp.int32
        return (self.e.param_structs, self._state_structs(), jax.ShapeDtypeStruct((n, L), i32),
                jax.ShapeDtypeStruct((n,), i32), jax.ShapeDtypeStruct((n, L // self.ps), i32),
                jax.ShapeDtypeStruct((n,), i32))

    def _chunk_args(self, w: int):
        i32, S = jnp.int32, self.S
        vec = jax.ShapeDtypeStruct((S,), i32)
        flag = jax.ShapeDtypeStruct((S,), jnp.bool_)
        admit = {"on": flag, "reset": flag, "handle": vec, "plen": vec, "limit": vec, "row": vec}
        return (self.e.param_structs, self._state_structs(), jax.ShapeDtypeStruct((S, self.MP + w), i32), admit,
                jax.ShapeDtypeStruct((2,), jnp.uint32))

    def _plen(self, bucket: int) -> int:
        return math.ceil(bucket / self.ps) * self.ps

    def cells(self) -> list[tuple]:
        """Every program of the grid: ("prefill", prompts, length) and ("decode", view pages)."""
        out = [("prefill", n, self._plen(p)) for n in self.prefill_rows for p in self.cfg.prompt_buckets]
        out = list(dict.fromkeys(out))
        return out + [("decode", w) for w in self.views]

    def ensure(self, cell: tuple) -> None:
        """Build ``cell`` if missing (counted as a compile: after ``precompile`` it never is)."""
        if cell in self._compiled:
            return
        if cell[0] == "prefill":  # logged as ("prefill:n", length, 0)
            self._compile(cell, (f"prefill:{cell[1]}", cell[2], 0), self._prefill_fn(),
                          self._prefill_args(cell[1], cell[2]))
        else:  # logged as ("decode:S", tokens a slot's view holds, steps per chunk)
            w = cell[1]
            self._compile(cell, (f"decode:{self.S}", (self.MP + w) * self.ps, self.C), self._chunk_fn(),
                          self._chunk_args(w))

    def precompile(self) -> None:
        for cell in self.cells():
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
        prompts, truncated = e._fit_prompts(prompts)
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
        slot_row = np.full(S, -1)
        slot_pages: list[list[int]] = [[] for _ in range(S)]
        slot_glen = np.zeros(S, np.int64)
        slot_order = np.zeros(S, np.int64)
        admitted = 0
        c = dict(prefill_tokens=0, prefill_flops=0.0, prefill_slots=0, prefill_calls=0, chunks=0,
                 preemptions=0, prompt_evictions=0, live_token_sum=0, used_page_sum=0, peak_pages=0, samples=0)
        steps0, busy0 = (int(x) for x in jax.device_get((state["steps"], state["busy"])))
        n_mm = matmul_params(e.param_structs, self.mcfg.tie_word_embeddings)
        program_s = 0.0

        while queue or (slot_row >= 0).any():
            admit = {"on": np.zeros(S, bool), "reset": np.zeros(S, bool), "handle": np.zeros(S, np.int32),
                     "plen": np.zeros(S, np.int32), "limit": np.full(S, n_new, np.int32),
                     "row": np.zeros(S, np.int32)}
            # 1. admit waiting samples into free slots while pages last (a new prompt needs its pages)
            to_prefill: list[int] = []
            first = math.ceil(min(self.C, n_new) / ps)
            for s in np.flatnonzero(slot_row < 0):
                if not queue:
                    break
                r = queue[0]
                p = r // G
                need = first + (0 if p in prompt_pages else math.ceil(lens[p] / ps))
                if need > len(free_pages):  # drop the pages of prompts no slot reads (re-prefilled later)
                    reading = {int(x) // G for x in slot_row[slot_row >= 0]} | {p}
                    for q in [q for q in prompt_pages if q not in reading]:
                        free_pages.extend(prompt_pages.pop(q))
                        free_handles.append(prompt_handle.pop(q))
                        c["prompt_evictions"] += 1
                    need = first + (0 if p in prompt_pages else math.ceil(lens[p] / ps))
                if need > len(free_pages) or (p not in prompt_pages and not free_handles):
                    break
                queue.popleft()
                if p not in prompt_pages:
                    prompt_pages[p] = [free_pages.pop() for _ in range(math.ceil(lens[p] / ps))]
                    prompt_handle[p] = free_handles.pop()
                    to_prefill.append(p)
                slot_row[s], slot_glen[s], slot_order[s] = r, 0, admitted
                admitted += 1
                admit["on"][s] = admit["reset"][s] = True
                admit["handle"][s], admit["plen"][s], admit["row"][s] = prompt_handle[p], lens[p], r
            t0 = time.perf_counter()
            state = self._prefill(params, state, prompts, to_prefill, prompt_pages, prompt_handle, c, n_mm)
            program_s += time.perf_counter() - t0
            # 2. pages for the next chunk; preempt the youngest rows while the pool is short
            for s in np.argsort(slot_order):
                if slot_row[s] < 0:
                    continue
                want = math.ceil(min(slot_glen[s] + self.C, n_new) / ps)
                while len(slot_pages[s]) < want:
                    if not free_pages:  # first the pages of prompts no slot reads (re-prefilled later)
                        reading = {int(x) // G for x in slot_row[slot_row >= 0]}
                        for q in [q for q in prompt_pages if q not in reading]:
                            free_pages.extend(prompt_pages.pop(q))
                            free_handles.append(prompt_handle.pop(q))
                            c["prompt_evictions"] += 1
                        if free_pages:
                            continue
                    if not free_pages:
                        busy = np.flatnonzero(slot_row >= 0)
                        v = busy[np.argmax(slot_order[busy])]
                        queue.appendleft(int(slot_row[v]))
                        free_pages.extend(slot_pages[v])
                        slot_pages[v], slot_row[v] = [], -1
                        admit["on"][v], admit["reset"][v] = False, True
                        c["preemptions"] += 1
                        if v == s:
                            break
                        continue
                    slot_pages[s].append(free_pages.pop())
            busy = np.flatnonzero(slot_row >= 0)
            if not len(busy):
                if queue:
                    raise RuntimeError("continuous sampler admitted nothing with every slot free (pool too small)")
                break
            # 3. the block table at the narrowest view that covers every busy slot
            w = pick_bucket(max(len(slot_pages[s]) for s in busy), self.views, "generated pages")
            table = np.zeros((S, self.MP + w), np.int32)
            live = 0
            for s in busy:
                p = int(slot_row[s]) // G
                table[s, :len(prompt_pages[p])] = prompt_pages[p]
                table[s, self.MP:self.MP + len(slot_pages[s])] = slot_pages[s]
                live += int(slot_glen[s])
            live += sum(lens[p] for p in prompt_pages)
            used = self.n_pages - 1 - len(free_pages)
            c["live_token_sum"] += live
            c["used_page_sum"] += used
            c["peak_pages"] = max(c["peak_pages"], used)
            c["samples"] += 1
            # 4. one decode chunk
            self.ensure(("decode", w))
            t0 = time.perf_counter()
            args = (table, admit, key)
            if e.mesh is not None:
                args = jax.device_put(args, e._replicated)
            state = self._compiled[("decode", w)](params, state, *args)
            active, glen = jax.device_get((state["active"], state["glen"]))
            c["chunks"] += 1
            # 5. rows that stopped: collect, free their pages
            done = [s for s in busy if not active[s]]
            if done:
                toks, lps = jax.device_get((state["tokens"], state["logprobs"]))
            program_s += time.perf_counter() - t0
            for s in done:
                r, n = int(slot_row[s]), int(glen[s])
                out_tok[r, :n], out_lp[r, :n], out_len[r] = toks[s, :n], lps[s, :n], n
                free_pages.extend(slot_pages[s])
                slot_pages[s], slot_row[s] = [], -1
                p = r // G
                prompt_left[p] -= 1
                if prompt_left[p] == 0:
                    free_pages.extend(prompt_pages.pop(p))
                    free_handles.append(prompt_handle.pop(p))
            slot_glen[:] = glen
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
                     ("decode_steps", steps), ("slot_steps", steps * S), ("busy_slot_steps", busy_steps),
                     ("useful_tokens", useful), ("preemptions", c["preemptions"])):
            t[k] += v
        return {
            "prompt": prompt, "prompt_mask": mask, "tokens": out_tok, "logprobs": out_lp, "lengths": out_len,
            "version": version, "versions": np.full(R, version, np.int64), "truncated_prompts": truncated,
            "engine": "continuous", "new_tokens": useful, "decode_steps": steps, "bucket": (S, plen_out, self.T),
            "compiles": e.stats.compiles - compiles0, "compile_seconds": compile_s,
            # token slots: prefill rows x length, decode slots x steps; padded = not a real token
            "padded_slots": c["prefill_slots"] - c["prefill_tokens"] + steps * S - useful,
            "total_slots": c["prefill_slots"] + steps * S,
            "seconds": program_s, "program_seconds": program_s,
            "host_seconds": time.perf_counter() - t_call - program_s - compile_s,
            # issue 17 counters
            "slots": S, "decode_chunk": self.C, "chunks": c["chunks"], "slot_steps": steps * S,
            "busy_slot_steps": busy_steps, "occupancy": busy_steps / max(steps * S, 1),
            "slot_steps_per_token": steps * S / max(useful, 1), "preemptions": c["preemptions"],
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
        """Prefill the prompts ``todo`` (indices) into their pages, grouped by prompt bucket and
        batched by the prefill row buckets."""
        by_len: dict[int, list[int]] = {}
        for p in todo:
            L = self._plen(pick_bucket(len(prompts[p]), self.cfg.prompt_buckets, "prompt length"))
            by_len.setdefault(L, []).append(p)
        for L, ps_ in by_len.items():
            while ps_:
                n = next((b for b in self.prefill_rows if b >= len(ps_)), self.prefill_rows[-1])
                part, ps_ = ps_[:n], ps_[n:]
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
