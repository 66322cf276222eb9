"""The sampling engine: the whole generation loop as one compiled JAX program per shape bucket.

Why: on TPU every new shape is a new compile. Requests are padded into the smallest cell of a
fixed (rows, prompt length, new tokens) grid; every cell is compiled ahead of time
(``jax.jit(...).lower(...).compile()``) and the executables are kept, so a call can never silently
recompile: a cell missing from the cache is compiled *and counted*. With a persistent compilation
cache directory (``enable_compile_cache``) a restarted process loads the executables from disk
instead of compiling them; such loads are counted as cache hits.

One program = prefill the left-padded prompts into a KV cache, then a ``lax.while_loop`` of decode
steps (temperature / top-k / top-p sampling, per-token logprobs) that exits early once every real
row has emitted a stop token or the request's token limit is reached. Logprobs are those of
``softmax(logits / temperature)`` (``T = 1`` when greedy), the distribution the trainer scores,
before top-k / top-p truncation.

That is the ``static`` engine. ``sampler.engine: continuous`` (the default) routes ``generate``
and ``precompile`` to ``rltpu.sampling.continuous`` instead: one prefill per prompt shared by its G
samples, a fixed slot grid refilled between decode chunks, a paged KV cache. Both engines share the
weights, the version, the compile counters and the output contract.

Over k devices (``devices=``, one sampler's ``placement.chips_per_sampler`` chips) the same
programs (of either engine) are compiled for a mesh and GSPMD partitions them: see
``rltpu.sampling.tp``.

It is the default ``RolloutBackend`` (``rltpu.sampling.backend``). Testable without Ray;
``actors/sampler_actor.py`` only forwards to it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from rltpu.models import jax_llama
from rltpu.sampling.common import matmul_params, pick_bucket, prefill_flops, token_chooser

_CACHE_HITS = [0]  # process-wide count of persistent-cache loads (JAX reports them as events)


def _on_event(event: str, **_kwargs) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _CACHE_HITS[0] += 1


jax.monitoring.register_event_listener(_on_event)
_forward = jax.jit(jax_llama.forward, static_argnums=1)  # the uncached forward, for probes


def enable_compile_cache(directory: str) -> None:
    """Use ``directory`` as JAX's persistent compilation cache, for every program size."""
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


@dataclass
class SamplerStats:
    compiles: int = 0  # programs built in this process (compiled or loaded from the disk cache)
    cache_hits: int = 0  # of those, loaded from the persistent cache
    compile_seconds: float = 0.0
    compile_log: list = field(default_factory=list)  # [(rows, prompt_len, new_tokens, seconds, from_cache)]


class SamplerEngine:
    """``devices``: None (the default device; the unsharded engine) or the k devices (or just k:
    the first k) of one sampler, ``placement.chips_per_sampler`` of them. With k > 1 the engine
    builds a mesh over them (``rltpu.sampling.tp``): weights live in their ``param_shardings``,
    the KV cache is split by kv heads, and every program is compiled for the mesh."""

    def __init__(self, model_cfg, sampler_cfg, vocab_size: int, pad_id: int, eos_id: int, param_shapes: dict,
                 devices=None, lora=None, pack: bool = True):
        """``lora`` (a ``LoraConfig``; ``param_shapes`` then lists the adapters too): the engine keeps
        the base once and applies the adapters as ``lora.sampler_apply`` says (``SamplerAdapters``).
        ``pack=False`` keeps the trainer's layout of the weights: a colocated sampler adopts (or
        aliases) the trainer's tensors without a copy, and packing would copy them."""
        self.mcfg, self.cfg = model_cfg, sampler_cfg
        self.adapters = None
        if lora is not None:
            from rltpu.sampling.lora import SamplerAdapters

            self.adapters = SamplerAdapters(lora, param_shapes)
            param_shapes = self.adapters.program_shapes()
        self.vocab_size, self.pad_id, self.eos_id = vocab_size, pad_id, eos_id
        self.stop_ids = tuple(dict.fromkeys((eos_id, *sampler_cfg.stop_token_ids)))
        self.dtype = jnp.bfloat16 if model_cfg.dtype == "bfloat16" else jnp.float32
        self.param_structs = {
            k: jax.ShapeDtypeStruct(tuple(s), jnp.dtype(d)) for k, (s, d) in param_shapes.items()
        }
        self.params: dict | None = None
        self.version = -1
        self.stats = SamplerStats()
        self._compiled: dict[tuple[int, int, int], object] = {}
        self._continuous = None  # the continuous sampler, built on first use (``continuous``)
        self._greedy = None  # the temperature-0 twin for evaluation rows, built on first use
        self.mesh = self.layout = self.param_shardings = None
        if isinstance(devices, int):
            devices = jax.devices()[:devices]
        if devices is not None and len(devices) > 1:
            from jax.sharding import NamedSharding

            from rltpu.sampling import tp

            v = self.param_structs["model.embed_tokens.weight"].shape[0]
            self.layout = tp.plan(model_cfg, v, len(devices))
            self.mesh = tp.make_mesh(list(devices), self.layout)
            self.param_shardings = {k: NamedSharding(self.mesh, tp.param_spec(k, len(s.shape), self.layout))
                                    for k, s in self.param_structs.items()}
            self._replicated = NamedSharding(self.mesh, jax.sharding.PartitionSpec())
            self._cache_sharding = NamedSharding(self.mesh, tp.cache_spec())
        # what the compiled programs take: the weights packed (``jax_llama.pack_params``) on an
        # unsharded XLA:CPU engine without adapters. A mesh shards q/k/v and gate/up by their own
        # heads and columns and adapters change with every sync, so those keep the trainer's names;
        # and the gain was measured on XLA:CPU only, while on a chip the packed copy would hold a
        # second set of weights in HBM during each sync, so a chip's engine keeps them too
        # XLA:CPU: where the CPU-only layouts and compiler options apply (measured there only)
        self.xla_cpu = (jax.default_backend() if self.mesh is None else self.mesh.devices.flat[0].platform) == "cpu"
        self.packed = pack and self.mesh is None and self.adapters is None and self.xla_cpu
        self.program_structs = (jax_llama.pack_params(self.param_structs, model_cfg) if self.packed
                                else self.param_structs)

    @property
    def tp(self) -> int:
        """Devices this engine spans (1: unsharded)."""
        return self.layout.k if self.layout else 1

    # -- weights -----------------------------------------------------------------------------
    def set_params(self, params: dict, version: int) -> None:
        """A full set of weights (with LoRA: the base and the adapters)."""
        if self.adapters is not None:
            params = self.adapters.set_full(params)
        self._set(params, version)

    def set_adapters(self, adapters: dict, version: int) -> None:
        """LoRA: new adapter values over the base this engine already holds; the compiled programs'
        inputs keep their names and shapes, so nothing recompiles."""
        if self.adapters is None:
            raise ValueError("this sampler was built without trainer.lora; it takes full weights only")
        self._set(self.adapters.set_adapters(adapters), version)

    def _set(self, params: dict, version: int) -> None:
        missing = set(self.param_structs) - set(params)
        if missing:
            raise ValueError(f"weights for version {version} lack {sorted(missing)[:3]}")
        for k, s in self.param_structs.items():
            if tuple(params[k].shape) != s.shape:
                raise ValueError(f"weight {k} has shape {tuple(params[k].shape)}, expected {s.shape}")
        if self.mesh is not None:
            params = self.place(params)
        elif self.packed:
            params = jax_llama.pack_params(params, self.mcfg)
        self.params, self.version = params, version

    def place(self, params: dict) -> dict:
        """Put each named array (numpy, or a JAX array anywhere) into this engine's sharding for it:
        each device receives only its slice. A no-op for arrays already placed (e.g. by
        ``load_jax_params(..., shardings=engine.param_shardings)`` or weight sync's
        ``device_put_params(tensors, engine.param_shardings)``)."""
        if self.mesh is None:
            return dict(params)
        return {k: jax.device_put(v, self.param_shardings[k]) if k in self.param_shardings else v
                for k, v in params.items()}

    def device_weight_bytes(self) -> dict:
        """Weight bytes held per device (its addressable shards)."""
        from rltpu.sampling.tp import device_weight_bytes

        return device_weight_bytes(self.params or {})

    # -- the compiled program ------------------------------------------------------------------
    def _sample_fn(self):
        """Row r draws its token t from ``fold_in(fold_in(key(seed), r), t)``, as the continuous
        engine does: both engines give the same rows for the same seed, and a request can run on
        either (``generate`` picks)."""
        choose = token_chooser(self.cfg)

        def sample(logits, key, t):  # logits (B, V) float32 -> tokens (B,), logprobs (B,)
            rows = jnp.arange(logits.shape[0], dtype=jnp.int32)
            u = jax.vmap(lambda r: jax.random.uniform(jax.random.fold_in(jax.random.fold_in(key, r), t), (),
                                                      jnp.float32))(rows)
            return choose(logits, u[:, None])

        return sample

    def _program(self, prompt_len: int, new_tokens: int):
        mcfg, P, T = self.mcfg, prompt_len, new_tokens
        S, pad = P + T, self.pad_id
        stop = jnp.asarray(self.stop_ids, jnp.int32)
        sample = self._sample_fn()
        if self.mesh is None:
            def shard_cache(cache):
                return cache
        else:  # split by kv heads; GSPMD then keeps each device's heads local through the loop
            def shard_cache(cache):
                return jax.lax.with_sharding_constraint(cache, self._cache_sharding)

        def generate(params, prompt, prompt_mask, key, n_real, limit):
            B = prompt.shape[0]  # prompt: (B, P) left-padded; rows >= n_real only fill the bucket
            positions = jnp.maximum(jnp.cumsum(prompt_mask, axis=-1) - 1, 0).astype(jnp.int32)
            kv_mask = jnp.zeros((B, S), jnp.int32).at[:, :P].set(prompt_mask)
            cache = shard_cache(jax_llama.init_cache(mcfg, B, S, self.dtype))  # L x (B, kv_heads, S, head_dim)
            logits, cache = jax_llama.forward_with_cache(params, mcfg, prompt, positions, cache, 0, kv_mask)
            state = dict(
                i=jnp.int32(0), logits=logits[:, -1], pos=positions[:, -1] + 1, cache=cache, kv_mask=kv_mask,
                key=key, done=jnp.arange(B) >= n_real,  # padding rows never hold the loop open
                tokens=jnp.full((B, T), pad, jnp.int32), logprobs=jnp.zeros((B, T), jnp.float32),
            )

            def cond(s):
                return (s["i"] < jnp.minimum(limit, T)) & ~jnp.all(s["done"])

            def body(s):
                key = s["key"]
                tok, lp = sample(s["logits"], key, s["i"])
                tok = jnp.where(s["done"], pad, tok)
                lp = jnp.where(s["done"], 0.0, lp)
                tokens = s["tokens"].at[:, s["i"]].set(tok)
                logprobs = s["logprobs"].at[:, s["i"]].set(lp)
                slot = P + s["i"]
                kv_mask = s["kv_mask"].at[:, slot].set(1)
                logits, cache = jax_llama.forward_with_cache(
                    params, mcfg, tok[:, None], s["pos"][:, None], s["cache"], slot, kv_mask
                )
                done = s["done"] | jnp.isin(tok, stop)
                return dict(i=s["i"] + 1, logits=logits[:, 0], pos=s["pos"] + 1, cache=shard_cache(cache),
                            kv_mask=kv_mask, key=key, done=done, tokens=tokens, logprobs=logprobs)

            out = jax.lax.while_loop(cond, body, state)
            is_stop = jnp.isin(out["tokens"], stop)
            lengths = jnp.where(is_stop.any(-1), jnp.argmax(is_stop, -1) + 1, out["i"])
            return out["tokens"], out["logprobs"], lengths, out["i"]

        return generate

    def compile_bucket(self, rows: int, prompt_len: int, new_tokens: int | None = None) -> float:
        """Build one grid cell ahead of time (compile, or load from the disk cache); returns seconds."""
        T = new_tokens or self.cfg.new_tokens_grid[-1]
        t0, hits0 = self._compile_mark()
        i32 = jnp.int32
        args = (
            self.program_structs,
            jax.ShapeDtypeStruct((rows, prompt_len), i32),
            jax.ShapeDtypeStruct((rows, prompt_len), i32),
            jax.ShapeDtypeStruct((2,), jnp.uint32),
            jax.ShapeDtypeStruct((), i32),
            jax.ShapeDtypeStruct((), i32),
        )
        if self.mesh is None:
            fn = jax.jit(self._program(prompt_len, T))
        else:  # weights in their shardings, everything else (and every output) replicated
            r = self._replicated
            fn = jax.jit(self._program(prompt_len, T), in_shardings=(self.param_shardings, r, r, r, r, r),
                         out_shardings=r)
        self._compiled[(rows, prompt_len, T)] = fn.lower(*args).compile()
        return self._compile_done((rows, prompt_len, T), t0, hits0)

    def _compile_mark(self) -> tuple[float, int]:
        return time.perf_counter(), _CACHE_HITS[0]

    def _compile_done(self, cell: tuple, t0: float, hits0: int) -> float:
        """Count one built program: ``cell`` (3 fields) + seconds + from_cache go to ``compile_log``."""
        dt = time.perf_counter() - t0
        from_cache = _CACHE_HITS[0] > hits0
        self.stats.compiles += 1
        self.stats.cache_hits += int(from_cache)
        self.stats.compile_seconds += dt
        self.stats.compile_log.append((*cell, round(dt, 3), from_cache))
        return dt

    @property
    def continuous(self):
        """The continuous-batching sampler over this engine's weights (built on first use)."""
        if self._continuous is None:
            from rltpu.sampling.continuous import ContinuousSampler

            self._continuous = ContinuousSampler(self)
        return self._continuous

    def precompile(self, cells: list[tuple[int, int, int]] | None = None, engine: str | None = None) -> list:
        """Build every program of ``engine`` (default ``sampler.engine``): the continuous sampler's
        prefill and decode-chunk programs, or the static grid (or the given ``(rows, prompt_len,
        new_tokens)`` subset of it)."""
        if (engine or self.cfg.engine) == "continuous" and cells is None:
            self.continuous.precompile()
            if not self.stops_unreachable:
                return list(self.stats.compile_log)
            # requests then run as whole static batches (``_whole_batch``): their grid too
        if cells is None:
            cells = [(r, p, t) for r in self.cfg.batch_buckets for p in self.cfg.prompt_buckets
                     for t in self.cfg.new_tokens_grid]
        for cell in cells:
            if cell not in self._compiled:
                self.compile_bucket(*cell)
        return list(self.stats.compile_log)

    # -- generation ----------------------------------------------------------------------------
    def _whole_batch(self, prompts, n_per_prompt: int) -> bool:
        """Whether a ``continuous`` request runs as one static program instead: when no stop token
        can be sampled (every stop id is outside the vocabulary) every row runs ``max_new_tokens``,
        so there is no long tail to cut and one program without chunk boundaries is the cheaper
        engine (``benchmarks/sampler.py --vs-vllm``), as long as the rows fit one batch bucket.
        Both engines key their draws by (seed, row, position), so the rows are the same either way."""
        return (self.stops_unreachable and len(prompts) * n_per_prompt <= max(self.cfg.batch_buckets)
                and not self.cfg.microbatch_rows)

    @property
    def stops_unreachable(self) -> bool:
        return all(t >= self.vocab_size or t < 0 for t in self.stop_ids)

    def programs(self) -> list:
        """The compiled executables held (the colocated memory report reads XLA's figures from them)."""
        return list(self._compiled.values()) + (list(self._continuous.programs()) if self._continuous else [])

    def describe(self) -> dict:
        """Where the weights live: the mesh and the weight bytes each device holds (tensor parallel:
        about 1/k of the model each, plus the replicated norms)."""
        return {"tp": self.tp, "mesh": dict(self.mesh.shape) if self.mesh is not None else None,
                "device_weight_bytes": {str(d): n for d, n in self.device_weight_bytes().items()},
                "model_bytes": sum(int(a.nbytes) for a in (self.params or {}).values())}

    def greedy_twin(self) -> "SamplerEngine":
        """A temperature-0 engine sharing this one's weights (the temperature is compiled into the
        programs); it keeps its own compile counters, so training's ``compiles`` stay training's."""
        if self._greedy is None:
            shapes = {k: (tuple(s.shape), str(s.dtype)) for k, s in self.param_structs.items()}
            devices = list(self.mesh.devices.flat) if self.mesh is not None else None
            self._greedy = SamplerEngine(self.mcfg, self.cfg.model_copy(update={"temperature": 0.0}),
                                         self.vocab_size, self.pad_id, self.eos_id, shapes, devices)
            self._greedy.packed, self._greedy.program_structs = self.packed, self.program_structs  # same weights
        self._greedy.params, self._greedy.version = self.params, self.version
        return self._greedy

    def fit_prompts(self, prompts: list[list[int]]) -> tuple[list[list[int]], int]:
        """Prompts cut to the largest prompt bucket (keeping their ends) and how many were cut; an
        error instead unless ``sampler.truncate_prompts``."""
        limit = max(self.cfg.prompt_buckets)
        too_long = [len(p) for p in prompts if len(p) > limit]
        if too_long and not self.cfg.truncate_prompts:
            raise ValueError(
                f"prompt length={max(too_long)} exceeds the largest bucket {limit}; add a larger "
                f"sampler.prompt_buckets entry or set sampler.truncate_prompts=true"
            )
        return [p[-limit:] for p in prompts], len(too_long)  # keep the end, nearest the answer

    def generate(self, prompts: list[list[int]], n_per_prompt: int, seed: int, greedy: bool = False,
                 max_new_tokens: int | None = None, engine: str | None = None) -> dict:
        """Sample ``n_per_prompt`` completions per prompt (rows prompt-major: p0 x G, p1 x G, ...).

        Returns numpy arrays: ``prompt`` (R, P) left-padded, ``prompt_mask``, ``tokens`` (R, N)
        and ``logprobs`` (R, N) with N = ``max_new_tokens``, ``lengths`` (R,) counting the stop
        token, plus shape / padding / time accounting.

        With ``sampler.microbatch_rows`` the request runs as sequential micro-batches that each
        exit when *their* rows finish, instead of one batch that waits for its longest row.
        ``greedy``: evaluation rows, on the temperature-0 twin (``greedy_twin``).
        """
        if greedy:
            return self.greedy_twin().generate(prompts, n_per_prompt, seed, False, max_new_tokens, engine)
        if (engine or self.cfg.engine) == "continuous":
            if not self._whole_batch(prompts, n_per_prompt):
                return self.continuous.generate(prompts, n_per_prompt, seed, max_new_tokens)
            engine = "static"  # no stop token can be sampled: no tail for continuous batching to cut
        if self.params is None:
            raise RuntimeError("sampler has no weights yet: call set_params (weight sync) first")
        prompts, truncated = self.fit_prompts(prompts)
        mb = self.cfg.microbatch_rows // n_per_prompt if self.cfg.microbatch_rows else 0
        if not mb or len(prompts) <= mb:
            return self._generate(prompts, n_per_prompt, seed, max_new_tokens) | {"truncated_prompts": truncated}
        plen = pick_bucket(max(len(p) for p in prompts), self.cfg.prompt_buckets, "prompt length")
        parts = [self._generate(prompts[i:i + mb], n_per_prompt, seed * 7919 + i, max_new_tokens, plen)
                 for i in range(0, len(prompts), mb)]
        out = {k: np.concatenate([p[k] for p in parts]) for k in
               ("prompt", "prompt_mask", "tokens", "logprobs", "lengths")}
        for k in ("new_tokens", "decode_steps", "compiles", "compile_seconds", "padded_slots", "total_slots",
                  "seconds", "program_seconds", "host_seconds", "slot_steps", "prefill_tokens", "prefill_flops"):
            out[k] = sum(p[k] for p in parts)
        return out | {"version": self.version, "bucket": parts[0]["bucket"], "microbatches": len(parts),
                      "truncated_prompts": truncated}

    def _generate(self, prompts, n_per_prompt, seed, max_new_tokens=None, plen=None) -> dict:
        """One compiled call on prompts that already fit the grid (see ``fit_prompts``)."""
        t_call = time.perf_counter()
        n_new = max_new_tokens or self.cfg.max_new_tokens
        T = pick_bucket(n_new, self.cfg.new_tokens_grid, "max_new_tokens")
        R = len(prompts) * n_per_prompt
        rows = pick_bucket(R, self.cfg.batch_buckets, "rows")
        plen = plen or pick_bucket(max(len(p) for p in prompts), self.cfg.prompt_buckets, "prompt length")
        prompt = np.full((rows, plen), self.pad_id, np.int32)
        mask = np.zeros((rows, plen), np.int32)
        for i, p in enumerate(prompts):
            r0 = i * n_per_prompt
            prompt[r0:r0 + n_per_prompt, plen - len(p):] = p
            mask[r0:r0 + n_per_prompt, plen - len(p):] = 1
        compiles0, compile_s0 = self.stats.compiles, self.stats.compile_seconds
        if (rows, plen, T) not in self._compiled:
            self.compile_bucket(rows, plen, T)
        t0 = time.perf_counter()
        inputs = (jnp.asarray(prompt), jnp.asarray(mask), jax.random.PRNGKey(seed), jnp.int32(R), jnp.int32(n_new))
        if self.mesh is not None:
            inputs = jax.device_put(inputs, self._replicated)
        out = self._compiled[(rows, plen, T)](self.params, *inputs)
        tokens, logprobs, lengths, steps = jax.device_get(out)
        program_s = time.perf_counter() - t0
        lengths = np.asarray(lengths)[:R]
        real_prompt, new_tokens = int(mask[:R].sum()), int(lengths.sum())
        decode_slots = rows * int(steps)
        compile_s = self.stats.compile_seconds - compile_s0
        return {
            "prompt": prompt[:R], "prompt_mask": mask[:R], "tokens": np.asarray(tokens)[:R, :n_new],
            "logprobs": np.asarray(logprobs)[:R, :n_new], "lengths": lengths, "version": self.version,
            "new_tokens": new_tokens, "decode_steps": int(steps), "bucket": (rows, plen, T),
            "compiles": self.stats.compiles - compiles0, "compile_seconds": compile_s,
            # padded / total token slots, prefill and decode together
            "padded_slots": rows * plen - real_prompt + decode_slots - new_tokens,
            "total_slots": rows * plen + decode_slots,
            # time inside the compiled program vs in Python around it (padding, host copies)
            "seconds": program_s, "program_seconds": program_s,
            "host_seconds": time.perf_counter() - t_call - program_s - compile_s,
            # the counters the continuous sampler reports too: every row prefills its prompt, every
            # bucket row takes a slot for every decode step
            "engine": "static", "slot_steps": decode_slots, "occupancy": new_tokens / max(decode_slots, 1),
            "slot_steps_per_token": decode_slots / max(new_tokens, 1), "prefill_tokens": real_prompt,
            "prefill_flops": prefill_flops(self.mcfg, matmul_params(self.param_structs, self.mcfg.tie_word_embeddings),
                                           mask[:R].sum(axis=1)),
            "kv_dense_bytes": self.dense_cache_bytes(rows, plen + T),
        }

    def dense_cache_bytes(self, rows: int, seq_len: int) -> int:
        """K + V bytes of ``jax_llama.init_cache`` for ``rows`` x ``seq_len``, all layers."""
        m = self.mcfg
        itemsize = jnp.dtype(self.dtype).itemsize
        return 2 * m.num_hidden_layers * rows * m.num_key_value_heads * seq_len * m.head_dim * itemsize

    def probe_logits(self, tokens, position_ids, attention_mask) -> np.ndarray:
        out = _forward(
            self.params, self.mcfg, jnp.asarray(tokens), jnp.asarray(position_ids), jnp.asarray(attention_mask)
        )
        return np.asarray(out, dtype=np.float32)
