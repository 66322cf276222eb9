"""Fault handling: a pure policy decides, the supervisor acts.

``plan_recovery`` (pure, table-tested) maps the actors found failed and their restart counts to
actions keyed by role:
  * ``REPLACE`` samplers / reward actors: fence each, start a new process on the same
    placement-group bundle (so the same chips), claim and compile (from the JAX disk cache); every
    actor then joins the next weight-sync generation and gets the current weight version; the
    interrupted call is re-issued with the same seed;
  * ``RESTART_TRAINERS``: a trainer that died or hung takes the whole group down: new trainer
    processes on the same bundles, the newest checkpoint that verifies, and step / weight version /
    data cursor rewound to it (the ledger records the rollback); with no checkpoint yet, step 0;
  * ``STOP``: past ``health.max_restarts`` failures of one actor, ``HealthError`` with the reason.
The ``Watchdog`` thread only reports (``rltpu.observe.health.decide``: which actor is hung); the
supervisor fences what it reports. Its collaborators are explicit: the ``Placement`` (handles,
replacement), the weight handoff (``start``), and a ``Job``: the callables of the run it
watches (progress, engine rebuilds, rewind). It also keeps the run's health record:
``health.json``, the driver's phase spans and ``trace.json``, and the dashboard.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from rltpu.chips.topology import Role
from rltpu.control.placement import form_process_groups
from rltpu.observe.health import (HealthError, HealthMonitor, Watchdog, actor_rows, bounded_get, role_of,
                                  trace_events, write_health, write_trace)
from rltpu.observe.log import get_logger

logger = get_logger(__name__)

REPLACE, RESTART_TRAINERS, STOP = "replace", "restart-trainers", "stop"


class TrainerGroupFailed(RuntimeError):
    """A trainer rank died or hung: the group restarts from the last checkpoint."""


def _error_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[-1][:200] if text else ''}"


@dataclass(frozen=True)
class Action:
    kind: str  # REPLACE, RESTART_TRAINERS or STOP
    keys: tuple[str, ...] = ()  # the actors it is about (RESTART_TRAINERS: the trainers that failed)
    reason: str = ""


def plan_recovery(failed: dict[str, str], restarts: dict[str, int], max_restarts: int,
                  trainer_group: bool = False) -> list[Action]:
    """Actions for ``failed`` (actor key -> why), in the order to take them. ``restarts``: each
    key's restarts so far; ``trainer_group``: the trainer group is known to have failed (a
    collective broke) even if no trainer is among ``failed`` (trainer-0 is then counted)."""
    trainers = [k for k in failed if role_of(k) == "trainer"]
    counted = dict(failed) | ({"trainer-0": failed.get("trainer-0", "the trainer group failed")}
                              if trainer_group and not trainers else {})
    for key, why in counted.items():
        if restarts.get(key, 0) + 1 > max_restarts:
            return [Action(STOP, (key,), f"{key} failed {restarts.get(key, 0) + 1} times (last: {why}); "
                                         f"health.max_restarts={max_restarts} reached")]
    others = tuple(k for k in failed if role_of(k) != "trainer")
    if trainers or trainer_group:
        group = tuple(trainers) or ("trainer-0",)
        return [Action(RESTART_TRAINERS, group, "; ".join(f"{k}: {failed.get(k, 'the trainer group failed')}"
                                                         for k in group))] + \
            ([Action(REPLACE, others)] if others else [])
    return [Action(REPLACE, others)] if others else []


@dataclass
class Job:
    """What the supervisor asks of the run it watches (the controller supplies these callables)."""

    progress: Callable[[], tuple[int, int]]  # (step, weight version) now
    build_samplers: Callable[[list[int]], list]  # refs: rebuild these sampler ranks' engines
    build_trainers: Callable[[], list]  # refs: rebuild every trainer engine
    rewind: Callable[[], None]  # after a trainer restart: back to the newest valid checkpoint (or step 0)
    redraw: Callable[[dict], None]  # a step that never reached the trainers: its prompts go back
    reward_health: Callable[[], dict | None] = field(default=lambda: None)


class Supervisor:
    def __init__(self, cfg, run_dir, placement, job: Job):
        self.cfg, self.run_dir, self.placement, self.job = cfg, run_dir, placement, job
        self.ray = self.weights = None  # given at ``start``
        self.monitor = self.watch = self.dashboard = None
        self.fenced: dict[str, str] = {}  # key -> reason, until the actor is replaced
        self.lock = threading.Lock()
        self.restarts: dict[str, int] = {}
        self.incarnation: dict[str, int] = {}
        hc = self.cfg.health  # bounded history: health.json/trace.json on disk are the record
        self.events: deque[dict] = deque(maxlen=hc.max_events)
        self.state = "starting"
        self.error: str | None = None
        self.t0 = time.time()
        self.spans: deque[dict] = deque(maxlen=max(hc.trace_max_spans // 4, 1))  # the controller's own phases
        self._trace_written = 0.0
        self._phase, self._phase_since = "idle", time.time()

    @property
    def groups(self):
        return self.placement.groups

    # -- the driver's phase -----------------------------------------------------------------------
    @property
    def phase(self) -> str:
        return self._phase

    def set_phase(self, name: str, step: int) -> None:
        """Every change closes a span of ``trace.json``'s controller track."""
        now, prev = time.time(), self._phase
        if prev != "idle" and prev != name:
            self.spans.append({"actor": "controller", "pid": os.getpid(), "phase": prev, "start": self._phase_since,
                               "end": now, "step": step + (prev == "sample")})  # sample precedes the increment
        if prev != name:
            self._phase_since = now
        self._phase = name

    # -- start ----------------------------------------------------------------------------------
    def start(self, ray, weights) -> None:
        """The monitor actor (no CPU, no chips), every actor's heartbeat thread, the watchdog, the
        dashboard. ``weights``: the weight handoff the supervisor re-joins after a replacement."""
        self.ray, self.weights = ray, weights
        hc = self.cfg.health
        if hc.enabled:
            self.monitor = ray.remote(HealthMonitor).options(
                name=f"rltpu-health-{os.getpid()}", num_cpus=0, max_concurrency=4).remote()
            for key, (role, rank) in self.groups.keys().items():
                self.incarnation[key] = 0
                self.groups.group(role)[rank].start_heartbeat.remote(self.monitor, hc.heartbeat_s, 0)
            self.watch = Watchdog(self.monitor, hc, self.on_hung, self.write_health, hc.poll_s, ray,
                                  skip=lambda: set(self.fenced))
            self.watch.start()
        if self.cfg.dashboard.enabled:
            from rltpu.observe.dashboard import serve

            self.dashboard = serve(self.run_dir, self.cfg.dashboard.host, self.cfg.dashboard.port)
            host, port = self.dashboard.server_address[:2]
            logger.info(f"rltpu: dashboard at http://{host}:{port}/")

    # -- the files ------------------------------------------------------------------------------
    def write_health(self) -> None:
        watch, cfg = self.watch, self.cfg
        table = self.placement.table
        reports, fenced = (dict(watch.reports) if watch else {}), dict(self.fenced)
        now = time.time()
        step, version = self.job.progress()
        doc = {"time": now, "state": self.state, "error": self.error, "run_dir": str(self.run_dir),
               "step": step, "steps": cfg.trainer.steps, "weight_version": version,
               "phase": self._phase, "emulated": self.placement.emulated if self.ray else None,
               "pod_type": table.pod_type,
               # colocated: each trainer-<rank> process also runs that chip's sampler
               "mode": cfg.placement.mode, "staleness": cfg.placement.staleness,
               "heartbeat_timeout_s": cfg.health.heartbeat_timeout_s,
               "stale_after_s": max(30.0, 10 * cfg.health.poll_s),
               "chips": table.to_rows(),
               "actors": self._rows(reports, fenced, now),
               "restarts": dict(self.restarts), "events": list(self.events),
               "deadlines": cfg.health.deadlines.model_dump(), "max_restarts": cfg.health.max_restarts,
               # the CPU reward workers: replacements, running failure totals, the newest step's counters
               "rewards": self.job.reward_health()}
        write_health(self.run_dir / "health.json", doc)

    def _rows(self, reports: dict, fenced: dict, now: float) -> list[dict]:
        rows = actor_rows(reports, list(self.groups.keys()), self.restarts, fenced, now)
        if self.state in ("finished", "stopped", "failed"):
            # the job is over: the last heartbeat (up to heartbeat_s old) may still say "training" at an
            # earlier step; no actor works any more, and a trainer holds the job's final version
            for row in rows:
                row["phase"] = "exited"
                if row["group"] == "trainer" and self.state == "finished":
                    row["step"] = row["version"] = self.job.progress()[1]
        return rows

    def write_trace(self) -> None:
        if self.watch is not None:
            with self.watch.lock:
                spans = list(self.watch.spans)
        else:
            spans = []
        self._trace_written = time.monotonic()
        write_trace(self.run_dir / "trace.json", trace_events(spans, list(self.spans), self.t0))

    def maybe_write_trace(self) -> None:
        """Between steps: trace.json at most every ``health.trace_every_s``; a failed write (full disk,
        read-only dir) is one warning line, never the end of the job: it is a debug file."""
        if time.monotonic() - self._trace_written < self.cfg.health.trace_every_s:
            return
        try:
            self.write_trace()
        except OSError as err:
            logger.warning(f"rltpu: warning: could not write trace.json ({err.strerror or err}); training goes on")

    # -- fencing --------------------------------------------------------------------------------
    def on_hung(self, key: str, why: str, incarnation: int) -> None:
        """The watchdog's report (its thread): ``key`` is hung. A verdict about an incarnation already
        replaced is dropped; else the actor is fenced, which unblocks a step waiting on it."""
        if incarnation != self.incarnation.get(key, 0):
            return
        with self.lock:
            self.fenced[key] = why
        self.fence(key, why)

    def fence(self, key: str, why: str) -> None:
        """Make ``key``'s current process unable to act again: Ray kill, plus SIGKILL of its pid when
        it runs on this host (a SIGSTOPped process cannot run Ray's own exit path)."""
        handle = self.groups.handle(key)
        report = (self.watch.reports.get(key) if self.watch else None) or {}
        try:
            self.ray.kill(handle, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
        pid = report.get("pid")
        if pid and report.get("host") == socket.gethostname():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"ray" in f.read():
                        os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        self.event(key, "fenced", why)

    def event(self, key: str, what: str, why: str) -> None:
        ev = {"time": time.time(), "actor": key, "what": what, "why": why, "step": self.job.progress()[0]}
        self.events.append(ev)
        logger.warning(f"rltpu: health: {key} {what}: {why}")

    def _fenced(self, key: str) -> bool:
        return key in self.fenced

    def find_failed(self, err: BaseException | None = None) -> dict[str, str]:
        """Actors that are dead (their calls fail) or fenced; waits for busy ones to answer."""
        ray = self.ray
        failed = dict(self.fenced)
        pending = {key: self.groups.group(role)[rank].report.remote()
                   for key, (role, rank) in self.groups.keys().items() if key not in failed}
        d = self.cfg.health.deadlines
        give_up = time.time() + max(d.sampling, d.training, d.syncing) + self.cfg.health.heartbeat_timeout_s
        while pending and time.time() < give_up:
            ready, _ = ray.wait(list(pending.values()), num_returns=len(pending), timeout=1.0)
            for key, ref in list(pending.items()):
                if ref in ready:
                    try:
                        ray.get(ref)
                    except Exception as e:  # noqa: BLE001 - the process is gone
                        failed[key] = f"died ({_error_line(e)})"
                    del pending[key]
                elif self._fenced(key):
                    failed[key] = self.fenced[key]
                    del pending[key]
            if any(role_of(k) == "trainer" for k in failed):
                # the trainer group restarts as a whole: a rank blocked in a collective with the
                # dead one cannot answer and need not (``restart_trainers`` fences every rank)
                for key in [k for k in pending if role_of(k) == "trainer"]:
                    del pending[key]
        failed |= {key: "unresponsive" for key in pending}
        return failed

    # -- acting on the policy's actions ------------------------------------------------------------
    def _plan(self, failed: dict[str, str], trainer_group: bool = False) -> list[Action]:
        """The policy's actions; a STOP is taken here (the job ends with ``HealthError``)."""
        actions = plan_recovery(failed, self.restarts, self.cfg.health.max_restarts, trainer_group)
        for a in actions:
            if a.kind == STOP:
                self.state, self.error = "failed", f"{a.reason}; events in {self.run_dir / 'health.json'}"
                self.write_health()
                raise HealthError(self.error)
        return actions

    def _respawn(self, key: str) -> None:
        """A new process for ``key`` on its old bundle: same chips, checked; heartbeat started."""
        role, rank = self.groups.keys()[key]
        inc = self.incarnation.get(key, 0) + 1
        self.incarnation[key] = inc
        if self.monitor is not None:
            self.ray.get(self.monitor.expect.remote(key, inc), timeout=30)
        new = self.placement.replace(role, rank, inc)
        if self.monitor is not None:
            new.start_heartbeat.remote(self.monitor, self.cfg.health.heartbeat_s, inc)
        with self.lock:
            self.fenced.pop(key, None)

    def _replace(self, keys, failed: dict[str, str]) -> None:
        """REPLACE: samplers / reward actors fenced, respawned, built (no weights yet)."""
        t0 = time.time()
        for key in keys:
            self.restarts[key] = self.restarts.get(key, 0) + 1
            if not self._fenced(key):
                self.fence(key, failed[key])
            self._respawn(key)
        ranks = {role: [r for k, (role_k, r) in self.groups.keys().items() if k in keys and role_k == role]
                 for role in (Role.SAMPLER, Role.REWARD)}
        bounded_get(self.ray, self.job.build_samplers(ranks[Role.SAMPLER])
                    + [self.groups.rewarders[r].build.remote() for r in ranks[Role.REWARD]], "compiling",
                    self.cfg.health.deadlines, f"rebuilding {', '.join(keys)}")
        for key in keys:
            self.event(key, "replaced", f"new process on the same chips in {time.time() - t0:.1f}s")

    def heal(self, err: BaseException) -> bool:
        """After a failed call mid-step: replace dead/hung samplers and reward actors and bring every
        sampler to the current weight version. False when no actor failed (the error is not ours);
        a failed trainer raises ``TrainerGroupFailed`` for the step loop's ``recover``."""
        if self.monitor is None:
            return False
        self.state = "recovering"
        failed = self.find_failed(err)
        actions = self._plan(failed)
        if not actions:
            self.state = "running"
            return False
        if actions[0].kind == RESTART_TRAINERS:
            raise TrainerGroupFailed(actions[0].reason)
        self._replace(actions[0].keys, failed)
        self.resync()
        self.state = "running"
        return True

    def resync(self) -> None:
        """Next sync generation for everyone, then the current version (the weight-sync re-join)."""
        while True:
            try:
                self.weights.join()
                self.weights.push(self.job.progress()[1])
                return
            except Exception as err:  # noqa: BLE001 - another actor failed meanwhile
                failed = self.find_failed(err)
                actions = self._plan(failed)
                if not actions:
                    raise
                if actions[0].kind == RESTART_TRAINERS:
                    raise TrainerGroupFailed(actions[0].reason) from err
                self._replace(actions[0].keys, failed)

    def restart_trainers(self, action: Action, failed: dict[str, str]) -> None:
        """RESTART_TRAINERS: fence every trainer rank, start the group again on its bundles and rewind
        the job to the newest valid checkpoint (step, weight version, data cursor; ledger rollback).
        The samplers get the rewound version at the next ``resync``."""
        ray, why = self.ray, action.reason
        self.state, t0 = "recovering", time.time()
        for key in action.keys:
            self.restarts[key] = self.restarts.get(key, 0) + 1
        for key in self.groups.keys():
            if role_of(key) == "trainer" and not self._fenced(key):
                self.fence(key, failed.get(key, f"restarting the trainer group ({why})"))
        trainers = self.groups.trainers
        for r in range(len(trainers)):
            self._respawn(f"trainer-{r}")
        d = self.cfg.health.deadlines
        form_process_groups(ray, trainers, trainers, self.placement.trainer_tp, self.cfg.sync.timeout_s, d,
                            "the new trainer group")
        bounded_get(ray, self.job.build_trainers(), "loading", d, "rebuilding the trainer engines")
        self.job.rewind()
        self.weights.forget_store()  # it lived in the old trainer 0
        self.event("trainer", "restarted", f"group from step {self.job.progress()[0]} in {time.time() - t0:.1f}s "
                                           f"({why})")

    def recover(self, err: BaseException, data_before: dict, step_before: int) -> None:
        """A step failed: the policy's actions, taken in order; a step whose batch never reached the
        trainers is drawn again."""
        if self.monitor is None:
            raise err
        self.state = "recovering"
        group_failed = isinstance(err, TrainerGroupFailed)
        failed = self.find_failed(None if group_failed else err)
        actions = self._plan(failed, trainer_group=group_failed)
        if not actions:
            raise err
        for action in actions:
            if action.kind == RESTART_TRAINERS:
                self.restart_trainers(action, failed)
            else:
                self._replace(action.keys, failed)
        self.resync()
        if actions[0].kind == REPLACE and self.job.progress()[0] == step_before:
            self.job.redraw(data_before)  # the batch never reached the trainers: draw it again
        self.state = "running"

    def stop(self, state: str) -> None:
        if self.state != "failed":
            self.state = state
        if self.watch is not None:
            self.watch.stop()
            try:
                self.watch.poll(act=False)  # the actors' last reports, nobody fenced at shutdown
            except Exception:  # noqa: BLE001 - Ray may already be down
                pass
        try:
            self.write_health()
            self.write_trace()
        except Exception as err:  # noqa: BLE001
            logger.warning(f"rltpu: could not write health.json/trace.json ({err})")
        if self.dashboard is not None:
            self.dashboard.shutdown()
            self.dashboard.server_close()
