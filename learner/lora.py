"""LoRA on the trainer's policy: low-rank adapters beside frozen base projections.

Why: the base needs no gradients or AdamW states (12 of the 16 bytes per parameter the trainer
holds), and after each update only the adapters change, so only they are synced and checkpointed.

Each targeted ``nn.Linear`` (``trainer.lora.target_modules``) gets two child linears, ``lora_A``
``[rank, in]`` and ``lora_B [out, rank]``, and computes ``x W^T + b + (alpha / rank) B (A dropout(x))``.
The module's class is swapped in place, so the base keeps its Hugging Face name (``...q_proj.weight``)
and the adapters get PEFT's (``...q_proj.lora_A.weight``): checkpoint loading, FSDP2 wrapping and
weight sync address both by name. ``B = 0`` at start, so the model starts equal to the base.
``adapters_off`` runs the base alone: that is the reference policy (no second copy).
``lm_head`` may be a target too: its forward is not called (the trainer reads the head's tensors through
``LlamaForCausalLM.output_weight``), so its adapter runs without dropout.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from rltpu.models.spec import is_adapter


class LoRALinear(nn.Linear):
    """An ``nn.Linear`` with a low-rank update; made by ``add_lora`` (class swap), never constructed."""

    lora_scale: float
    lora_dropout: float
    lora_off: bool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if self.lora_off:
            return y
        h = x
        if self.lora_dropout and self.training and torch.is_grad_enabled():
            h = F.dropout(h, self.lora_dropout)
        return y + self.lora_B(self.lora_A(h)) * self.lora_scale


def add_lora(model: nn.Module, lora) -> list[str]:
    """Turn the targeted projections of ``model`` into ``LoRALinear`` (on the model's device: meta
    for a streamed checkpoint, initialised later by ``init_adapters``) and freeze everything else.
    Call before FSDP2 wraps the model. Returns the adapter parameter names."""
    targets = set(lora.target_modules)
    for name, mod in list(model.named_modules()):
        if type(mod) is nn.Linear and name.rsplit(".", 1)[-1] in targets and (name.startswith("model.layers.")
                                                                               or name == "lm_head"):
            dev, dt = mod.weight.device, mod.weight.dtype
            mod.lora_A = nn.Linear(mod.in_features, lora.rank, bias=False, device=dev, dtype=dt)
            mod.lora_B = nn.Linear(lora.rank, mod.out_features, bias=False, device=dev, dtype=dt)
            mod.lora_scale, mod.lora_dropout, mod.lora_off = float(lora.scale), float(lora.dropout), False
            mod.__class__ = LoRALinear
    freeze_base(model)
    names = adapter_names(model)
    if not names:
        raise ValueError(f"trainer.lora.target_modules {list(lora.target_modules)} matched no projection")
    return names


def freeze_base(model: nn.Module) -> None:
    """Only adapters train: the base gets no gradients, hence no optimizer state."""
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name))


def adapter_names(model: nn.Module) -> list[str]:
    return [n for n, _ in model.named_parameters() if is_adapter(n)]


def initial_adapters(shapes: dict[str, tuple[int, ...]], seed: int, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """PEFT's default init, drawn from one seeded generator in name order (identical on every rank):
    A ~ kaiming-uniform(a=sqrt(5)) (U(-1/sqrt(in), 1/sqrt(in))), B = 0."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + 17)
    out = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if name.endswith(".lora_A.weight"):
            bound = 1.0 / math.sqrt(shape[1])
            t = torch.empty(shape).uniform_(-bound, bound, generator=gen)
        else:
            t = torch.zeros(shape)
        out[name] = t.to(dtype)
    return out


@torch.no_grad()
def load_adapters(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy full adapter tensors into the model's (possibly FSDP-sharded) adapter parameters: each
    rank keeps only its block."""
    from rltpu.models.hf.load import local_block

    params = dict(model.named_parameters())
    for name, full in tensors.items():
        local, box = local_block(params[name], tuple(full.shape))
        if box is not None:
            full = full[tuple(slice(lo, hi) for lo, hi in box)]
        local.copy_(full.to(local.dtype))


def init_adapters(model: nn.Module, seed: int) -> None:
    params = dict(model.named_parameters())
    shapes = {n: tuple(params[n].shape) for n in adapter_names(model)}
    load_adapters(model, initial_adapters(shapes, seed))


@contextlib.contextmanager
def adapters_off(model: nn.Module):
    """The base model alone (the frozen reference policy) for the duration."""
    mods = [m for m in model.modules() if isinstance(m, LoRALinear)]
    for m in mods:
        m.lora_off = True
    try:
        yield model
    finally:
        for m in mods:
            m.lora_off = False


def merge_into(base: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """Full base weights with ``W + scale B A`` for every adapted projection (computed in fp32, cast
    back): what ``rltpu export`` writes as the merged model. Base tensors without adapters pass as is."""
    out = dict(base)
    for name in adapters:
        if not name.endswith(".lora_A.weight"):
            continue
        module = name[: -len(".lora_A.weight")]
        w = base[module + ".weight"]
        a, b = adapters[name].float(), adapters[module + ".lora_B.weight"].float()
        out[module + ".weight"] = (w.float() + scale * (b @ a)).to(w.dtype)
    return out
