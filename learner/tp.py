"""Trainer tensor parallelism: torch's TP plans on the Llama projections, before FSDP2 over dp.

Why this shape: a TP rank holds ``1/tp`` of every projection (whole heads, whole MLP columns), so a
model too big for one chip's memory at FSDP's all-gathered layer fits; FSDP2 then shards what each
TP rank holds over the ``"dp"`` axis (``learner.fsdp.parallelize_llama``). The split (which module,
which dim) is ``rltpu.models.tp_plan``, shared with weight sync. Parameter names stay the HF ones.

Per decoder layer: q/k/v and gate/up ``ColwiseParallel`` (outputs stay local: this rank's heads /
MLP columns), o_proj and down ``RowwiseParallel`` (local inputs, outputs all-reduced). Attention
then runs on its local heads: ``n_heads / tp`` query and ``n_kv / tp`` kv heads, so GQA's grouping
(q head h reads kv head h // rep) holds inside each rank. Qwen3's per-head q/k norms stay whole
(``SequenceParallel`` over the heads dim: their shared weight's gradient is summed over TP).
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

from rltpu.models.tp_plan import COLWISE, ROWWISE, tp_problem


def apply_tp(model: torch.nn.Module, tp_mesh: DeviceMesh) -> torch.nn.Module:
    """Split every decoder layer's projections over ``tp_mesh`` (in place; a policy or a critic).

    Every rank starts from the same weights (same seed, or the meta device before a checkpoint
    load), so each takes its own slice locally (``src_data_rank=None``: no scatter)."""
    tp = tp_mesh.size()
    problem = tp_problem(model.cfg, tp)
    if problem:
        raise ValueError(problem)
    plan = {name: ColwiseParallel() for name in COLWISE} | {name: RowwiseParallel() for name in ROWWISE}
    if model.cfg.qk_norm:  # one weight shared by every head: it sees this rank's heads (dim 2 of
        # [B, T, heads, hd]) and its gradient is summed over the TP group
        plan |= {f"self_attn.{n}": SequenceParallel(sequence_dim=2, use_local_output=True) for n in ("q_norm", "k_norm")}
    for layer in model.model.layers:
        parallelize_module(layer, tp_mesh, plan, src_data_rank=None)
        attn = layer.self_attn
        attn.n_heads, attn.n_kv = attn.n_heads // tp, attn.n_kv // tp  # this rank's heads
    return model


def tp_degree(mesh: DeviceMesh | None) -> int:
    """The size of the mesh's ``"tp"`` axis (1 without one)."""
    if mesh is None or mesh.ndim < 2:
        return 1
    return mesh["tp"].size()


def clip_grad_norm_(params, max_norm: float) -> torch.Tensor:
    """Global grad-norm clip over FSDP x TP parameters, whose gradients live on two meshes (2-D for
    the split projections, dp only for the rest): torch's own clip stacks per-tensor norms, which
    DTensor refuses across meshes. Norms are taken per mesh, made full, then combined."""
    groups: dict = {}
    for p in params:
        if p.grad is not None:
            groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    parts = []
    for ps in groups.values():
        n = torch.nn.utils.get_total_norm([p.grad for p in ps])
        parts.append(n.full_tensor() if hasattr(n, "full_tensor") else n)
    total = torch.linalg.vector_norm(torch.stack(parts))
    for ps in groups.values():  # one mesh at a time: a foreach op may not mix meshes either
        torch.nn.utils.clip_grads_with_norm_(ps, max_norm, total)
    return total


def mesh_position(mesh: DeviceMesh | None) -> tuple[int, int]:
    """(the FSDP x TP shard this rank holds, as a flat position dp * tp + t; its index in its TP group).

    Read from the process groups of the mesh dims, not from ``mesh.get_coordinate()``: FSDP2 picks a
    rank's chunk by its shard group's rank (``torch/distributed/fsdp/_fully_shard/_fsdp_common.py``,
    ``shard_mesh_rank = shard_process_group.rank()``) and ``new_group`` sorts its ranks
    (``distributed_c10d.py``), so on a mesh whose layout is not rank order (TorchTPU's
    ``topology_aware_mesh`` orders v5e/v6e chips as a ring) the coordinate names another rank's rows.
    Weight sync places each stream by this position (``rltpu.sync.collective.send_shards``)."""
    if mesh is None:
        return 0, 0
    if mesh.ndim == 1:
        return mesh.get_group().rank(), 0
    d, t = mesh.get_group(0).rank(), mesh.get_group(1).rank()
    return d * mesh.size(1) + t, t