"""Where a decode step of rltpu's compiled sampler spends its time (CPU), by ablation.

    .venv/bin/python benchmarks/sampler_profile.py [--model quickstart|llama20m] [--rows 32] [--reps 3]

The sampler's generation program (``rltpu/sampling/engine.py``: prefill + ``lax.while_loop`` of decode
steps) is rebuilt here from ``rltpu.models.jax_llama``'s pieces with switches that remove or
replace one part at a time; the difference in per-step time is that part's cost. Nothing in
rltpu is changed. Variants:

  engine        the real ``SamplerEngine`` program (reference)
  base          the copy below with no switch (must match ``engine``)
  greedy        argmax instead of ``jax.random.categorical``      -> cost of sampling
  noupdate      no KV-cache writes                                -> cost of the cache update
  noattn        no attention at all (q passed through)            -> attention + cache cost
  noattn+greedy what is left: projections, MLP, norms, lm_head, loop overhead
  canon         kv-major cache [L, B, n_kv, S, hd] and the one-token decode attention written as
                canonical batched dots ('bgrd,bgsd->bgrs', 'bgrs,bgsd->bgrd'): a candidate fix
  canon+perlayer   canon with one cache array per layer (a tuple of L arrays [B, n_kv, S, hd])
                   instead of one stacked [L, ...] array whose per-layer slices are copies
  canon+invcdf     canon + inverse-CDF sampling (one uniform per row instead of B x V Gumbels)
  canon+perlayer+invcdf  all three

Also: all matmuls of one decode step alone (jitted), and the fp32 GEMM peak. Prints one JSON
document; progress on stderr. Same process setup as benchmarks/sampler.py (pinned CPUs, threads,
precision "highest").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from rltpu.chips import backend  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sampler as bench  # noqa: E402  (benchmarks/sampler.py: models, FLOPs, GEMM peak, Monitor)

VARIANTS = ("engine", "base", "greedy", "noupdate", "noattn", "noattn+greedy", "canon", "canon+perlayer",
            "canon+perlayer+invcdf")


def build(mcfg, rows: int, P: int, T: int, V: int, opts: set):
    import jax
    import jax.numpy as jnp
    from jax import lax

    from rltpu.models import jax_llama as J

    B, S = rows, P + T
    nh, nkv, hd = mcfg.num_attention_heads, mcfg.num_key_value_heads, mcfg.head_dim
    rep = nh // nkv
    canon = "canon" in opts
    perlayer = "perlayer" in opts
    z = jnp.int32(0)

    def fwc(params, tok, pos, cache, ci, kv_mask):  # jax_llama.forward_with_cache with switches
        Tn = tok.shape[1]
        ci = jnp.asarray(ci, jnp.int32)
        x = params["model.embed_tokens.weight"][tok]
        cos, sin = J.rope_cos_sin(pos, hd, mcfg.rope_theta, x.dtype)
        q_slot = ci + jnp.arange(Tn, dtype=jnp.int32)
        s = jnp.arange(S, dtype=jnp.int32)
        allowed = (s[None, :] <= q_slot[:, None])[None] & kv_mask.astype(bool)[:, None, :]
        allowed = allowed | (s[None, :] == q_slot[:, None])[None]
        ck, cv = cache["k"], cache["v"]
        for i in range(mcfg.num_hidden_layers):
            h = J.rms_norm(x, params[f"model.layers.{i}.input_layernorm.weight"], mcfg.rms_norm_eps)
            q, k, v = J._qkv(params, mcfg, i, h, cos, sin)
            li = jnp.int32(i)
            if "noattn" in opts:
                att = q.reshape(B, Tn, nh * hd)
            elif canon:
                if perlayer:  # ck, cv: tuples of L arrays [B, nkv, S, hd]
                    ki = lax.dynamic_update_slice(ck[i], jnp.swapaxes(k, 1, 2), (z, z, ci, z))
                    vi = lax.dynamic_update_slice(cv[i], jnp.swapaxes(v, 1, 2), (z, z, ci, z))
                    ck, cv = ck[:i] + (ki,) + ck[i + 1:], cv[:i] + (vi,) + cv[i + 1:]
                else:
                    ck = lax.dynamic_update_slice(ck, jnp.swapaxes(k, 1, 2)[None], (li, z, z, ci, z))
                    cv = lax.dynamic_update_slice(cv, jnp.swapaxes(v, 1, 2)[None], (li, z, z, ci, z))
                    ki, vi = ck[i], cv[i]
                if Tn == 1:
                    qq = q.reshape(B, nkv, rep, hd)
                    sc = jnp.einsum("bgrd,bgsd->bgrs", qq, ki) * hd**-0.5
                    sc = jnp.where(allowed[:, 0][:, None, None, :], sc, jnp.finfo(jnp.float32).min)
                    att = jnp.einsum("bgrs,bgsd->bgrd", jax.nn.softmax(sc, -1), vi).reshape(B, 1, nh * hd)
                else:
                    att = J._attend(q, jnp.swapaxes(ki, 1, 2), jnp.swapaxes(vi, 1, 2), allowed)
            elif "noupdate" in opts:
                att = J._attend(q, ck[i], cv[i], allowed)
            else:
                ck = lax.dynamic_update_slice(ck, k[None], (li, z, ci, z, z))
                cv = lax.dynamic_update_slice(cv, v[None], (li, z, ci, z, z))
                att = J._attend(q, ck[i], cv[i], allowed)
            x = x + J._linear(att, params[f"model.layers.{i}.self_attn.o_proj.weight"])
            x = J._mlp_block(params, mcfg, i, x)
        return J._logits(params, mcfg, x), {"k": ck, "v": cv}

    def sample(logits, key):
        logp_all = jax.nn.log_softmax(logits, -1)
        if "greedy" in opts:
            tok = jnp.argmax(logits, -1)
        elif "invcdf" in opts:
            c = jnp.cumsum(jnp.exp(logp_all), -1)
            u = jax.random.uniform(key, (B, 1))
            tok = jnp.minimum(jnp.sum(c < u * c[:, -1:], -1), V - 1)
        else:
            tok = jax.random.categorical(key, logits, axis=-1)
        tok = tok.astype(jnp.int32)
        return tok, jnp.take_along_axis(logp_all, tok[:, None], -1)[:, 0]

    def generate(params, prompt, mask, key):
        positions = jnp.maximum(jnp.cumsum(mask, -1) - 1, 0).astype(jnp.int32)
        kv_mask = jnp.zeros((B, S), jnp.int32).at[:, :P].set(mask)
        L = mcfg.num_hidden_layers
        shape = (L, B, nkv, S, hd) if canon else (L, B, S, nkv, hd)
        cache = {"k": jnp.zeros(shape), "v": jnp.zeros(shape)}
        if perlayer:
            cache = {n: tuple(jnp.zeros(shape[1:]) for _ in range(L)) for n in ("k", "v")}
        logits, cache = fwc(params, prompt, positions, cache, 0, kv_mask)
        st = dict(i=jnp.int32(0), logits=logits[:, -1], pos=positions[:, -1] + 1, cache=cache, kv_mask=kv_mask,
                  key=key, tokens=jnp.zeros((B, T), jnp.int32), lp=jnp.zeros((B, T)))

        def body(s):
            key, sub = jax.random.split(s["key"])
            tok, lp = sample(s["logits"], sub)
            slot = P + s["i"]
            kvm = s["kv_mask"].at[:, slot].set(1)
            lg, cache = fwc(params, tok[:, None], s["pos"][:, None], s["cache"], slot, kvm)
            return dict(i=s["i"] + 1, logits=lg[:, 0], pos=s["pos"] + 1, cache=cache, kv_mask=kvm, key=key,
                        tokens=s["tokens"].at[:, s["i"]].set(tok), lp=s["lp"].at[:, s["i"]].set(lp))

        out = lax.while_loop(lambda s: s["i"] < T, body, st)
        return out["tokens"], out["lp"]

    return jax.jit(generate), fwc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama20m", choices=["quickstart", "llama20m"])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args(argv)

    cpus = sorted(os.sched_getaffinity(0))
    backend.configure_threads(len(cpus), cpus)
    backend.configure_precision("highest")
    import jax
    import jax.numpy as jnp

    from rltpu.models import jax_llama as J
    from rltpu.models.torch_llama import init_state_dict

    spec = next(s for s in bench.model_specs(quick=False) if s["name"] == args.model)
    mcfg, V, B = spec["cfg"], spec["vocab"], args.rows
    P, T = bench.PROMPT_LEN, bench.NEW_TOKENS
    sd = init_state_dict(mcfg, V, 0)
    params = J.params_from_torch(sd)
    prompt = jnp.asarray(np.random.default_rng(0).integers(3, V, (B, P)), jnp.int32)
    mask = jnp.ones((B, P), jnp.int32)
    bench.wait_for_quiet()
    peak = bench.gemm_peak()

    # correctness of the candidate fix: one decode step, canon vs jax_llama.forward_with_cache
    _, fwc_canon = build(mcfg, B, P, T, V, {"canon"})
    S, L = P + T, mcfg.num_hidden_layers
    rng = np.random.default_rng(1)
    ck = jnp.asarray(rng.normal(size=(L, B, S, mcfg.num_key_value_heads, mcfg.head_dim)), jnp.float32)
    cv = jnp.asarray(rng.normal(size=ck.shape), jnp.float32)
    kvm = jnp.asarray(np.arange(S)[None, :] < P + 5 + rng.integers(0, 5, (B, 1)), jnp.int32)
    tok = jnp.asarray(rng.integers(3, V, (B, 1)), jnp.int32)
    pos = jnp.full((B, 1), P + 5, jnp.int32)
    per_layer = {"k": tuple(ck[i].transpose(0, 2, 3, 1) for i in range(L)),  # its layout: per layer K [B, n_kv, hd, S]
                 "v": tuple(jnp.swapaxes(cv[i], 1, 2) for i in range(L))}  # and V [B, n_kv, S, hd]
    ref, _ = J.forward_with_cache(params, mcfg, tok, pos, per_layer, P + 5, kvm)
    got, _ = fwc_canon(params, tok, pos, {"k": jnp.swapaxes(ck, 2, 3), "v": jnp.swapaxes(cv, 2, 3)}, P + 5, kvm)
    canon_diff = float(jnp.max(jnp.abs(ref - got)))
    _, fwc_pl = build(mcfg, B, P, T, V, {"canon", "perlayer"})
    got, _ = fwc_pl(params, tok, pos, {"k": tuple(jnp.swapaxes(c, 2, 3) for c in per_layer["k"]), "v": per_layer["v"]},
                    P + 5, kvm)
    canon_diff = max(canon_diff, float(jnp.max(jnp.abs(ref - got))))

    results = {}
    for v in args.variants.split(","):
        if v == "engine":
            eng = bench.Rltpu(mcfg, V, sd, (B,), (P,))
            t0 = time.perf_counter()
            eng.engine.compile_bucket(B, P)
            first = time.perf_counter() - t0
            prompts = np.asarray(prompt).tolist()

            def call(i, eng=eng, prompts=prompts):
                eng.engine.generate(prompts, 1, i)
        else:
            f, _ = build(mcfg, B, P, T, V, set(v.split("+")))
            t0 = time.perf_counter()
            jax.block_until_ready(f(params, prompt, mask, jax.random.PRNGKey(0)))
            first = time.perf_counter() - t0

            def call(i, f=f):
                jax.block_until_ready(f(params, prompt, mask, jax.random.PRNGKey(i)))
        ts = []
        for i in range(3 * args.reps):
            with bench.Monitor() as m:
                call(i + 1)
            if not m.disturbed:
                ts.append(m.wall)
            if len(ts) >= args.reps:
                break
        med = float(np.median(ts)) if ts else float("nan")
        results[v] = {"median_s": round(med, 4), "ms_per_step": round(med / T * 1e3, 3),
                      "first_call_incl_compile_s": round(first, 2), "clean_reps": len(ts)}
        bench.log(f"{args.model} B={B} {v:14s} {med / T * 1e3:8.2f} ms/step")

    def mm_only(p, x):  # every matmul of one decode step, nothing else
        out = 0.0
        for i in range(L):
            pre = f"model.layers.{i}."
            for n in ("q_proj", "k_proj", "v_proj"):
                out = out + jnp.sum(J._linear(x, p[pre + f"self_attn.{n}.weight"]))
            h = J._linear(x, p[pre + "self_attn.o_proj.weight"])
            g, u = J._linear(h, p[pre + "mlp.gate_proj.weight"]), J._linear(h, p[pre + "mlp.up_proj.weight"])
            x = x + J._linear(g * u, p[pre + "mlp.down_proj.weight"])
        w = p["model.embed_tokens.weight" if mcfg.tie_word_embeddings else "lm_head.weight"]
        return out + jnp.sum(J._linear(x, w))

    mm = jax.jit(mm_only)
    x = jnp.ones((B, mcfg.hidden_size), jnp.float32)
    jax.block_until_ready(mm(params, x))
    mts = []
    for _ in range(20):
        t0 = time.perf_counter()
        jax.block_until_ready(mm(params, x))
        mts.append(time.perf_counter() - t0)
    mp = bench.param_counts(mcfg, sd)["matmul_per_token"]
    step_flops = 2.0 * mp * B
    ms = lambda k: results[k]["ms_per_step"] if k in results else None  # noqa: E731
    diff = lambda a, b: round(ms(a) - ms(b), 3) if ms(a) is not None and ms(b) is not None else None  # noqa: E731
    doc = {
        "model": args.model, "rows": B, "prompt_len": P, "new_tokens": T, "cache_slots": S,
        "gemm_peak": peak, "variants": results,
        "matmuls_only_per_step_ms": round(float(np.median(mts)) * 1e3, 3),
        "matmul_gflop_per_step": round(step_flops / 1e9, 4),
        "matmul_ms_at_gemm_peak": round(step_flops / (max(peak["torch_gflops"], peak["jax_gflops"]) * 1e9) * 1e3, 3),
        "breakdown_ms_per_step": {
            "sampling (base - greedy)": diff("base", "greedy"),
            "kv cache update (base - noupdate)": diff("base", "noupdate"),
            "attention incl. cache (base - noattn)": diff("base", "noattn"),
            "rest: projections, MLP, norms, lm_head, loop (noattn+greedy)": ms("noattn+greedy"),
            "saved by canon (base - canon)": diff("base", "canon"),
            "saved by canon+perlayer (base - canon+perlayer)": diff("base", "canon+perlayer"),
            "saved by all three (base - canon+perlayer+invcdf)": diff("base", "canon+perlayer+invcdf"),
        },
        # one decode step of the canon / canon+perlayer forward vs jax_llama.forward_with_cache
        "canon_decode_logits_max_abs_diff_vs_forward_with_cache": canon_diff,
    }
    print(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
