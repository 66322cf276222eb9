"""Time to the end of the first step, by phase: what a user waits for before training starts.

The clock starts at the process's launch (the kernel's start time, so interpreter start-up and
imports count), not at ``Controller``'s construction. The controller's start-up phases are spans
of ``trace.json``'s controller track (``STARTUP``, in order); the first step's own phases follow
them; the actors' ``compiling`` and ``loading`` spans say what ``build`` waited for.
``first_step_report`` adds them up for the run's summary line.
"""

from __future__ import annotations

import os
import time

_IMPORTED = time.time()  # the fallback launch time where /proc is not there

# the controller's start-up phases, in order: python and the imports until Controller is built;
# the config's inputs read and checked (tokenizer, dataset, checkpoint headers); Ray started or
# joined; the chip actors' processes started, imported and their chips claimed; the process
# groups and reward workers; the trainers' weights loaded while the samplers compile; the first
# weight sync
STARTUP = ("imports", "prepare", "ray_start", "actors", "rendezvous", "build", "first_sync")


def launch_time() -> float:
    """Wall-clock time this process started (Linux: /proc's start tick against the uptime clock,
    10 ms resolution); elsewhere the time this module was first imported."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        t = time.time() - uptime + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return _IMPORTED
    return t if t <= _IMPORTED else _IMPORTED


def first_step_report(controller_spans: list[dict], actor_spans: list[dict], launch: float, end: float,
                      step: int) -> dict:
    """Seconds from ``launch`` to ``end`` (the first step's record written), split into the start-up
    phases and step ``step``'s phases (controller spans), with what ``build`` waited for
    (``actor_waits``)."""
    startup = {p: 0.0 for p in STARTUP}
    phases: dict[str, float] = {}
    for s in controller_spans:
        if s["phase"] in startup:
            startup[s["phase"]] += s["end"] - s["start"]
        elif s.get("step") == step and s["end"] <= end:
            phases[s["phase"]] = phases.get(s["phase"], 0.0) + s["end"] - s["start"]
    first = min((s["start"] for s in controller_spans if s.get("step") == step and s["phase"] not in startup),
                default=end)
    return {"first_step_s": end - launch, "step": step, "step_start": first, "startup_s": startup, "step_s": phases,
            "actors_s": actor_waits(actor_spans, first)}


def actor_waits(actor_spans: list[dict], before: float) -> dict:
    """The longest actor ``compiling`` (samplers) and ``loading`` (trainers) span that began before
    ``before``; None where none has arrived (heartbeats deliver spans a beat late)."""
    out = {}
    for name in ("compiling", "loading"):
        spans = [s["end"] - s["start"] for s in actor_spans if s["phase"] == name and s["start"] < before]
        out[name] = max(spans) if spans else None
    return out


def report_line(rep: dict) -> str:
    """``first step 38.0 s after launch (imports 12.7, ..., build 15.0 [compile 14.9, load 1.2], ...;
    step 1: sample 0.3, train 0.2, sync 0.0)``."""
    parts = []
    for name, s in rep["startup_s"].items():
        text = f"{name} {s:.1f}"
        if name == "build":
            inner = [f"{short} {rep['actors_s'][key]:.1f}" for key, short in (("compiling", "compile"),
                                                                               ("loading", "load"))
                     if rep["actors_s"].get(key) is not None]
            text += f" [{', '.join(inner)}]" if inner else ""
        parts.append(text)
    step = ", ".join(f"{k} {v:.1f}" for k, v in rep["step_s"].items())
    return f"first step {rep['first_step_s']:.1f} s after launch ({', '.join(parts)}; step {rep['step']}: {step})"
