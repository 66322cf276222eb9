"""Restarted sampler, cold vs warm persistent compilation cache: time to the first sample.

    .venv/bin/python benchmarks/compile_cache.py [CONFIG] [--repeats 3] [--set sampler.prompt_buckets=[8,16] ...]

Each measurement is a fresh process (what a restarted actor is): import, build the engine for the
config's model and sampler grid, precompile, load weights, generate once. The first process
starts with an empty cache directory; the next one finds it filled. ``first_sample_s`` counts
from process start (Python + library imports included, a fixed cost the cache cannot remove);
``engine_to_sample_s`` counts from engine construction (JAX backend start, programs, first
generate). Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, time
t_start = float(sys.argv[3])
from rltpu.config import load_config
from rltpu.sampling.engine import SamplerEngine, enable_compile_cache
from rltpu.data.char_tokenizer import CharTokenizer
from rltpu.sync.collective import param_spec
from rltpu.models import jax_llama
from rltpu.models.torch_llama import init_state_dict
enable_compile_cache(sys.argv[2])
cfg = load_config(sys.argv[1], json.loads(sys.argv[4]))
tok = CharTokenizer()
spec = param_spec(cfg.model, tok.vocab_size)
weights = init_state_dict(cfg.model, tok.vocab_size, 0)  # in a restart these arrive by weight sync
t_engine = time.time()
eng = SamplerEngine(cfg.model, cfg.sampler, tok.vocab_size, tok.pad_id, tok.eos_id, {n: (s, d) for n, s, d in spec})
eng.precompile()
eng.set_params(jax_llama.params_from_torch(weights), 0)
prompts = [tok.encode("c1234=")] * (cfg.sampler.batch_buckets[-1] // cfg.sampler.group_size)
eng.generate(prompts, cfg.sampler.group_size, seed=0)
t_end = time.time()
print(json.dumps({"first_sample_s": t_end - t_start, "engine_to_sample_s": t_end - t_engine,
                  "programs": eng.stats.compiles, "cache_hits": eng.stats.cache_hits,
                  "compile_s": eng.stats.compile_seconds}))
"""


def run_child(config: str, cache: str, overrides: list[str]) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    res = subprocess.run([sys.executable, "-c", CHILD, config, cache, repr(time.time()), json.dumps(overrides)],
                         cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    if res.returncode:
        raise SystemExit(res.stderr[-3000:])
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config", nargs="?", default=str(ROOT / "configs" / "quickstart.yaml"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--set", nargs="*", default=[], help="dotted config overrides (e.g. a larger sampler grid)")
    args = ap.parse_args()
    cold, warm = [], []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="rltpu-jax-cache-") as cache:
            cold.append(run_child(args.config, cache, args.set))
            warm.append(run_child(args.config, cache, args.set))
    med = lambda rs, k: statistics.median(r[k] for r in rs)  # noqa: E731
    print(json.dumps({
        "config": args.config, "overrides": args.set, "repeats": args.repeats, "programs": cold[0]["programs"],
        "cold": {"first_sample_s": med(cold, "first_sample_s"), "engine_to_sample_s": med(cold, "engine_to_sample_s"),
                 "compile_s": med(cold, "compile_s"), "cache_hits": cold[0]["cache_hits"]},
        "warm": {"first_sample_s": med(warm, "first_sample_s"), "engine_to_sample_s": med(warm, "engine_to_sample_s"),
                 "compile_s": med(warm, "compile_s"), "cache_hits": warm[0]["cache_hits"]},
        "speedup_first_sample": med(cold, "first_sample_s") / med(warm, "first_sample_s"),
        "speedup_engine_to_sample": med(cold, "engine_to_sample_s") / med(warm, "engine_to_sample_s"),
    }, indent=1))


if __name__ == "__main__":
    main()
