"""Placement modes on the quickstart workload, on the same chips: step time, idle share per chip
group, reward after N steps.

    .venv/bin/python benchmarks/modes.py [--chips 2|4] [--steps 100] [--only on_policy,async_s1,colocated] [--out FILE]

Modes (each one ``rltpu train configs/quickstart.yaml <overrides>`` run; the JSON carries the command),
with ``--chips N`` (default 2):
  * ``on_policy``:  disaggregated, N/2 sampler + N/2 trainer chips, staleness 0 (sample, then train);
  * ``async_s1``:   the same chips, staleness 1 with truncated IS: the samplers generate step k+1
    while the trainers train step k;
  * ``colocated``:  N processes, each one chip hosting a trainer rank and a sampler; phases alternate.

Why 2 chips by default: an emulated chip is pinned to core ``chip_id % cores``. On a 2-core machine
the quickstart's own 4 chips put a sampler and a trainer on each core, so the two groups cannot
run at once whatever the schedule, and overlap shows up only as contention. With 2 chips each
process has a core of its own, as each process has its own chip on a TPU host. ``--chips 4`` runs
the quickstart's layout as configured.

Per mode, over the steps after the first (compilation and warm-up excluded): median step seconds,
median sample/train/sync seconds as the controller saw them, and each chip group's idle share:
``1 - busy / wall`` where a group's busy time is its own compute (``sampler_busy_s``, the mean
sampler's generate time; ``trainer_busy_s``, the slowest rank's update) plus the weight sync both
take part in. A colocated chip does both, so its busy time is the sum. ``overlap_vs_on_policy``
compares a mode's step time with the on-policy run's sample + train time (below 1: overlap).
On emulated chips every process shares this machine's cores, so "idle" means waiting on the other
group, not an idle core. Prints one JSON document.
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

def modes(chips: int) -> dict[str, list[str]]:
    half = [f"placement.sampler_chips={chips // 2}", f"placement.trainer_chips={chips // 2}"]
    if chips == 2:  # one sampler draws all 64 x 16 rows: a bucket that holds them
        half.append("sampler.batch_buckets=[1024]")
    return {
        "on_policy": half,
        "async_s1": [*half, "placement.staleness=1", "trainer.off_policy_correction=tis"],
        "colocated": ["placement.mode=colocated", f"placement.sampler_chips={chips}", f"placement.trainer_chips={chips}"],
    }


MODES = modes(4)  # names; the overrides depend on --chips


def summarize(recs: list[dict], mode: str) -> dict:
    """Figures of one run from its ``metrics.jsonl`` records (see the module docstring)."""
    steady = recs[1:] or recs
    med = lambda k: round(statistics.median(r[k] for r in steady), 4)  # noqa: E731
    wall = sum(r["step_s"] for r in steady)
    sync = sum(r["sync_s"] for r in steady)
    s_busy = sum(r["sampler_busy_s"] for r in steady)
    t_busy = sum(r["trainer_busy_s"] for r in steady)
    if mode == "colocated":
        idle = {"colocated_chips": round(1 - (s_busy + t_busy + sync) / wall, 3)}
    else:
        idle = {"sampler_chips": round(1 - (s_busy + sync) / wall, 3), "trainer_chips": round(1 - (t_busy + sync) / wall, 3)}
    out = {
        "steps": len(recs), "emulated": recs[-1]["emulated"],
        "step_s": med("step_s"), "sample_s": med("sample_s"), "train_s": med("train_s"), "sync_s": med("sync_s"),
        "sampler_busy_s": med("sampler_busy_s"), "trainer_busy_s": med("trainer_busy_s"), "idle_share": idle,
        "reward_first5": round(statistics.fmean(r["reward_mean"] for r in recs[:5]), 4),
        "reward_last5": round(statistics.fmean(r["reward_mean"] for r in recs[-5:]), 4),
        "staleness_max": max(r.get("staleness", 0) for r in recs),
    }
    if mode == "colocated":
        out["proc_peak_rss_mb"] = round(max(r["proc_peak_rss_mb"] for r in recs), 1)
    return out


def run(name: str, overrides: list[str], steps: int) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix=f"rltpu-mode-{name}-"))
    cmd = ["rltpu", "train", "configs/quickstart.yaml", *overrides, f"trainer.steps={steps}", "trainer.target_reward=null", "progress=false",
           "--run-dir", str(run_dir)]
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "rltpu.cli", *cmd[1:]], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=1800)
    wall = time.perf_counter() - t0
    if res.returncode:
        return {"command": " ".join(cmd), "error": res.stderr.strip().splitlines()[-8:]}
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    out = {"command": " ".join(cmd), "wall_s": round(wall, 1), **summarize(recs, name)}
    if name == "colocated":
        placement = json.loads((run_dir / "placement.json").read_text())
        out["processes"] = len(placement["actors"])
        out["memory_per_process"] = placement.get("memory")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--chips", type=int, choices=(2, 4), default=2)
    ap.add_argument("--only", default=",".join(MODES))
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args()
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    bad = [n for n in names if n not in MODES]
    if bad:
        sys.exit(f"benchmarks/modes.py: unknown mode {bad[0]!r}; choose from {', '.join(MODES)}")
    results, load = {}, os.getloadavg()[0]
    for name in names:
        print(f"modes: {name} ...", file=sys.stderr, flush=True)
        results[name] = run(name, modes(args.chips)[name], args.steps)
    ref = results.get("on_policy")
    if ref and "error" not in ref:
        for r in results.values():
            if "error" not in r:
                r["overlap_vs_on_policy"] = round(r["step_s"] / (ref["sample_s"] + ref["train_s"]), 3)
    doc = {"benchmark": "modes", "steps": args.steps, "chips": args.chips, "cores": os.cpu_count(), "load_avg_at_start": load, "modes": results}
    text = json.dumps(doc, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
