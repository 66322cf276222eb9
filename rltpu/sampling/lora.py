"""LoRA on the sampler: hold the base once, apply each sync's adapters without recompiling.

Two ways (``trainer.lora.sampler_apply``):

- ``merged``: after each sync, ``W' = W + (alpha / rank) B A`` for every adapted projection (one
  jitted program, compiled once: same shapes every sync); decode then runs the base's programs on
  ``W'``. Memory: the base plus a merged copy of the adapted matrices.
- ``lowrank``: the adapters (B pre-scaled) are extra program inputs and every adapted linear adds
  ``(x A^T) B^T`` (``rltpu.models.jax_llama._proj``); memory: the base plus the adapters.

Either way the programs' input names and shapes never change between syncs: 0 recompiles.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rltpu.models.spec import is_adapter


def _module(name: str) -> str:
    return name.rsplit(".", 2)[0]  # "...q_proj.lora_A.weight" -> "...q_proj"


@jax.jit
def _merge(weights: dict, adapters: dict, scale) -> dict:
    """{module: W + scale B A} in fp32, cast back to W's dtype."""
    out = {}
    for m, w in weights.items():
        a = adapters[m + ".lora_A.weight"].astype(jnp.float32)
        b = adapters[m + ".lora_B.weight"].astype(jnp.float32)
        out[m + ".weight"] = (w.astype(jnp.float32) + scale * (b @ a)).astype(w.dtype)
    return out


@jax.jit
def _scale_b(adapters: dict, scale) -> dict:
    return {k: (v * scale).astype(v.dtype) if k.endswith(".lora_B.weight") else v for k, v in adapters.items()}


class SamplerAdapters:
    """The base (set once, by a full sync) and the newest adapters; builds the params the programs take."""

    def __init__(self, lora, shapes: dict):
        self.mode, self.scale = lora.sampler_apply, float(lora.scale)
        self.shapes = dict(shapes)
        self.adapter_names = [k for k in shapes if is_adapter(k)]
        self.modules = sorted({_module(k) for k in self.adapter_names})
        self.base: dict | None = None
        self.merges = 0  # merged mode: merges run (one per sync)

    def program_shapes(self) -> dict:
        """What the compiled programs take: the base (merged) or the base and the adapters (lowrank)."""
        if self.mode == "lowrank":
            return dict(self.shapes)
        return {k: v for k, v in self.shapes.items() if not is_adapter(k)}

    def set_full(self, params: dict) -> dict:
        self.base = {k: v for k, v in params.items() if not is_adapter(k)}
        return self.set_adapters({k: params[k] for k in self.adapter_names if k in params})

    def set_adapters(self, adapters: dict) -> dict:
        if self.base is None:
            raise ValueError("adapters arrived before the base: the first sync after joining must be a full one")
        missing = [k for k in self.adapter_names if k not in adapters]
        if missing:
            raise ValueError(f"adapter sync lacks {missing[:3]}")
        for k in self.adapter_names:
            if tuple(adapters[k].shape) != tuple(self.shapes[k][0]):
                raise ValueError(f"adapter {k} has shape {tuple(adapters[k].shape)}, expected {tuple(self.shapes[k][0])}")
        ad = {k: adapters[k] for k in self.adapter_names}
        scale = jnp.float32(self.scale)
        if self.mode == "lowrank":
            return {**self.base, **_scale_b(ad, scale)}
        self.merges += 1
        merged = _merge({m: self.base[m + ".weight"] for m in self.modules}, ad, scale)
        return {**self.base, **merged}

    def merge_compiles(self) -> int:
        """Programs the merge / scale functions compiled in this process (1 after any number of syncs)."""
        return _merge._cache_size() + _scale_b._cache_size()

    def held_bytes(self, params: dict | None) -> dict:
        """Weight bytes this engine holds: the base once, plus the merged copies or the adapters."""
        base = sum(int(v.nbytes) for v in (self.base or {}).values())
        extra = sum(int(v.nbytes) for k, v in (params or {}).items()
                    if self.base is None or k not in self.base or v is not self.base[k])
        return {"base_bytes": base, "lora_extra_bytes": extra}
