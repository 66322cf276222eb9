"""Actor health: heartbeats, per-phase deadlines, the decision to fence, and ``health.json``.

    rltpu status runs/quickstart          # table of actors; exit 1 when the job is unhealthy

Who does what:
  * every chip-owning actor runs a ``Heartbeat`` thread that sends its report (group, rank, chips,
    host, pid, phase and how long it has been in it, step, weight version, RSS, compiles, last
    progress) to the ``HealthMonitor`` actor every ``health.heartbeat_s``: a thread, so an actor
    whose work loop hangs still reports, and one stopped whole (SIGSTOP) goes quiet;
  * ``decide`` (pure) turns the latest reports into verdicts: HUNG when a phase ran past its
    deadline (compiling long, syncing short) or the heartbeats stopped;
  * the controller's ``Watchdog`` thread polls the monitor, reports each hung actor (``on_hung``)
    and writes ``health.json``; it acts on nothing itself: the supervisor fences what it reports
    (Ray kill plus SIGKILL of the pid on this host, so they never write again) and replaces actors
    (``rltpu.control.supervisor``).
A heartbeat carries the actor's incarnation; the monitor drops beats from a fenced incarnation.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections import deque
from contextlib import contextmanager
from pathlib import Path

from rltpu.observe.log import log

PHASES = ("compiling", "idle", "sampling", "training", "syncing", "checkpointing", "scoring", "loading",
          "identity", "claim", "rendezvous", "join_sync", "probe")
HEALTHY_STATES = ("ok", "restarted")


class HealthError(RuntimeError):
    """An actor failed more often than ``health.max_restarts`` allows: the job stops."""


class PhaseTimeout(RuntimeError):
    """A remote call of a start-up or supervision phase missed its ``health.deadlines`` entry."""


def bounded_get(ray, refs, phase: str, deadlines, what: str, slack_s: float = 0.0):
    """``ray.get(refs)`` that waits at most ``health.deadlines.<phase>`` seconds (+ ``slack_s``): a
    hang in start-up or supervision (no heartbeat deadline covers a call the driver itself waits
    on) becomes a ``PhaseTimeout`` naming the phase and the setting, never an endless wait. On the
    step and checkpoint paths ``slack_s`` is the heartbeat timeout: with health on, the watchdog
    fences a hung actor first (and the step is recovered); with it off, the wait still ends."""
    limit = float(getattr(deadlines, phase)) + slack_s
    try:
        return ray.get(refs, timeout=limit)
    except ray.exceptions.GetTimeoutError:
        extra = f" + {slack_s:g}s" if slack_s else ""
        raise PhaseTimeout(f"{what} did not finish within health.deadlines.{phase}="
                           f"{float(getattr(deadlines, phase)):g}s{extra} (raise it for a slow machine)") from None


def rss_mb() -> float:
    """Resident memory of this process (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0


class Heartbeat:
    """In-actor phase tracker plus the background thread that reports it.

    ``stats`` returns the engine's counters (step, version, compiles) at report time; completed
    phase spans ride along with the next beat and become ``trace.json``.
    """

    def __init__(self, group: str, rank: int, stats=None):
        self.group, self.rank, self.stats = group, rank, stats or (lambda: {})
        self.phase_name, self.phase_since, self.last_progress = "idle", time.time(), time.time()
        self.identity: dict = {}
        self.incarnation = 0
        self._spans: list[tuple[str, float, float]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @contextmanager
    def phase(self, name: str):
        self.phase_name, self.phase_since = name, time.time()
        try:
            yield
        finally:
            end = time.time()
            with self._lock:
                self._spans.append((name, self.phase_since, end))
            self.last_progress = end
            self.phase_name, self.phase_since = "idle", end

    def report(self) -> dict:
        try:
            extra = dict(self.stats())
        except Exception:  # noqa: BLE001 - an engine mid-build has no counters yet
            extra = {}
        with self._lock:
            spans, self._spans = self._spans, []
        now = time.time()
        return {"group": self.group, "rank": self.rank, "incarnation": self.incarnation,
                "chips": self.identity.get("chips", []), "chip_ids": self.identity.get("chip_ids", []),
                "host": self.identity.get("host") or socket.gethostname(), "pid": os.getpid(),
                "phase": self.phase_name, "phase_since": self.phase_since, "last_progress": self.last_progress,
                "rss_mb": round(rss_mb(), 1), "time": now, "spans": spans,
                "step": extra.get("step"), "version": extra.get("version"), "compiles": extra.get("compiles"),
                # what the process computes on, from its claim (rltpu.chips.backend's decision)
                **{k: self.identity.get(k) for k in ("emulated", "device", "dist_backend", "runtime", "jax_platforms")}}

    def start(self, monitor, interval_s: float, incarnation: int, identity: dict) -> None:
        """Begin reporting to ``monitor`` (anything with ``beat.remote(report)``)."""
        self.incarnation, self.identity = incarnation, identity
        if self._thread is not None:
            return

        def loop():
            while not self._stop.is_set():
                try:
                    monitor.beat.remote(self.report())
                except Exception as err:  # noqa: BLE001 - the monitor is gone (shutdown): keep quiet
                    log.warning(f"rltpu: heartbeat of {self.group} {self.rank} failed: {err}")
                self._stop.wait(interval_s)

        self._thread = threading.Thread(target=loop, name="rltpu-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()


class HealthMonitor:
    """Latest report per actor, plus phase spans not yet collected. Wrapped by the controller with
    ``ray.remote`` (no CPU, no chips)."""

    def __init__(self):
        self.reports: dict[str, dict] = {}
        self.incarnations: dict[str, int] = {}
        self.spans: deque[dict] = deque(maxlen=50_000)  # bounded even if nobody collects them

    def beat(self, report: dict) -> None:
        key = f"{report['group']}-{report['rank']}"
        if report["incarnation"] < self.incarnations.get(key, 0):
            return  # a fenced incarnation: it must not count as alive
        self.incarnations[key] = report["incarnation"]
        spans = report.pop("spans", [])
        report["received"] = time.time()
        self.reports[key] = report
        self.spans += [{"actor": key, "pid": report["pid"], "phase": p, "start": a, "end": b} for p, a, b in spans]

    def expect(self, key: str, incarnation: int) -> None:
        """From now on only beats of ``incarnation`` or later count for ``key``."""
        self.incarnations[key] = incarnation
        if self.reports.get(key, {}).get("incarnation", incarnation) < incarnation:
            del self.reports[key]

    def snapshot(self) -> dict:
        spans, self.spans = list(self.spans), deque(maxlen=self.spans.maxlen)
        return {"reports": self.reports, "spans": spans, "time": time.time()}


SYNC_ROLES = ("sampler", "trainer")  # the members of a weight sync: each waits on all the others


def decide(reports: dict[str, dict], now: float, deadlines: dict[str, float], heartbeat_timeout_s: float,
           skip: set | frozenset = frozenset(), heartbeat_s: float | None = None) -> dict[str, str]:
    """Actor key -> why it is HUNG, for every actor that missed its phase deadline or went quiet.

    Idle has no deadline (nobody waits on it); a stopped process is caught by its silent heartbeat.
    A weight sync waits on every member (samplers and trainers). A member past its syncing deadline
    that still beats is *waiting*. A member that misses beats (three of ``heartbeat_s``; its own
    verdict comes at ``heartbeat_timeout_s``), is hung in another phase, or is in ``skip`` (reported,
    not yet replaced) is a *cause*. While there is a cause, waiters get no verdict: fencing them would
    replace healthy samplers or restart the trainer group and roll back steps for nothing (a
    report can lag the cause's fencing by a heartbeat). With waiters alone, the samplers are
    judged first (a replacement is cheap; a trainer restart rolls back). A waiter is judged again
    once the cause is back.
    """
    verdicts, waiters, missing = {}, [], []
    missing_beats = min(3 * heartbeat_s, heartbeat_timeout_s) if heartbeat_s else heartbeat_timeout_s
    for key, r in reports.items():
        if key in skip:
            continue
        quiet = now - r.get("received", r["time"])
        in_phase = now - r["phase_since"]
        limit = deadlines.get(r["phase"])
        if role_of(key) in SYNC_ROLES and quiet > missing_beats:
            missing.append(key)
        if limit is not None and r["phase"] != "idle" and in_phase > limit:
            verdicts[key] = f"hung in {r['phase']} for {in_phase:.0f}s > deadline {limit:g}s"
            if r["phase"] == "syncing" and role_of(key) in SYNC_ROLES and key not in missing:
                waiters.append(key)
        elif quiet > heartbeat_timeout_s:
            verdicts[key] = f"no heartbeat for {quiet:.0f}s > {heartbeat_timeout_s:g}s (last phase {r['phase']})"
    causes = [k for k in [*verdicts, *skip, *missing] if role_of(k) in SYNC_ROLES and k not in waiters]
    if causes:
        excused = waiters
    elif any(role_of(k) == "sampler" for k in waiters):
        excused = [k for k in waiters if role_of(k) == "trainer"]
    else:
        excused = []
    for key in excused:
        del verdicts[key]
    return verdicts


def role_of(key: str) -> str:
    """``sampler-1`` -> ``sampler``: actor keys are role-rank."""
    return key.rsplit("-", 1)[0]


def deadlines_of(health_cfg) -> dict[str, float]:
    return {k: float(v) for k, v in health_cfg.deadlines.model_dump().items()}


class Watchdog(threading.Thread):
    """Controller-side poller: monitor snapshot -> verdicts -> ``on_hung(key, why, incarnation)`` ->
    health.json. It only reports.

    Runs beside the step loop, so a phase blocked in ``ray.get`` on a hung actor is unblocked by
    what the report leads to (the supervisor fences it: the call fails with an actor error and the
    actor is replaced).
    """

    def __init__(self, monitor, cfg, on_hung, write, poll_s: float = 1.0, ray=None, skip=lambda: set()):
        """``ray``: the module (or the controller tests' in-process stand-in) that reaches ``monitor``;
        ``skip()``: actors already reported and not yet replaced (no verdict again)."""
        super().__init__(name="rltpu-watchdog", daemon=True)
        self.monitor, self.cfg, self.on_hung, self.write, self.poll_s = monitor, cfg, on_hung, write, poll_s
        self.ray, self.skip = ray, skip
        self.deadlines = deadlines_of(cfg)
        self.reports: dict[str, dict] = {}
        # the newest phase spans only (trace.json); older ones are in earlier trace.json writes
        self.spans: deque[dict] = deque(maxlen=getattr(cfg, "trace_max_spans", 20_000))
        self.lock = threading.Lock()
        self._stop = threading.Event()

    def poll(self, act: bool = True) -> None:
        """One round; ``act=False`` (the final one, at shutdown) only refreshes health.json."""
        ray = self.ray
        if ray is None:
            import ray
        snap = ray.get(self.monitor.snapshot.remote(), timeout=30)
        with self.lock:
            self.reports = snap["reports"]
            self.spans.extend(snap["spans"])
            verdicts = decide(self.reports, time.time(), self.deadlines, self.cfg.heartbeat_timeout_s,
                              skip=self.skip(), heartbeat_s=self.cfg.heartbeat_s)
        for key, why in verdicts.items() if act else ():
            self.on_hung(key, why, self.reports[key]["incarnation"])
        self.write()

    def run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.poll()
            except Exception as err:  # noqa: BLE001 - keep watching; the step loop reports real failures
                log.warning(f"rltpu: watchdog: {type(err).__name__}: {str(err)[:200]}")

    def stop(self) -> None:
        self._stop.set()


# -- health.json and `rltpu status` ---------------------------------------------------------------
def actor_rows(reports: dict[str, dict], expected: list[str], restarts: dict[str, int], fenced: dict[str, str],
               now: float) -> list[dict]:
    """One row per expected actor (missing reports show as 'no heartbeat')."""
    rows = []
    for key in expected:
        r = reports.get(key)
        group, rank = key.rsplit("-", 1)
        row = {"key": key, "group": group, "rank": int(rank), "restarts": restarts.get(key, 0)}
        if r is None:
            row |= {"state": "fenced" if key in fenced else "starting", "phase": None, "heartbeat": None}
        else:
            state = "fenced" if key in fenced else ("restarted" if restarts.get(key) else "ok")
            row |= {k: r.get(k) for k in ("chips", "chip_ids", "host", "pid", "phase", "step", "version", "rss_mb",
                                          "compiles", "incarnation", "emulated", "device", "dist_backend",
                                          "runtime", "jax_platforms")}
            row |= {"heartbeat": r.get("received", r["time"]), "phase_since": r["phase_since"],
                    "last_progress": r["last_progress"], "state": state}
        if key in fenced:
            row["reason"] = fenced[key]
        rows.append(row)
    return rows


def write_health(path: Path, doc: dict) -> None:
    """Atomic replace, so a reader (status, dashboard) never sees half a file."""
    path = Path(path)
    tmp = _tmp_name(path)
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    os.replace(tmp, path)


def _tmp_name(path: Path) -> Path:
    """A temp name of this process *and thread*: the watchdog thread and the main thread both write
    health.json (and trace.json); one shared temp name let one's rename publish the other's half."""
    return path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")


def read_health(run_dir: Path) -> dict:
    path = Path(run_dir) / "health.json"
    if not path.exists():
        raise FileNotFoundError(f"no health file {path}; is RUN_DIR a run directory of `rltpu train`?")
    return json.loads(path.read_text())


def assess(doc: dict, now: float | None = None) -> tuple[bool, list[str]]:
    """(healthy, problems). A running job is unhealthy when an actor is not ok, its heartbeat is
    stale, or the controller stopped refreshing the file; a failed job is unhealthy."""
    now = time.time() if now is None else now
    problems = []
    state = doc.get("state")
    if state == "failed":
        problems.append(f"job failed: {doc.get('error', 'see health.json')}")
    if state in ("running", "recovering", "starting"):
        stale = now - doc.get("time", 0)
        if stale > doc.get("stale_after_s", 60):
            problems.append(f"health.json not refreshed for {stale:.0f}s (driver gone?)")
        for a in doc.get("actors", []):
            if a["state"] not in HEALTHY_STATES:
                problems.append(f"{a['key']}: {a['state']}{' (' + a['reason'] + ')' if a.get('reason') else ''}")
            elif a.get("heartbeat") and now - a["heartbeat"] > doc.get("heartbeat_timeout_s", 60):
                problems.append(f"{a['key']}: heartbeat {now - a['heartbeat']:.0f}s old")
    return not problems, problems


def device_label(a: dict) -> str:
    """What the actor's process really computes on, from its own claim: ``tpu/tpu`` (torch device /
    process-group backend; JAX platform) on real chips, ``cpu/gloo (emulated)`` here."""
    if not a.get("device"):
        return "-"
    label = f"{a['device']}/{a.get('dist_backend') or '-'}"
    if a.get("jax_platforms") and a.get("jax_platforms") != a["device"]:
        label += f" jax:{a['jax_platforms']}"
    return label + (" (emulated)" if a.get("emulated") else "")


def format_status(doc: dict, now: float | None = None) -> str:
    now = time.time() if now is None else now
    head = ("group", "rank", "chips", "host", "device", "phase", "step", "version", "heartbeat", "restarts", "state")
    rows = []
    for a in doc.get("actors", []):
        age = f"{now - a['heartbeat']:.1f}s" if a.get("heartbeat") else "-"
        rows.append((a["group"], str(a["rank"]), ",".join(map(str, a.get("chip_ids") or [])) or "-",
                     str(a.get("host") or "-"), device_label(a), str(a.get("phase") or "-"), str(a.get("step") if a.get("step") is not None else "-"),
                     str(a.get("version") if a.get("version") is not None else "-"), age, str(a["restarts"]), a["state"]))
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    healthy, problems = assess(doc, now)
    lines = [f"run {doc.get('run_dir')}: {doc.get('state')} at step {doc.get('step')}/{doc.get('steps')}, "
             f"weight version {doc.get('weight_version')}, {'healthy' if healthy else 'UNHEALTHY'}"
             + (f"; {doc['mode']}" if doc.get("mode") else "")
             + (f", staleness <= {doc['staleness']}" if doc.get("staleness") else ""),
             fmt.format(*head), *(fmt.format(*r) for r in rows)]
    rw = doc.get("rewards")
    if rw:
        last = rw.get("last_step") or {}
        lines.append(f"rewards: {rw['workers']} CPU workers for {rw['fn']} (deadline {rw['timeout_s']:g}s), "
                     f"{rw['replaced']} replaced; "
                     + (f"step {last['step']}: {last['reward_errors']} errors, {last['reward_timeouts']} timeouts "
                        f"of {last['reward_calls']} calls; " if last else "")
                     + f"run: {rw['reward_errors']} errors, {rw['reward_timeouts']} timeouts of {rw['reward_calls']}")
    for ev in doc.get("events", [])[-10:]:
        lines.append(f"event: {time.strftime('%H:%M:%S', time.localtime(ev['time']))} {ev['actor']} {ev['what']}: "
                     f"{ev['why']}")
    lines += [f"problem: {p}" for p in problems]
    return "\n".join(lines)


# -- trace.json (Chrome trace event format, opens in Perfetto / chrome://tracing) -----------------
def trace_events(spans: list[dict], controller_spans: list[dict], t0: float) -> list[dict]:
    """Complete ('X') events in microseconds since ``t0``: one track per actor, one for the driver."""
    events, pids = [], {}
    for s in controller_spans + spans:
        actor = s["actor"]
        if actor not in pids:
            pids[actor] = len(pids) + 1
            events.append({"name": "process_name", "ph": "M", "pid": pids[actor], "tid": 0,
                           "args": {"name": f"{actor} (pid {s.get('pid', '?')})"}})
        events.append({"name": s["phase"], "ph": "X", "pid": pids[actor], "tid": 0, "cat": actor.split("-")[0],
                       "ts": round((s["start"] - t0) * 1e6), "dur": max(round((s["end"] - s["start"]) * 1e6), 1),
                       "args": {k: s[k] for k in ("step",) if k in s}})
    return events


def write_trace(path: Path, events: list[dict]) -> None:
    tmp = _tmp_name(Path(path))
    tmp.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    os.replace(tmp, path)
