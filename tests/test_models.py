"""The torch and JAX Llama decoders agree with each other and with a plain numpy reference.

The numpy reference (fp64, loops over rows and heads, explicit per-head kv lookup) is written
independently of both models, so a shared mistake in torch and JAX still fails here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from rltpu.config import ModelConfig
from rltpu.models import jax_llama
from rltpu.models.spec import param_shapes
from rltpu.models.torch_llama import LlamaForCausalLM, RMSNorm, init_state_dict

jax.config.update("jax_default_matmul_precision", "highest")
torch.set_float32_matmul_precision("highest")

V = 17
TOL = 1e-4
jforward = jax.jit(jax_llama.forward, static_argnums=1)  # eager JAX dispatch is slow on CPU
jstep = jax.jit(jax_llama.forward_with_cache, static_argnums=1)


def small_cfg(tied: bool, dtype: str = "float32") -> ModelConfig:
    # init_std 0.2 (not 0.02) so attention and MLP move the logits well above the tolerance
    return ModelConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=10000.0,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        dtype=dtype,
        init_std=0.2,
    )


def left_padded(lengths: list[int], T: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ids, mask, positions [B, T]; pads (id 0) at the start, positions = cumsum(mask)-1 clipped at 0."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, V, size=(len(lengths), T))
    mask = np.zeros((len(lengths), T), np.int64)
    for b, n in enumerate(lengths):
        mask[b, T - n :] = 1
    ids = ids * mask
    pos = np.clip(np.cumsum(mask, -1) - 1, 0, None)
    return ids, mask, pos


def model_and_params(tied: bool, dtype: str = "float32", seed: int = 0):
    cfg = small_cfg(tied, dtype)
    model = LlamaForCausalLM(cfg, V)
    model.init_weights(seed)
    return cfg, model, jax_llama.params_from_torch(model.state_dict())


def torch_logits(model, ids, pos, mask) -> np.ndarray:
    with torch.no_grad():
        out = model(torch.as_tensor(ids), torch.as_tensor(pos), torch.as_tensor(mask))
    assert out.dtype == torch.float32
    return out.numpy()


# ---------------------------------------------------------------------------------------------
# independent numpy reference (fp64)


def np_rmsnorm(x, w, eps):
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * w


def np_rope(x, pos, theta):
    """x [T, hd] at integer positions pos [T]: rotate pairs (j, j + hd/2) by pos * theta^(-2j/hd)."""
    hd = x.shape[-1]
    out = np.empty_like(x)
    for t in range(x.shape[0]):
        for j in range(hd // 2):
            a = pos[t] * theta ** (-2.0 * j / hd)
            x1, x2 = x[t, j], x[t, j + hd // 2]
            out[t, j] = x1 * np.cos(a) - x2 * np.sin(a)
            out[t, j + hd // 2] = x2 * np.cos(a) + x1 * np.sin(a)
    return out


def np_forward(sd: dict[str, np.ndarray], cfg: ModelConfig, ids, pos, mask) -> np.ndarray:
    nh, nkv, hd, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
    out = []
    for b in range(ids.shape[0]):
        T = ids.shape[1]
        x = sd["model.embed_tokens.weight"][ids[b]]
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            h = np_rmsnorm(x, sd[p + "input_layernorm.weight"], eps)
            q = h @ sd[p + "self_attn.q_proj.weight"].T
            k = h @ sd[p + "self_attn.k_proj.weight"].T
            v = h @ sd[p + "self_attn.v_proj.weight"].T
            heads = []
            for head in range(nh):
                g = head // (nh // nkv)
                qh = np_rope(q[:, head * hd : (head + 1) * hd], pos[b], cfg.rope_theta)
                kh = np_rope(k[:, g * hd : (g + 1) * hd], pos[b], cfg.rope_theta)
                vh = v[:, g * hd : (g + 1) * hd]
                o = np.zeros((T, hd))
                for t in range(T):
                    keys = [s for s in range(t + 1) if mask[b, s] or s == t]
                    sc = np.array([qh[t] @ kh[s] for s in keys]) / np.sqrt(hd)
                    wts = np.exp(sc - sc.max())
                    o[t] = (wts / wts.sum()) @ vh[keys]
                heads.append(o)
            x = x + np.concatenate(heads, -1) @ sd[p + "self_attn.o_proj.weight"].T
            h = np_rmsnorm(x, sd[p + "post_attention_layernorm.weight"], eps)
            gate, up = h @ sd[p + "mlp.gate_proj.weight"].T, h @ sd[p + "mlp.up_proj.weight"].T
            x = x + (gate / (1 + np.exp(-gate)) * up) @ sd[p + "mlp.down_proj.weight"].T
        x = np_rmsnorm(x, sd["model.norm.weight"], eps)
        head_w = sd["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]
        out.append(x @ head_w.T)
    return np.stack(out)


# ---------------------------------------------------------------------------------------------


def test_rmsnorm_by_hand():
    x = [3.0, -4.0]  # mean(x^2) = 12.5
    w = [2.0, 0.5]
    want = np.array([3.0 * 2.0, -4.0 * 0.5]) / np.sqrt(12.5 + 1e-5)
    norm = RMSNorm(2, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.tensor(w))
        got_t = norm(torch.tensor([x])).numpy()[0]
    got_j = np.asarray(jax_llama.rms_norm(jnp.array(x), jnp.array(w), 1e-5))
    np.testing.assert_allclose(got_t, want, rtol=1e-6)
    np.testing.assert_allclose(got_j, want, rtol=1e-6)


def test_rope_by_hand():
    # hd=2: one pair rotated by angle = position (inv_freq = 1); [1, 0] at position 1 -> [cos 1, sin 1]
    cos, sin = jax_llama.rope_cos_sin(jnp.array([[1]]), 2, 10000.0, jnp.float32)
    got = np.asarray(jax_llama.apply_rope(jnp.array([[[[1.0, 0.0]]]]), cos, sin))[0, 0, 0]
    np.testing.assert_allclose(got, [np.cos(1.0), np.sin(1.0)], rtol=1e-6)


@pytest.mark.parametrize("tied", [False, True])
def test_state_dict_names_and_shapes(tied):
    cfg = small_cfg(tied)
    model = LlamaForCausalLM(cfg, V)
    want = ["model.embed_tokens.weight"]
    for i in range(2):
        want += [
            f"model.layers.{i}.input_layernorm.weight",
            f"model.layers.{i}.post_attention_layernorm.weight",
            *(f"model.layers.{i}.self_attn.{n}_proj.weight" for n in "qkvo"),
            *(f"model.layers.{i}.mlp.{n}_proj.weight" for n in ("gate", "up", "down")),
        ]
    want += ["model.norm.weight"] + ([] if tied else ["lm_head.weight"])
    sd = model.state_dict()
    assert sorted(sd) == sorted(want)
    assert list(sd) == list(param_shapes(cfg, V))  # same order as the shared shape table
    assert {k: tuple(v.shape) for k, v in sd.items()} == param_shapes(cfg, V)
    assert sd["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 16, 64)
    assert sd["model.layers.0.self_attn.k_proj.weight"].shape == (2 * 16, 64)
    assert sd["model.layers.1.self_attn.o_proj.weight"].shape == (64, 4 * 16)
    assert sd["model.layers.1.mlp.down_proj.weight"].shape == (64, 96)
    assert isinstance(model.model.layers, torch.nn.ModuleList)


def test_init_is_deterministic():
    cfg = small_cfg(False)
    a, b, c = init_state_dict(cfg, V, 1), init_state_dict(cfg, V, 1), init_state_dict(cfg, V, 2)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])
    assert torch.equal(a["model.norm.weight"], torch.ones(64))
    assert abs(a["model.layers.0.mlp.up_proj.weight"].std().item() - 0.2) < 0.02


@pytest.mark.parametrize("tied", [False, True])
def test_torch_jax_numpy_agree(tied):
    cfg, model, params = model_and_params(tied)
    ids, mask, pos = left_padded([7, 4, 1], T=7)
    lt = torch_logits(model, ids, pos, mask)
    lj = np.asarray(jforward(params, cfg, ids, pos, mask))
    sd = {k: v.double().numpy() for k, v in model.state_dict().items()}
    ln = np_forward(sd, cfg, ids, pos, mask)
    real = mask.astype(bool)
    assert lj.dtype == np.float32
    assert np.isfinite(lt).all() and np.isfinite(lj).all()  # pad rows included
    assert np.abs(lt - lj)[real].max() <= TOL
    assert np.abs(lt - ln)[real].max() <= TOL
    assert np.abs(lt).max() > 0.5  # the comparison is not of near-zero numbers


def test_masking_and_positions_matter():
    """Pads are invisible to real tokens; real context and positions change the logits."""
    cfg, model, _ = model_and_params(False)
    ids, mask, pos = left_padded([3], T=6)
    base = torch_logits(model, ids, pos, mask)[0, 3:]
    other_pads = ids.copy()
    other_pads[0, :3] = [5, 9, 2]
    np.testing.assert_allclose(torch_logits(model, other_pads, pos, mask)[0, 3:], base, atol=1e-6)
    unpadded = torch_logits(model, ids[:, 3:], pos[:, 3:], mask[:, 3:])[0]
    np.testing.assert_allclose(unpadded, base, atol=TOL)
    other_ctx = ids.copy()
    other_ctx[0, 3] = ids[0, 3] % (V - 1) + 1
    assert np.abs(torch_logits(model, other_ctx, pos, mask)[0, 4:] - base[1:]).max() > 10 * TOL
    # RoPE is relative: shifting every position is a no-op, a gap before the last token is not
    np.testing.assert_allclose(torch_logits(model, ids, pos + 5, mask)[0, 3:], base, atol=TOL)
    gap = pos.copy()
    gap[0, -1] += 3
    assert np.abs(torch_logits(model, ids, gap, mask)[0, -1] - base[-1]).max() > 10 * TOL


@pytest.mark.parametrize("tied", [False, True])
def test_cache_prefill_then_decode_matches_forward(tied):
    cfg, _, params = model_and_params(tied, seed=3)
    P, steps, S = 5, 4, 12
    ids, mask, pos = left_padded([5, 2], T=P, seed=1)
    B = ids.shape[0]
    new_tokens = np.random.default_rng(2).integers(1, V, size=(B, steps))
    full_ids = np.concatenate([ids, new_tokens], 1)
    full_mask = np.concatenate([mask, np.ones_like(new_tokens)], 1)
    full_pos = np.clip(np.cumsum(full_mask, -1) - 1, 0, None)
    want = np.asarray(jforward(params, cfg, full_ids, full_pos, full_mask))

    step = functools.partial(jstep, cfg=cfg)
    cache = jax_llama.init_cache(cfg, B, S, jnp.float32)
    assert len(cache["k"]) == 2 and cache["k"][0].shape == (B, 2, 16, S)  # per layer K [B, kv, hd, S]
    assert cache["v"][0].shape == (B, 2, S, 16)  # and V [B, kv, S, hd]
    kv_mask = np.zeros((B, S), np.int32)
    kv_mask[:, :P] = mask
    logits, cache = step(params, input_ids=ids, positions=pos, cache=cache, cache_index=jnp.int32(0), kv_mask=kv_mask)
    real = mask.astype(bool)
    assert np.abs(np.asarray(logits) - want[:, :P])[real].max() <= TOL
    for j in range(steps):
        slot = P + j
        kv_mask[:, slot] = 1
        logits, cache = step(
            params,
            input_ids=new_tokens[:, j : j + 1],
            positions=full_pos[:, slot : slot + 1],
            cache=cache,
            cache_index=jnp.int32(slot),
            kv_mask=kv_mask,
        )
        assert logits.shape == (B, 1, V) and logits.dtype == jnp.float32
        assert np.abs(np.asarray(logits)[:, 0] - want[:, slot]).max() <= TOL, f"decode step {j}"
    # slots past the last write are untouched
    assert not np.asarray(cache["k"][0])[..., P + steps :].any() and not np.asarray(cache["v"][0])[:, :, P + steps :].any()
    assert np.asarray(cache["k"][1])[..., P + steps - 1].any() and np.asarray(cache["v"][1])[:, :, P + steps - 1].any()


def test_bf16_smoke():
    cfg, model, params = model_and_params(False, dtype="bfloat16")
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert params["lm_head.weight"].dtype == jnp.bfloat16
    ids, mask, pos = left_padded([6, 2], T=6)
    lt = torch_logits(model, ids, pos, mask)
    lj = np.asarray(jforward(params, cfg, ids, pos, mask))
    assert lj.dtype == np.float32 and np.isfinite(lt).all() and np.isfinite(lj).all()
    # bf16 rounding differs by op order; still the same model within a loose bound
    assert np.abs(lt - lj)[mask.astype(bool)].max() < 0.25
    cache = jax_llama.init_cache(cfg, 2, 8)
    assert all(c.dtype == jnp.bfloat16 for c in cache["k"] + cache["v"])
    kv = np.zeros((2, 8), np.int32)
    kv[:, :6] = mask
    logits, _ = jstep(params, cfg, ids, pos, cache, 0, kv)  # cache_index traced
    assert np.isfinite(np.asarray(logits)).all()


def test_packed_weights_give_the_same_logits_and_leave_adapted_groups_apart():
    """``pack_params`` (the sampler's layout): q/k/v and gate/up become one matrix each, biases
    too, the four per-layer linears are stored ``[in, out]``, and the forward pass is unchanged;
    a group carrying a LoRA adapter keeps its members as they were."""
    cfg = small_cfg(False).model_copy(update={"attention_bias": True, "attention_out_bias": True, "qk_norm": True})
    model = LlamaForCausalLM(cfg, V)
    model.init_weights(3)
    params = jax_llama.params_from_torch(model.state_dict())
    packed = jax_llama.pack_params(params, cfg)
    p = "model.layers.0."
    hd = cfg.head_dim
    assert packed[p + "self_attn.qkv_proj.weight_t"].shape == (64, (4 + 2 * 2) * hd)
    assert packed[p + "self_attn.qkv_proj.bias"].shape == ((4 + 2 * 2) * hd,)
    np.testing.assert_array_equal(packed[p + "self_attn.qkv_proj.weight_t"][:, 4 * hd:6 * hd],
                                  np.asarray(params[p + "self_attn.k_proj.weight"]).T)
    assert packed[p + "mlp.gate_up_proj.weight_t"].shape == (64, 2 * 96)
    assert packed[p + "mlp.down_proj.weight_t"].shape == (96, 64) and p + "self_attn.o_proj.bias" in packed
    assert not any(k.endswith((".weight", ".k_proj.bias")) and ".layers." in k and "norm" not in k for k in packed)
    ids, mask, pos = left_padded([6, 3], T=6, seed=4)
    want = np.asarray(jforward(params, cfg, ids, pos, mask))
    got = np.asarray(jforward(packed, cfg, ids, pos, mask))
    assert np.abs(got - want).max() <= 1e-5 and np.abs(want).max() > 0.1
    structs = jax_llama.pack_params({k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in params.items()}, cfg)
    assert {k: v.shape for k, v in structs.items()} == {k: v.shape for k, v in packed.items()}
    adapted = dict(params, **{p + "self_attn.v_proj.lora_A.weight": jnp.zeros((2, 64))})
    kept = jax_llama.pack_params(adapted, cfg)
    assert p + "self_attn.v_proj.weight" in kept and p + "self_attn.qkv_proj.weight_t" not in kept
    assert p + "mlp.gate_up_proj.weight_t" in kept and "model.layers.1.self_attn.qkv_proj.weight_t" in kept
