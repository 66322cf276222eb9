"""Where the rollout engines' time goes, op by op, in their real compiled programs (XLA:CPU here).

    .venv/bin/python benchmarks/sampler_ops.py [--cells static:fixed_b256,continuous:longtail_b64] [--out FILE]

``benchmarks/sampler_profile.py`` ablates a copy of the decode step; this one leaves the engine alone: it
builds ``SamplerEngine`` on issue 30's 25M shape (hidden 512, 8 layers, 8 heads / 4 KV, 68 ids, float32 at
"highest", random weights), times each cell (median of 3 warm calls, 0 compiles asserted), then traces one
more call with ``jax.profiler`` and charges every XLA op the trace shows to what its HLO metadata says it
computes (the ``op_name`` of the executables in ``SamplerEngine.programs()``):

  linear     the per-layer projections and MLP (``...i,io->...o`` dots: q/k/v, o, gate/up, down)
  attention  the score and value dots of attention (every other dot); its softmax counts as other
  lm_head    the vocabulary projection
  cache      KV-cache writes (dynamic-update-slice) and page gathers
  other      everything else (norms, RoPE, residual adds, the token draw, loop bookkeeping)

each split into inside the decode loop (a ``while`` body) and outside it (prefill, set-up). The linear
dots' rate (executed FLOPs / their seconds) is printed beside a standalone jitted dot of the gate/up
shape at the same rows, so a dot that runs below the machine's own dot rate inside the program shows.
One JSON document on stdout (progress on stderr); ``--out`` also writes it.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import platform
import re
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import numpy as np  # noqa: E402

from rltpu.chips import backend  # noqa: E402
from tpu_sampler import median_call_s, prompts_for, random_params  # noqa: E402

MODEL = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=256, vocab_size=68)
SMOKE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, vocab_size=68)
NEW = {"fixed": 64, "longtail": 200}  # as benchmarks/sampler.py's --vs-vllm cells
CELLS = "static:fixed_b8,static:fixed_b256,continuous:longtail_b64,continuous:longtail_b256"
PAD, EOS = 0, 1


def log(msg: str) -> None:
    print(f"[sampler_ops] {msg}", file=sys.stderr, flush=True)


def category(op_name: str, shape: str, vocab: int) -> str:
    """What an HLO op computes, from its jax ``op_name`` metadata and its output shape."""
    if "dynamic_update_slice" in op_name or "gather" in op_name or "scatter" in op_name:
        return "cache"
    if "dot_general" in op_name:
        if "...i,io->...o" in op_name:
            return "linear"
        if re.search(rf"[\[,]{vocab}\]", shape) or "oi->...o" in op_name:
            return "lm_head"
        return "attention"
    return "other"


def op_table(programs, vocab: int) -> dict[tuple[str, str], tuple[str, bool]]:
    """(HLO module, op) -> (category, inside a while body), from the executables' HLO text."""
    table = {}
    for prog in programs:
        text = prog.as_text()
        module = re.search(r"^HloModule (\S+?)[,\s]", text, re.M).group(1)
        for m in re.finditer(r"%(\S+) = (\S+) .*?op_name=\"([^\"]+)\"", text):
            op, shape, name = m.groups()
            table[(module, op)] = (category(name, shape, vocab), "/while/body/" in name)
    return table


def traced_seconds(fn, table: dict) -> dict:
    """Run ``fn`` under jax's profiler; seconds per (category, loop) of the XLA ops the trace shows."""
    import jax

    out, unmatched = collections.Counter(), 0.0
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d, create_perfetto_trace=True)
        fn()
        jax.profiler.stop_trace()
        (path,) = glob.glob(f"{d}/**/perfetto_trace.json.gz", recursive=True)
        events = json.load(gzip.open(path))
    for e in events["traceEvents"] if isinstance(events, dict) else events:
        args = e.get("args") or {}
        if e.get("ph") != "X" or "hlo_op" not in args:
            continue
        key = table.get((args.get("hlo_module"), args["hlo_op"]))
        if re.match(r"(while|conditional|call)(\.\d+)?$", args["hlo_op"]):
            continue  # control flow: its event encloses the ops it runs, which are counted themselves
        if key is None:
            unmatched += e["dur"] / 1e6
            continue
        out[key] += e["dur"] / 1e6
    res = {f"{cat}_{'loop' if loop else 'outside'}_s": round(s, 4) for (cat, loop), s in sorted(out.items())}
    res["unmatched_s"] = round(unmatched, 4)
    return res


def standalone_dot_flops(rows: int, k: int, n: int) -> float:
    """FLOP/s of one jitted ``x @ w`` at the gate/up shape (median of 20 calls): this machine's XLA:CPU dot rate."""
    import jax
    import jax.numpy as jnp

    x, w = jnp.ones((rows, k), jnp.float32), jnp.ones((k, n), jnp.float32)
    return 2 * rows * k * n / median_call_s(jax.jit(lambda a, b: a @ b), x, w)


def bench_cell(cell: str, mcfg: dict, reps: int) -> dict:
    from rltpu.config import ModelConfig, SamplerConfig
    from rltpu.models.spec import param_shapes
    from rltpu.sampling.engine import SamplerEngine

    engine, rest = cell.split(":")
    mode, rows = rest.split("_b")
    rows, n_new = int(rows), NEW[mode]
    cfg = ModelConfig(**mcfg)
    V = cfg.vocab_size
    shapes = {k: (tuple(s), cfg.dtype) for k, s in param_shapes(cfg, V).items()}
    scfg = SamplerConfig(group_size=2, temperature=1.0, max_new_tokens=n_new, batch_buckets=(rows,),
                         prompt_buckets=(32,))
    eng = SamplerEngine(cfg, scfg, V, PAD, V if mode == "fixed" else EOS, shapes)  # fixed: no reachable stop
    eng.set_params(random_params(shapes, cfg.dtype, seed=0), 0)
    t0 = time.perf_counter()
    if engine == "continuous":
        eng.precompile(engine="continuous")
    else:
        eng.precompile(cells=[(rows, 32, n_new)], engine="static")
    compile_s = time.perf_counter() - t0
    prompts = prompts_for(rows, V, 1, seed=0)
    eng.generate(prompts, 1, 0, engine=engine)
    calls = []
    for i in range(reps):
        t = time.perf_counter()
        out = eng.generate(prompts, 1, 1 + i, engine=engine)
        wall = time.perf_counter() - t
        assert int(out["compiles"]) == 0, f"{cell}: {out['compiles']} compiles in a timed call"
        calls.append({"wall_s": wall, "tokens": int(np.sum(out["lengths"])), "decode_steps": int(out["decode_steps"]),
                      "ran": out["engine"], "slot_steps": int(out.get("slot_steps") or rows * int(out["decode_steps"]))})
    med = sorted(calls, key=lambda c: c["wall_s"])[len(calls) // 2]
    # the traced call repeats calls[0] (seed 1): same rows, same slot-steps
    ops = traced_seconds(lambda: eng.generate(prompts, 1, 1, engine=engine), op_table(eng.programs(), V))
    # executed linear FLOPs inside the loop: every slot-step (a row's step; the static engine runs every row
    # every step) runs every projection
    lin_params = sum(int(np.prod(s)) for k, (s, _) in shapes.items() if k.endswith("proj.weight"))
    slot_steps = med["slot_steps"]
    lin_s = ops.get("linear_loop_s", 0.0)
    res = {"cell": cell, "engine_ran": med["ran"], "rows": rows, "new_tokens": n_new, "compile_s": round(compile_s, 2),
           "wall_s": round(med["wall_s"], 4), "tokens": med["tokens"],
           "tokens_per_s": round(med["tokens"] / med["wall_s"], 1), "decode_steps": med["decode_steps"],
           "ms_per_step": round(1000 * med["wall_s"] / med["decode_steps"], 3), "slot_steps": slot_steps,
           "traced_ops_s": ops, "traced_ops_total_s": round(sum(ops.values()), 4),
           "linear_loop_flops_per_s": round(2 * lin_params * calls[0]["slot_steps"] / lin_s / 1e9, 1) if lin_s else None,
           "standalone_dot_flops_per_s": round(standalone_dot_flops(
               rows if engine == "static" else min(rows, 64), cfg.hidden_size, 2 * cfg.intermediate_size) / 1e9, 1)}
    log(f"{cell}: {res['tokens_per_s']} tok/s, {res['ms_per_step']} ms/step; ops {ops}")
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", default=CELLS, help="engine:mode_bROWS, comma-separated")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="a 0.1M model: checks the script, nothing to quote")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    env = backend.configure_threads(args.threads)
    backend.configure_precision("highest")
    import jax

    from all import commit_info  # benchmarks/all.py: the commit and any dirty files measured

    doc = {"benchmark": "rollout engines' compiled programs, time per op category (jax profiler, XLA:CPU)",
           "command": " ".join([Path(sys.executable).name, *sys.argv]), "model": SMOKE if args.smoke else MODEL,
           "env": {"jax": jax.__version__, "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                   **env, "loadavg_start": os.getloadavg(),
                   **commit_info()},
           "cells": [bench_cell(c, SMOKE if args.smoke else MODEL, args.reps) for c in args.cells.split(",")]}
    doc["env"]["loadavg_end"] = os.getloadavg()
    text = json.dumps(doc, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
