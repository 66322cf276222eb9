"""The sampler's two ways to apply LoRA adapters, timed on this machine (issue 20 point 2).

    python benchmarks/lora_sampler.py [--hidden 512] [--layers 4] [--rank 8] [--rows 64] [--new 32] [--reps 3]

One process, one random model, the static engine: ``merged`` (``W + s B A`` once per sync, decode on the
base's programs) vs ``lowrank`` (the adapters as program inputs, ``(x A^T) B^T`` per adapted linear per
token). Per mode: seconds of one adapter sync's apply (``set_adapters``; the merge program is compiled
by the first, untimed, call), seconds of one ``generate`` of ``--rows`` x ``--new`` tokens (median of
``--reps``, the modes interleaved so load drifts hit both), and compiles after the first sync (0 expected).
One JSON document on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    import jax.numpy as jnp
    import numpy as np

    from rltpu.config import LoraConfig, ModelConfig, SamplerConfig
    from rltpu.models.spec import is_adapter, lora_shapes, param_shapes
    from rltpu.sampling.engine import SamplerEngine

    V = 256
    m = ModelConfig(hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                    num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256, init_std=0.05)
    grid = SamplerConfig(engine="static", group_size=2, max_new_tokens=args.new, batch_buckets=(args.rows,),
                         prompt_buckets=(16,), temperature=1.0)
    rng = np.random.default_rng(0)
    shapes = param_shapes(m, V)
    engines, out = {}, {"model": {"hidden": args.hidden, "layers": args.layers, "vocab": V, "rank": args.rank,
                                  "params": int(sum(np.prod(s) for s in shapes.values()))},
                        "rows": args.rows, "new_tokens": args.new, "modes": {}}
    for mode in ("merged", "lowrank"):
        lora = LoraConfig(rank=args.rank, alpha=2 * args.rank, sampler_apply=mode)
        full = shapes | lora_shapes(m, lora, V)
        e = SamplerEngine(m, grid, V, 0, 1, {k: (s, "float32") for k, s in full.items()}, lora=lora)
        e.precompile()
        params = {k: jnp.asarray(rng.normal(0, 0.05, s).astype(np.float32)) for k, s in full.items()}
        e.set_params(params, 0)
        engines[mode] = (e, [k for k in full if is_adapter(k)], e.stats.compiles)
        out["modes"][mode] = {"apply_s": [], "generate_s": []}
    prompts = [list(rng.integers(3, V, 12)) for _ in range(args.rows)]
    for rep in range(args.reps):
        for mode, (e, names, _) in engines.items():
            ad = {k: jnp.asarray(rng.normal(0, 0.05, e.adapters.shapes[k][0]).astype(np.float32)) for k in names}
            t0 = time.perf_counter()
            e.set_adapters(ad, rep + 1)
            import jax

            jax.block_until_ready(list(e.params.values()))
            out["modes"][mode]["apply_s"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            e.generate(prompts, 1, seed=rep)
            out["modes"][mode]["generate_s"].append(time.perf_counter() - t0)
    for mode, (e, _, compiles) in engines.items():
        d = out["modes"][mode]
        d["apply_s_median"] = statistics.median(d["apply_s"][1:] or d["apply_s"])  # the first compiled the merge
        d["generate_s_median"] = statistics.median(d["generate_s"])
        d["compiles_after_first_sync"] = e.stats.compiles - compiles
        d["held_bytes"] = e.adapters.held_bytes(e.params)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
