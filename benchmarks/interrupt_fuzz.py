"""Interrupt fuzz (issue 19): SIGTERM and SIGINT at random moments of a quickstart run, progress bar
on (a real pseudo-terminal, so tqdm draws) and off; every interrupt must end with exit 143/130, one
``rltpu: stopped by ...`` line and no traceback, a checkpoint that verifies (or, stopped during
start-up, none needed), and a ``--resume`` to the end whose ledger has no prompt lost or replayed and
whose metrics.jsonl has one line per step, in order, each at weight version = step.

    python benchmarks/interrupt_fuzz.py --trials 20 --steps 4            # 20 moments x 2 signals
    python benchmarks/interrupt_fuzz.py --trials 2 --steps 3 --out f.json  # a reduced run

One JSON document on stdout and in ``--out`` (default
``benchmarks/results/single/interrupt_fuzz-<machine>-<date>.json``, rewritten after every trial so a
stopped fuzz keeps what it measured): per trial the signal, progress mode, delay, the phase the driver
was in (from its stop line), exit codes and what failed; ``clean`` counts; the machine, commit and
load (as ``benchmarks/all.py`` records them).
SIGTERM goes to the driver only (as ``kill`` or a scheduler sends it); SIGINT to the whole
process group (as Ctrl-C in a terminal does).
"""

from __future__ import annotations

import argparse
import json
import os
import pty
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")  # no libtpu in the harness process
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
ENV = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"} | {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}  # the product default: token auth


def bench_all():
    """benchmarks/all.py as a module: machine(), commit_info(), loadavg(), LoadSampler."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("rltpu_bench_all", ROOT / "benchmarks" / "all.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


EXTRA: list[str] = []  # overrides every run of the fuzz gets (--compile-cache)


def launch(run_dir: Path, steps: int, progress: bool, resume: bool = False, extra: tuple = ()):
    cmd = [sys.executable, "-m", "rltpu.cli", "train", str(QUICKSTART), f"run_dir={run_dir}", f"trainer.steps={steps}",
           f"progress={'true' if progress else 'false'}", "sync.verify_every=2", "checkpoint.every_steps=2",
           # every planned step runs: the quickstart stops once learned (about 65 steps), and a run with a
           # long --tail would otherwise end at its target, short of the steps the checks expect
           "trainer.target_reward=null", *EXTRA, *extra, *(["--resume"] if resume else [])]
    if progress:  # a pseudo-terminal: the tqdm bar path, carriage returns and all
        master, slave = pty.openpty()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave,
                                start_new_session=True)
        os.close(slave)
        buf = bytearray()

        def drain():
            while True:
                try:
                    chunk = os.read(master, 65536)
                except OSError:
                    break
                if not chunk:
                    break
                buf.extend(chunk)

        t = threading.Thread(target=drain, daemon=True)
        t.start()
        return proc, lambda: (t.join(timeout=10), os.close(master), buf.decode("utf-8", "replace"))[2]
    out = open(run_dir.parent / f"{run_dir.name}.{'resume' if resume else 'run'}.log", "w+")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)
    return proc, lambda: (out.seek(0), out.read())[1]


def trial(i: int, sig: int, progress: bool, delay: float, steps: int, base: Path, after_step: int = 0) -> dict:
    """``after_step`` 0: the signal ``delay`` s after launch; k > 0: ``delay`` s after step k's metrics line."""
    run_dir = base / f"t{i}"
    res = {"trial": i, "signal": signal.Signals(sig).name, "progress": progress, "after_step": after_step,
           "delay_s": round(delay, 2)}
    proc, output = launch(run_dir, steps, progress)
    t0 = time.time()
    metrics = run_dir / "metrics.jsonl"
    while after_step and proc.poll() is None and \
            (metrics.read_bytes().count(b"\n") if metrics.exists() else 0) < after_step:
        time.sleep(0.05)
    t1 = time.time()
    while time.time() - t1 < delay and proc.poll() is None:
        time.sleep(0.02)
    res["signal_at_s"] = round(time.time() - t0, 1)
    if proc.poll() is not None:
        res["problems"] = [f"run ended (rc {proc.returncode}) before the signal"]
        return res
    (os.kill(proc.pid, sig) if sig == signal.SIGTERM else os.killpg(proc.pid, sig))
    try:
        proc.wait(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    text = output()
    res["rc"] = proc.returncode
    problems = []
    want = 143 if sig == signal.SIGTERM else 130
    if proc.returncode != want:
        problems.append(f"exit {proc.returncode}, want {want}")
    if "Traceback" in text:
        problems.append("traceback: " + text[text.index("Traceback"):][:400])
    stops = [ln.strip() for ln in re.split(r"[\r\n]", text) if "rltpu: stopped by" in ln]
    if len(stops) != 1:
        problems.append(f"{len(stops)} stop lines")
    else:
        res["line"] = stops[0][stops[0].index("rltpu:"):]
        m = re.search(r"\(in (\w+)\)|during start-up \((\w[\w ]*)\)|(before anything ran)|while (shutting down|exiting)",
                      stops[0])
        res["phase"] = next((g for g in (m.groups() if m else ()) if g), "start-up" if "start-up" in stops[0] else "?")
    from learner.checkpoint import latest_valid, verify_checkpoint

    ckpt = latest_valid(run_dir / "checkpoint")
    started = "during start-up" not in res.get("line", "") and "before anything ran" not in res.get("line", "")
    if ckpt is not None:
        try:
            res["checkpoint_step"] = int(verify_checkpoint(ckpt)["step"])
        except Exception as err:  # noqa: BLE001
            problems.append(f"checkpoint does not verify: {err}")
    elif started:
        problems.append("no checkpoint after a started run")
    proc2, output2 = launch(run_dir, steps, False, resume=True)
    proc2.wait(timeout=1800)
    res["resume_rc"] = proc2.returncode
    if proc2.returncode != 0:
        problems.append(f"--resume exit {proc2.returncode}: {output2()[-600:]}")
    from rltpu.observe.ledger import check, read_ledger

    ledger_problems = check(read_ledger(run_dir / "ledger.jsonl"), steps, 64)
    if ledger_problems:
        problems.append(f"ledger: {ledger_problems}")
    from rltpu.observe.metrics import read_metrics

    # one metrics line per step, in order, each after exactly that many updates (a signal during the train
    # dispatch once left a checkpoint one version short and its step without a line; the ledger was clean)
    lines = [(r["step"], r.get("weight_version")) for r in read_metrics(run_dir / "metrics.jsonl")]
    if lines != [(k, k) for k in range(1, steps + 1)]:
        problems.append(f"metrics (step, weight_version): {lines}")
    res["problems"] = problems
    return res


def main() -> int:
    import datetime as dt

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=20, help="moments per signal (each: progress on and off alternate)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--tail", type=int, default=0,
                    help="extra steps each run trains after the planned moments (the moments stay those of --steps): "
                         "on an idle machine a step takes about 1 s, so a moment up to --step-window s after the last "
                         "planned step can fall after a --steps run ended")
    ap.add_argument("--moments", choices=("steps", "time"), default="steps",
                    help="steps (default): a random step k in 0..steps-1, the signal a random 0..--step-window s after "
                         "step k's metrics line (k=0: 1..--startup-window s after launch), so the step phases are hit "
                         "whatever the machine's load; time: uniform 1..--max-delay s after launch")
    ap.add_argument("--startup-window", type=float, default=60.0)
    ap.add_argument("--step-window", type=float, default=3.0)
    ap.add_argument("--max-delay", type=float, default=None, help="--moments time: latest moment (s); default: a "
                    "measured run's length")
    ap.add_argument("--compile-cache", default=None, metavar="DIR",
                    help="sampler.compile_cache_dir for every run (the fuzz measures interrupts, not compiles)")
    ap.add_argument("--only", default=None, help="comma-separated trial numbers of the plan to run (a rerun)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None,
                    help="default: benchmarks/results/single/interrupt_fuzz-<machine>-<date>.json")
    ap.add_argument("--keep", action="store_true", help="keep the run directories")
    ap.add_argument("--shard", default="0/1", help="K/N: run only the trials i with i %% N == K (same plan, delays "
                    "and seed as the whole fuzz; pass the same --max-delay to every shard), for N processes at once")
    ap.add_argument("--merge", nargs="+", default=None, metavar="FILE",
                    help="measure nothing: merge the shards' JSON documents into --out")
    args = ap.parse_args()
    if args.merge:
        return merge(args)
    shard, shards = (int(x) for x in args.shard.split("/"))
    rng = random.Random(args.seed)
    A = bench_all()
    mach = A.machine()
    out = Path(args.out) if args.out else (ROOT / "benchmarks" / "results" / "single" /
                                          f"interrupt_fuzz-{A.machine_slug(mach)}-{dt.date.today().isoformat()}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="rltpu-fuzz-"))
    meta = {"benchmark": "interrupt_fuzz", "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "machine": mach, **A.commit_info(), "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "loadavg_before": A.loadavg(), "base_dir": str(base), "shard": args.shard}
    load = A.LoadSampler(every=30.0)
    load.start()
    t0 = time.time()
    if args.compile_cache:
        EXTRA.append(f"sampler.compile_cache_dir={Path(args.compile_cache).resolve()}")
    max_delay = args.max_delay if args.moments == "time" else 0.0
    if max_delay is None:  # one uninterrupted run sets the window: start-up to the last step
        proc, _ = launch(base / "reference", args.steps, False)
        proc.wait(timeout=1800)
        max_delay = time.time() - t0
    plan = [(sig, k % 2 == 0) for k in range(args.trials) for sig in (signal.SIGTERM, signal.SIGINT)]
    results = []

    def document() -> dict:
        from collections import Counter

        planned = sum(i % shards == shard and (only is None or i in only) for i in range(len(plan)))
        return {**meta, "trials_planned": planned, "plan_size": len(plan), "trials": len(results),
                "clean": sum(not r["problems"] for r in results), "steps": args.steps, "tail": args.tail,
                "max_delay_s": round(max_delay, 1), "phases": sorted({r.get("phase", "?") for r in results}),
                "phase_counts": dict(Counter(r.get("phase", "?") for r in results)),
                "wall_s": round(time.time() - t0, 1), "loadavg_now": A.loadavg(), "load_during": load.summary(),
                "results": results}

    # drawn for the whole plan: a shard's trials (and --only's) are the whole fuzz's
    if args.moments == "time":
        moments = [(0, rng.uniform(1.0, max_delay)) for _ in plan]
    else:
        moments = []
        for _ in plan:
            k = rng.randrange(args.steps)
            moments.append((k, rng.uniform(1.0, args.startup_window) if k == 0 else rng.uniform(0.0, args.step_window)))
    only = {int(x) for x in args.only.split(",")} if args.only else None
    meta |= {"moments": args.moments, "startup_window_s": args.startup_window, "step_window_s": args.step_window,
             "compile_cache": args.compile_cache, "only": sorted(only) if only else None}
    for i, (sig, progress) in enumerate(plan):
        if i % shards != shard or (only is not None and i not in only):
            continue
        results.append(trial(i, sig, progress, moments[i][1], args.steps + args.tail, base, after_step=moments[i][0]))
        print(json.dumps(results[-1]), file=sys.stderr, flush=True)
        out.write_text(json.dumps(document(), indent=1))
    load.stop.set()
    doc = document()
    clean = doc["clean"]
    print(json.dumps(doc, indent=1))
    out.write_text(json.dumps(doc, indent=1))
    if not args.keep:
        import shutil

        shutil.rmtree(base, ignore_errors=True)
    return 0 if clean == len(results) else 1


def merge(args) -> int:
    """One document from the shards' documents (trials sorted; counts recomputed). A trial in a later
    file replaces the same trial of an earlier one (a rerun with ``--only``); what it replaced is kept
    under ``superseded``, and the planned count is the plan's, not the files' sum."""
    from collections import Counter

    docs = [json.loads(Path(f).read_text()) for f in args.merge]
    by_trial: dict[int, dict] = {}
    superseded = []
    for d in docs:
        for r in d["results"]:
            if r["trial"] in by_trial:
                superseded.append(by_trial[r["trial"]] | {"commit": by_trial[r["trial"]].get("commit")})
            by_trial[r["trial"]] = r | {"commit": d.get("commit")}
    results = [by_trial[k] for k in sorted(by_trial)]
    first = docs[0]
    doc = {k: v for k, v in first.items() if k not in ("results", "shard", "base_dir", "command", "wall_s",
                                                        "loadavg_now", "load_during", "trials_planned")}
    keys = ("shard", "command", "commit", "dirty", "base_dir", "started", "wall_s", "loadavg_before", "loadavg_now",
            "load_during", "trials_planned", "trials", "clean", "only")
    doc |= {"shards": [s for d in docs for s in (d["shards"] if "shards" in d else [{k: d.get(k) for k in keys}])],
            "trials_planned": max(d.get("plan_size", d["trials_planned"]) for d in docs)
            if any("plan_size" in d for d in docs) else sum(d["trials_planned"] for d in docs),
            "trials": len(results), "superseded": superseded,
            "clean": sum(not r["problems"] for r in results),
            "phases": sorted({r.get("phase", "?") for r in results}),
            "phase_counts": dict(Counter(r.get("phase", "?") for r in results)),
            "wall_s": max(d["wall_s"] for d in docs), "results": results}
    print(json.dumps({k: v for k, v in doc.items() if k != "results"}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1))
    return 0 if doc["clean"] == doc["trials"] == doc["trials_planned"] else 1


if __name__ == "__main__":
    sys.exit(main())
