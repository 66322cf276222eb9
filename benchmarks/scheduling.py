"""One static batch vs sequential micro-batches on skewed response lengths.

    .venv/bin/python benchmarks/scheduling.py [--rows 256] [--reps 5]

A random quickstart-size model whose EOS logit is raised so that response lengths are roughly
geometric (most rows stop early, a few run to ``max_new_tokens``). One static batch decodes until
its longest row stops; micro-batches each stop with their own longest row, at the price of more,
smaller programs. Same weights, prompts and token budget for every variant. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from rltpu.config import ModelConfig, SamplerConfig  # noqa: E402
from rltpu.models import jax_llama  # noqa: E402
from rltpu.models.torch_llama import init_state_dict  # noqa: E402
from rltpu.sampling.engine import SamplerEngine  # noqa: E402
from rltpu.sync.collective import param_spec  # noqa: E402

V, PAD, EOS = 17, 0, 2


def skewed_weights(mcfg: ModelConfig, eos_boost: float) -> dict:
    sd = init_state_dict(mcfg, V, 0)
    sd["model.embed_tokens.weight"][:, 0] = 1.0  # a constant feature every token carries...
    sd["lm_head.weight"][:, 0] = 0.0
    sd["lm_head.weight"][EOS, 0] = eos_boost  # ...that only the EOS logit reads
    return sd


def run(mcfg, rows: int, max_new: int, micro: int, sd, reps: int) -> dict:
    cfg = SamplerConfig(engine="static", group_size=8, max_new_tokens=max_new,
                        batch_buckets=tuple(sorted({micro or rows, rows})), prompt_buckets=(8,), microbatch_rows=micro)
    spec = param_spec(mcfg, V)
    eng = SamplerEngine(mcfg, cfg, V, PAD, EOS, {n: (s, d) for n, s, d in spec})
    eng.precompile()
    eng.set_params(jax_llama.params_from_torch(sd), 0)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, V, size=6)) for _ in range(rows // 8)]
    eng.generate(prompts, 8, seed=0)  # warm
    times, steps, toks = [], [], []
    for r in range(reps):
        t0 = time.perf_counter()
        out = eng.generate(prompts, 8, seed=r + 1)
        times.append(time.perf_counter() - t0)
        steps.append(out["decode_steps"])
        toks.append(out["new_tokens"])
    return {"microbatch_rows": micro, "median_s": statistics.median(times), "decode_steps_sum": statistics.median(steps),
            "new_tokens": statistics.median(toks), "new_tokens_per_s": statistics.median(toks) / statistics.median(times),
            "padding_frac": out["padded_slots"] / out["total_slots"], "mean_len": float(out["lengths"].mean()),
            "max_len": int(out["lengths"].max()), "compiles_after_warmup": out["compiles"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--eos-boost", type=float, default=0.1)
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    mcfg = ModelConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=128)
    sd = skewed_weights(mcfg, args.eos_boost)
    results = [run(mcfg, args.rows, args.max_new, m, sd, args.reps) for m in (0, 32, 64, 128)]
    static = results[0]["median_s"]
    for r in results:
        r["speedup_vs_static"] = static / r["median_s"]
    best = max(results, key=lambda r: r["speedup_vs_static"])
    print(json.dumps({"rows": args.rows, "max_new_tokens": args.max_new, "cpus": os.cpu_count(),
                      "results": results, "best_microbatch_rows": best["microbatch_rows"]}, indent=1))


if __name__ == "__main__":
    main()
