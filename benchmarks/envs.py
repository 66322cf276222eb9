"""The two bundled multi-turn examples from random init, and each with the environment's turn removed.

    .venv/bin/python benchmarks/envs.py [--examples calculator,guess] [--seed 0] [--out FILE]

For each example: ``rltpu train configs/env_<example>.yaml`` (until its target reward or its step
limit), then the same config with ``env.max_turns=1`` for as many steps as the first run took (the
policy's first turn only: no tool result, no feedback). Reported per run: wall time (Ray start and
compilation included), steps, mean reward of the first and last 5 steps, policy turns per episode
at the end, median step/sample/train seconds, and the machine, load and commit. Writes
``benchmarks/results/single/envs-<machine>-<date>.json`` unless ``--out`` says otherwise (``-``: only
print it, as ``benchmarks/all.py --only envs`` runs it); prints it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from all import LoadSampler, commit_info, loadavg, machine, machine_slug  # noqa: E402


def run(config: str, seed: int, *overrides: str) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix="rltpu-envs-"))
    cmd = ["rltpu", "train", config, f"seed={seed}", "progress=false", *overrides, "--run-dir", str(run_dir)]
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0")
    load = LoadSampler()
    load.start()
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "rltpu.cli", *cmd[1:]], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=3600)
    wall = time.perf_counter() - t0
    load.stop.set()
    out = {"command": " ".join(cmd[:-2]), "load": load.summary()}
    if res.returncode:
        return out | {"error": res.stderr.strip().splitlines()[-8:]}
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steady = recs[1:] or recs
    med = lambda k: round(statistics.median(r[k] for r in steady), 3)  # noqa: E731
    return out | {
        "wall_s": round(wall, 1), "steps": len(recs),
        "reward_first5": round(statistics.fmean(r["reward_mean"] for r in recs[:5]), 4),
        "reward_last5": round(statistics.fmean(r["reward_mean"] for r in recs[-5:]), 4),
        "turns_last": recs[-1]["env_turns_mean"], "step_s": med("step_s"), "sample_s": med("sample_s"),
        "train_s": med("train_s"), "curve": [round(r["reward_mean"], 3) for r in recs],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", default="calculator,guess")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    m = machine()
    doc = {"benchmark": "envs", "machine": m, "date": dt.date.today().isoformat(), **commit_info(),
           "load_at_start": loadavg(), "runs": {}}
    for name in args.examples.split(","):
        config = f"configs/env_{name}.yaml"
        print(f"envs: {name} ...", file=sys.stderr, flush=True)
        full = run(config, args.seed)
        steps = full.get("steps", 30)
        print(f"envs: {name} without the environment's turn ({steps} steps) ...", file=sys.stderr, flush=True)
        ablated = run(config, args.seed, "env.max_turns=1", f"trainer.steps={steps}", "trainer.target_reward=null")
        doc["runs"][name] = {"multi_turn": full, "max_turns_1": ablated}
    text = json.dumps(doc, indent=1)
    print(text)
    if args.out != "-":  # '-': stdout only (benchmarks/all.py keeps it in the day's results file)
        out = Path(args.out) if args.out else ROOT / "benchmarks/results/single" / f"envs-{machine_slug(m)}-{doc['date']}.json"
        out.write_text(text + "\n")
    if any("error" in r for runs in doc["runs"].values() for r in runs.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
