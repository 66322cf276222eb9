"""FSDP2 wrapping of the Llama-style policy, as an ordered list: per block, then the root.

Each decoder layer is its own FSDP unit (all-gathered just before its forward, freed after),
then the root wraps embeddings, final norm and head. Options:

- ``mixed_precision="bf16"``: FSDP2's ``MixedPrecisionPolicy`` all-gathers bf16 copies for compute
  while the sharded parameters, gradients' reduction and AdamW states stay fp32 (master weights).
- ``activation_checkpointing``: each layer's forward runs under ``torch.utils.checkpoint`` and is
  recomputed in backward. The module is patched in place (not wrapped), so parameter names stay
  the Hugging Face ones that weight sync and checkpoints use.
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


def trainer_mesh(group, device: str, slices: int = 1) -> DeviceMesh:
    """The trainer group's 1-D FSDP mesh. On TorchTPU the rank layout comes from
    ``torch.tpu.distributed.topology_aware_mesh`` (logically adjacent ranks on ICI-adjacent chips;
    with several slices the FSDP axis is split across them over DCN, outermost); elsewhere the
    group's own rank order."""
    if device != "tpu":
        return DeviceMesh.from_group(group, device)
    import torch.distributed as dist

    n = dist.get_world_size(group)
    ranks = torch.tpu.distributed.topology_aware_mesh("tpu", (n,), dcn_mesh_shape=(slices,) if slices > 1 else None)
    return DeviceMesh("tpu", ranks)


def parallelize_llama(model: torch.nn.Module, mesh: DeviceMesh, mixed_precision: str = "fp32",
                      activation_checkpointing: bool = False) -> torch.nn.Module:
    if activation_checkpointing:
        checkpoint_layers(model)
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
