"""Every figure README.md quotes, measured again in one command.

    .venv/bin/python benchmarks/all.py [--only quickstart,plan,...] [--seeds 0,1,2,3,4] [--readme]
    make bench                         (the same; ONLY=part,part for a subset)

Runs each part's benchmark as a subprocess that prints one JSON document (the command is recorded
per part) and writes ``benchmarks/results/<machine>-<YYYY-MM-DD>.json`` with the machine (platform,
CPU model, cores, RAM), the git commit and whether the tree was dirty, the date, and per part its
command, exit code, wall seconds, ``/proc/loadavg`` before and after and the 1-minute load sampled
every 5 s while it ran. ``--only`` runs a subset and merges it into the same day's file (parts not
run keep their earlier entry, each with its own commit and date).

``--readme`` rewrites README.md's figure blocks (``<!-- bench:NAME -->`` ... ``<!-- /bench:NAME -->``)
from the newest results file (``--results FILE`` picks another); alone it measures nothing.
``tests/test_bench_results.py`` renders the same blocks from the newest *committed* results file
and fails if README differs: a README figure cannot change without a new measurement.

Parts (each in its quick mode where one exists; the results file has each part's wall seconds):
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"
QS_KEEP = Path("/tmp") / "rltpu-bench-quickstart"  # seed 0's run dir is what the plan part compares with

# name -> (script and arguments, what it is for). The quickstart's seeds come from --seeds.
PARTS = {
    "quickstart": (["benchmarks/quickstart.py", "--keep", str(QS_KEEP)],
                   "the quickstart as `make demo` runs it, per seed (README: The quickstart)"),
    "plan": (["benchmarks/plan_against.py"],
             "rltpu plan's cpu prediction vs the quickstart's seed-0 run (README: Planning a placement)"),
    "modes": (["benchmarks/modes.py", "--chips", "2"],
              "the quickstart workload in each placement mode on 2 chips (README: Placement modes)"),
    "sampler": (["benchmarks/sampler.py", "--quick"], "rltpu's sampler vs HF generate (README: Benchmarks)"),
    "compile_cache": (["benchmarks/compile_cache.py", "--repeats", "2"],
                      "cold vs warm compile cache, time to first sample (README: Benchmarks)"),
    "trainer": (["benchmarks/trainer.py"], "trainer step, 1 process vs 2 FSDP2 ranks (README: Benchmarks)"),
    "envs": (["benchmarks/envs.py", "--out", "-"],
             "the two multi-turn examples from random init, and with env.max_turns=1 (README: Multi-turn environments)"),
    "lora": (["benchmarks/lora.py", "--out", "-"],
             "the quickstart full-parameter and with LoRA rank 8 through rltpu train (README: LoRA)"),
}
__doc__ += "".join(f"\n  {k:14s} {v[1]}" for k, v in PARTS.items()) + "\n"


# -- machine, commit, load ----------------------------------------------------------------------


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    ram = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                ram = round(int(line.split()[1]) * 1024 / 2**30, 1)
    except OSError:
        pass
    affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {"platform": platform.platform(), "cpu_model": cpu, "cores": os.cpu_count(),
            "cpu_affinity": affinity, "ram_gib": ram, "python": platform.python_version(),
            "accelerator": "none (chips are emulated Ray resources; everything runs on the CPU)"}


def machine_slug(m: dict) -> str:
    cpu = re.sub(r"\(r\)|\(tm\)|processor|cpu|@.*$|\d+-core", "", m["cpu_model"].lower())
    cpu = re.sub(r"[^a-z0-9]+", "-", cpu).strip("-") or "cpu"
    return f"{cpu}-{m['cores']}core"


def git(*args: str, strip: bool = True) -> str:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.strip() if strip else out


def commit_info() -> dict:
    # the results file itself is rewritten part by part: it does not make the measured code dirty
    dirty = [ln[3:] for ln in git("status", "--porcelain", "--untracked-files=no", strip=False).splitlines()
             if ln and not ln[3:].startswith("benchmarks/results/")]
    return {"commit": git("rev-parse", "HEAD") or None, "dirty": bool(dirty), "dirty_files": dirty[:50]}


def loadavg() -> list[float]:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return list(os.getloadavg())


class LoadSampler(threading.Thread):
    """The 1-minute load average every ``every`` seconds while a part runs."""

    def __init__(self, every: float = 5.0):
        super().__init__(daemon=True)
        self.every, self.samples, self.stop = every, [], threading.Event()

    def run(self):
        while not self.stop.wait(self.every):
            self.samples.append(loadavg()[0])

    def summary(self) -> dict:
        s = self.samples or [loadavg()[0]]
        return {"samples": len(s), "mean_1m": round(sum(s) / len(s), 2), "max_1m": max(s)}


def train_run(config: str, seed: int, *overrides: str, prefix: str = "rltpu-bench-") -> tuple[dict, list[dict]]:
    """``rltpu train CONFIG seed=SEED progress=false OVERRIDES`` in a fresh run dir (embedded Ray), the load
    sampled while it runs: ({command, load[, error] | wall_s, steps, reward_first5, reward_last5, the median
    step/sample/train seconds after step 1, curve}, metrics rows)."""
    import statistics
    import tempfile

    run_dir = Path(tempfile.mkdtemp(prefix=prefix))
    cmd = ["rltpu", "train", config, f"seed={seed}", "progress=false", *overrides, "--run-dir", str(run_dir)]
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0")
    load = LoadSampler()
    load.start()
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "rltpu.cli", *cmd[1:]], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=3600)
    wall = time.perf_counter() - t0
    load.stop.set()
    out = {"command": " ".join(cmd[:-2]), "load": load.summary()}
    if res.returncode:
        return out | {"error": res.stderr.strip().splitlines()[-8:]}, []
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steady = recs[1:] or recs
    return out | {"wall_s": round(wall, 1), "steps": len(recs),
                  "reward_first5": round(statistics.fmean(r["reward_mean"] for r in recs[:5]), 4),
                  "reward_last5": round(statistics.fmean(r["reward_mean"] for r in recs[-5:]), 4),
                  **{k: round(statistics.median(r[k] for r in steady), 4) for k in ("step_s", "sample_s", "train_s")},
                  "curve": [round(r["reward_mean"], 3) for r in recs]}, recs


# -- running parts ------------------------------------------------------------------------------


def rel_python() -> str:
    exe = Path(sys.executable)
    try:
        return str(exe.relative_to(ROOT))
    except ValueError:
        return str(exe)


def parse_json(stdout: str):
    text = stdout.strip()
    try:
        return json.loads(text)
    except ValueError:
        start = text.find("\n{")
        return json.loads(text[start + 1:]) if start >= 0 else None


def run_part(name: str, argv: list[str], timeout: float) -> dict:
    cmd = [sys.executable, *argv]
    shown = " ".join([rel_python(), *map(shlex.quote, argv)])
    print(f"bench: {name}: {shown}", file=sys.stderr, flush=True)
    entry = {"command": shown, "started": dt.datetime.now().isoformat(timespec="seconds"), **commit_info(),
             "loadavg_before": loadavg()}
    sampler = LoadSampler()
    sampler.start()
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")  # no TorchTPU/libtpu import on CPU, as rltpu's own processes
    t0 = time.perf_counter()
    try:
        res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        rc, out, err = res.returncode, res.stdout, res.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = "timeout", (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), \
            f"timed out after {timeout:.0f} s"
    entry["wall_s"] = round(time.perf_counter() - t0, 1)
    sampler.stop.set()
    sampler.join()
    entry["loadavg_after"] = loadavg()
    entry["load_during"] = sampler.summary()
    entry["returncode"] = rc
    try:
        entry["result"] = parse_json(out)
    except ValueError:
        entry["result"] = None
    if rc != 0 or entry["result"] is None:
        entry["stderr_tail"] = (err or "").strip().splitlines()[-15:]
    print(f"bench: {name}: rc {rc}, {entry['wall_s']} s, load {entry['loadavg_before'][0]} -> "
          f"{entry['loadavg_after'][0]}", file=sys.stderr, flush=True)
    return entry


def part_argv(name: str, seeds: str, ran: dict) -> list[str]:
    argv = list(PARTS[name][0])
    if name == "quickstart":
        argv += ["--seeds", seeds]
    if name == "plan":  # compare with the quickstart's seed-0 run when this invocation just made one
        qs = ran.get("quickstart")
        if qs and qs.get("returncode") == 0 and (QS_KEEP / "seed0" / "metrics.jsonl").is_file() and \
                any(r.get("seed") == 0 for r in qs["result"]["runs"]):
            argv += ["--run-dir", str(QS_KEEP / "seed0")]
    return argv


# -- results files ------------------------------------------------------------------------------

FILE_RE = re.compile(r"^(?P<machine>.+)-(?P<date>\d{4}-\d{2}-\d{2})\.json$")


def latest_results(committed: bool = False) -> Path | None:
    """The newest results file by the date in its name (then by its ``updated`` time)."""
    if committed:
        names = [ROOT / p for p in git("ls-files", "benchmarks/results").splitlines() if p.endswith(".json")]
        if not names and not (ROOT / ".git").exists():  # an unpacked tarball: what is there
            names = list(RESULTS.glob("*.json"))
    else:
        names = list(RESULTS.glob("*.json"))
    # only the top level: benchmarks/results/single/ holds one benchmark's own files, not all.py's
    names = [p for p in names if p.parent == RESULTS and FILE_RE.match(p.name) and p.is_file()]
    if not names:
        return None

    def key(p: Path):
        try:
            updated = json.loads(p.read_text()).get("updated", "")
        except ValueError:
            updated = ""
        return FILE_RE.match(p.name)["date"], updated

    return max(names, key=key)


# -- README blocks ------------------------------------------------------------------------------
# Each block is rendered from a results document alone. The tests' bounds quoted in a block are
# listed in TEST_BOUNDS and checked against the test files by tests/test_bench_results.py.

TEST_BOUNDS = [  # (test file, code the test runs): each bound quoted in a block
    ("tests/test_e2e.py", 'assert wall < 300'),
    ("tests/test_e2e.py", "assert first5 <= 0.2 and last5 >= 0.8"),
    ("tests/test_e2e.py", 'assert all(r["compiles"] == 0 for r in m[1:])'),
    ("tests/test_e2e.py", "max(probes) <= 1e-4"),
    ("tests/test_e2e_modes.py", "first5 <= 0.2 and last5 >= TARGET"),
    ("tests/test_e2e_modes.py", "TARGET, PROMPTS = 0.5, 32"),
    ("tests/test_plan.py", "assert all(abs(e) <= 0.50 for e in errs.values())"),
    ("tests/test_e2e_algorithms.py", "STEPS = 30"),
    ("tests/test_e2e_algorithms.py", "assert last5 > first5 + 0.1"),
    ("tests/test_e2e_envs.py", "assert _mean(m[-5:]) <= 0.15"),
]


def _src(doc: dict, path: Path, only: str) -> str:
    return f"`benchmarks/results/{path.name}` (`python benchmarks/all.py --only {only}`)"


def _load(entry: dict) -> str:
    return (f"load {entry['loadavg_before'][0]:g} → {entry['loadavg_after'][0]:g} "
            f"(mean {entry['load_during']['mean_1m']:g})")


class MissingPart(Exception):
    pass


def _part(doc: dict, name: str) -> dict:
    entry = doc["parts"].get(name)
    if not entry or entry.get("returncode") != 0 or not entry.get("result"):
        raise MissingPart(f"no successful `{name}` part; `python benchmarks/all.py --only {name}` measures it")
    return entry


def _rng(vals, fmt) -> str:
    lo, hi = fmt.format(min(vals)), fmt.format(max(vals))
    return lo if lo == hi else f"{lo}–{hi}"


def _sci(x: float) -> str:
    m, e = f"{x:.1e}".split("e")
    return f"{m}e{int(e)}"


def _pct(x: float) -> str:
    return f"{x:.0%}"


def _signed_pct(x: float) -> str:
    s = f"{x:+.0%}"
    return s.replace("-", "−")


def block_quickstart(doc: dict, path: Path) -> str:
    e = _part(doc, "quickstart")
    res = e["result"]
    runs = [r for r in res["runs"] if "error" not in r]
    s0 = next(r for r in runs if r["seed"] == 0)
    many = len(runs) > 1
    seeds = _rng([r["seed"] for r in runs], "{}")
    head = (f"Measured on the machine described under [Benchmarks](#benchmarks), from {_src(doc, path, 'quickstart')}, "
            f"{_load(e)} over the part. Seed 0 is `make demo`"
            + (f"; seeds {seeds} are `seed=N`" if many else "") + ". The last column is the bound "
            "`tests/test_e2e.py` checks (with `sync.verify_every=4`); a figure without one is measured, not tested.")
    cols = "| figure | seed 0 |" + (f" seeds {seeds} |" if many else "") + " test's bound |"
    sep = "|---|---|" + ("---|" if many else "") + "---|"

    def row(name, one, all_, bound):
        return f"| {name} | {one} |" + (f" {all_} |" if many else "") + f" {bound} |"

    rows = [
        row("wall time, incl. Ray start and compilation", f"{s0['wall_s']:.0f} s",
            _rng([r["wall_s"] for r in runs], "{:.0f}") + " s", "< 300 s"),
        row("steps run (stops when the last-5 mean reward reaches `trainer.target_reward` 0.95; at most 100)",
            f"{s0['steps']}", _rng([r["steps"] for r in runs], "{}"), "measured, not tested"),
        row("mean reward, first 5 steps → last 5 steps", f"{s0['reward_first5']:.3f} → {s0['reward_last5']:.3f}",
            _rng([r["reward_first5"] for r in runs], "{:.3f}") + " → "
            + _rng([r["reward_last5"] for r in runs], "{:.3f}"), "≤ 0.2 → ≥ 0.8"),
        row(f"step time, median of steps 2–{s0['steps']} (sample / train / sync)",
            f"{s0['step_s']:.3f} s ({s0['sample_s']:.3f} / {s0['train_s']:.3f} / {s0['sync_s']:.3f})",
            _rng([r["step_s"] for r in runs], "{:.3f}") + " s", "measured, not tested"),
        row("compilations after step 1", f"{s0['compiles_after_step1']}",
            _rng([r["compiles_after_step1"] for r in runs], "{}"), "0"),
        row("sampler-vs-trainer logit gap on a probe after sync, max", _sci(s0["probe_max_diff"]),
            "≤ " + _sci(max(r["probe_max_diff"] for r in runs)), "≤ 1e-4"),
    ]
    tail = f"The policy has {res['params']:,} parameters."
    return "\n".join([head, "", cols, sep, *rows, "", tail])


def block_modes(doc: dict, path: Path) -> str:
    e = _part(doc, "modes")
    res = e["result"]
    m = res["modes"]
    half = res["chips"] // 2
    head = (f"`benchmarks/modes.py --chips {res['chips']}` runs the quickstart workload in all three on the same "
            f"{res['chips']} chips, one core each. From {_src(doc, path, 'modes')}, {_load(e)}; medians of steps "
            f"2–{res['steps']}; idle share = 1 − (own work + sync) / wall. Measured, not tested:")
    out = [head, "",
           f"| mode, {res['chips']} chips | step | sample / train / sync | idle: samplers / trainers | reward, last 5 |",
           "|---|---|---|---|---|"]
    if "on_policy" in m:
        r = m["on_policy"]
        idle = r["idle_share"]
        out.append(f"| disaggregated on-policy, {half} + {half} | {r['step_s']:.3f} s | {r['sample_s']:.3f} / "
                   f"{r['train_s']:.3f} / {r['sync_s']:.3f} s | {_pct(idle['sampler_chips'])} / "
                   f"{_pct(idle['trainer_chips'])} | {r['reward_last5']:.3f} |")
    if "async_s1" in m:
        r = m["async_s1"]
        idle = r["idle_share"]
        ov = f" ({r['overlap_vs_on_policy']:.2f}× on-policy sample + train)" if "overlap_vs_on_policy" in r else ""
        out.append(f"| async, staleness 1, TIS, {half} + {half} | {r['step_s']:.3f} s{ov} | wait {r['sample_s']:.3f} "
                   f"(generate {r['sampler_busy_s']:.3f}) / {r['train_s']:.3f} / {r['sync_s']:.3f} s | "
                   f"{_pct(idle['sampler_chips'])} / {_pct(idle['trainer_chips'])} | {r['reward_last5']:.3f} |")
    if "colocated" in m:
        r = m["colocated"]
        out.append(f"| colocated, {res['chips']} processes | {r['step_s']:.3f} s | {r['sample_s']:.3f} / "
                   f"{r['train_s']:.3f} / {r['sync_s']:.3f} s | {_pct(r['idle_share']['colocated_chips'])} (one group) "
                   f"| {r['reward_last5']:.3f} |")
        out += ["", f"Colocated peak RSS: {r['proc_peak_rss_mb'] / 1024:.2f} GB per process (largest "
                    f"`proc_peak_rss_mb` of the run), almost all of it the torch + JAX runtimes."]
    return "\n".join(out)


def block_plan(doc: dict, path: Path) -> str:
    e = _part(doc, "plan")
    res = e["result"]
    ph = res["phases"]
    mb = res.get("microbench") or {}
    if res.get("run_dir_given"):
        qs = doc["parts"]["quickstart"]
        run = f"the quickstart part's seed-0 run ({_load(qs)})"
        only = "quickstart,plan"
    else:
        run = (f"a quickstart run of its own (load {res['run_loadavg_before'][0]:g} → "
               f"{res['run_loadavg_after'][0]:g})")
        only = "plan"
    head = (f"The quickstart on this machine, from {_src(doc, path, only)}: `rltpu plan configs/quickstart.yaml "
            f"--hardware cpu --rebench --against RUN` with the micro-benchmark measured in the part (load "
            f"{mb.get('load_avg_1m', float('nan')):.1f} when it started), RUN being {run}; medians of steps "
            f"2–{res['steps']}. These errors are measured, not tested: `tests/test_plan.py` checks "
            f"|error| ≤ 50% for sample, train and sync against a 20-step run (a cost-model bound: the same "
            f"code timed minutes apart on this shared VM drifts by up to 30%).")
    out = [head, "", "| phase | predicted | measured | error |", "|---|---|---|---|"]
    for name in ("sample", "train", "sync", "step"):
        r = ph[name]
        out.append(f"| {name} | {r['predicted_s']:.4f} s | {r['measured_s']:.4f} s | {_signed_pct(r['error'])} |")
    return "\n".join(out)


def block_benchmarks(doc: dict, path: Path) -> str:
    sp, cc, tr = _part(doc, "sampler"), _part(doc, "compile_cache"), _part(doc, "trainer")
    s = sp["result"]["summary"]
    q32, m32 = s["quickstart"]["B32"], s["llama20m"]["B32"]
    params = sp["result"]["models"]["llama20m"]["params"]
    n20 = params["total"] if isinstance(params, dict) and "total" in params else params
    c = cc["result"]
    t = tr["result"]
    return "\n".join([
        f"Measured, not tested, on the machine above; from `benchmarks/results/{path.name}` "
        f"(`python benchmarks/all.py --only sampler,compile_cache,trainer`):",
        f"- Sampler vs HF `generate` at batch 32, warm tokens/s (`benchmarks/sampler.py --quick`, {_load(sp)}): "
        f"{q32['ratio']:.1f}× on the quickstart model; {m32['ratio']:.1f}× on a {n20 / 1e6:.1f}M model, with rltpu at "
        f"{_pct(m32['rltpu_frac_peak'])} of the measured fp32 GEMM peak and HF at {_pct(m32['hf_frac_peak'])}. "
        f"Where a decode step's time goes: `benchmarks/sampler_profile.py`.",
        f"- A warm compile cache (`benchmarks/compile_cache.py --repeats 2`, {_load(cc)}) takes engine start to first "
        f"sample on the quickstart grid from {c['cold']['engine_to_sample_s']:.1f} s to "
        f"{c['warm']['engine_to_sample_s']:.1f} s (median of 2 restarts each).",
        f"- Trainer (`benchmarks/trainer.py`, {t['model']['params'] / 1e6:.1f}M model, {t['workload']['rows_per_rank']} "
        f"rows × {t['workload']['len']} tokens per rank, {_load(tr)}): one process reaches "
        f"{_pct(t['single']['frac_of_peak'])} of the GEMM peak; {t['workload']['ranks']} FSDP2 ranks "
        f"{_pct(t['fsdp']['frac_of_peak'])} of each rank's one-core peak; FSDP time per token is "
        f"{t['fsdp_overhead_ratio']:.2f}× the single process.",
        "- Algorithm presets: no figures here. `tests/test_e2e_algorithms.py` checks that each preset's last-5 mean "
        "reward beats its first 5 by more than 0.1 within 30 steps (on half the quickstart's prompts a step at 3x its lr, "
        "one sampler and one trainer chip); `benchmarks/algorithms.py` prints the 100-step "
        "figures.",
    ])


def block_envs(doc: dict, path: Path) -> str:
    e = _part(doc, "envs")
    runs = e["result"]["runs"]
    head = (f"Measured from {_src(doc, path, 'envs')}, {_load(e)} over the part, seed 0: each example until its "
            "`trainer.target_reward` (0.9, last-5 mean) or its `trainer.steps`, then the same config with `env.max_turns=1` "
            "(the policy's first turn only) for as many steps. Measured, not tested (the suite's bound: "
            "`tests/test_e2e_envs.py` checks the guess game's `max_turns=1` last-5 mean ≤ 0.15 after 20 steps).")
    rows = ["| example | wall time, incl. Ray start and compilation | steps | mean reward, first 5 → last 5 | "
            "policy turns per episode at the end | `env.max_turns=1`: first 5 → last 5 |", "|---|---|---|---|---|---|"]
    for name, r in runs.items():
        full, one = r["multi_turn"], r["max_turns_1"]
        if "error" in full or "error" in one:
            rows.append(f"| {name} | failed: see the results file | | | | |")
            continue
        rows.append(f"| `configs/env_{name}.yaml` | {full['wall_s']:.0f} s | {full['steps']} | "
                    f"{full['reward_first5']:.3f} → {full['reward_last5']:.3f} | {full['turns_last']:.2f} | "
                    f"{one['reward_first5']:.3f} → {one['reward_last5']:.3f} |")
    return "\n".join([head, "", *rows])


def block_lora(doc: dict, path: Path) -> str:
    e = _part(doc, "lora")
    runs = e["result"]["runs"]
    head = (f"Measured from {_src(doc, path, 'lora')}, {_load(e)} over the part, seed 0: `rltpu train "
            "configs/quickstart.yaml` until its `trainer.target_reward` (0.95, last-5 mean) or 100 steps, as configured "
            "and with `trainer.lora.rank=8 trainer.lr=3e-3` (default targets: the seven projections and `lm_head`); "
            "then both on the Hugging Face example, `rltpu train configs/hf_chat.yaml` (a tiny random Llama "
            "written by `transformers`, its word-level tokenizer and chat template, a chat JSONL file: "
            f"`{'`, `'.join(e['result']['hf_commands'])}`), until its target 0.9 or 150 steps. "
            "Bytes per sync: what each step's sync moved (the start-up sync, before step 1, sends the base too). "
            "Measured, not tested (the suite's bound: `tests/test_e2e_lora.py` checks that a LoRA run's reward rises "
            "and that every step's sync is adapter-only, the bytes equal to the adapters' by hand).")
    rows = ["| run | wall time, incl. Ray start and compilation | steps | mean reward, first 5 → last 5 | "
            "bytes per sync (each step) | median step | median sync |", "|---|---|---|---|---|---|---|"]
    names = {"full": "full-parameter", "lora_rank8": "LoRA rank 8, lr 3e-3",
             "hf_full": "`hf_chat.yaml`: full-parameter", "hf_lora_rank8": "`hf_chat.yaml`: LoRA rank 8, lr 3e-3"}
    for name, r in runs.items():
        if "error" in r:
            rows.append(f"| {names.get(name, name)} | failed: see the results file | | | | | |")
            continue
        b = ", ".join(f"{x:,}" for x in r["sync_bytes"]) + (" (adapters only)" if r["adapter_only_every_step"] else "")
        rows.append(f"| {names.get(name, name)} | {r['wall_s']:.0f} s | {r['steps']} | {r['reward_first5']:.3f} → "
                    f"{r['reward_last5']:.3f} | {b} | {r['step_s']:.3f} s | {r['sync_s']:.4f} s |")
    out = [head, "", *rows]
    q = e["result"].get("qwen2_0_5b") or {}
    if "runs" in q:
        gb = lambda b: f"{b / 1e9:.2f} GB" if b >= 1e8 else f"{b / 1e6:.1f} MB"  # noqa: E731
        per = {k: list(v["per_rank"].values()) for k, v in q["runs"].items()}
        rng = lambda k, f: " / ".join(sorted({gb(r[f]) for r in per[k]}))  # noqa: E731
        full, lo = q["runs"]["full"], q["runs"]["lora"]
        out += ["", f"A {q['model']['shape']}-shaped policy ({q['model']['layers']} layers, {q['model']['dtype']}, "
                f"{q['model']['params']:,} params; LoRA rank {q['lora_rank']}: {q['model']['lora_params']:,} adapter "
                f"params; tied embeddings, so no `lm_head` adapter) on {q['ranks']} gloo FSDP2 ranks, one GRPO step each "
                f"way, measured on the live engines per rank (same file, `{q['command']}`):", "",
                "| per rank | full-parameter | LoRA |", "|---|---|---|"]
        for label, f in (("parameters (frozen base / trained)", "param_base_bytes"), ("gradients", "grad_bytes"),
                         ("AdamW states", "adam_bytes"), ("peak RSS (one step)", "peak_rss"), ("step time", None)):
            if f is None:
                secs = {k: " / ".join(sorted({"%.1f s" % r["step_s"] for r in per[k]})) for k in ("full", "lora")}
                out.append(f"| {label} | {secs['full']} | {secs['lora']} |")
                continue
            out.append(f"| {label} | {rng('full', f)} | {rng('lora', f)}"
                       + (f" + {rng('lora', 'param_adapter_bytes')} adapters" if f == "param_base_bytes" else "") + " |")
        out.append(f"| bytes per sync after the first (all trainer streams) | {full['sync_bytes_per_step']:,} | "
                   f"{lo['sync_bytes_per_step']:,} ({full['sync_bytes_per_step'] / lo['sync_bytes_per_step']:.0f}× fewer; "
                   f"the first: {lo['first_sync_bytes']:,}) |")
    return "\n".join(out)


BLOCKS = {"quickstart": block_quickstart, "modes": block_modes, "plan": block_plan, "benchmarks": block_benchmarks,
          "envs": block_envs, "lora": block_lora}
MACHINE_BLOCK = "machine"


def block_machine(doc: dict, path: Path) -> str:
    m = doc["machine"]
    return (f"The machine of `benchmarks/results/{path.name}`: {m['cpu_model']}, {m['cores']} cores, "
            f"{m['ram_gib']} GiB RAM, {m['platform']}, no accelerator; commit `{(doc.get('commit') or '?')[:12]}`"
            f"{' (tree dirty)' if doc.get('dirty') else ''}, {doc['date']}. The load figures are `/proc/loadavg` "
            f"1-minute averages: other work shared the machine.")


BLOCKS[MACHINE_BLOCK] = block_machine


def render(name: str, doc: dict, path: Path) -> str:
    """A block's markdown; a part that is missing or failed in the file leaves no figures, only a note."""
    try:
        return BLOCKS[name](doc, path)
    except MissingPart as err:
        return f"No figures here: `benchmarks/results/{path.name}` has {err}."


def block_re(name: str) -> re.Pattern:
    return re.compile(rf"(<!-- bench:{name} -->\n)(.*?)(\n<!-- /bench:{name} -->)", re.S)


def update_readme(path: Path, readme: Path = README) -> list[str]:
    doc = json.loads(path.read_text())
    text = readme.read_text()
    done = []
    for name in BLOCKS:
        pat = block_re(name)
        if not pat.search(text):
            continue
        body = render(name, doc, path)
        text = pat.sub(lambda mt: mt.group(1) + body + mt.group(3), text)
        done.append(name)
    readme.write_text(text)
    return done


# -- main ---------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(f"  {k:14s} {v[1]}" for k, v in PARTS.items()))
    ap.add_argument("--only", default=None, help="comma-separated parts (default: all)")
    ap.add_argument("--seeds", default="0,1,2,3,4", help="the quickstart's seeds")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per part")
    ap.add_argument("--readme", action="store_true", help="rewrite README's figure blocks from the newest results file")
    ap.add_argument("--results", default=None, help="with --readme: this results file instead of the newest")
    args = ap.parse_args()
    if args.readme and not args.only:
        path = Path(args.results) if args.results else latest_results()
        if not path:
            sys.exit("benchmarks/all.py: no results file yet; run benchmarks/all.py first")
        print(f"README blocks from {path.name}: {', '.join(update_readme(path))}")
        return 0
    names = [n.strip() for n in (args.only or ",".join(PARTS)).split(",") if n.strip()]
    bad = [n for n in names if n not in PARTS]
    if bad:
        sys.exit(f"benchmarks/all.py: unknown part {bad[0]!r}; choose from {', '.join(PARTS)}")
    m = machine()
    date = dt.date.today().isoformat()
    out = RESULTS / f"{machine_slug(m)}-{date}.json"
    doc = json.loads(out.read_text()) if out.is_file() else {"parts": {}}
    prev = latest_results()
    if not out.is_file() and prev is not None:
        # a new day's file starts with the newest file's parts (each keeps its own commit, start time and load,
        # and says where it came from), so the newest file always holds every figure README quotes
        doc["parts"] = {k: v | {"carried_from": v.get("carried_from", prev.name)}
                        for k, v in json.loads(prev.read_text()).get("parts", {}).items()}
    doc.update({"machine": m, "date": date, "command": " ".join([rel_python(), "benchmarks/all.py", *sys.argv[1:]])})
    ran = {}
    t0 = time.perf_counter()
    for name in names:
        ran[name] = run_part(name, part_argv(name, args.seeds, ran), args.timeout)
        doc["parts"][name] = ran[name]
        doc.update(commit_info(), updated=dt.datetime.now().isoformat(timespec="seconds"))
        RESULTS.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1) + "\n")  # after every part: a later failure keeps the rest
    doc["last_run_wall_s"] = round(time.perf_counter() - t0, 1)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    failed = [n for n in names if ran[n]["returncode"] != 0]
    print(f"bench: wrote {out.relative_to(ROOT)} ({', '.join(names)}; {doc['last_run_wall_s']:.0f} s)"
          + (f"; FAILED: {', '.join(failed)}" if failed else ""), file=sys.stderr)
    if args.readme:
        print(f"README blocks from {out.name}: {', '.join(update_readme(out))}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
