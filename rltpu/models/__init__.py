"""One Llama-style decoder written twice: torch (trainer) and JAX (sampler).

Both sides use the Hugging Face ``LlamaForCausalLM`` parameter names and torch ``[out, in]``
shapes, so a single ``dict[str, tensor]`` state dict is the weight-sync wire format.
``param_shapes`` is the one list of names and shapes; it is pure Python so either side can
preallocate buffers without importing the other framework. The framework modules are imported
lazily (``rltpu.models.torch_llama`` / ``rltpu.models.jax_llama``) so a sampler process never
pays for importing torch and a trainer process never imports JAX unless it asks to.
"""

from __future__ import annotations

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
    """HF parameter name -> shape, in state-dict order (``lm_head`` only when untied)."""
    V, H, I = resolve_vocab_size(cfg, vocab_size), cfg.hidden_size, cfg.intermediate_size
    q_dim = cfg.num_attention_heads * cfg.head_dim
    kv_dim = cfg.num_key_value_heads * cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, H)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "self_attn.q_proj.weight"] = (q_dim, H)
        shapes[p + "self_attn.k_proj.weight"] = (kv_dim, H)
        shapes[p + "self_attn.v_proj.weight"] = (kv_dim, H)
        shapes[p + "self_attn.o_proj.weight"] = (H, q_dim)
        shapes[p + "mlp.gate_proj.weight"] = (I, H)
        shapes[p + "mlp.up_proj.weight"] = (I, H)
        shapes[p + "mlp.down_proj.weight"] = (H, I)
        shapes[p + "input_layernorm.weight"] = (H,)
        shapes[p + "post_attention_layernorm.weight"] = (H,)
    shapes["model.norm.weight"] = (H,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, H)
    return shapes


_LAZY = {
    "LlamaForCausalLM": "rltpu.models.torch_llama",
    "LlamaDecoderLayer": "rltpu.models.torch_llama",
    "init_state_dict": "rltpu.models.torch_llama",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rltpu.models' has no attribute {name!r}")


__all__ = ["param_shapes", "resolve_vocab_size", *_LAZY]
