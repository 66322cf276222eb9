"""The sampling engine: the whole generation loop as one compiled JAX program per shape bucket.

Why: on TPU every new shape is a new compile. Requests are padded into the smallest bucket of a
fixed (rows, prompt length) grid, with ``max_new_tokens`` fixed per job; every bucket is compiled
ahead of time (``jax.jit(...).lower(...).compile()``) and the executables are kept, so a call can
never silently recompile: a bucket missing from the cache is compiled *and counted*.

One program = prefill the left-padded prompts into a KV cache, then a ``lax.while_loop`` of decode
steps (temperature / top-p sampling, per-token logprobs) that exits early once every row has
emitted EOS. Logprobs are those of ``softmax(logits / temperature)``, the distribution the trainer
scores, before top-p truncation.

Testable without Ray; ``actors/sampler_actor.py`` only forwards to it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from rltpu.models import jax_llama


@dataclass
class SamplerStats:
    compiles: int = 0
    compile_seconds: float = 0.0
    compile_log: list = field(default_factory=list)  # [(rows, prompt_len, seconds)]


def pick_bucket(value: int, buckets: tuple[int, ...], what: str) -> int:
    for b in buckets:
        if value <= b:
            return b
    raise ValueError(f"{what}={value} exceeds the largest bucket {max(buckets)}; add a larger bucket to the config")


class SamplerEngine:
    def __init__(self, model_cfg, sampler_cfg, vocab_size: int, pad_id: int, eos_id: int, param_shapes: dict):
        self.mcfg, self.cfg = model_cfg, sampler_cfg
        self.vocab_size, self.pad_id, self.eos_id = vocab_size, pad_id, eos_id
        self.dtype = jnp.bfloat16 if model_cfg.dtype == "bfloat16" else jnp.float32
        self.param_structs = {
            k: jax.ShapeDtypeStruct(tuple(s), jnp.dtype(d)) for k, (s, d) in param_shapes.items()
        }
        self.params: dict | None = None
        self.version = -1
        self.stats = SamplerStats()
        self._compiled: dict[tuple[int, int], object] = {}

    # -- weights -----------------------------------------------------------------------------
    def set_params(self, params: dict, version: int) -> None:
        missing = set(self.param_structs) - set(params)
        if missing:
            raise ValueError(f"weights for version {version} lack {sorted(missing)[:3]}")
        for k, s in self.param_structs.items():
            if tuple(params[k].shape) != s.shape:
                raise ValueError(f"weight {k} has shape {tuple(params[k].shape)}, expected {s.shape}")
        self.params, self.version = params, version

    # -- compilation ---------------------------------------------------------------------------
    def _program(self, rows: int, prompt_len: int):
        cfg, mcfg = self.cfg, self.mcfg
        T, P = cfg.max_new_tokens, prompt_len
        S = P + T
        temperature, top_p, eos, pad = cfg.temperature, cfg.top_p, self.eos_id, self.pad_id

        def sample(logits, key):  # logits (B, V) float32
            scaled = logits / temperature
            logp_all = jax.nn.log_softmax(scaled, axis=-1)
            if top_p < 1.0:
                sorted_logits = jnp.sort(scaled, axis=-1)[:, ::-1]
                cum = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
                # smallest logit still inside the nucleus (always keeps the top token)
                k = jnp.sum(cum - jax.nn.softmax(sorted_logits, axis=-1) < top_p, axis=-1)
                cutoff = jnp.take_along_axis(sorted_logits, (k - 1)[:, None], axis=-1)
                scaled = jnp.where(scaled < cutoff, -jnp.inf, scaled)
            tok = jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)
            return tok, jnp.take_along_axis(logp_all, tok[:, None], axis=-1)[:, 0]

        def generate(params, prompt, prompt_mask, key, n_real):
            B = prompt.shape[0]  # prompt: (B, P) left-padded; rows >= n_real only fill the bucket
            positions = jnp.maximum(jnp.cumsum(prompt_mask, axis=-1) - 1, 0).astype(jnp.int32)
            kv_mask = jnp.zeros((B, S), jnp.int32).at[:, :P].set(prompt_mask)
            cache = jax_llama.init_cache(mcfg, B, S, self.dtype)
            logits, cache = jax_llama.forward_with_cache(params, mcfg, prompt, positions, cache, 0, kv_mask)
            state = dict(
                i=jnp.int32(0), logits=logits[:, -1], pos=positions[:, -1] + 1, cache=cache, kv_mask=kv_mask,
                key=key, done=jnp.arange(B) >= n_real,  # padding rows never hold the loop open
                tokens=jnp.full((B, T), pad, jnp.int32), logprobs=jnp.zeros((B, T), jnp.float32),
            )

            def cond(s):
                return (s["i"] < T) & ~jnp.all(s["done"])

            def body(s):
                key, sub = jax.random.split(s["key"])
                tok, lp = sample(s["logits"], sub)
                tok = jnp.where(s["done"], pad, tok)
                lp = jnp.where(s["done"], 0.0, lp)
                tokens = s["tokens"].at[:, s["i"]].set(tok)
                logprobs = s["logprobs"].at[:, s["i"]].set(lp)
                slot = P + s["i"]
                kv_mask = s["kv_mask"].at[:, slot].set(1)
                logits, cache = jax_llama.forward_with_cache(
                    params, mcfg, tok[:, None], s["pos"][:, None], s["cache"], slot, kv_mask
                )
                return dict(i=s["i"] + 1, logits=logits[:, 0], pos=s["pos"] + 1, cache=cache, kv_mask=kv_mask,
                            key=key, done=s["done"] | (tok == eos), tokens=tokens, logprobs=logprobs)

            out = jax.lax.while_loop(cond, body, state)
            is_eos = out["tokens"] == eos
            lengths = jnp.where(is_eos.any(-1), jnp.argmax(is_eos, -1) + 1, T)
            return out["tokens"], out["logprobs"], lengths, out["i"]

        return generate

    def compile_bucket(self, rows: int, prompt_len: int) -> float:
        """Compile one bucket ahead of time; returns seconds. Counted in ``stats``."""
        t0 = time.perf_counter()
        args = (
            self.param_structs,
            jax.ShapeDtypeStruct((rows, prompt_len), jnp.int32),
            jax.ShapeDtypeStruct((rows, prompt_len), jnp.int32),
            jax.ShapeDtypeStruct((2,), jnp.uint32),
            jax.ShapeDtypeStruct((), jnp.int32),
        )
        self._compiled[(rows, prompt_len)] = jax.jit(self._program(rows, prompt_len)).lower(*args).compile()
        dt = time.perf_counter() - t0
        self.stats.compiles += 1
        self.stats.compile_seconds += dt
        self.stats.compile_log.append((rows, prompt_len, round(dt, 3)))
        return dt

    def precompile(self) -> list:
        for rows in self.cfg.batch_buckets:
            for plen in self.cfg.prompt_buckets:
                if (rows, plen) not in self._compiled:
                    self.compile_bucket(rows, plen)
        return list(self.stats.compile_log)

    # -- generation ----------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], n_per_prompt: int, seed: int) -> dict:
        """Sample ``n_per_prompt`` completions per prompt (rows prompt-major: p0 x G, p1 x G, ...).

        Returns numpy arrays: ``prompt`` (R, P) left-padded, ``prompt_mask``, ``tokens`` (R, T),
        ``logprobs`` (R, T), ``lengths`` (R,) counting EOS, plus shape/padding accounting.
        """
        if self.params is None:
            raise RuntimeError("sampler has no weights yet: call set_params (weight sync) first")
        R = len(prompts) * n_per_prompt
        rows = pick_bucket(R, self.cfg.batch_buckets, "rows")
        longest = max(len(p) for p in prompts)
        plen = pick_bucket(longest, self.cfg.prompt_buckets, "prompt length")
        prompt = np.full((rows, plen), self.pad_id, np.int32)
        mask = np.zeros((rows, plen), np.int32)
        for i, p in enumerate(prompts):
            for g in range(n_per_prompt):
                r = i * n_per_prompt + g
                prompt[r, plen - len(p):] = p
                mask[r, plen - len(p):] = 1
        compiles_before = self.stats.compiles
        if (rows, plen) not in self._compiled:
            self.compile_bucket(rows, plen)
        t0 = time.perf_counter()
        tokens, logprobs, lengths, steps = self._compiled[(rows, plen)](
            self.params, jnp.asarray(prompt), jnp.asarray(mask), jax.random.PRNGKey(seed), jnp.int32(R)
        )
        tokens, logprobs, lengths, steps = jax.device_get((tokens, logprobs, lengths, steps))
        seconds = time.perf_counter() - t0
        lengths = np.asarray(lengths)[:R]
        real_prompt = int(mask[:R].sum())
        new_tokens = int(lengths.sum())
        decode_slots = rows * int(steps)
        return {
            "prompt": prompt[:R], "prompt_mask": mask[:R], "tokens": np.asarray(tokens)[:R],
            "logprobs": np.asarray(logprobs)[:R], "lengths": lengths, "version": self.version,
            "seconds": seconds, "new_tokens": new_tokens, "compiles": self.stats.compiles - compiles_before,
            "bucket": (rows, plen),
            # padded / total token slots, prefill and decode together
            "padded_slots": rows * plen - real_prompt + decode_slots - new_tokens,
            "total_slots": rows * plen + decode_slots,
        }

    def probe_logits(self, tokens, position_ids, attention_mask) -> np.ndarray:
        out = jax.jit(jax_llama.forward, static_argnums=1)(
            self.params, self.mcfg, jnp.asarray(tokens), jnp.asarray(position_ids), jnp.asarray(attention_mask)
        )
        return np.asarray(out, dtype=np.float32)
