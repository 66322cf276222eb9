"""Soak (issue 19): many steps of a tiny config; the driver's RSS is sampled as steps complete and
must stay flat (bounded spans, events, records; files are the record).

    python benchmarks/soak.py --steps 5000 --early 500       # the acceptance run
    python benchmarks/soak.py --steps 600 --early 100        # a reduced run

One JSON document: driver RSS (MB) per sampled step, the growth from step ``--early`` to the end,
``trace.json``'s event count against ``health.trace_max_spans``, wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")  # no libtpu in the harness process
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
ENV = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"} | {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
TINY = ["placement.sampler_chips=1", "placement.trainer_chips=1", "trainer.prompts_per_step=4", "sampler.group_size=2",
        "sampler.batch_buckets=[8]", "sampler.max_new_tokens=2", "model.hidden_size=32", "model.intermediate_size=64",
        "model.num_hidden_layers=1", "model.num_attention_heads=2", "model.num_key_value_heads=1",
        "sync.verify_every=0", "checkpoint.every_steps=0", "progress=false", "health.trace_max_spans=2000",
        "health.trace_every_s=5", "trainer.target_reward=null"]  # every step runs


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--early", type=int, default=500, help="the step whose RSS is the baseline")
    ap.add_argument("--every", type=int, default=100, help="sample RSS every this many steps")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    run_dir = Path(tempfile.mkdtemp(prefix="rltpu-soak-")) / "run"
    cmd = [sys.executable, "-m", "rltpu.cli", "train", str(QUICKSTART), f"run_dir={run_dir}",
           f"trainer.steps={args.steps}", *TINY]
    log = open(run_dir.parent / "train.log", "w+")
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    samples: dict[int, float] = {}
    metrics = run_dir / "metrics.jsonl"
    while proc.poll() is None:
        n = metrics.read_bytes().count(b"\n") if metrics.exists() else 0
        mark = n - n % args.every
        if n and mark not in samples and (mark == args.early or n % args.every < 5):
            try:
                samples[mark] = round(rss_mb(proc.pid), 1)
            except OSError:
                break
        if n >= args.steps:
            try:
                rss = round(rss_mb(proc.pid), 1)
            except OSError:
                rss = 0.0
            if rss:  # 0: the process is already exiting (no VmRSS)
                samples[args.steps] = rss
        time.sleep(0.05)
    rc = proc.wait()
    trace = json.loads((run_dir / "trace.json").read_text()) if (run_dir / "trace.json").exists() else {}
    events = len([e for e in trace.get("traceEvents", []) if e.get("ph") == "X"])
    base = samples.get(args.early) or next((v for k, v in sorted(samples.items()) if k >= args.early), None)
    last = samples[max(samples)] if samples else None  # the newest sample taken while the driver ran
    doc = {"steps": args.steps, "rc": rc, "rss_mb": dict(sorted(samples.items())), "early_step": args.early,
           "rss_early_mb": base, "rss_last_mb": last,
           "growth_mb": round(last - base, 1) if base is not None and last is not None else None,
           "trace_events": events, "trace_cap": 2000 + 2000 // 4, "wall_s": round(time.time() - t0, 1)}
    print(json.dumps(doc, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1))
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    return 0 if rc == 0 and doc["growth_mb"] is not None and doc["growth_mb"] <= 50 else 1


if __name__ == "__main__":
    sys.exit(main())
