"""Soak (issue 19): many steps of a tiny config; the driver's RSS is sampled as steps complete and
must stay flat (bounded spans, events, records; files are the record).

    python benchmarks/soak.py --steps 5000 --early 500 --full   # the acceptance run (issue 34)
    python benchmarks/soak.py --steps 600 --early 100            # a reduced run

``--full`` runs what a user's long job runs: a checkpoint every 100 steps, the sync probe every 10 steps
and the live dashboard (any free loopback port), instead of all three off.

One JSON document: driver RSS (MB) per sampled step, the growth from step ``--early`` to the end,
``trace.json``'s event count against ``health.trace_max_spans``, wall time, the step rate, and the machine,
commit and load (as ``benchmarks/all.py`` records them). Written to ``--out`` (default
``benchmarks/results/single/soak-<machine>-<date>.json``) after every RSS sample, so a run stopped early
(SIGTERM/SIGINT to the harness: the training run is stopped, the partial curve kept, ``complete: false``)
still leaves its curve.
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
FULL = ["checkpoint.every_steps=100", "sync.verify_every=10", "dashboard.enabled=true", "dashboard.port=0"]


def bench_all():
    """benchmarks/all.py as a module: machine(), commit_info(), loadavg(), LoadSampler."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("rltpu_bench_all", ROOT / "benchmarks" / "all.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def main() -> int:
    import datetime as dt

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--early", type=int, default=500, help="the step whose RSS is the baseline")
    ap.add_argument("--every", type=int, default=100, help="sample RSS every this many steps")
    ap.add_argument("--out", default=None, help="default: benchmarks/results/single/soak-<machine>-<date>.json")
    ap.add_argument("--full", action="store_true", help="checkpoints every 100 steps, probes every 10, dashboard on")
    args = ap.parse_args()
    keys = {o.split("=")[0] for o in FULL}
    tiny = [*(o for o in TINY if o.split("=")[0] not in keys), *FULL] if args.full else TINY
    A = bench_all()
    mach = A.machine()
    out = Path(args.out) if args.out else (ROOT / "benchmarks" / "results" / "single" /
                                          f"soak-{A.machine_slug(mach)}-{dt.date.today().isoformat()}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix="rltpu-soak-")) / "run"
    cmd = [sys.executable, "-m", "rltpu.cli", "train", str(QUICKSTART), f"run_dir={run_dir}",
           f"trainer.steps={args.steps}", *tiny]
    meta = {"benchmark": "soak", "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "train_command": " ".join(cmd[1:]), "machine": mach, **A.commit_info(),
            "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "loadavg_before": A.loadavg(),
            "run_dir": str(run_dir), "full": args.full}
    load = A.LoadSampler(every=30.0)
    load.start()
    log = open(run_dir.parent / "train.log", "w+")
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    samples: dict[int, float] = {}
    times: dict[int, float] = {}
    metrics = run_dir / "metrics.jsonl"
    stop = {"sig": None}

    def on_signal(signum, _frame):
        stop["sig"] = signal.Signals(signum).name

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    def document(rc, final: bool) -> dict:
        base = samples.get(args.early) or next((v for k, v in sorted(samples.items()) if k >= args.early), None)
        last_step = max(samples) if samples else None
        last = samples[last_step] if samples else None  # the newest sample taken while the driver ran
        trace_events = None
        if final and (run_dir / "trace.json").exists():
            try:
                trace = json.loads((run_dir / "trace.json").read_text())
                trace_events = len([e for e in trace.get("traceEvents", []) if e.get("ph") == "X"])
            except ValueError:
                trace_events = None
        n = metrics.read_bytes().count(b"\n") if metrics.exists() else 0
        t_first = min(times.values()) if times else None
        rate = None
        if len(times) >= 2:
            (s0, ta), (s1, tb) = min(times.items()), max(times.items())
            rate = round((s1 - s0) / (tb - ta), 3) if tb > ta else None
        return {**meta, "steps": args.steps, "steps_reached": n, "complete": bool(final and rc == 0 and n >= args.steps),
                "stopped_by": stop["sig"], "rc": rc, "rss_mb": {str(k): v for k, v in sorted(samples.items())},
                "t_s": {str(k): v for k, v in sorted(times.items())}, "early_step": args.early,
                "rss_early_mb": base, "rss_last_mb": last, "rss_last_step": last_step,
                "growth_mb": round(last - base, 1) if base is not None and last is not None else None,
                "rss_max_after_early_mb": max((v for k, v in samples.items() if k >= args.early), default=None),
                "steps_per_s": rate, "first_sample_t_s": t_first,
                "trace_events": trace_events, "trace_cap": 2000 + 2000 // 4,
                "in_memory_bounds": {"health.trace_max_spans": 2000, "supervisor spans": 2000 // 4,
                                     "health.max_events": 200},
                "wall_s": round(time.time() - t0, 1), "loadavg_now": A.loadavg(), "load_during": load.summary()}

    def write(doc):
        tmp = out.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(doc, indent=1))
        os.replace(tmp, out)

    while proc.poll() is None and stop["sig"] is None:
        n = metrics.read_bytes().count(b"\n") if metrics.exists() else 0
        mark = n - n % args.every
        if n and mark not in samples and (mark == args.early or n % args.every < 5):
            try:
                samples[mark] = round(rss_mb(proc.pid), 1)
                times[mark] = round(time.time() - t0, 1)
            except OSError:
                break
            write(document(None, False))
            print(f"soak: step {n}: rss {samples[mark]} MB, {times[mark]} s", file=sys.stderr, flush=True)
        if n >= args.steps:
            try:
                rss = round(rss_mb(proc.pid), 1)
            except OSError:
                rss = 0.0
            if rss:  # 0: the process is already exiting (no VmRSS)
                samples[args.steps] = rss
                times[args.steps] = round(time.time() - t0, 1)
        time.sleep(0.05)
    if stop["sig"] is not None and proc.poll() is None:  # stopped early: stop the run the way a user would
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    rc = proc.wait()
    load.stop.set()
    doc = document(rc, True)
    print(json.dumps(doc, indent=1))
    write(doc)
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # stragglers of the run's process group
    except ProcessLookupError:
        pass
    ok = doc["complete"] and doc["growth_mb"] is not None and doc["growth_mb"] <= 50 \
        and doc["trace_events"] is not None and doc["trace_events"] <= doc["trace_cap"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
