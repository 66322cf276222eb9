"""Trainer -> sampler weight sync over a torch.distributed collective, in flat versioned buckets.

Ordering (every participant runs the same loop, so the collectives line up):

    trainers (all ranks): full = all-gather of the FSDP shards           # FSDP2 full_tensor()
    trainer rank 0:       broadcast header [version, n_buckets, spec_digest]
    samplers:             receive header; refuse a digest (or version) that is not theirs
    all:                  all-reduce(MAX) of the samplers' refusal flags: on a refusal every
                          participant raises at once, before any payload (no one is left blocked
                          in a broadcast, and the group stays aligned for the next sync)
    for bucket in plan:   trainer 0 packs bucket -> broadcast(flat, src=0, group=sync_group)
                          samplers unpack views of the flat buffer (no copy) -> JAX via DLPack
    samplers:             swap to the new params dict only after the last bucket arrived

The plan (which tensors share a bucket, in what order) is a pure function of the parameter spec
(names, shapes, dtypes) and the bucket size, so sender and receivers compute it independently and
the header digest proves they agree before any payload moves. Collectives inherit the process
group timeout (``sync.timeout_s``), so a dead peer fails the sync instead of hanging it.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

ParamSpec = list[tuple[str, tuple[int, ...], str]]  # (name, shape, torch dtype name)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def param_spec(model_cfg, vocab_size: int) -> ParamSpec:
    """Names, shapes and dtypes of the policy, in state-dict order (every parameter is in
    ``model.dtype``)."""
    from rltpu.models import param_shapes

    return [(k, shape, model_cfg.dtype) for k, shape in param_shapes(model_cfg, vocab_size).items()]


def spec_digest(spec: ParamSpec) -> int:
    h = hashlib.sha256(repr(spec).encode()).digest()
    return int.from_bytes(h[:7], "little")  # fits in int64


@dataclass(frozen=True)
class Bucket:
    dtype: str
    entries: tuple[tuple[str, tuple[int, ...], int, int], ...]  # (name, shape, offset, numel)
    numel: int


ALIGN_BYTES = 64  # JAX's CPU client aliases (zero-copy) DLPack buffers only at 64-byte alignment


def plan_buckets(spec: ParamSpec, bucket_bytes: int) -> list[Bucket]:
    """Consecutive same-dtype tensors share a bucket up to ``bucket_bytes``; each entry starts at
    a 64-byte-aligned offset so receivers can hand views of the flat buffer to JAX without a copy.
    A tensor larger than a bucket gets a bucket of its own."""
    buckets, cur, cur_dtype, cur_numel = [], [], None, 0

    def flush():
        nonlocal cur, cur_numel
        if cur:
            buckets.append(Bucket(cur_dtype, tuple(cur), cur_numel))
        cur, cur_numel = [], 0

    for name, shape, dtype in spec:
        numel = int(np.prod(shape)) if shape else 1
        itemsize = _DTYPES[dtype].itemsize
        align = ALIGN_BYTES // itemsize
        offset = -(-cur_numel // align) * align
        if cur and (dtype != cur_dtype or (offset + numel) * itemsize > bucket_bytes):
            flush()
            offset = 0
        cur_dtype = dtype
        cur.append((name, tuple(shape), offset, numel))
        cur_numel = offset + numel
    flush()
    return buckets


_LAYOUT, _VERSION = 1, 2  # why a sampler refuses a header (bit flags)


def _verdict(flags: int, group) -> int:
    """Every participant learns every refusal: a 2-element MAX all-reduce, one slot per reason."""
    t = torch.tensor([flags & _LAYOUT, flags & _VERSION], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t[0]) | int(t[1])


def _refusals(flags: int, version: int) -> str:
    why = []
    if flags & _LAYOUT:
        why.append("parameter layout differs: trainer and sampler model configs disagree")
    if flags & _VERSION:
        why.append(f"version {version} is not the one the controller expected")
    return "; ".join(why)


def send_weights(state: dict[str, torch.Tensor], spec: ParamSpec, version: int, bucket_bytes: int, group,
                 src: int = 0) -> dict:
    """Run on the source trainer rank: header, then every bucket, over ``group``."""
    t0 = time.perf_counter()
    plan = plan_buckets(spec, bucket_bytes)
    header = torch.tensor([version, len(plan), spec_digest(spec)], dtype=torch.int64)
    dist.broadcast(header, src=src, group=group)
    refused = _verdict(0, group)
    if refused:
        raise RuntimeError(
            f"weight sync v{version}: refused by a sampler ({_refusals(refused, version)}); nothing sent")
    sent = 0
    for b in plan:
        flat = torch.zeros(b.numel, dtype=_DTYPES[b.dtype])  # zeros: alignment gaps are deterministic
        for name, _shape, off, n in b.entries:
            flat[off:off + n].copy_(state[name].reshape(-1))
        dist.broadcast(flat, src=src, group=group)
        sent += flat.numel() * flat.element_size()
    return {"bytes": sent, "buckets": len(plan), "seconds": time.perf_counter() - t0}


def receive_weights(spec: ParamSpec, expected_version: int, bucket_bytes: int, group, src: int = 0):
    """Run on each sampler: returns ``(tensors, stats)``; tensors are views into fresh flat buffers."""
    t0 = time.perf_counter()
    plan = plan_buckets(spec, bucket_bytes)
    header = torch.zeros(3, dtype=torch.int64)
    dist.broadcast(header, src=src, group=group)
    version, n_buckets, digest = (int(x) for x in header)
    layout_ok = digest == spec_digest(spec) and n_buckets == len(plan)
    mine = (0 if layout_ok else _LAYOUT) | (0 if version == expected_version else _VERSION)
    refused = _verdict(mine, group)
    if not layout_ok:
        raise RuntimeError(
            f"weight sync v{version}: sender's parameter layout (digest {digest}, {n_buckets} buckets) differs "
            f"from this sampler's ({spec_digest(spec)}, {len(plan)} buckets); trainer and sampler model configs disagree"
        )
    if version != expected_version:
        raise RuntimeError(f"weight sync: received version {version}, controller expected {expected_version}")
    if refused:
        raise RuntimeError(
            f"weight sync v{version}: another sampler refused ({_refusals(refused, version)}); nothing sent")
    out, received = {}, 0
    for b in plan:
        flat = torch.empty(b.numel, dtype=_DTYPES[b.dtype])
        dist.broadcast(flat, src=src, group=group)
        received += flat.numel() * flat.element_size()
        for name, shape, off, n in b.entries:
            out[name] = flat[off:off + n].view(shape)
    return out, {"bytes": received, "buckets": len(plan), "seconds": time.perf_counter() - t0, "version": version}


def torch_to_jax(tensors: dict[str, torch.Tensor]) -> dict:
    """Zero-copy where DLPack allows (aligned, supported dtype); JAX copies otherwise."""
    import jax

    return {k: jax.dlpack.from_dlpack(v.contiguous()) for k, v in tensors.items()}


def count_zero_copy(tensors: dict[str, torch.Tensor], arrays: dict) -> int:
    """How many JAX arrays alias their torch buffer (no copy was made); on CPU, where pointers
    are comparable."""
    n = 0
    for k, t in tensors.items():
        try:
            n += int(arrays[k].unsafe_buffer_pointer() == t.data_ptr())
        except Exception:  # noqa: BLE001 - non-CPU or sharded arrays: not comparable, count as copied
            pass
    return n
