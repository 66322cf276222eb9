"""FSDP2 wrapping of the Llama-style policy, as an ordered list: (TP,) per block, then the root.

Each decoder layer is its own FSDP unit (all-gathered just before its forward, freed after),
then the root wraps embeddings, final norm and head. Options:

- ``mixed_precision="bf16"``: FSDP2's ``MixedPrecisionPolicy`` all-gathers bf16 copies for compute
  while the sharded parameters, gradients' reduction and AdamW states stay fp32 (master weights).
- ``activation_checkpointing``: each layer's forward runs under ``torch.utils.checkpoint`` and is
  recomputed in backward. The module is patched in place (not wrapped), so parameter names stay
  the Hugging Face ones that weight sync and checkpoints use.
- a 2-D ``("dp", "tp")`` mesh: tensor parallelism first (``learner/tp.py``), FSDP2 over ``"dp"``.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint


def checkpoint_layers(model: torch.nn.Module) -> None:
    for layer in model.model.layers:
        if getattr(layer, "_rltpu_checkpointed", False):
            continue
        inner = layer.forward

        def forward(*args, _inner=inner):
            return checkpoint(_inner, *args, use_reentrant=False)

        layer.forward = forward
        layer._rltpu_checkpointed = True


def trainer_mesh(group, device: str, slices: int = 1, tp: int = 1, groups: tuple | None = None) -> DeviceMesh:
    """The trainer group's mesh: 1-D ``("dp",)``-like FSDP over the group, or with ``tp > 1`` 2-D
    ``("dp", "tp")`` of shape ``(n / tp, tp)`` (each run of ``tp`` consecutive ranks is one TP group:
    the chips of one ``assign_roles`` block). On TorchTPU the rank layout comes from
    ``torch.tpu.distributed.topology_aware_mesh`` (logically adjacent ranks on ICI-adjacent chips, the
    TP axis innermost; with several slices the dp axis is split across them over DCN). Elsewhere the
    group's own rank order; the 2-D mesh is built from ``groups`` = (this rank's dp group, its tp group),
    created on every rank of the world by ``rltpu.chips.runtime`` (``new_group`` is collective)."""
    import torch.distributed as dist

    n = dist.get_world_size(group)
    if tp == 1:
        if device != "tpu":
            return DeviceMesh.from_group(group, device)
        ranks = torch.tpu.distributed.topology_aware_mesh((n,), dcn_mesh_shape=(slices,) if slices > 1 else None)
        return DeviceMesh("tpu", ranks)
    if n % tp:
        raise ValueError(f"{n} trainer ranks cannot form tensor-parallel groups of {tp}; set placement.trainer_chips "
                         f"to a multiple of placement.chips_per_trainer")
    shape = (n // tp, tp)
    if device == "tpu":
        ranks = torch.tpu.distributed.topology_aware_mesh(shape, dcn_mesh_shape=(slices, 1) if slices > 1 else None)
        return DeviceMesh("tpu", ranks, mesh_dim_names=("dp", "tp"))
    ranks = torch.tensor(dist.get_process_group_ranks(group)).view(shape)
    return DeviceMesh.from_group(list(groups), device, mesh=ranks, mesh_dim_names=("dp", "tp"))


def parallelize_llama(model: torch.nn.Module, mesh: DeviceMesh, mixed_precision: str = "fp32",
                      activation_checkpointing: bool = False) -> torch.nn.Module:
    """AC, then (2-D mesh) tensor parallelism over ``"tp"``, then ``fully_shard`` per block and the
    root over the FSDP axis (the whole 1-D mesh, or ``"dp"``)."""
    if activation_checkpointing:
        checkpoint_layers(model)
    if mesh.ndim == 2:
        from learner.tp import apply_tp

        apply_tp(model, mesh["tp"])
        mesh = mesh["dp"]
    mp = None
    if mixed_precision == "bf16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kw = {"mesh": mesh} | ({"mp_policy": mp} if mp is not None else {})
    for block in model.model.layers:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded parameters in HF names. Every rank of the mesh must call it (it all-gathers)."""
    out = {}
    for name, tensor in model.state_dict().items():
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        out[name] = full.detach()
    return out
