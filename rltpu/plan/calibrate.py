"""``rltpu plan CONFIG --against RUN_DIR``: predicted vs measured seconds per phase.

The prediction is for the run's own placement (the ``as configured`` candidate), not the
winner; its mode is the config's (``placement.mode``, ``staleness``). Measured figures are medians over the run's ``metrics.jsonl`` steps after the first (the
first step pays one-off warm-up; an async run's sample is ``sampler_busy_s``, the samplers' own
generate time, since the driver's wait overlaps training); compile is ``placement.json``'s
``compiling.wall_s``. Error is
(predicted - measured) / measured.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from rltpu.config import ConfigError
from rltpu.plan.planner import Plan

PHASES = (("sample", "sample_s"), ("train", "train_s"), ("sync", "sync_s"), ("step", "step_s"))


def read_run(run_dir: str | Path) -> dict:
    d = Path(run_dir)
    path = d / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(f"--against {d}: no metrics.jsonl there; point it at a finished `rltpu train` run dir")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        raise ConfigError(f"--against {d}: metrics.jsonl is empty; let the run finish at least one step")
    steady = rows[1:] or rows
    out = {"steps": len(rows), "emulated": bool(rows[0].get("emulated", True))}
    stale = any(r.get("staleness") for r in steady)
    for name, key in PHASES:
        if name == "sample" and stale:  # async: the driver barely waits; the samplers' own time
            key = "sampler_busy_s"
        vals = [r[key] for r in steady if key in r]
        out[name] = statistics.median(vals) if vals else None
    place = d / "placement.json"
    if place.is_file():
        info = json.loads(place.read_text())
        out["compile"] = (info.get("compiling") or {}).get("wall_s")
        out["emulated"] = bool(info.get("emulated", out["emulated"]))
    return out


def compare(plan: Plan, run_dir: str | Path) -> dict:
    measured = read_run(run_dir)
    pred = plan.as_configured.phases
    rows = []
    for name, _ in (*PHASES, ("compile", None)):
        p, m = getattr(pred, name), measured.get(name)
        err = (p - m) / m if m else None
        rows.append({"phase": name, "predicted_s": p, "measured_s": m, "error": err})
    return {"run_dir": str(run_dir), "steps": measured["steps"], "emulated": measured["emulated"],
            "candidate": plan.as_configured.name, "label": plan.label(), "phases": rows}


def format_table(cmp: dict) -> str:
    out = [f"# {cmp['candidate']} vs {cmp['run_dir']} ({cmp['steps']} steps, median after step 1)",
           f"> {cmp['label']}", "", "| phase | predicted | measured | error |", "|---|---|---|---|"]
    for r in cmp["phases"]:
        m = f"{r['measured_s']:.4f} s" if r["measured_s"] is not None else "-"
        e = f"{r['error']:+.0%}" if r["error"] is not None else "-"
        note = " (one-off, uncalibrated)" if r["phase"] == "compile" else ""
        out.append(f"| {r['phase']}{note} | {r['predicted_s']:.4f} s | {m} | {e} |")
    return "\n".join(out) + "\n"
