"""The quickstart as ``make demo`` runs it, once per seed: wall time, reward, phase times, compiles, probe gap.

    .venv/bin/python benchmarks/quickstart.py [--seeds 0,1,2,3,4] [--keep DIR] [--out FILE]

Each seed is one ``rltpu train configs/quickstart.yaml seed=S progress=false --run-dir DIR`` (what
``make demo`` runs, with the seed set and the progress bar off), from random weights on emulated
chips, in a fresh process that starts its own Ray. Reported per seed (the JSON carries the command):

* ``wall_s``: the whole command, Ray start and compilation included;
* ``reward_first5`` / ``reward_last5``: mean reward of the first and the last 5 steps;
* ``step_s``, ``sample_s``, ``train_s``, ``sync_s``: medians over the steps after the first;
* ``compiles_after_step1``: programs compiled in steps 2..N (0: the grid was compiled before step 1);
* ``probe_max_diff``: the largest sampler-vs-trainer logit difference on the probe after a sync
  (``sync.verify_every``), and how many probes ran;
* ``params``: the policy's parameter count.

``--keep DIR`` keeps each run directory as ``DIR/seed<S>`` (``benchmarks/plan_against.py`` reads
seed 0's). Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/quickstart.yaml"


def summarize(recs: list[dict]) -> dict:
    steady = recs[1:] or recs
    med = lambda k: round(statistics.median(r[k] for r in steady), 4)  # noqa: E731
    probes = [r["sync_probe_max_diff"] for r in recs if r.get("sync_probe_max_diff") is not None]
    return {
        "steps": len(recs), "emulated": recs[-1]["emulated"],
        "reward_first5": round(statistics.fmean(r["reward_mean"] for r in recs[:5]), 4),
        "reward_last5": round(statistics.fmean(r["reward_mean"] for r in recs[-5:]), 4),
        "step_s": med("step_s"), "sample_s": med("sample_s"), "train_s": med("train_s"), "sync_s": med("sync_s"),
        "compiles_after_step1": sum(r["compiles"] for r in recs[1:]),
        "probes": len(probes), "probe_max_diff": max(probes) if probes else None,
    }


def params() -> int:
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")  # no TorchTPU/libtpu import on CPU
    sys.path.insert(0, str(ROOT))
    from rltpu.config import load_config
    from rltpu.data.char_tokenizer import CharTokenizer
    from rltpu.models.torch_llama import init_state_dict

    cfg = load_config(ROOT / CONFIG)
    return sum(t.numel() for t in init_state_dict(cfg.model, CharTokenizer().vocab_size, 0).values())


def run(seed: int, run_dir: Path) -> dict:
    cmd = ["rltpu", "train", CONFIG, f"seed={seed}", "progress=false", "--run-dir", str(run_dir)]
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0")
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "rltpu.cli", *cmd[1:]], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=1800)
    wall = time.perf_counter() - t0
    if res.returncode:
        return {"command": " ".join(cmd), "seed": seed, "error": res.stderr.strip().splitlines()[-8:]}
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {"command": " ".join(cmd), "seed": seed, "wall_s": round(wall, 1), **summarize(recs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--keep", default=None, help="keep each run dir as DIR/seed<S>")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    runs = []
    for seed in seeds:
        print(f"quickstart: seed {seed} ...", file=sys.stderr, flush=True)
        if args.keep:
            run_dir = Path(args.keep) / f"seed{seed}"
            shutil.rmtree(run_dir, ignore_errors=True)
            run_dir.parent.mkdir(parents=True, exist_ok=True)
        else:
            run_dir = Path(tempfile.mkdtemp(prefix=f"rltpu-quickstart-s{seed}-"))
        runs.append(run(seed, run_dir))
        if not args.keep:
            shutil.rmtree(run_dir, ignore_errors=True)
    ok = [r for r in runs if "error" not in r]
    summary = {}
    if ok:
        summary = {
            "seeds": [r["seed"] for r in ok],
            "reward_last5_min": min(r["reward_last5"] for r in ok), "reward_last5_max": max(r["reward_last5"] for r in ok),
            "reward_first5_max": max(r["reward_first5"] for r in ok),
            "wall_s_max": max(r["wall_s"] for r in ok),
            "compiles_after_step1_max": max(r["compiles_after_step1"] for r in ok),
            "probe_max_diff_max": max((r["probe_max_diff"] for r in ok if r["probe_max_diff"] is not None), default=None),
        }
    doc = {"benchmark": "quickstart", "config": CONFIG, "params": params(), "runs": runs, "summary": summary}
    text = json.dumps(doc, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if len(ok) < len(runs):
        sys.exit(1)


if __name__ == "__main__":
    main()
