"""The trainer's policy: a Llama-family decoder in plain torch with Hugging Face parameter names.

One module covers Llama (incl. Llama 3 RoPE scaling), Qwen2 (q/k/v bias), Qwen3 (per-head q/k
RMSNorm, explicit head_dim) and Mistral (sliding window), switched by ``ModelConfig`` fields.

Kept free of caches and fused kernels so FSDP2 can wrap each ``LlamaDecoderLayer`` and the
numbers match ``rltpu.models.jax_llama`` (the sampler) to fp32 rounding. Norms, RoPE angles
and the softmax run in fp32 whatever the parameter dtype; logits are returned as fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rltpu.config import ModelConfig
from rltpu.models.spec import param_shapes, resolve_vocab_size, rope_inv_freq

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * w, reduced in fp32 (HF ``LlamaRMSNorm``)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(
    position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype, scaling=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [B, T, hd] for HF "rotate_half" RoPE; angles computed in fp32 (``rope_inv_freq``)."""
    inv_freq = torch.from_numpy(rope_inv_freq(head_dim, theta, scaling)).to(position_ids.device)
    freqs = position_ids.float()[:, :, None] * inv_freq[None, None, :]  # [B, T, hd/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [B, T, hd]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, hd]; cos/sin [B, T, hd]."""
    cos, sin = cos[:, None], sin[:, None]  # [B, 1, T, hd]
    return x * cos + rotate_half(x) * sin


def attention_allowed(attention_mask: torch.Tensor, position_ids: torch.Tensor | None = None,
                      window: int | None = None) -> torch.Tensor:
    """[B, 1, T, T] bool: causal AND key is real, OR the diagonal (so pad rows stay finite).

    ``attention_mask`` may hold segment ids instead of 1s (several sequences packed into one row,
    ``learner.microbatch.pack_batch``): a real query then sees only the keys of its own segment. A
    0/1 mask is one segment, so this is the plain rule. With ``window`` a query also sees only keys
    fewer than ``window`` positions back (HF's sliding window: ``q - k < window``), measured in
    ``position_ids``.
    """
    T = attention_mask.shape[1]
    idx = torch.arange(T, device=attention_mask.device)
    causal = idx[None, :] <= idx[:, None]  # [T(query), T(key)]
    allowed = causal[None] & attention_mask.bool()[:, None, :]  # [B, T, T]
    q = attention_mask[:, :, None]  # packed rows: a real query's keys are its own segment's (pad queries: as before)
    allowed = allowed & ((attention_mask[:, None, :] == q) | (q == 0))
    if window is not None:
        allowed = allowed & ((position_ids[:, :, None] - position_ids[:, None, :]) < window)
    allowed = allowed | torch.eye(T, dtype=torch.bool, device=attention_mask.device)[None]
    return allowed[:, None]


class LlamaAttention(nn.Module):
    """Grouped-query attention; scores and softmax in fp32."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        H = cfg.hidden_size
        self.q_proj = nn.Linear(H, self.n_heads * self.head_dim, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(H, self.n_kv * self.head_dim, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(H, self.n_kv * self.head_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, H, bias=cfg.attention_out_bias)
        if cfg.qk_norm:  # Qwen3: RMSNorm over each head's vector, before RoPE
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        hd = self.head_dim
        q = self.q_proj(x).view(B, T, self.n_heads, hd)
        k = self.k_proj(x).view(B, T, self.n_kv, hd)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, nh, T, hd], [B, nkv, T, hd]
        v = self.v_proj(x).view(B, T, self.n_kv, hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if q.dtype == torch.float32:
            # fused: q head h uses kv head h // (nh / nkv) without repeated copies, softmax in fp32,
            # the [B, nh, T, T] scores never kept for backward (2-3x less time than the three ops below)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=self.n_heads != self.n_kv)
        else:  # bf16: scores and softmax in fp32 as the sampler computes them
            rep = self.n_heads // self.n_kv
            k = k.repeat_interleave(rep, dim=1)  # [B, nh, T, hd]; q head h uses kv head h // rep
            v = v.repeat_interleave(rep, dim=1)
            scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * hd**-0.5  # [B, nh, T, T]
            scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
            probs = torch.softmax(scores, dim=-1).to(v.dtype)
            out = torch.matmul(probs, v)  # [B, nh, T, hd]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.n_heads * hd))


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        H, I = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    """One pre-norm block; the unit FSDP2 shards (``fully_shard`` per layer)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # definition order = HF state-dict order (self_attn, mlp, input_ln, post_attention_ln)
        self.self_attn = LlamaAttention(cfg)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, allowed)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, vocab_size: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Causal LM with HF names; ``lm_head`` exists only when embeddings are untied."""

    def __init__(self, cfg: ModelConfig, vocab_size: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.vocab_size = resolve_vocab_size(cfg, vocab_size)
        self.model = LlamaModel(cfg, self.vocab_size)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, self.vocab_size, bias=False)
        self.to(_DTYPES[cfg.dtype])

    def output_weight(self):
        """The LM head for ``head_logits``: its ``[V, H]`` weight, or, while a LoRA adapter on ``lm_head``
        is on, ``(W, A, B, scale)``: the chunked logprob path then forms ``x W^T + scale (x A^T) B^T`` a
        chunk at a time instead of a merged ``[V, H]`` copy (the adapter's dropout does not apply here)."""
        if self.cfg.tie_word_embeddings:
            return self.model.embed_tokens.weight
        h = self.lm_head
        if getattr(h, "lora_A", None) is not None and not h.lora_off:
            return h.weight, h.lora_A.weight, h.lora_B.weight, h.lora_scale
        return h.weight

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Reset every parameter to ``init_state_dict(cfg, V, seed)`` (same values as the sampler's)."""
        sd = init_state_dict(self.cfg, self.vocab_size, seed)
        for name, p in self.named_parameters():
            p.copy_(sd[name].to(device=p.device, dtype=p.dtype))

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        head=None,
    ):
        """input_ids/position_ids/attention_mask [B, T] (mask: 1 real, 0 pad) -> fp32 logits [B, T, V].

        ``head(hidden [B, T, H], output_weight())``, when given, replaces the LM head and its result
        is returned: the trainer computes logprobs chunk by chunk there (``learner.losses``) without the
        full logits. It runs inside ``forward`` so FSDP2's hooks see the (unsharded) head weight."""
        hidden = self.hidden_states(input_ids, position_ids, attention_mask)
        if head is not None:
            return head(hidden, self.output_weight())
        return head_logits(hidden, self.output_weight()).float()

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The final-norm hidden states [B, T, H] (what the LM head, or a value head, reads)."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if position_ids is None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        x = self.model.embed_tokens(input_ids)  # [B, T, H]
        cos, sin = rope_cos_sin(position_ids, self.cfg.head_dim, self.cfg.rope_theta, x.dtype, self.cfg.rope_scaling)
        masks = {}  # one mask per distinct window (None = full causal)
        for i, layer in enumerate(self.model.layers):
            w = self.cfg.layer_window(i)
            if w not in masks:
                masks[w] = attention_allowed(attention_mask, position_ids, w)
            x = layer(x, cos, sin, masks[w])
        return self.model.norm(x)


def head_logits(x: torch.Tensor, weight) -> torch.Tensor:
    """``x [..., H]`` through the LM head ``weight`` (see ``LlamaForCausalLM.output_weight``)."""
    if isinstance(weight, tuple):
        w, a, b, scale = weight
        return F.linear(x, w) + F.linear(F.linear(x, a), b) * scale
    return F.linear(x, weight)


def init_state_dict(cfg: ModelConfig, vocab_size: int | None = None, seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic initial weights on CPU: N(0, init_std) for matrices, ones for norms, zero biases.

    Drawn in fp32 from one generator in ``param_shapes`` order, then cast to ``cfg.dtype``,
    so fp32 and bf16 runs with the same seed start from the same (rounded) values.
    """
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in param_shapes(cfg, vocab_size).items():
        if name.endswith(".bias"):
            t = torch.zeros(shape)
        elif len(shape) == 1:
            t = torch.ones(shape)
        else:
            t = torch.empty(shape).normal_(0.0, cfg.init_std, generator=gen)
        out[name] = t.to(_DTYPES[cfg.dtype])
    return out
