"""``rltpu plan`` for the quickstart on this CPU, predicted vs measured per phase.

    .venv/bin/python benchmarks/plan_against.py [--run-dir DIR] [--cached] [--out FILE]

1. Unless ``--run-dir`` names a finished quickstart run, trains one:
   ``rltpu train configs/quickstart.yaml progress=false --run-dir TMP``.
2. ``rltpu plan configs/quickstart.yaml --hardware cpu --rebench --against RUN --json`` with
   ``RLTPU_CACHE_DIR`` set to a fresh directory, so the cpu micro-benchmark is measured now, in this
   run (``--cached`` uses the machine's cached one instead). A failed micro-benchmark is tried once more.

Reported: the plan's predicted seconds and the run's measured medians (steps after the first) for
sample / train / sync / step, the error ``(predicted - measured) / measured``, and when and at what
load the micro-benchmark ran. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/quickstart.yaml"
ENV = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0")


def cli(*args: str, env=None, timeout=1800) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rltpu.cli", *args], cwd=ROOT, env=env or ENV, capture_output=True,
                          text=True, timeout=timeout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run-dir", default=None, help="a finished `rltpu train configs/quickstart.yaml` run dir")
    ap.add_argument("--cached", action="store_true", help="use the cached cpu micro-benchmark (no --rebench)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    doc: dict = {"benchmark": "plan_against", "config": CONFIG, "commands": []}
    tmp = Path(tempfile.mkdtemp(prefix="rltpu-plan-against-"))
    try:
        run_dir = Path(args.run_dir) if args.run_dir else tmp / "run"
        if not args.run_dir:
            cmd = ["train", CONFIG, "progress=false", "--run-dir", str(run_dir)]
            doc["commands"].append("rltpu " + " ".join(cmd))
            doc["run_loadavg_before"] = list(os.getloadavg())
            res = cli(*cmd)
            doc["run_loadavg_after"] = list(os.getloadavg())
            if res.returncode:
                sys.exit(f"plan_against: training failed: {res.stderr[-2000:]}")
        doc["run_dir_given"] = bool(args.run_dir)
        run_cfg = run_dir / "config.yaml"  # the engine the run sampled with (the planner costs the same one)
        if run_cfg.is_file():
            import yaml

            doc["sampler_engine"] = (yaml.safe_load(run_cfg.read_text()).get("sampler") or {}).get("engine")
        cache = tmp / "cache"
        env = dict(ENV, **({} if args.cached else {"RLTPU_CACHE_DIR": str(cache)}))
        cmd = ["plan", CONFIG, "--hardware", "cpu", *([] if args.cached else ["--rebench"]), "--against", str(run_dir),
               "--json"]
        doc["commands"].append("rltpu " + " ".join(cmd))
        errors = []
        for attempt in range(2):
            t0 = time.perf_counter()
            res = cli(*cmd, env=env)
            if res.returncode == 0:
                break
            errors.append(res.stderr.strip().splitlines()[-1:])
            print(f"plan_against: attempt {attempt + 1} failed: {errors[-1]}", file=sys.stderr, flush=True)
        else:
            sys.exit(f"plan_against: rltpu plan failed twice: {errors}")
        doc["plan_wall_s"] = round(time.perf_counter() - t0, 1)
        doc["failed_attempts"] = errors
        plan = json.loads(res.stdout)
        against = plan["against"]
        doc["candidate"] = against["candidate"]
        doc["label"] = against["label"]
        doc["steps"] = against["steps"]
        doc["emulated"] = against["emulated"]
        doc["phases"] = {r["phase"]: {"predicted_s": r["predicted_s"], "measured_s": r["measured_s"],
                                      "error": r["error"]} for r in against["phases"]}
        bench_file = (cache if not args.cached else
                      Path(os.environ.get("RLTPU_CACHE_DIR") or Path.home() / ".cache" / "rltpu")) / "cpu_microbench.json"
        if bench_file.is_file():
            bench = json.loads(bench_file.read_text())
            doc["microbench"] = {k: bench.get(k) for k in ("machine", "measured_at", "load_avg_1m", "bench_seconds",
                                                         "jax_sample_probes_cpu_share", "seconds_by_part")}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    text = json.dumps(doc, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
