"""The sampler's copy of the Llama decoder: pure JAX functions over the trainer's state dict.

``params`` is ``dict[str, jax.Array]`` keyed by the Hugging Face names with torch ``[out, in]``
layout kept (we compute ``x @ W.T``), so weight sync is a rename-free copy. ``forward`` mirrors
``rltpu.models.torch_llama`` op for op (fp32 norms, RoPE angles, scores and softmax);
``forward_with_cache`` is the same math over a static-shape KV cache for a jitted sampler.
``cfg`` is a frozen (hashable) ``ModelConfig``: pass it as a static argument under ``jit``.
The Qwen2 biases, Qwen3 q/k norms, Llama 3 RoPE scaling and Mistral sliding window are local
switches on ``cfg`` (a layer without them compiles to exactly the plain Llama program).
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
from jax import lax

from rltpu.config import ModelConfig
from rltpu.models.spec import rope_inv_freq

Params = Mapping[str, jax.Array]
_F32 = jnp.float32
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def params_from_torch(state_dict: Mapping[str, Any], dtype: Any = None) -> dict[str, jax.Array]:
    """torch state dict -> JAX params (same keys, same layout), via host numpy.

    bf16 tensors are moved bit-for-bit (numpy has no bf16, so through a uint16 view).
    ``dtype`` optionally casts every array (e.g. ``jnp.bfloat16``).
    """
    import torch

    out: dict[str, jax.Array] = {}
    for name, t in state_dict.items():
        t = t.detach().to("cpu").contiguous()
        if t.dtype == torch.bfloat16:
            arr = t.view(torch.uint16).numpy().view(jnp.bfloat16)
        else:
            arr = t.numpy()
        a = jnp.asarray(arr)
        out[name] = a.astype(dtype) if dtype is not None else a
    return out


def _linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., in] @ w[out, in].T -> [..., out] (torch Linear layout)."""
    return jnp.einsum("...i,oi->...o", x, w)


def _proj(params: Params, module: str, x: jax.Array) -> jax.Array:
    """``module``'s linear; with LoRA adapters in ``params`` (``sampler_apply: lowrank``) plus the
    low-rank term ``(x A^T) B^T``, B already scaled by alpha / rank. Which keys exist is fixed per
    compiled program, so new adapter values never recompile. A packed weight (``pack_params``,
    ``[in, out]``) is used as it is stored."""
    if module + ".weight_t" in params:
        return jnp.einsum("...i,io->...o", x, params[module + ".weight_t"])
    y = _linear(x, params[module + ".weight"])
    a = params.get(module + ".lora_A.weight")
    if a is not None:
        y = y + _linear(_linear(x, a), params[module + ".lora_B.weight"])
    return y


_PACKS = (("self_attn.", ("q_proj", "k_proj", "v_proj"), "qkv_proj"), ("self_attn.", ("o_proj",), "o_proj"),
          ("mlp.", ("gate_proj", "up_proj"), "gate_up_proj"), ("mlp.", ("down_proj",), "down_proj"))


def pack_params(params: Params, cfg: ModelConfig) -> Params:
    """The sampler's layout of the weights. Per layer, q/k/v become one ``qkv_proj`` and gate/up one
    ``gate_up_proj`` (rows in that order, biases likewise), and these and ``o_proj``/``down_proj``
    are stored transposed, ``[in, out]``, as ``<name>.weight_t``.

    Why, measured with XLA:CPU on 2 cores (jax's profiler over the 25M Qwen2 of
    ``benchmarks/sampler.py --vs-vllm``): at 64 rows its dot ran ~95 GFLOP/s on a 512x1536 weight
    and ~175 on a 512x3072 one, so two wide dots beat five narrow ones (+13% tokens/s at 64 rows);
    and a weight already ``[in, out]`` gave 3-10% more tokens/s on 8-64 decode slots than ``x @ W.T``.
    A group with a LoRA adapter on any member (``sampler_apply: lowrank``) keeps the trainer's
    names and layout. Works on arrays and on ``jax.ShapeDtypeStruct`` (the programs' input shapes)."""
    out = dict(params)
    structs = any(isinstance(v, jax.ShapeDtypeStruct) for v in params.values())

    def cat(xs):
        if structs:
            return jax.ShapeDtypeStruct((sum(x.shape[0] for x in xs), *xs[0].shape[1:]), xs[0].dtype)
        return jnp.concatenate([jnp.asarray(x) for x in xs], axis=0) if len(xs) > 1 else jnp.asarray(xs[0])

    def transposed(w):
        return jax.ShapeDtypeStruct(w.shape[::-1], w.dtype) if structs else jnp.asarray(w).T

    for i in range(cfg.num_hidden_layers):
        for sub, members, fused in _PACKS:
            p = f"model.layers.{i}.{sub}"
            names = [p + m for m in members]
            if not all(n + ".weight" in out for n in names) or any(n + ".lora_A.weight" in out for n in names):
                continue
            if all(n + ".bias" in out for n in names):
                out[p + fused + ".bias"] = cat([out.pop(n + ".bias") for n in names])
            out[p + fused + ".weight_t"] = transposed(cat([out.pop(n + ".weight") for n in names]))
    return out


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """x * rsqrt(mean(x^2) + eps) * w, reduced in fp32, result in x's dtype times w."""
    xf = x.astype(_F32)
    xf = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return w * xf.astype(x.dtype)


def rope_cos_sin(positions: jax.Array, head_dim: int, theta: float, dtype: Any,
                 scaling: Any = None) -> tuple[jax.Array, jax.Array]:
    """cos/sin [B, T, hd] for HF "rotate_half" RoPE; angles in fp32 (``rope_inv_freq``, shared with torch)."""
    inv_freq = jnp.asarray(rope_inv_freq(head_dim, theta, scaling))
    freqs = positions.astype(_F32)[:, :, None] * inv_freq[None, None, :]  # [B, T, hd/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # [B, T, hd]
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def rotate_half(x: jax.Array) -> jax.Array:
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-x2, x1], axis=-1)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, T, heads, hd]; cos/sin [B, T, hd]."""
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # [B, T, 1, hd]
    return x * cos + rotate_half(x) * sin


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array) -> jax.Array:
    """GQA. q [B, T, nh, hd]; k, v [B, S, nkv, hd]; allowed [B, T, S] -> [B, T, nh*hd]."""
    B, T, nh, hd = q.shape
    nkv = k.shape[2]
    rep = nh // nkv
    q = q.reshape(B, T, nkv, rep, hd)  # q head h = g*rep + r uses kv head g (= torch repeat_interleave)
    scores = jnp.einsum("btgrd,bsgd->bgrts", q.astype(_F32), k.astype(_F32)) * hd**-0.5  # [B, nkv, rep, T, S]
    scores = jnp.where(allowed[:, None, None], scores, jnp.finfo(_F32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bgrts,bsgd->btgrd", probs, v)  # [B, T, nkv, rep, hd]
    return out.reshape(B, T, nh * hd)


def _qkv(params: Params, cfg: ModelConfig, i: int, h: jax.Array, cos: jax.Array, sin: jax.Array):
    """Projected q [B, T, nh, hd] and k, v [B, T, nkv, hd] for layer i, RoPE applied to q and k
    (after the per-head q/k RMSNorm when ``cfg.qk_norm``)."""
    p = f"model.layers.{i}.self_attn."
    B, T, _ = h.shape
    hd = cfg.head_dim

    def proj(name: str, heads: int) -> jax.Array:
        y = _proj(params, p + name, h)
        if cfg.attention_bias:
            y = y + params[p + name + ".bias"]
        return y.reshape(B, T, heads, hd)

    if p + "qkv_proj.weight_t" in params:  # packed (``pack_params``)
        nq, nkv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
        y = proj("qkv_proj", (nq + 2 * nkv) // hd)
        q, k, v = y[:, :, :nq // hd], y[:, :, nq // hd:(nq + nkv) // hd], y[:, :, (nq + nkv) // hd:]
    else:
        q, k, v = proj("q_proj", cfg.num_attention_heads), proj("k_proj", cfg.num_key_value_heads), \
            proj("v_proj", cfg.num_key_value_heads)
    if cfg.qk_norm:
        q = rms_norm(q, params[p + "q_norm.weight"], cfg.rms_norm_eps)
        k = rms_norm(k, params[p + "k_norm.weight"], cfg.rms_norm_eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def _out_proj(params: Params, cfg: ModelConfig, i: int, att: jax.Array) -> jax.Array:
    p = f"model.layers.{i}.self_attn.o_proj."
    y = _proj(params, p[:-1], att)
    return y + params[p + "bias"] if cfg.attention_out_bias else y


def _mlp_block(params: Params, cfg: ModelConfig, i: int, x: jax.Array) -> jax.Array:
    p = f"model.layers.{i}."
    h = rms_norm(x, params[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
    if p + "mlp.gate_up_proj.weight_t" in params:  # packed (``pack_params``)
        gate, up = jnp.split(_proj(params, p + "mlp.gate_up_proj", h), 2, axis=-1)
    else:
        gate = _proj(params, p + "mlp.gate_proj", h)
        up = _proj(params, p + "mlp.up_proj", h)
    return x + _proj(params, p + "mlp.down_proj", jax.nn.silu(gate) * up)


def _logits(params: Params, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    x = rms_norm(x, params["model.norm.weight"], cfg.rms_norm_eps)
    if cfg.tie_word_embeddings:
        return _linear(x, params["model.embed_tokens.weight"]).astype(_F32)
    return _proj(params, "lm_head", x).astype(_F32)  # with a LoRA adapter on the head (lowrank): its term too


def forward(
    params: Params, cfg: ModelConfig, input_ids: jax.Array, position_ids: jax.Array, attention_mask: jax.Array
) -> jax.Array:
    """[B, T] ids/positions/mask (1 real, 0 pad) -> fp32 logits [B, T, V]; no cache."""
    T = input_ids.shape[1]
    x = params["model.embed_tokens.weight"][input_ids]  # [B, T, H]
    cos, sin = rope_cos_sin(position_ids, cfg.head_dim, cfg.rope_theta, x.dtype, cfg.rope_scaling)
    idx = jnp.arange(T)
    causal = idx[None, :] <= idx[:, None]  # [T(query), T(key)]
    allowed = causal[None] & attention_mask.astype(bool)[:, None, :]  # [B, T, T]
    eye = jnp.eye(T, dtype=bool)[None]
    for i in range(cfg.num_hidden_layers):
        w = cfg.layer_window(i)  # sliding window: keys fewer than w positions back
        ok = allowed if w is None else allowed & ((position_ids[:, :, None] - position_ids[:, None, :]) < w)
        h = rms_norm(x, params[f"model.layers.{i}.input_layernorm.weight"], cfg.rms_norm_eps)
        q, k, v = _qkv(params, cfg, i, h, cos, sin)
        x = x + _out_proj(params, cfg, i, _attend(q, k, v, ok | eye))
        x = _mlp_block(params, cfg, i, x)
    return _logits(params, cfg, x)


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype: Any = None) -> dict[str, tuple[jax.Array, ...]]:
    """Zeroed KV cache: ``k`` is a tuple of one ``[B, n_kv_heads, head_dim, S]`` array per layer,
    ``v`` one ``[B, n_kv_heads, S, head_dim]`` array per layer.

    Why this layout: per-layer arrays are updated in place inside a ``while_loop`` (a slice of one
    stacked ``[L, ...]`` array is a copy); kv-major makes one-token decode attention two batched
    dots over (B, kv) (3-4x faster on XLA:CPU than the ``[B, S, kv, hd]`` einsum); and K stored
    transposed makes the score dot ``q @ K^T`` read K in its natural order (XLA:CPU ran it 1.5-2.5x
    slower with ``head_dim`` minor, repacking K every step). ``dtype`` defaults to ``cfg.dtype``.
    """
    dtype = _DTYPES[cfg.dtype] if dtype is None else dtype
    kv, hd = cfg.num_key_value_heads, cfg.head_dim
    return {"k": tuple(jnp.zeros((batch, kv, hd, max_len), dtype) for _ in range(cfg.num_hidden_layers)),
            "v": tuple(jnp.zeros((batch, kv, max_len, hd), dtype) for _ in range(cfg.num_hidden_layers))}


def _attend_one(q: jax.Array, kt: jax.Array, v: jax.Array, allowed: jax.Array) -> jax.Array:
    """One-token GQA decode. q [B, 1, nh, hd]; kt [B, nkv, hd, S]; v [B, nkv, S, hd]; allowed [B, S]
    -> [B, 1, nh*hd]. Same math as ``_attend`` (fp32 scores and softmax) written as batched dots over (B, kv).
    """
    B, _, nh, hd = q.shape
    nkv = kt.shape[1]
    qg = q.reshape(B, nkv, nh // nkv, hd).astype(_F32)
    scores = jnp.einsum("bgrd,bgds->bgrs", qg, kt.astype(_F32)) * hd**-0.5  # [B, nkv, rep, S]
    scores = jnp.where(allowed[:, None, None, :], scores, jnp.finfo(_F32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bgrs,bgsd->bgrd", probs, v).reshape(B, 1, nh * hd)


def forward_with_cache(
    params: Params,
    cfg: ModelConfig,
    input_ids: jax.Array,
    positions: jax.Array,
    cache: dict[str, tuple[jax.Array, ...]],
    cache_index: jax.Array | int,
    kv_mask: jax.Array,
) -> tuple[jax.Array, dict[str, tuple[jax.Array, ...]]]:
    """Run T new tokens against the cache; returns (fp32 logits [B, T, V], updated cache).

    The new tokens' K (after RoPE) and V go to slots ``cache_index .. cache_index+T-1``; the
    query in slot ``cache_index+t`` sees slots ``s <= cache_index+t`` with ``kv_mask[b, s]``
    (plus its own slot, so pad queries stay finite). Shapes are static; ``cache_index`` may be
    traced. Slots must not run past S (``dynamic_update_slice`` would clamp the start).
    A sliding-window layer also hides slots ``s <= q_slot - W``: slots stand in for positions,
    which holds because a row's real tokens occupy consecutive slots (left-padded prompt, then
    one slot per new token).
    """
    T = input_ids.shape[1]
    S = cache["v"][0].shape[2]
    ci = jnp.asarray(cache_index, jnp.int32)
    zero = jnp.zeros((), jnp.int32)
    x = params["model.embed_tokens.weight"][input_ids]  # [B, T, H]
    cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, x.dtype, cfg.rope_scaling)
    q_slot = ci + jnp.arange(T, dtype=jnp.int32)  # [T]
    s = jnp.arange(S, dtype=jnp.int32)
    allowed = (s[None, :] <= q_slot[:, None])[None] & kv_mask.astype(bool)[:, None, :]  # [B, T, S]
    own = (s[None, :] == q_slot[:, None])[None]
    masks = {None: allowed | own}
    ks, vs = list(cache["k"]), list(cache["v"])
    for i in range(cfg.num_hidden_layers):
        w = cfg.layer_window(i)
        if w not in masks:
            masks[w] = (allowed & (s[None, :] > q_slot[:, None] - w)[None]) | own
        allowed_i = masks[w]
        h = rms_norm(x, params[f"model.layers.{i}.input_layernorm.weight"], cfg.rms_norm_eps)
        q, k, v = _qkv(params, cfg, i, h, cos, sin)  # k, v [B, T, nkv, hd]
        ks[i] = lax.dynamic_update_slice(ks[i], k.transpose(0, 2, 3, 1).astype(ks[i].dtype),
                                         (zero, zero, zero, ci))  # [B, nkv, hd, S]
        vs[i] = lax.dynamic_update_slice(vs[i], jnp.swapaxes(v, 1, 2).astype(vs[i].dtype),
                                         (zero, zero, ci, zero))  # [B, nkv, S, hd]
        ki, vi = ks[i].astype(x.dtype), vs[i].astype(x.dtype)
        if T == 1:
            att = _attend_one(q, ki, vi, allowed_i[:, 0])
        else:
            att = _attend(q, ki.transpose(0, 3, 1, 2), jnp.swapaxes(vi, 1, 2), allowed_i)
        x = x + _out_proj(params, cfg, i, att)
        x = _mlp_block(params, cfg, i, x)
    return _logits(params, cfg, x), {"k": tuple(ks), "v": tuple(vs)}
