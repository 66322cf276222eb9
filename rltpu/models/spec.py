"""What the torch (trainer) and JAX (sampler) decoders share: parameter names, shapes, RoPE.

Both sides use the Hugging Face ``LlamaForCausalLM`` parameter names and torch ``[out, in]``
shapes, so a single ``dict[str, tensor]`` state dict is the weight-sync wire format.
``param_shapes`` is the one list of names and shapes; it is pure Python so either side can
preallocate buffers without importing the other framework. Nothing here imports torch or JAX, so
a sampler process never pays for importing torch and a trainer process never imports JAX.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rltpu.config import ModelConfig


def resolve_vocab_size(cfg: "ModelConfig", vocab_size: int | None) -> int:
    """The vocab size passed in, else ``cfg.vocab_size``; one of them must be set."""
    v = vocab_size if vocab_size is not None else cfg.vocab_size
    if v is None or v < 1:
        raise ValueError("vocab_size is unknown: pass it (from the tokenizer) or set model.vocab_size")
    return int(v)


def param_shapes(cfg: "ModelConfig", vocab_size: int | None = None) -> dict[str, tuple[int, ...]]:
    """HF parameter name -> shape, in state-dict order (``lm_head`` only when untied).

    Biases (``attention_bias`` / ``attention_out_bias``) and per-head q/k norms (``qk_norm``)
    appear where Hugging Face puts them, so weight sync and checkpoint loading carry them.
    """
    V, H, I = resolve_vocab_size(cfg, vocab_size), cfg.hidden_size, cfg.intermediate_size
    hd = cfg.head_dim
    q_dim = cfg.num_attention_heads * hd
    kv_dim = cfg.num_key_value_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, H)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for proj, out in (("q_proj", q_dim), ("k_proj", kv_dim), ("v_proj", kv_dim)):
            shapes[p + f"self_attn.{proj}.weight"] = (out, H)
            if cfg.attention_bias:
                shapes[p + f"self_attn.{proj}.bias"] = (out,)
        shapes[p + "self_attn.o_proj.weight"] = (H, q_dim)
        if cfg.attention_out_bias:
            shapes[p + "self_attn.o_proj.bias"] = (H,)
        if cfg.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
        shapes[p + "mlp.gate_proj.weight"] = (I, H)
        shapes[p + "mlp.up_proj.weight"] = (I, H)
        shapes[p + "mlp.down_proj.weight"] = (H, I)
        shapes[p + "input_layernorm.weight"] = (H,)
        shapes[p + "post_attention_layernorm.weight"] = (H,)
    shapes["model.norm.weight"] = (H,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, H)
    return shapes


LORA_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


def is_adapter(name: str) -> bool:
    """A LoRA adapter tensor (``<module>.lora_A.weight`` / ``.lora_B.weight``), not a base weight."""
    return name.endswith(LORA_SUFFIXES)


def lora_shapes(cfg: "ModelConfig", lora: Any, vocab_size: int | None = None,
                base: dict[str, tuple[int, ...]] | None = None) -> dict[str, tuple[int, ...]]:
    """Adapter name -> shape for ``lora`` (a ``LoraConfig``): per targeted projection ``W [out, in]``,
    ``lora_A [rank, in]`` and ``lora_B [out, rank]`` (PEFT's names and layout), in state-dict order.
    ``lm_head`` counts only where the model has one (untied embeddings). ``base``: the model's own
    name -> shape (a transformers model of another family), else ``param_shapes``."""
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in (base if base is not None else param_shapes(cfg, vocab_size)).items():
        if not (name.startswith("model.layers.") or name == "lm_head.weight"):
            continue
        if not name.endswith(".weight") or len(shape) != 2:
            continue
        module = name[: -len(".weight")]
        if module.rsplit(".", 1)[-1] in lora.target_modules:
            out[module + ".lora_A.weight"] = (lora.rank, shape[1])
            out[module + ".lora_B.weight"] = (shape[0], lora.rank)
    return out


@functools.lru_cache(maxsize=64)
def rope_inv_freq(head_dim: int, theta: float, scaling: Any = None):
    """RoPE inverse frequencies [head_dim / 2] as float32 numpy, with ``scaling`` (a ``RopeScaling``).

    One function for both engines so the trainer and the sampler rotate by identical angles.
    ``linear`` divides every frequency by ``factor``; ``llama3`` divides the low frequencies
    (wavelength > original_len / low_freq_factor) by ``factor``, keeps the high ones
    (wavelength < original_len / high_freq_factor) and interpolates smoothly in between.
    Cached per arguments: treat the returned array as read-only.
    """
    import numpy as np

    f32 = np.float32
    inv = (f32(1.0) / (f32(theta) ** (np.arange(0, head_dim, 2, dtype=f32) / f32(head_dim)))).astype(f32)
    if scaling is None:
        return inv
    factor = f32(scaling.factor)
    if scaling.rope_type == "linear":
        return (inv / factor).astype(f32)
    old_len = f32(scaling.original_max_position_embeddings)
    low, high = f32(scaling.low_freq_factor), f32(scaling.high_freq_factor)
    wavelen = (f32(2 * np.pi) / inv).astype(f32)
    scaled = np.where(wavelen > old_len / low, inv / factor, inv).astype(f32)
    smooth = ((old_len / wavelen - low) / (high - low)).astype(f32)
    smoothed = ((f32(1) - smooth) * scaled / factor + smooth * scaled).astype(f32)
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return np.where(medium, smoothed, scaled).astype(f32)


__all__ = ["is_adapter", "lora_shapes", "param_shapes", "resolve_vocab_size", "rope_inv_freq"]
