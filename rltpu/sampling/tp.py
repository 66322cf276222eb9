"""Sampler tensor parallelism: the device mesh and where each weight and the KV cache live on it.

Why GSPMD and not hand-written collectives: the engine's programs stay the single-device code;
the weights arrive in ``NamedSharding``s, the KV cache is constrained to its sharding, and XLA
partitions the prefill + ``while_loop`` decode program and inserts the all-reduces itself.

The layout (Megatron): q/k/v projections split by output heads, ``o_proj`` by input columns
(its all-reduce closes the attention block), MLP gate/up by output rows and down by input
columns, the embedding and ``lm_head`` by vocabulary rows (an 8B model's 128k x 4k tables are
1 GB each in bf16: replicating them would cost more than the split saves elsewhere). Norm weights,
the q/k RMSNorm weights and ``o_proj``'s bias (added after the all-reduce) are replicated.

GQA with fewer kv heads than devices: the mesh is 2-D, ``("tp", "tp_rep")`` of shape
``(g, k // g)`` with ``g = gcd(kv_heads, k)``. Head-split tensors (q, MLP, vocab) are split over
both axes (k ways); k/v projections and the KV cache only over ``"tp"`` (g ways), so each kv head
is held by exactly the ``k // g`` devices whose q heads read it (q head h uses kv head
``h // (heads // kv_heads)``, and q blocks are numbered tp-major). With ``kv_heads % k == 0``
``"tp_rep"`` has size 1: plain tensor parallelism. Refused (one line): ``heads`` or
``intermediate_size`` not divisible by k.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

TP, REP = "tp", "tp_rep"
ALL = (TP, REP)  # a dimension split over every device of the mesh

# name suffix -> which dim is split and over which axes (None: replicated)
_RULES = (
    ("self_attn.q_proj.weight", 0, ALL), ("self_attn.q_proj.bias", 0, ALL),
    ("self_attn.k_proj.weight", 0, TP), ("self_attn.k_proj.bias", 0, TP),
    ("self_attn.v_proj.weight", 0, TP), ("self_attn.v_proj.bias", 0, TP),
    ("self_attn.o_proj.weight", 1, ALL),
    ("mlp.gate_proj.weight", 0, ALL), ("mlp.up_proj.weight", 0, ALL), ("mlp.down_proj.weight", 1, ALL),
)
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True)
class Layout:
    """How k devices split one model: ``kv_ways`` = size of ``"tp"``; ``vocab_sharded`` False when
    the vocabulary does not divide by k (the tables are then replicated)."""

    k: int
    kv_ways: int
    vocab_sharded: bool

    @property
    def mesh_shape(self) -> tuple[int, int]:
        return self.kv_ways, self.k // self.kv_ways


def plan(mcfg, vocab_size: int, k: int) -> Layout:
    """Validate that ``mcfg`` splits over ``k`` devices; raise a one-line ValueError if not."""
    nh, nkv, inter = mcfg.num_attention_heads, mcfg.num_key_value_heads, mcfg.intermediate_size
    for what, n in (("num_attention_heads", nh), ("intermediate_size", inter)):
        if n % k:
            raise ValueError(f"sampler tensor parallelism over {k} devices needs {what}={n} divisible by {k}; "
                             f"use placement.chips_per_sampler dividing it")
    return Layout(k=k, kv_ways=math.gcd(nkv, k), vocab_sharded=vocab_size % k == 0)


def make_mesh(devices, layout: Layout):
    from jax.sharding import AxisType, Mesh

    if len(devices) != layout.k:
        raise ValueError(f"layout for {layout.k} devices given {len(devices)}")
    # Auto axes: GSPMD propagates shardings through the unannotated model code
    return Mesh(np.asarray(devices, dtype=object).reshape(layout.mesh_shape), (TP, REP),
                axis_types=(AxisType.Auto, AxisType.Auto))


def param_spec(name: str, ndim: int, layout: Layout):
    """The PartitionSpec of weight ``name`` (HF name, torch [out, in] layout)."""
    from jax.sharding import PartitionSpec as P

    axes = None
    dim = 0
    for suffix, d, a in _RULES:
        if name.endswith(suffix):
            dim, axes = d, a
            break
    if name in _VOCAB and layout.vocab_sharded:
        axes = ALL
    if axes is None:
        return P()
    spec = [None] * ndim
    spec[dim] = axes
    return P(*spec)


def kind(name: str, ndim: int, layout: Layout) -> str:
    """``"split"`` (1/k per device), ``"kv"`` (1/kv_ways: a GQA kv head on several devices) or
    ``"replicated"``."""
    spec = param_spec(name, ndim, layout)
    axes = [a for a in spec if a is not None]
    if not axes:
        return "replicated"
    return "split" if axes[0] == ALL or layout.kv_ways == layout.k else "kv"


def cache_spec():
    """KV cache ``[B, kv_heads, S, head_dim]``: split by kv heads over ``"tp"``."""
    from jax.sharding import PartitionSpec as P

    return P(None, TP, None, None)


def expected_device_bytes(shapes: dict, itemsize: dict, layout: Layout) -> dict[str, int]:
    """Per-device weight bytes by kind, from shapes alone: what ``device_weight_bytes`` must measure."""
    out = {"split": 0, "kv": 0, "replicated": 0}
    div = {"split": layout.k, "kv": layout.kv_ways, "replicated": 1}
    for name, shape in shapes.items():
        c = kind(name, len(shape), layout)
        out[c] += int(np.prod(shape)) * itemsize[name] // div[c]
    return out


def device_weight_bytes(params: dict) -> dict:
    """Bytes of ``params`` each device holds (its addressable shards), keyed by device."""
    out: dict = {}
    for a in params.values():
        for s in a.addressable_shards:
            out[s.device] = out.get(s.device, 0) + s.data.nbytes
    return out
