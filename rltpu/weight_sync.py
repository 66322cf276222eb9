"""Trainer -> sampler weight sync over a torch.distributed collective, in flat versioned buckets.

Ordering (every participant runs the same loop, so the collectives line up):

    trainers (all ranks): full = all-gather of the FSDP shards           # FSDP2 full_tensor()
    trainer rank 0:       broadcast header [version, n_buckets, spec_digest]
    samplers:             receive header; refuse a digest that is not theirs
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
    """Names, shapes and dtypes of the policy, from a meta-device build (no memory)."""
    from rltpu.models.torch_llama import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(model_cfg, vocab_size)
    return [(k, tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in model.state_dict().items()]


def spec_digest(spec: ParamSpec) -> int:
    h = hashlib.sha256(repr(spec).encode()).digest()
    return int.from_bytes(h[:7], "little")  # fits in int64


@dataclass(frozen=True)
class Bucket:
    dtype: str
    entries: tuple[tuple[str, tuple[int, ...], int, int], ...]  # (name, shape, offset, numel)
    numel: int


def plan_buckets(spec: ParamSpec, bucket_bytes: int) -> list[Bucket]:
    buckets, cur, cur_dtype, cur_numel = [], [], None, 0

    def flush():
        nonlocal cur, cur_numel
        if cur:
            buckets.append(Bucket(cur_dtype, tuple(cur), cur_numel))
        cur, cur_numel = [], 0

    for name, shape, dtype in spec:
        numel = int(np.prod(shape)) if shape else 1
        size = numel * _DTYPES[dtype].itemsize
        if cur and (dtype != cur_dtype or (cur_numel * _DTYPES[cur_dtype].itemsize + size) > bucket_bytes):
            flush()
        cur_dtype = dtype
        cur.append((name, tuple(shape), cur_numel, numel))
        cur_numel += numel
    flush()
    return buckets


def send_weights(state: dict[str, torch.Tensor], spec: ParamSpec, version: int, bucket_bytes: int, group,
                 src: int = 0) -> dict:
    """Run on the source trainer rank: header, then every bucket, over ``group``."""
    t0 = time.perf_counter()
    plan = plan_buckets(spec, bucket_bytes)
    header = torch.tensor([version, len(plan), spec_digest(spec)], dtype=torch.int64)
    dist.broadcast(header, src=src, group=group)
    sent = 0
    for b in plan:
        flat = torch.empty(b.numel, dtype=_DTYPES[b.dtype])
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
    if digest != spec_digest(spec) or n_buckets != len(plan):
        raise RuntimeError(
            f"weight sync v{version}: sender's parameter layout (digest {digest}, {n_buckets} buckets) differs "
            f"from this sampler's ({spec_digest(spec)}, {len(plan)} buckets); trainer and sampler model configs disagree"
        )
    if version != expected_version:
        raise RuntimeError(f"weight sync: received version {version}, controller expected {expected_version}")
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
