"""rltpu's two JAX rollout engines on whatever chip this process's JAX opens: a real TPU on a TPU VM.

    python3 benchmarks/tpu_sampler.py [--models 25M,0.5B] [--reps 3] [--out FILE] [--smoke]

Needs only what a TPU VM's own JAX has beside it: jax, numpy, pydantic and pyyaml (no torch, no Ray), so
it runs on a bare TPU host from a checkout. Prints ONE JSON document (progress on stderr).

What runs, per model (random weights drawn on the device; Llama-shaped, from ``ModelConfig``):
  * 25M: the issue-30 cells' shape (hidden 512, 8 layers, 8 heads / 4 KV, 68-token vocabulary), float32
    at the product's default "highest" matmul precision;
  * 0.5B: Qwen2.5-0.5B's dimensions (hidden 896, 24 layers, 14 heads / 2 KV, 151,936-token vocabulary,
    tied), bfloat16.
  Cells: fixed 64 new tokens (no stop token can be sampled) at 8 / 64 / 256 rows, and the long tail (a
  stop set of V/68 ids, so P(stop) ~ 1/68 per token on a random model as with EOS in a 68-token
  vocabulary; up to 200 new tokens) at 64 / 256 rows on the 25M model; on the 0.5B one (each of its 24
  unrolled layers lengthens every compile) fixed 64 tokens at 64 rows and the long tail at 256 rows of up
  to 512 new tokens. Prompts of 8-32 tokens, one sample each (n_per_prompt=1).
  Each engine is precompiled (seconds recorded), then the calls alternate engine order over ``--reps``
  repetitions; tokens/s is the median over calls of useful (generated, stop included) tokens / wall.
  Compiles during the timed calls must be 0 (asserted).
  Parity: greedy (temperature 0) rows of both engines on the long-tail engine, 64 rows: the share of rows
  identical token for token (on a chip, float reduction order differs between the paged and the dense
  attention, so an argmax tie can flip; the CPU tests assert equality).
  Planner: ``rltpu.plan.costmodel.sample_seconds`` for the same cell on the ``hardware.tpu(generation)``
  entry (public figures, stated efficiencies), with the measured mean length as the planner's
  ``mean_response_len``: predicted vs measured seconds per call. Only on a real TPU (``--generation``,
  default read from the device kind).

``--smoke``: a 0.3M model and short cells, for a CPU check of the script itself (nothing to quote).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

PAD, STOP0 = 0, 1  # prompts draw ids >= 2


def log(msg: str) -> None:
    print(f"[tpu_sampler {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def r(x, nd=4):
    return None if x is None else round(float(x), nd)


MODELS = {
    "25M": dict(cfg=dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                         num_key_value_heads=4, vocab_size=68, max_position_embeddings=256, dtype="float32"),
                cells=[("fixed", 8, 64), ("fixed", 64, 64), ("fixed", 256, 64), ("longtail", 64, 200),
                       ("longtail", 256, 200)]),
    "0.5B": dict(cfg=dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                          num_key_value_heads=2, vocab_size=151936, max_position_embeddings=2048,
                          tie_word_embeddings=True, attention_bias=True, rope_theta=1e6, rms_norm_eps=1e-6,
                          dtype="bfloat16"),
                 cells=[("fixed", 64, 64), ("longtail", 256, 512)]),
    "smoke": dict(cfg=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=68, max_position_embeddings=256, dtype="float32"),
                  cells=[("fixed", 8, 16), ("longtail", 16, 48)]),
}


def device_facts() -> dict:
    import jax

    d = jax.devices()[0]
    out = {"platform": d.platform, "device_kind": getattr(d, "device_kind", ""), "devices": len(jax.devices()),
           "jax": jax.__version__, "host_cpus": os.cpu_count(), "python": platform.python_version()}
    for pkg in ("jaxlib", "libtpu", "libtpu-nightly"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out


def generation_of(kind: str) -> str | None:
    k = kind.lower()
    for needle, gen in (("v5 lite", "v5e"), ("v5e", "v5e"), ("v6 lite", "v6e"), ("v6e", "v6e"), ("v5p", "v5p"),
                        ("v5", "v5p"), ("v4", "v4")):
        if needle in k:
            return gen
    return None


def random_params(shapes: dict, dtype: str, seed: int) -> dict:
    """Normal(0, 0.02) matrices and biases, norms at 1, drawn on the default device."""
    import jax
    import jax.numpy as jnp

    key, out = jax.random.PRNGKey(seed), {}
    dt = jnp.bfloat16 if dtype == "bfloat16" else jnp.float32
    for i, (name, (shape, _)) in enumerate(sorted(shapes.items())):
        if "norm" in name:
            out[name] = jnp.ones(shape, dt)
        else:
            out[name] = (0.02 * jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32)).astype(dt)
    return out


def prompts_for(rows: int, vocab: int, stops: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(2, vocab - stops, int(rng.integers(8, 33))).tolist() for _ in range(rows)]


def bench_model(name: str, args, gen: str | None, save=lambda part: None) -> dict:
    import jax

    from rltpu.config import ModelConfig, SamplerConfig
    from rltpu.models.spec import param_shapes
    from rltpu.sampling.engine import SamplerEngine

    spec = MODELS[name]
    cfg = ModelConfig(**spec["cfg"])
    V = cfg.vocab_size
    shapes = {k: (tuple(s), cfg.dtype) for k, s in param_shapes(cfg, V).items()}
    n_params = int(sum(np.prod(s) for s, _ in shapes.values()))
    params = random_params(shapes, cfg.dtype, seed=0)
    jax.block_until_ready(params)
    n_stops = max(1, V // 68)
    stops = tuple(range(V - n_stops + 1, V))  # with the EOS, STOP0: n_stops ids; prompts avoid the top ones
    log(f"{name}: {n_params:,} params ({cfg.dtype}), stop set {n_stops} ids")
    cells = [c for c in spec["cells"] if not args.cells or f"{c[0]}{c[2]}_b{c[1]}" in args.cells.split(",")]
    engines, compile_s = {}, {}
    for mode in dict.fromkeys(m for m, _, _ in cells):
        mode_cells = [c for c in cells if c[0] == mode]
        n_new = max(t for _, _, t in mode_cells)
        batches = tuple(sorted({b for _, b, _ in mode_cells}))
        tgrid = tuple(sorted({t for _, _, t in mode_cells}))
        scfg = SamplerConfig(group_size=2, temperature=1.0, max_new_tokens=n_new, batch_buckets=batches,
                             new_token_buckets=tgrid, prompt_buckets=(32,),
                             stop_token_ids=stops if mode == "longtail" else ())
        eos = STOP0 if mode == "longtail" else V  # fixed: an id outside the vocabulary, never sampled
        eng = SamplerEngine(cfg, scfg, V, PAD, eos, shapes)
        eng.set_params(params, 0)
        t0 = time.perf_counter()
        if mode == "longtail":
            eng.precompile(engine="continuous")
        t1 = time.perf_counter()
        eng.precompile(cells=[(b, 32, t) for _, b, t in mode_cells], engine="static")
        compile_s[mode] = {"continuous_s": r(t1 - t0, 2), "static_s": r(time.perf_counter() - t1, 2),
                           "programs": eng.stats.compiles}
        engines[mode] = eng
        log(f"{name} {mode}: precompiled {compile_s[mode]}")

    def call(mode, system, prompts, seed, n_new):
        t0 = time.perf_counter()
        out = engines[mode].generate(prompts, 1, seed, max_new_tokens=n_new, engine=system)
        wall = time.perf_counter() - t0
        lengths = np.asarray(out["lengths"])
        if mode == "fixed":
            assert (lengths == n_new).all(), f"{system}: fixed-length rows stopped early"
        rec = {"wall_s": r(wall, 4), "tokens": int(lengths.sum()), "mean_len": r(lengths.mean(), 2),
               "max_len": int(lengths.max()), "compiles": int(out["compiles"]), "engine": out["engine"],
               "decode_steps": int(out["decode_steps"])}
        if out["engine"] == "continuous":
            rec |= {"chunks": int(out["chunks"]), "occupancy": r(out["occupancy"], 4),
                    "host_s": r(out["host_seconds"], 3), "program_s": r(out["program_seconds"], 3)}
        return rec

    res_cells = {}
    seed = 1
    for mode, rows, n_new in cells:
        prompts = prompts_for(rows, V, n_stops, 1000 + rows)
        systems = ("continuous", "static")
        for s in systems:  # one untimed call per engine: the first run of a program on a chip pays its load
            call(mode, s, prompts, 0, n_new)
        calls = {s: [] for s in systems}
        for rep in range(args.reps):
            for s in (systems if rep % 2 == 0 else systems[::-1]):
                calls[s].append(call(mode, s, prompts, seed, n_new))
                seed += 1
        res = {}
        for s, cs in calls.items():
            assert all(c["compiles"] == 0 for c in cs), f"{name} {mode} b{rows} {s}: compiled during a timed call"
            res[s] = {"tokens_per_s": r(statistics.median(c["tokens"] / c["wall_s"] for c in cs), 1),
                      "median_wall_s": r(statistics.median(c["wall_s"] for c in cs), 4), "calls": cs}
        res["continuous"]["over_static"] = r(res["continuous"]["tokens_per_s"] / res["static"]["tokens_per_s"], 3)
        cell = {"mode": mode, "rows": rows, "max_new_tokens": n_new, "systems": res}
        if gen:
            cell["planner"] = predict(cfg, engines[mode].cfg, gen, rows, n_new,
                                      statistics.mean(c["mean_len"] for c in calls["continuous"]),
                                      {s: res[s]["median_wall_s"] for s in systems})
        res_cells[f"{mode}{n_new}_b{rows}"] = cell
        save({"params": n_params, "precompile": compile_s, "cells": res_cells})  # kept if a later cell runs out of time
        log(f"{name} {mode} b{rows} x{n_new}: continuous {res['continuous']['tokens_per_s']:.0f} tok/s "
            f"({res['continuous']['calls'][0]['engine']}), static {res['static']['tokens_per_s']:.0f} tok/s"
            + (f"; planner {cell['planner']}" if gen else ""))
    parity = greedy_parity(engines["longtail"], V, n_stops) if "longtail" in engines and args.parity else None
    if parity:
        log(f"{name} greedy parity: {parity}")
    return {"params": n_params, "config": spec["cfg"], "stop_ids": n_stops, "precompile": compile_s,
            "cells": res_cells, "greedy_parity": parity}


def greedy_parity(eng, V: int, n_stops: int) -> dict:
    prompts = prompts_for(min(64, max(eng.cfg.batch_buckets)), V, n_stops, 7)
    a = eng.generate(prompts, 1, 3, greedy=True, engine="continuous")
    b = eng.generate(prompts, 1, 3, greedy=True, engine="static")
    same, first_diff = 0, []
    for i in range(len(prompts)):
        la, lb = int(a["lengths"][i]), int(b["lengths"][i])
        ta, tb = np.asarray(a["tokens"][i][:la]), np.asarray(b["tokens"][i][:lb])
        if la == lb and (ta == tb).all():
            same += 1
        else:
            n = min(la, lb)
            d = np.nonzero(ta[:n] != tb[:n])[0]
            first_diff.append(int(d[0]) if d.size else n)
    return {"rows": len(prompts), "identical_rows": same, "first_divergence_positions": sorted(first_diff)[:16],
            "mean_len": r(np.mean(a["lengths"]), 1)}


def predict(mcfg, scfg, gen: str, rows: int, n_new: int, mean_len: float, measured: dict) -> dict:
    """The planner's sampling seconds for one call of this cell, each engine, on the ``gen`` entry."""
    from rltpu.config import RunConfig
    from rltpu.plan import costmodel as cm
    from rltpu.plan import hardware as hwmod

    hw = hwmod.tpu(gen)
    out = {"hardware": gen}
    for engine in ("continuous", "static"):
        cfg = RunConfig.model_validate({
            "model": mcfg.model_dump(), "sampler": scfg.model_dump() | {"engine": engine, "group_size": 2},
            "trainer": {"prompts_per_step": max(rows // 2, 1)},
            "planner": {"response_len": n_new, "mean_response_len": max(int(round(mean_len)), 1)}})
        m, w = cm.model_shape(cfg), cm.Workload.from_config(cfg)
        parts = cm.sample_seconds(hw, m, w, tp=1, rows=rows)
        s = sum(parts.values())
        out[engine] = {"predicted_s": r(s, 4), "parts": {k: r(v, 5) for k, v in parts.items()},
                       "measured_s": measured[engine], "predicted_over_measured": r(s / measured[engine], 3)}
    return out


def median_call_s(f, *args, reps: int = 20) -> float:
    """Median seconds of ``f(*args)`` to a ready result, after one untimed call (its compile)."""
    import jax

    jax.block_until_ready(f(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


DRAW_SHAPES = ((64, 151936), (256, 151936), (256, 68), (256, 32768))  # (rows, vocab); --smoke: SMOKE_DRAWS
SMOKE_DRAWS = ((8, 68), (16, 1024))


def chooser_ablation(shapes) -> list[dict]:
    """The token draw alone, per (rows, vocab): one cumsum over the vocabulary (the draw before
    ``rltpu.sampling.common.inverse_cdf``) against the two-level draw, and the log-softmax + argmax
    floor; how often the two draws agree on the same uniforms."""
    import jax
    import jax.numpy as jnp

    from rltpu.sampling.common import inverse_cdf

    def full(probs, u):
        cdf = jnp.cumsum(probs, axis=-1)
        return jnp.minimum(jnp.sum(cdf < (1.0 - u) * cdf[:, -1:], axis=-1), probs.shape[-1] - 1).astype(jnp.int32)

    fns = {"full_cumsum": jax.jit(lambda lg, u: full(jax.nn.softmax(lg, -1), u)),
           "two_level": jax.jit(lambda lg, u: inverse_cdf(jax.nn.softmax(lg, -1), u)),
           "argmax_floor": jax.jit(lambda lg, u: jnp.argmax(jax.nn.log_softmax(lg, -1), -1))}
    out = []
    for B, V in shapes:
        k1, k2 = jax.random.split(jax.random.PRNGKey(B + V))
        logits = 3.0 * jax.random.normal(k1, (B, V), jnp.float32)
        u = jax.random.uniform(k2, (B, 1), jnp.float32)
        rec = {"rows": B, "vocab": V}
        for name, f in fns.items():
            rec[f"{name}_ms"] = r(1e3 * median_call_s(f, logits, u), 3)
        agree = []
        for i in range(20):
            uu = jax.random.uniform(jax.random.PRNGKey(1000 + i), (B, 1), jnp.float32)
            agree.append(float(jnp.mean(fns["full_cumsum"](logits, uu) == fns["two_level"](logits, uu))))
        rec["agreement"] = r(statistics.mean(agree), 6)
        out.append(rec)
        log(f"draw {B} x {V}: {rec}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="25M,0.5B")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--generation", default=None, help="hardware entry for the planner (default: from the device)")
    ap.add_argument("--smoke", action="store_true", help="a 0.3M model, short cells: checks the script on a CPU")
    ap.add_argument("--cells", default="", help="only these cells, e.g. longtail200_b256 (default: all)")
    ap.add_argument("--no-parity", dest="parity", action="store_false", help="skip the greedy parity check")
    ap.add_argument("--chooser", action="store_true", help="time the token draw alone (full vs two-level cumsum)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import jax

    # the product's default backend.matmul_precision, "highest" (rltpu.chips.backend.configure_precision
    # sets the same flag, but that module imports torch, which a bare TPU VM lacks)
    jax.config.update("jax_default_matmul_precision", "float32")
    precision = "highest"
    facts = device_facts()
    gen = args.generation or (generation_of(facts["device_kind"]) if facts["platform"] == "tpu" else None)
    log(f"JAX {facts['jax']} on {facts['devices']} x {facts['platform']} ({facts['device_kind']}); planner: {gen}")
    t0 = time.perf_counter()
    models = ["smoke"] if args.smoke else args.models.split(",")
    doc = {"benchmark": "tpu_sampler", "command": " ".join(["python3", "benchmarks/tpu_sampler.py", *sys.argv[1:]]),
           "commit": os.environ.get("RLTPU_COMMIT", ""), "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "device": facts, "real_chip": facts["platform"] == "tpu", "matmul_precision": precision,
           "models": {}}

    def save(name=None, part=None):
        if name:
            doc["models"][name] = part
        doc["wall_s"] = r(time.perf_counter() - t0, 1)
        if args.out:
            Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")

    if args.chooser:
        doc["token_draw"] = chooser_ablation(SMOKE_DRAWS if args.smoke else DRAW_SHAPES)
        models = []
        save()
    for m in models:
        save(m, bench_model(m, args, gen, lambda part, m=m: save(m, part | {"partial": True})))
    print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
