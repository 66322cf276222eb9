"""``trainer.model_impl: hf``: the policy, reference and critic as ``transformers`` builds them.

Why: the native decoder (``rltpu.models.torch_llama``) covers the Llama family only; transformers'
modeling code covers whatever architecture it ships (Gemma 3, Qwen3-MoE...) the day it ships it.

``load_causal_lm`` reads ``model.path`` with ``AutoModelForCausalLM.from_pretrained`` (its own
config.json, so any architecture) and gives the instance the native policy's call signature by a
class swap (``RltpuHF<Class>``, built once per class): ``model(tokens, position_ids, attention_mask,
head=...)`` runs the decoder body (``model.model``) and hands the final hidden states and the LM
head's weight to ``head`` (the trainer's chunked logprobs), or returns fp32 logits. Parameter
names stay transformers' own (what its ``state_dict`` holds), so checkpoints, LoRA
(``learner.lora``: adapters on the ``nn.Linear`` projections) and weight sync address them by name.

Micro-batches for these models are padded rows (the trainer never packs them): transformers builds
its own causal + padding (+ sliding-window) masks from the 0/1 ``attention_mask``, and the
segment-id masks of packed lines are the native decoder's. Position ids are passed as the sampler
counted them. FSDP2: ``fully_shard`` per decoder layer (the classes the model names in
``_no_split_modules``), then the root; a 1-rank group is not wrapped (as for the native model).
Each rank reads the whole checkpoint before sharding (fine at the sizes tested here; the native
path streams each rank's block instead). No tensor parallelism (a config error).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_SWAPPED: dict[type, type] = {}


class _PolicyCalls:
    """Mixed into transformers' ``*ForCausalLM`` class: the native policy's ``forward``."""

    def forward(self, input_ids, position_ids=None, attention_mask=None, head=None):  # noqa: D401
        """[B, T] ids (+ positions, 0/1 mask) -> fp32 logits [B, T, V], or ``head(hidden, weight)``."""
        hidden = self.hidden_states(input_ids, position_ids, attention_mask)
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap:  # Gemma 2 style: logits = cap * tanh(logits / cap); the head gets whole logits
            logits = head_logits(hidden, self.output_weight()).float()
            logits = torch.tanh(logits / cap) * cap
            return head(logits, None) if head is not None else logits
        if head is not None:
            return head(hidden, self.output_weight())
        return head_logits(hidden, self.output_weight()).float()

    def hidden_states(self, input_ids, position_ids=None, attention_mask=None) -> torch.Tensor:
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if position_ids is None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=(attention_mask != 0).long(),
                         use_cache=False)
        return out.last_hidden_state  # [B, T, H], after the final norm

    def output_weight(self):
        """The LM head's ``[V, H]`` weight, or with a LoRA adapter on it ``(W, A, B, scale)``
        (``rltpu.models.torch_llama.head_logits`` reads both)."""
        h = self.get_output_embeddings()
        if getattr(h, "lora_A", None) is not None and not h.lora_off:
            return h.weight, h.lora_A.weight, h.lora_B.weight, h.lora_scale
        return h.weight


def head_logits(x, weight):
    from rltpu.models.torch_llama import head_logits as native

    return native(x, weight)


def _as_policy(model: nn.Module) -> nn.Module:
    cls = type(model)
    if cls not in _SWAPPED:
        _SWAPPED[cls] = type(f"RltpuHF{cls.__name__}", (_PolicyCalls, cls), {})
    model.__class__ = _SWAPPED[cls]
    return model


def _transformers():
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        import transformers
    except ImportError:
        raise RuntimeError("trainer.model_impl=hf needs transformers: pip install 'rltpu[hf]'") from None
    return transformers


def load_causal_lm(model_cfg, device: str = "cpu") -> nn.Module:
    """``model.path`` through ``AutoModelForCausalLM`` in ``model.dtype``, with the policy's calls."""
    T = _transformers()
    model = T.AutoModelForCausalLM.from_pretrained(model_cfg.path, dtype=_DTYPES[model_cfg.dtype],
                                                   attn_implementation="sdpa")
    model.config.use_cache = False
    return _as_policy(model).to(device).train()


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder blocks: modules of the classes it lists in ``_no_split_modules``."""
    kinds = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in kinds]
    if not layers:
        raise ValueError(f"{type(model).__name__} names no decoder layer class (_no_split_modules); "
                         f"use trainer.model_impl=native for it")
    return layers


def parallelize_hf(model: nn.Module, mesh, mixed_precision: str = "fp32", activation_checkpointing: bool = False):
    """AC (transformers' own gradient checkpointing), then ``fully_shard`` per decoder layer and the root."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if activation_checkpointing:
        checkpoint_hf(model)
    if mesh.ndim != 1:
        raise ValueError("trainer.model_impl=hf has no tensor parallelism; set placement.chips_per_trainer=1")
    kw = {"mesh": mesh}
    if mixed_precision == "bf16":
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in decoder_layers(model):
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model


def checkpoint_hf(model: nn.Module) -> None:
    """Recompute each decoder layer in backward (non-reentrant), through transformers' switch."""
    body = getattr(model, "model", model)
    (body if hasattr(body, "gradient_checkpointing_enable") else model).gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": False})


class HFValue(nn.Module):
    """PPO's critic on a transformers body: ``model.*`` (the decoder, from ``model.path``) +
    ``score.weight`` at zero, like ``learner.critic.LlamaForValue``."""

    def __init__(self, causal_lm: nn.Module):
        super().__init__()
        self.model = causal_lm.model
        self._no_split_modules = getattr(causal_lm, "_no_split_modules", None)
        hidden = causal_lm.get_input_embeddings().weight
        self.score = nn.Linear(hidden.shape[1], 1, bias=False, dtype=hidden.dtype, device=hidden.device)
        nn.init.zeros_(self.score.weight)

    def forward(self, input_ids, position_ids=None, attention_mask=None) -> torch.Tensor:
        """[B, T] -> fp32 values [B, T]: the value of the state after token t."""
        hidden = _PolicyCalls.hidden_states(self, input_ids, position_ids, attention_mask)
        return F.linear(hidden, self.score.weight).squeeze(-1).float()


def load_value_model(model_cfg, device: str = "cpu") -> HFValue:
    critic = HFValue(load_causal_lm(model_cfg, device))
    return critic.train()

