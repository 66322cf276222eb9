"""Chaos (issue 19): SIGKILL random sampler and trainer actors at random moments of a quickstart run;
the run must still complete every step with a clean prompt ledger, and every restart must show in
``rltpu status`` (health.json ``restarts`` / events).

    python benchmarks/chaos.py --steps 50 --kills 10          # the acceptance run
    python benchmarks/chaos.py --steps 12 --kills 3           # a reduced run

One JSON document on stdout and in ``--out`` (default ``benchmarks/results/single/chaos-<machine>-<date>.json``):
kills (when, whom, pid), steps completed, ledger problems, restarts and events as ``rltpu status``
reports them (the table's restarts column per actor must cover every kill of that actor), and the
machine, commit and load (as ``benchmarks/all.py`` records them).
"""

from __future__ import annotations

import argparse
import json
import os
import random
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


def bench_all():
    """benchmarks/all.py as a module: machine(), commit_info(), loadavg(), LoadSampler."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("rltpu_bench_all", ROOT / "benchmarks" / "all.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def status_restarts(text: str) -> dict[str, int]:
    """``rltpu status``'s table: '<group>-<rank>' -> its restarts column."""
    lines = text.splitlines()
    head = next((i for i, ln in enumerate(lines) if ln.split()[:2] == ["group", "rank"]), None)
    if head is None:
        return {}
    assert lines[head].split()[-2:] == ["restarts", "state"], lines[head]
    out = {}
    for ln in lines[head + 1:]:  # a cell may hold spaces ('cpu/gloo (emulated)'): restarts is the next-to-last
        f = ln.split()
        if len(f) < 4 or not f[1].isdigit() or not f[-2].isdigit():
            break
        out[f"{f[0]}-{f[1]}"] = int(f[-2])
    return out


def main() -> int:
    import datetime as dt
    from collections import Counter

    from rltpu.observe.health import read_health
    from rltpu.observe.ledger import check, effective, read_ledger
    from rltpu.observe.metrics import read_metrics

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="default: benchmarks/results/single/chaos-<machine>-<date>.json")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    A = bench_all()
    mach = A.machine()
    out = Path(args.out) if args.out else (ROOT / "benchmarks" / "results" / "single" /
                                          f"chaos-{A.machine_slug(mach)}-{dt.date.today().isoformat()}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix="rltpu-chaos-")) / "run"
    cmd = [sys.executable, "-m", "rltpu.cli", "train", str(QUICKSTART), f"run_dir={run_dir}",
           f"trainer.steps={args.steps}", "trainer.target_reward=null", "progress=false", "sync.verify_every=0", "checkpoint.every_steps=3",
           f"health.max_restarts={args.kills}"]
    meta = {"benchmark": "chaos", "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "train_command": " ".join(cmd[1:]), "machine": mach, **A.commit_info(),
            "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "loadavg_before": A.loadavg(),
            "run_dir": str(run_dir)}
    load = A.LoadSampler(every=15.0)
    load.start()
    log = open(run_dir.parent / "train.log", "w+")
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    # kill moments: spread over the steps (a random step, then a random fraction of a step's time)
    at_steps = sorted(rng.sample(range(1, args.steps), min(args.kills, args.steps - 1)))
    kills = []

    def steps_done() -> int:
        m = run_dir / "metrics.jsonl"
        return len(read_metrics(m)) if m.exists() else 0

    for target in at_steps:
        while proc.poll() is None and steps_done() < target:
            time.sleep(0.2)
        if proc.poll() is not None:
            break
        time.sleep(rng.uniform(0.0, 1.5))
        try:
            actors = [a for a in read_health(run_dir)["actors"] if a.get("pid") and a["state"] in ("ok", "restarted")]
        except (OSError, ValueError):
            actors = []
        if not actors:
            continue
        victim = rng.choice(actors)
        try:
            os.kill(victim["pid"], signal.SIGKILL)
        except ProcessLookupError:
            continue
        kills.append({"t_s": round(time.time() - t0, 1), "after_step": steps_done(), "actor": victim["key"],
                      "pid": victim["pid"]})
        print(json.dumps(kills[-1]), file=sys.stderr, flush=True)
        # wait for the replacement before the next kill (a kill of a half-built replacement counts twice)
        deadline = time.time() + 600
        while proc.poll() is None and time.time() < deadline:
            try:
                a = next(x for x in read_health(run_dir)["actors"] if x["key"] == victim["key"])
                if a.get("pid") and a["pid"] != victim["pid"] and a["state"] in ("ok", "restarted") \
                        and read_health(run_dir)["state"] == "running":
                    break
            except (OSError, ValueError, StopIteration):
                pass
            time.sleep(0.5)
    try:
        proc.wait(timeout=3600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    health = read_health(run_dir)
    ledger = read_ledger(run_dir / "ledger.jsonl")
    status = subprocess.run([sys.executable, "-m", "rltpu.cli", "status", str(run_dir)], cwd=ROOT, env=ENV,
                            capture_output=True, text=True)
    shown = status_restarts(status.stdout)
    # actor keys are '<group>-<rank>' (as the table's first two columns)
    unseen = {k: n for k, n in Counter(k["actor"] for k in kills).items() if shown.get(k, 0) < n}
    load.stop.set()
    doc = {**meta, "steps": args.steps, "kills": len(kills), "kills_planned": args.kills, "rc": proc.returncode,
           "steps_completed": len(effective(ledger)), "ledger_problems": check(ledger, args.steps, 64),
           "restarts": health.get("restarts"), "restart_events": sum(e["what"] in ("replaced", "restarted")
                                                                     for e in health.get("events", [])),
           "state": health.get("state"), "wall_s": round(time.time() - t0, 1), "kill_log": kills,
           "status_restarts": shown, "kills_not_shown_in_status": unseen, "status_rc": status.returncode,
           "status": status.stdout.splitlines(), "loadavg_after": A.loadavg(), "load_during": load.summary()}
    log.seek(0)
    doc["traceback"] = "Traceback" in log.read()
    print(json.dumps(doc, indent=1))
    out.write_text(json.dumps(doc, indent=1))
    ok = proc.returncode == 0 and doc["steps_completed"] == args.steps and not doc["ledger_problems"] \
        and doc["kills"] == args.kills and not unseen and not doc["traceback"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
