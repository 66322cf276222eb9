"""Load a Hugging Face directory's weights into the trainer's (FSDP-sharded) policy or the
sampler's JAX params, by name, one tensor at a time.

Trainer: the policy is built on the ``meta`` device, wrapped with ``fully_shard`` (FSDP2 shards
each parameter's dim 0 in ``torch.chunk`` pieces), given real storage with ``to_empty``, and then
each rank reads *only its rows* of each tensor from the safetensors file into its local shard.
No rank ever holds a full copy of the model, and no step holds two (see
``benchmarks/load_memory.py`` for the measured peak).

Sampler: in a run the samplers receive version 0 over weight sync from the trainer (the weights
the trainer just loaded), so only the trainers read the directory; ``load_jax_params`` exists for
tests, benchmarks and single-process use.
"""

from __future__ import annotations

from typing import Any

from rltpu.models.hf.weights import CheckpointDir, CheckpointError


def _local_rows(param, n_rows: int) -> tuple[Any, tuple[int, int] | None]:
    """(local tensor, rows of the global tensor it holds) for a plain or FSDP2 (Shard(0)) parameter."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(param, DTensor):
        return param, None
    if len(param.placements) != 1 or param.placements[0] != Shard(0):
        raise CheckpointError(f"cannot stream into placements {param.placements} (expected FSDP2's Shard(0))")
    local = param.to_local()
    world, rank = param.device_mesh.size(), param.device_mesh.get_local_rank()
    chunk = -(-n_rows // world)  # torch.chunk: ceil-sized pieces, the last ones short or empty
    start = min(rank * chunk, n_rows)
    if start + local.shape[0] > n_rows:
        raise CheckpointError(f"FSDP shard of {n_rows} rows on rank {rank}/{world} has {local.shape[0]} rows; "
                              f"unexpected sharding")
    return local, (start, start + local.shape[0])


def load_policy_weights(model, cfg, vocab_size: int | None = None) -> dict:
    """Copy the checkpoint at ``cfg.path`` into ``model`` (plain or FSDP2-wrapped), each rank its
    own rows; cast to the parameter dtype. Returns {"tensors", "bytes_read"}."""
    import torch

    ckpt = CheckpointDir(cfg.path)
    ckpt.check(cfg, vocab_size)
    params = dict(model.named_parameters())
    read = 0
    with torch.no_grad():
        for name in ckpt.by_file(params):
            p = params[name]
            local, rows = _local_rows(p, ckpt.shape(name)[0])
            if rows is not None and rows[0] == rows[1]:
                continue  # this rank holds no rows of a short tensor
            t = ckpt.read(name, rows)
            local.copy_(t)
            read += t.numel() * t.element_size()
            del t
    return {"tensors": len(params), "bytes_read": read}


def build_policy(cfg, vocab_size: int, parallelize=None, device: str = "cpu"):
    """The trainer's policy loaded from ``cfg.path``: meta build -> ``parallelize(model)`` (e.g.
    FSDP2 ``fully_shard``) -> ``to_empty`` -> each rank streams in its shard."""
    import torch

    from rltpu.models.torch_llama import LlamaForCausalLM

    CheckpointDir(cfg.path).check(cfg, vocab_size)  # fail on a bad file before any allocation
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, vocab_size)
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
