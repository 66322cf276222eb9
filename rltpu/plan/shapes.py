"""Model shapes as the planner counts them, and the probe model the CPU micro-benchmarks run.

Pure arithmetic over a ``ModelConfig``: the cost model and the micro-benchmarks both read it, and
neither imports the other for it.
"""

from __future__ import annotations

from dataclasses import dataclass

from rltpu.config import ModelConfig

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

    @classmethod
    def from_config(cls, m: ModelConfig, vocab: int) -> "ModelShape":
        return cls(m.num_hidden_layers, m.hidden_size, m.intermediate_size, m.num_attention_heads,
                   m.num_key_value_heads, m.head_dim, vocab, m.tie_word_embeddings, m.dtype)

    @property
    def bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        H, q = self.hidden, self.heads * self.head_dim
        return H * q * 2 + H * self.kv_dim * 2 + 3 * H * self.inter + 2 * H

    @property
    def params(self) -> int:
        """Same count as ``rltpu.models.param_shapes`` (embedding, layers, final norm, untied head)."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.layers * self.layer_params + self.hidden

    @property
    def matmul_params(self) -> int:
        """Weights each token multiplies by (2 FLOPs each): every linear layer and the head."""
        return self.layers * (self.layer_params - 2 * self.hidden) + self.vocab * self.hidden

    def tensor_numels(self) -> list[int]:
        """Element counts of every tensor, in ``rltpu.models.param_shapes`` order."""
        H, q = self.hidden, self.heads * self.head_dim
        layer = [q * H, self.kv_dim * H, self.kv_dim * H, H * q, self.inter * H, self.inter * H, H * self.inter, H, H]
        return [self.vocab * H, *layer * self.layers, H, *([] if self.tied else [self.vocab * H])]

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_dim * self.bytes
