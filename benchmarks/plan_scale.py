"""``rltpu plan`` on the largest v5p slice: wall time, peak memory and report sizes.

    .venv/bin/python benchmarks/plan_scale.py [--config FILE] [--src DIR] [--keep DIR] [--out FILE]

Runs ``rltpu plan CONFIG --hardware v5p --out TMP`` in a fresh process (default CONFIG:
``configs/plan_llama8b_v5p_6144.yaml``, a Llama-3-8B shape on 16x16x24 = 6,144 chips, 2,048 sampler +
4,096 trainer chips; public v5p figures, no micro-benchmark) and prints one JSON document: wall
seconds of the whole command (interpreter start-up included), the child's peak RSS, and the bytes
of plan.html, plan.json, plan.md and ranks.csv. ``--src DIR`` runs the rltpu of another checkout
(e.g. a ``git worktree`` of an older commit) for a before/after. Speed is measured here, not
asserted in tests (the machine is shared).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "plan_llama8b_v5p_6144.yaml"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(CONFIG))
    ap.add_argument("--src", default=None, help="import rltpu from this checkout instead of this one")
    ap.add_argument("--keep", default=None, help="write the reports here and keep them")
    ap.add_argument("--out", default=None, help="also write the JSON document to this file")
    args = ap.parse_args()
    if not Path(args.config).is_file():
        sys.exit(f"plan_scale: no config at {args.config}")
    src = Path(args.src).resolve() if args.src else ROOT
    if not (src / "rltpu" / "cli.py").is_file():
        sys.exit(f"plan_scale: --src {src} has no rltpu/cli.py")
    tmp = Path(tempfile.mkdtemp(prefix="rltpu-plan-scale-"))
    out = Path(args.keep) if args.keep else tmp / "report"
    env = dict(os.environ, PYTHONPATH=str(src), RAY_USAGE_STATS_ENABLED="0")
    cmd = [sys.executable, "-m", "rltpu.cli", "plan", str(Path(args.config).resolve()), "--hardware", "v5p",
           "--out", str(out)]
    try:
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        res = subprocess.run(cmd, cwd=src, env=env, capture_output=True, text=True, timeout=1800)
        wall = time.perf_counter() - t0
        if res.returncode:
            sys.exit(f"plan_scale: rltpu plan failed: {res.stderr.strip().splitlines()[-1:]}")
        peak_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # Linux: KiB
        plan = json.loads((out / "plan.json").read_text())
        doc = {
            "benchmark": "plan_scale", "command": "rltpu plan " + " ".join(cmd[4:]), "src": str(src),
            "chips": plan["chips"], "candidates": len(plan["candidates"]), "winner": plan["winner"],
            "wall_s": round(wall, 2), "peak_rss_mb": round(peak_kb / 1024, 1), "load_avg_1m_before": load,
            "bytes": {name: (out / name).stat().st_size if (out / name).is_file() else None
                      for name in ("plan.html", "plan.json", "plan.md", "ranks.csv")},
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    text = json.dumps(doc, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
