"""Model shapes as the planner counts them, and the probe model the CPU micro-benchmarks run.

Pure arithmetic over a ``ModelConfig``: the cost model and the micro-benchmarks both read it, and
neither imports the other for it. Tensors are counted once, by ``rltpu.models.spec.param_shapes``
(the names and shapes weight sync and checkpoints use, biases and q/k norms included).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from types import SimpleNamespace

from rltpu.config import ModelConfig
from rltpu.models.spec import param_shapes

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}

# The sampler probe: a small Llama through rltpu's own ``SamplerEngine`` at several widths, with
# short prompts and completions (8 + 4 tokens, like the quickstart's bucket), at 64 and 256 rows.
PROBE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
PROBE_VOCAB, PROBE_ROWS, PROBE_PROMPT, PROBE_NEW = 64, 64, 8, 4


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    inter: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    dtype: str
    attention_bias: bool = False  # q/k/v biases (Qwen2)
    attention_out_bias: bool = False  # o_proj bias
    qk_norm: bool = False  # per-head q/k RMSNorm weights (Qwen3)

    @classmethod
    def from_config(cls, m: ModelConfig, vocab: int) -> "ModelShape":
        return cls(m.num_hidden_layers, m.hidden_size, m.intermediate_size, m.num_attention_heads,
                   m.num_key_value_heads, m.head_dim, vocab, m.tie_word_embeddings, m.dtype,
                   m.attention_bias, m.attention_out_bias, m.qk_norm)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's name and shape, in state-dict order (``param_shapes``)."""
        return _shapes(self)

    @property
    def bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """One decoder layer's parameters."""
        return sum(math.prod(s) for n, s in self.shapes().items() if n.startswith("model.layers.0."))

    @property
    def params(self) -> int:
        return sum(self.tensor_numels())

    @property
    def matmul_params(self) -> int:
        """Weights each token multiplies by (2 FLOPs each): every linear layer and the head."""
        linear = sum(math.prod(s) for n, s in self.shapes().items() if n.startswith("model.layers.0.") and len(s) == 2)
        return self.layers * linear + self.vocab * self.hidden

    def tensor_numels(self) -> list[int]:
        """Element counts of every tensor, in state-dict order."""
        return [math.prod(s) for s in self.shapes().values()]

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_dim * self.bytes


@functools.lru_cache(maxsize=32)
def _shapes(m: ModelShape) -> dict[str, tuple[int, ...]]:
    """``param_shapes`` of the sizes ``m`` holds (cached: a large plan asks for every candidate)."""
    cfg = SimpleNamespace(hidden_size=m.hidden, intermediate_size=m.inter, num_hidden_layers=m.layers,
                          num_attention_heads=m.heads, num_key_value_heads=m.kv_heads, head_dim=m.head_dim,
                          tie_word_embeddings=m.tied, attention_bias=m.attention_bias,
                          attention_out_bias=m.attention_out_bias, qk_norm=m.qk_norm, vocab_size=m.vocab)
    return param_shapes(cfg, m.vocab)
