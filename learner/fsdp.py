"""FSDP2 wrapping of the Llama-style policy, as an ordered list: per block, then the root.

Each decoder layer is its own FSDP unit (all-gathered just before its forward, freed after),
then the root wraps embeddings, final norm and head. Mixed precision and activation
checkpointing come with the learner issue; this is the plain fp32 path.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard


def parallelize_llama(model: torch.nn.Module, mesh: DeviceMesh) -> torch.nn.Module:
    for block in model.model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded parameters in HF names. Every rank of the mesh must call it (it all-gathers)."""
    out = {}
    for name, tensor in model.state_dict().items():
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        out[name] = full.detach()
    return out
