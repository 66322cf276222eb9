"""Load a Hugging Face directory's weights into the trainer's (FSDP x TP-sharded) policy or the
sampler's JAX params, by name, one tensor at a time.

Trainer: the policy is built on the ``meta`` device, parallelized (tensor parallelism over
``"tp"``, then ``fully_shard`` over the FSDP axis: ``learner.fsdp.parallelize_llama``), given real
storage with ``to_empty``, and then each rank reads *only its block* of each tensor from the
safetensors file into its local shard. The block comes from the parameter's own DTensor layout
(``compute_local_shape_and_global_offset`` of its mesh and placements), so it is whatever the
plan made: a colwise q/k/v/gate/up weight's TP rows then FSDP's piece of them, a rowwise
o_proj/down weight's FSDP rows x its TP columns, a whole tensor's FSDP rows. No rank ever holds a
full copy of a split tensor, and no step holds two (see ``benchmarks/load_memory.py`` for the
measured peak).

Sampler: in a run the samplers receive version 0 over weight sync from the trainer (the weights
the trainer just loaded), so only the trainers read the directory; ``load_jax_params`` exists for
tests, benchmarks and single-process use.
"""

from __future__ import annotations

from typing import Any

from rltpu.models.hf.weights import CheckpointDir, CheckpointError


def local_block(param, shape: tuple[int, ...]) -> tuple[Any, tuple[tuple[int, int], ...] | None]:
    """(local tensor, its ``[lo, hi)`` range in each dim of the global tensor) for a plain parameter
    (None: all of it) or a DTensor of any Shard/Replicate layout whose local part is one box."""
    from torch.distributed.tensor import DTensor, Partial
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(param, DTensor):
        return param, None
    if any(isinstance(p, Partial) for p in param.placements):
        raise CheckpointError(f"cannot stream into placements {param.placements} (a Partial parameter has no slice "
                              f"of the checkpoint); load before the plan makes it Partial")
    size, offset = compute_local_shape_and_global_offset(tuple(shape), param.device_mesh, param.placements)
    local = param.to_local()
    if tuple(local.shape) != tuple(size):  # the layout's box is not the rank's local tensor
        raise CheckpointError(f"shard of {list(shape)} under {param.placements} should be {list(size)} at "
                              f"{list(offset)} but this rank holds {list(local.shape)}; unexpected sharding")
    return local, tuple((o, o + n) for o, n in zip(offset, size))


def stream_into(params: dict, ckpt: CheckpointDir) -> int:
    """Read each parameter's own block from ``ckpt`` into its local tensor (cast to its dtype);
    returns the bytes read. Only dims 0 (rows) and 1 (columns of a 2-D weight) are ever split."""
    import torch

    read = 0
    with torch.no_grad():
        for name in ckpt.by_file(params):
            shape = ckpt.shape(name)
            local, box = local_block(params[name], shape)
            if box is None:
                t = ckpt.read(name)
            else:
                if any(hi <= lo for lo, hi in box):
                    continue  # this rank holds none of a short tensor
                if any(box[d] != (0, shape[d]) for d in range(2, len(shape))):
                    raise CheckpointError(f"{name}: shard {list(box)} splits a dim past 1; only rows and columns "
                                          f"are read in blocks")
                rows = box[0]
                cols = box[1] if len(shape) > 1 and box[1] != (0, shape[1]) else None
                t = ckpt.read(name, rows, cols)
            local.copy_(t)
            read += t.numel() * t.element_size()
            del t
    return read


def load_policy_weights(model, cfg, vocab_size: int | None = None) -> dict:
    """Copy the checkpoint at ``cfg.path`` into ``model`` (plain, FSDP2 or FSDP x TP), each rank its
    own block; cast to the parameter dtype. Returns {"tensors", "bytes_read"}."""
    ckpt = CheckpointDir(cfg.path)
    ckpt.check(cfg, vocab_size)
    from rltpu.models.spec import is_adapter

    params = {n: p for n, p in model.named_parameters() if not is_adapter(n)}  # LoRA adapters: not in the file
    return {"tensors": len(params), "bytes_read": stream_into(params, ckpt)}


def build_policy(cfg, vocab_size: int, parallelize=None, device: str = "cpu", prepare=None):
    """The trainer's policy loaded from ``cfg.path``: meta build -> ``prepare(model)`` (e.g. LoRA's
    adapters) -> ``parallelize(model)`` (e.g. ``parallelize_llama``: TP, then FSDP2) -> ``to_empty``
    -> each rank streams in its shard."""
    import torch

    from rltpu.models.torch_llama import LlamaForCausalLM

    CheckpointDir(cfg.path).check(cfg, vocab_size)  # fail on a bad file before any allocation
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, vocab_size)
    if prepare is not None:
        prepare(model)
    if parallelize is not None:
        parallelize(model)
    model.to_empty(device=device)
    load_policy_weights(model, cfg, vocab_size)
    return model


def load_jax_params(cfg, vocab_size: int | None = None, dtype: Any = None, shardings: dict | None = None) -> dict:
    """The sampler's params (HF names, torch layout) from ``cfg.path``, one tensor at a time, cast
    to ``cfg.dtype`` (or ``dtype``). With ``shardings`` (a tensor-parallel engine's
    ``param_shardings``) each tensor goes from host memory straight into its sharding, so no
    device ever holds a whole copy of a split tensor."""
    import jax
    import jax.numpy as jnp

    ckpt = CheckpointDir(cfg.path)
    want = ckpt.check(cfg, vocab_size)
    dt = dtype or (jnp.bfloat16 if cfg.dtype == "bfloat16" else jnp.float32)
    if shardings is not None:
        host = jnp.dtype(dt)
        return {name: jax.device_put(ckpt.read_numpy(name).astype(host, copy=False), shardings[name]) for name in want}
    return {name: jnp.asarray(ckpt.read_numpy(name)).astype(dt) for name in want}
