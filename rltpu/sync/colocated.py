"""Colocated mode: one process per trainer chip holds the FSDP2 trainer *and* the JAX sampler.

Weight handoff (``publish_local``), per case:

- **1 trainer rank** (no mesh, or an FSDP2 mesh of size 1): the local shards *are* the full
  tensors. Nothing crosses a process boundary. By default each tensor is copied once into a fresh
  64-byte-aligned buffer (a *snapshot*), which JAX then adopts through DLPack without a second
  copy. ``alias=True`` skips that copy: the JAX array points at the torch parameter's own memory.
- **N > 1 trainer ranks**: every rank calls ``publish_local`` at the same time; each tensor is
  all-gathered over the trainer group (``DTensor.full_tensor()``, FSDP's own collective). The
  gathered tensor is new memory that nothing else writes, so JAX adopts it as is (no copy).
  ``gathered_bytes`` counts the bytes that came from the other ranks.
- **dtype differs** from the sampler's (spec dtype): the conversion is the one copy; with N > 1
  ranks the local shard is converted *before* the gather, so a narrower dtype also means fewer
  bytes on the trainer links.
- A tensor on a non-CPU torch device is brought to the host first (one device-to-host copy);
  JAX then places it on its device. On TPU this is the part that stays to be verified.

Why a snapshot and not aliasing by default:
JAX arrays are immutable by contract and the DLPack import hands the buffer's ownership to JAX;
AdamW updates parameters *in place* (``param.addcdiv_``), as does ``load_checkpoint`` (a
``copy_`` into each parameter). With aliasing, the sampler's weights would change under it during
``train_step`` while it still reports the old version, a failed step would leave it half-updated,
and the sampler-vs-trainer probe after a publish could no longer tell a stale sampler from a
fresh one (they would share memory). What the snapshot costs, measured on the 2-core CPU machine
(load ~6, median of 5 publishes, one process, fp32):

    model                           snapshot    alias     extra resident (snapshot)
    quickstart, 0.3M params, 1.1 MB   9.9 ms    2.0 ms    1x params
    27M params, 104 MB               70 ms     13 ms     1x params (83 MB after malloc_trim)

i.e. one memcpy per publish and 1x the parameter bytes resident, against a trainer that already
holds ~4x them (params, grads, two AdamW moments). ``alias=True`` is kept for memory-bound
single-rank runs that accept those hazards (the sampler then reports ``shared_with_trainer_bytes``).

Memory (``process_memory``): both engines stay resident at once (a TPU has no sleep mode that
releases HBM between phases), so the report gives RSS now and at peak, the trainer's bytes
(local parameter shards, gradients, optimizer states; reference model and critic if present),
the sampler's bytes (its JAX parameters, whether they alias the trainer's, and the KV cache of its
largest grid cell, which exists only while a generate call runs, beside XLA's own temp-buffer
figure for its compiled programs), ``resident_estimate_bytes`` (their sum while generating), and
the accelerator's own figures when JAX offers them (``None`` on CPU). On CPU with a tiny model the
RSS is mostly the runtimes (torch + JAX + XLA, ~0.7 GB per process), not the model.

Testable without Ray (``tests/test_colocated.py``); ``actors/colocated_actor.py`` only wires it.
"""

from __future__ import annotations

import contextlib
import os
import time

import numpy as np
import torch

from rltpu.sync.collective import _DTYPES, ParamSpec, count_zero_copy, torch_to_jax


def _is_dtensor(t) -> bool:
    return hasattr(t, "full_tensor") and hasattr(t, "to_local")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if _is_dtensor(t) else t


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ---------------------------------------------------------------------------------------------
# weights: trainer -> in-process sampler


def full_params_for_sampler(model: torch.nn.Module, spec: ParamSpec, alias: bool = False) -> tuple[dict, dict]:
    """The full tensors named in ``spec``, in the spec's (sampler's) dtype, as host torch tensors
    that JAX can adopt; and what it took (see the module docstring for each case).

    Collective when the model is FSDP2-sharded over more than one rank: every rank must call it,
    with the same spec, at the same time.
    """
    sd = model.state_dict()  # FSDP2: DTensors (local shards), HF names; no gather here
    out: dict[str, torch.Tensor] = {}
    st = {"gathered_bytes": 0, "copied_bytes": 0, "converted": 0, "aliased_bytes": 0, "ranks": 1}
    for name, shape, dtype in spec:
        t = sd[name].detach()
        want = _DTYPES[dtype]
        sharded = _is_dtensor(t) and t.device_mesh.size() > 1
        if sharded:
            st["ranks"] = t.device_mesh.size()
            if t.dtype != want:
                t = t.to(want)  # shard-local conversion: the gather moves sampler-dtype bytes
                st["converted"] += 1
            mine = _nbytes(t.to_local())
            full = t.full_tensor()  # FSDP's all-gather over the trainer group: fresh memory
            st["gathered_bytes"] += _nbytes(full) - mine
        else:
            full = _local(t)
            if full.dtype != want:
                full = full.to(want)  # the conversion is the copy
                st["converted"] += 1
                st["copied_bytes"] += _nbytes(full)
            elif not alias:
                snap = torch.empty(full.shape, dtype=want, device=full.device)  # 64-byte aligned (c10)
                full = snap.copy_(full)
                st["copied_bytes"] += _nbytes(full)
            else:
                st["aliased_bytes"] += _nbytes(full)
        if full.device.type != "cpu":
            full = full.cpu()
            st["copied_bytes"] += _nbytes(full)
        if tuple(full.shape) != tuple(shape):
            raise ValueError(f"trainer tensor {name} has full shape {tuple(full.shape)}, the sampler expects "
                             f"{tuple(shape)}; trainer and sampler model configs disagree")
        out[name] = full.contiguous()
    return out, st


def publish_local(model: torch.nn.Module, sampler, spec: ParamSpec, version: int, alias: bool = False,
                  keep_live: bool = False) -> dict:
    """Hand the trainer's current weights to the in-process ``sampler`` engine as ``version``.

    Returns the keys the controller reads from a disaggregated sync (``version``, ``bytes``,
    ``buckets`` = 0, ``link_bytes`` = 0/0: no sync fabric, ``zero_copy``, ``tensors``) plus
    ``seconds``, ``gathered_bytes`` (from other trainer ranks, over FSDP's group), ``copied_bytes``
    (memcpy / conversion inside this process), ``aliased_bytes`` (sampler memory that *is* trainer
    memory), ``converted`` (tensors cast to the sampler dtype) and ``mode``.

    By default the sampler's live version is dropped first (version -1, no weights: a failed publish
    leaves a sampler that refuses to generate rather than a stale one), so the old and the new copy
    are never both held: measured on a 104 MB model, the publish peak is ~1.3x the parameter bytes
    instead of ~2x. ``keep_live=True`` keeps the live version until the new one is complete (the
    disaggregated sampler's contract), at the price of that peak. In colocated mode a failed
    publish means a broken trainer group anyway (the whole group restarts from a checkpoint).
    """
    t0 = time.perf_counter()
    if not keep_live:
        sampler.params, sampler.version = None, -1
    tensors, st = full_params_for_sampler(model, spec, alias)
    params = torch_to_jax(tensors)
    zero = count_zero_copy(tensors, params)
    sampler.set_params(params, version)
    nbytes = sum(_nbytes(t) for t in tensors.values())
    return {"version": version, "bytes": nbytes, "buckets": 0, "link_bytes": {"host": 0, "dcn": 0, "ici": 0},
            "zero_copy": zero, "tensors": len(tensors), "seconds": time.perf_counter() - t0,
            "mode": "alias" if alias else "snapshot", **st}


# ---------------------------------------------------------------------------------------------
# memory


def proc_status() -> dict:
    """Current and peak resident set of this process (Linux ``/proc/self/status``; None elsewhere)."""
    out = {"rss_bytes": None, "peak_rss_bytes": None}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    kb = int(rest.split()[0])
                    out["rss_bytes" if key == "VmRSS" else "peak_rss_bytes"] = kb * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors: their local shard, FSDP's padding
    included; tied or viewed tensors counted once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        s = _local(t).untyped_storage()
        if s.data_ptr() in seen:
            continue
        seen.add(s.data_ptr())
        total += s.nbytes()
    return total


def param_bytes(model: torch.nn.Module | None) -> int:
    return _storage_bytes(model.parameters()) if model is not None else 0


def grad_bytes(model: torch.nn.Module | None) -> int:
    return _storage_bytes(p.grad for p in model.parameters()) if model is not None else 0


def optimizer_bytes(opt) -> int:
    """AdamW: ``exp_avg`` + ``exp_avg_sq`` (each like its parameter) + a scalar ``step`` per
    parameter; allocated lazily at the first step (0 before it)."""
    if opt is None:
        return 0
    return _storage_bytes(v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))


def trainer_memory(engine) -> dict:
    if engine is None:
        return {}
    out = {"param_bytes": param_bytes(engine.model), "grad_bytes": grad_bytes(engine.model),
           "optimizer_bytes": optimizer_bytes(engine.optimizer),
           "reference_bytes": param_bytes(getattr(engine, "ref_model", None)),
           "critic_bytes": 0}
    critic = getattr(engine, "critic", None)
    if critic is not None:
        out["critic_bytes"] = param_bytes(critic) + grad_bytes(critic) + optimizer_bytes(engine.critic_optimizer)
    out["total_bytes"] = sum(out.values())
    return out


def kv_cache_bytes(model_cfg, rows: int, seq_len: int, itemsize: int) -> int:
    """K and V of every layer, ``rows x kv_heads x seq_len x head_dim`` each (``jax_llama.init_cache``)."""
    return 2 * model_cfg.num_hidden_layers * rows * model_cfg.num_key_value_heads * seq_len * model_cfg.head_dim \
        * itemsize


def largest_cell(sampler_cfg) -> tuple[int, int, int]:
    return max(sampler_cfg.batch_buckets), max(sampler_cfg.prompt_buckets), max(sampler_cfg.new_tokens_grid)


def sampler_memory(engine, trainer_model: torch.nn.Module | None = None) -> dict:
    """The sampler's JAX parameters (and how many of those bytes are the trainer's own memory),
    the KV cache of its largest grid cell (alive only during a generate call), and XLA's own
    temp-buffer figure for the compiled programs when it gives one."""
    if engine is None:
        return {}
    rows, plen, new = largest_cell(engine.cfg)
    itemsize = np.dtype(engine.dtype).itemsize
    out = {"param_bytes": 0, "shared_with_trainer_bytes": 0, "largest_cell": [rows, plen, new],
           "kv_cache_bytes": kv_cache_bytes(engine.mcfg, rows, plen + new, itemsize),
           "programs": len(engine.programs()), "program_temp_bytes": None}
    if engine.params is not None:
        out["param_bytes"] = int(sum(a.nbytes for a in engine.params.values()))
        if trainer_model is not None:
            mine = {_local(p).data_ptr() for p in trainer_model.parameters()}
            for a in engine.params.values():
                with contextlib.suppress(Exception):  # not comparable off CPU: counted as not shared
                    if a.unsafe_buffer_pointer() in mine:
                        out["shared_with_trainer_bytes"] += int(a.nbytes)
    temps = []
    for exe in engine.programs():
        with contextlib.suppress(Exception):  # backends without memory analysis
            temps.append(int(exe.memory_analysis().temp_size_in_bytes))
    if temps:
        out["program_temp_bytes"] = max(temps)
    return out


def device_memory() -> dict | None:
    """JAX's figures for this process's first device (bytes in use, peak, limit), or None where
    the device offers none (the CPU backend returns None)."""
    try:
        import jax

        dev = jax.local_devices()[0]
        stats = dev.memory_stats()
    except Exception:  # noqa: BLE001 - no backend / not supported
        return None
    if not stats:
        return None
    keep = ("bytes_in_use", "peak_bytes_in_use", "bytes_limit", "bytes_reserved", "largest_alloc_size")
    return {"platform": dev.platform, **{k: int(stats[k]) for k in keep if k in stats}}


def process_memory(trainer=None, sampler=None) -> dict:
    """What this process holds with both roles resident (see the module docstring)."""
    tr = trainer_memory(trainer)
    sm = sampler_memory(sampler, trainer.model if trainer is not None else None)
    dev = device_memory()
    out = {**proc_status(), "trainer": tr, "sampler": sm, "device_memory": dev,
           "pid": os.getpid()}
    if dev is None:
        out["device_memory_note"] = "device offers no memory stats (CPU backend): RSS is the figure"
    # while generating: XLA's temp figure for the program (it holds the KV cache and the loop's other
    # buffers) when known, else the KV cache alone
    gen = sm.get("program_temp_bytes") or sm.get("kv_cache_bytes", 0)
    out["resident_estimate_bytes"] = tr.get("total_bytes", 0) + sm.get("param_bytes", 0) \
        - sm.get("shared_with_trainer_bytes", 0) + gen
    return out
