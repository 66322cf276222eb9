"""Every advantage estimator / loss preset on the quickstart task: does it learn, and how fast.

    .venv/bin/python benchmarks/algorithms.py [--steps 100] [--only grpo,rloo] [--out FILE]

Each preset is one ``rltpu train configs/quickstart.yaml <overrides>`` run (the command printed in
the JSON is the one to reproduce it), from random weights, on emulated chips. Reported per preset:
mean reward over the first and last 5 steps, wall seconds of the whole command (Ray start and
compilation included), mean step seconds. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PRESETS = {
    "grpo": [],
    "dapo": ["trainer.clip_eps_high=0.28", "trainer.dynamic_sampling=true"],
    "drgrpo": ["trainer.algorithm=drgrpo"],
    # RLOO's advantages are not divided by the group std, so its steps are smaller: a higher lr
    "rloo": ["trainer.algorithm=rloo", "trainer.lr=0.002"],
    "reinforce_pp": ["trainer.algorithm=reinforce_pp"],
    "reinforce_pp_baseline": ["trainer.algorithm=reinforce_pp_baseline"],
    "ppo": ["trainer.algorithm=ppo", "critic.lr=0.001"],
    "grpo_kl_in_reward": ["trainer.kl_coef=0.001", "trainer.kl_in_reward=true", "trainer.kl_estimator=k1"],
}


def run(name: str, overrides: list[str], steps: int) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix=f"rltpu-alg-{name}-"))
    cmd = ["rltpu", "train", "configs/quickstart.yaml", *overrides, f"trainer.steps={steps}", "trainer.target_reward=null", "--run-dir", str(run_dir)]
    exe = [sys.executable, "-m", "rltpu.cli", *cmd[1:]]
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    t0 = time.perf_counter()
    res = subprocess.run(exe, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - t0
    if res.returncode:
        return {"command": " ".join(cmd), "error": res.stderr.strip().splitlines()[-8:]}
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {
        "command": " ".join(cmd), "steps": len(recs), "emulated": recs[-1]["emulated"],
        "reward_first5": round(mean([r["reward_mean"] for r in recs[:5]]), 4),
        "reward_last5": round(mean([r["reward_mean"] for r in recs[-5:]]), 4),
        "wall_s": round(wall, 1), "step_s": round(mean([r["step_s"] for r in recs]), 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--only", default=",".join(PRESETS))
    ap.add_argument("--out")
    args = ap.parse_args()
    out = {}
    for name in args.only.split(","):
        print(f"[algorithms] {name} ...", file=sys.stderr, flush=True)
        out[name] = run(name, PRESETS[name], args.steps)
        print(f"[algorithms] {name}: {out[name]}", file=sys.stderr, flush=True)
    doc = json.dumps({"task": "configs/quickstart.yaml", "presets": out}, indent=1)
    if args.out:
        Path(args.out).write_text(doc)
    print(doc)


if __name__ == "__main__":
    main()
