"""The controller's fault handling: watch, fence, replace, rewind.

A collaborator the ``Controller`` owns (not a base class): it reads the controller's parts
(placement, weights, prompt draws) and asks the controller only for what the step loop owns
(building engines, rewinding to a checkpoint). Deciding is ``rltpu.observe.health.decide``;
acting is here, and only the controller's supervisor acts:
  * a sampler (or reward actor) that died or hung is fenced, a new process starts on the same
    placement-group bundle (so the same chips), claims and compiles (from the JAX disk cache),
    every actor joins the next weight-sync generation and gets the current weight version; the
    interrupted call is re-issued with the same seed;
  * a trainer that died or hung takes the whole trainer group down: new trainer processes on the
    same bundles, the newest checkpoint that verifies, and step / weight version / data cursor
    rewound to it (the ledger records the rollback); with no checkpoint yet, back to step 0;
  * past ``health.max_restarts`` failures of one actor the job stops with ``HealthError``.
It also keeps the run's health record: ``health.json``, the controller's phase spans and
``trace.json``, and the dashboard.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from collections import deque

from rltpu.chips.topology import Role
from rltpu.observe.health import (HealthError, HealthMonitor, Watchdog, actor_rows, bounded_get, trace_events,
                                  write_health, write_trace)


class TrainerGroupFailed(RuntimeError):
    """A trainer rank died or hung: the group restarts from the last checkpoint."""


def _error_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[-1][:200] if text else ''}"


class Supervisor:
    def __init__(self, ctl):
        """``ctl``: the ``Controller`` that owns this supervisor (its parts are read through it)."""
        self.ctl, self.cfg = ctl, ctl.cfg
        self.monitor = self.watch = self.dashboard = None
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
        return self.ctl.placement.groups

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
    def start(self) -> None:
        """The monitor actor (no CPU, no chips), every actor's heartbeat thread, the watchdog, the
        dashboard."""
        ray, hc = self.ctl.ray, self.cfg.health
        if hc.enabled:
            self.monitor = ray.remote(HealthMonitor).options(
                name=f"rltpu-health-{os.getpid()}", num_cpus=0, max_concurrency=4).remote()
            for key, (role, rank) in self.groups.keys().items():
                self.incarnation[key] = 0
                self.groups.group(role)[rank].start_heartbeat.remote(self.monitor, hc.heartbeat_s, 0)
            self.watch = Watchdog(self.monitor, hc, self.fence, self.write_health, hc.poll_s, ray)
            self.watch.start()
        if self.cfg.dashboard.enabled:
            from rltpu.observe.dashboard import serve

            self.dashboard = serve(self.ctl.run_dir, self.cfg.dashboard.host, self.cfg.dashboard.port)
            host, port = self.dashboard.server_address[:2]
            print(f"rltpu: dashboard at http://{host}:{port}/", file=sys.stderr, flush=True)

    # -- the files ------------------------------------------------------------------------------
    def write_health(self) -> None:
        ctl, watch, cfg = self.ctl, self.watch, self.cfg
        table = ctl.placement.table
        reports, fenced = (dict(watch.reports), dict(watch.fenced)) if watch else ({}, {})
        now = time.time()
        doc = {"time": now, "state": self.state, "error": self.error, "run_dir": str(ctl.run_dir),
               "step": ctl.step_idx, "steps": cfg.trainer.steps, "weight_version": ctl.version,
               "phase": self._phase, "emulated": ctl.placement.emulated if ctl.ray else None,
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
               "rewards": ctl.rewards.health() if getattr(ctl, "rewards", None) is not None else None}
        write_health(ctl.run_dir / "health.json", doc)

    def _rows(self, reports: dict, fenced: dict, now: float) -> list[dict]:
        rows = actor_rows(reports, list(self.groups.keys()), self.restarts, fenced, now)
        if self.state in ("finished", "stopped", "failed"):
            # the job is over: the last heartbeat (up to heartbeat_s old) may still say "training" at an
            # earlier step; no actor works any more, and a trainer holds the job's final version
            for row in rows:
                row["phase"] = "exited"
                if row["group"] == "trainer" and self.state == "finished":
                    row["step"] = row["version"] = self.ctl.version
        return rows

    def write_trace(self) -> None:
        if self.watch is not None:
            with self.watch.lock:
                spans = list(self.watch.spans)
        else:
            spans = []
        self._trace_written = time.monotonic()
        write_trace(self.ctl.run_dir / "trace.json", trace_events(spans, list(self.spans), self.t0))

    def maybe_write_trace(self) -> None:
        """Between steps: trace.json at most every ``health.trace_every_s``; a failed write (full disk,
        read-only dir) is one warning line, never the end of the job: it is a debug file."""
        if time.monotonic() - self._trace_written < self.cfg.health.trace_every_s:
            return
        try:
            self.write_trace()
        except OSError as err:
            print(f"rltpu: warning: could not write trace.json ({err.strerror or err}); training goes on",
                  file=sys.stderr, flush=True)

    # -- fencing --------------------------------------------------------------------------------
    def fence(self, key: str, why: str, incarnation: int | None = None) -> None:
        """Make ``key``'s current process unable to act again: Ray kill, plus SIGKILL of its pid when
        it runs on this host (a SIGSTOPped process cannot run Ray's own exit path). A verdict about
        an incarnation already replaced is dropped."""
        if incarnation is not None and incarnation != self.incarnation.get(key, 0):
            with self.watch.lock:
                self.watch.fenced.pop(key, None)
            return
        handle = self.groups.handle(key)
        report = (self.watch.reports.get(key) if self.watch else None) or {}
        try:
            self.ctl.ray.kill(handle, no_restart=True)
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
        ev = {"time": time.time(), "actor": key, "what": what, "why": why, "step": self.ctl.step_idx}
        self.events.append(ev)
        print(f"rltpu: health: {key} {what}: {why}", file=sys.stderr, flush=True)

    def _fenced(self, key: str) -> bool:
        return bool(self.watch and key in self.watch.fenced)

    def find_failed(self, err: BaseException | None = None) -> dict[str, str]:
        """Actors that are dead (their calls fail) or fenced; waits for busy ones to answer."""
        ray = self.ctl.ray
        failed = dict(self.watch.fenced) if self.watch else {}
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
                    failed[key] = self.watch.fenced[key]
                    del pending[key]
            if any(k.startswith("trainer-") for k in failed):
                # the trainer group restarts as a whole: a rank blocked in a collective with the
                # dead one cannot answer and need not (``restart_trainers`` fences every rank)
                for key in [k for k in pending if k.startswith("trainer-")]:
                    del pending[key]
        failed |= {key: "unresponsive" for key in pending}
        return failed

    def _count_restart(self, key: str, why: str) -> None:
        self.restarts[key] = self.restarts.get(key, 0) + 1
        if self.restarts[key] > self.cfg.health.max_restarts:
            self.state, self.error = "failed", (
                f"{key} failed {self.restarts[key]} times (last: {why}); health.max_restarts="
                f"{self.cfg.health.max_restarts} reached; events in {self.ctl.run_dir / 'health.json'}")
            self.write_health()
            raise HealthError(self.error)

    # -- replacing ------------------------------------------------------------------------------
    def _respawn(self, key: str) -> None:
        """A new process for ``key`` on its old bundle: same chips, checked; heartbeat started."""
        role, rank = self.groups.keys()[key]
        inc = self.incarnation.get(key, 0) + 1
        self.incarnation[key] = inc
        if self.monitor is not None:
            self.ctl.ray.get(self.monitor.expect.remote(key, inc), timeout=30)
        new = self.ctl.placement.replace(role, rank, inc)
        if self.monitor is not None:
            new.start_heartbeat.remote(self.monitor, self.cfg.health.heartbeat_s, inc)
        if self.watch is not None:
            with self.watch.lock:
                self.watch.fenced.pop(key, None)

    def _replace(self, failed: dict[str, str]) -> None:
        """Samplers / reward actors in ``failed``: fence, respawn, build (no weights yet)."""
        t0 = time.time()
        for key, why in failed.items():
            self._count_restart(key, why)
            if not self._fenced(key):
                self.fence(key, why)
            self._respawn(key)
        ranks = {role: [r for k, (role_k, r) in self.groups.keys().items() if k in failed and role_k == role]
                 for role in (Role.SAMPLER, Role.REWARD)}
        bounded_get(self.ctl.ray, self.ctl.build_samplers(ranks[Role.SAMPLER])
                    + [self.groups.rewarders[r].build.remote() for r in ranks[Role.REWARD]], "compiling",
                    self.cfg.health.deadlines, f"rebuilding {', '.join(failed)}")
        for key in failed:
            self.event(key, "replaced", f"new process on the same chips in {time.time() - t0:.1f}s")

    def heal(self, err: BaseException) -> bool:
        """After a failed call: replace dead/hung samplers and reward actors and bring every sampler
        to the current weight version. False when no actor failed (the error is not ours)."""
        if self.monitor is None:
            return False
        self.state = "recovering"
        failed = self.find_failed(err)
        if not failed:
            self.state = "running"
            return False
        if any(k.startswith("trainer-") for k in failed):
            raise TrainerGroupFailed("; ".join(f"{k}: {w}" for k, w in failed.items()))
        self._replace(failed)
        self.resync()
        self.state = "running"
        return True

    def resync(self) -> None:
        """Next sync generation for everyone, then the current version (the weight-sync re-join)."""
        while True:
            try:
                self.ctl.weights.join()
                self.ctl.weights.push(self.ctl.version)
                return
            except Exception as err:  # noqa: BLE001 - another actor failed meanwhile
                failed = self.find_failed(err)
                if not failed:
                    raise
                if any(k.startswith("trainer-") for k in failed):
                    raise TrainerGroupFailed("; ".join(f"{k}: {w}" for k, w in failed.items())) from err
                self._replace(failed)

    def restart_trainers(self, why: str) -> None:
        """Fence every trainer rank, start the group again on its bundles and rewind the job to the
        newest valid checkpoint (step, weight version, data cursor; ledger rollback)."""
        ctl, ray = self.ctl, self.ctl.ray
        self.state, t0 = "recovering", time.time()
        failed = self.find_failed()
        for key in [k for k in failed if k.startswith("trainer-")] or ["trainer-0"]:
            self._count_restart(key, failed.get(key, why))
        for key in self.groups.keys():
            if key.startswith("trainer-") and not self._fenced(key):
                self.fence(key, failed.get(key, f"restarting the trainer group ({why})"))
        trainers = self.groups.trainers
        for r in range(len(trainers)):
            self._respawn(f"trainer-{r}")
        d = self.cfg.health.deadlines
        master, port = bounded_get(ray, trainers[0].rendezvous.remote(), "rendezvous", d, "the new trainer 0's address")
        bounded_get(ray, [t.init_process_groups.remote(master, port, len(trainers), r, len(trainers),
                                                       self.cfg.sync.timeout_s, ctl.placement.trainer_tp)
                          for r, t in enumerate(trainers)],
                    "rendezvous", d, "the new trainer group's process groups")
        bounded_get(ray, ctl.build_trainers(), "loading", d, "rebuilding the trainer engines")
        others = {k: w for k, w in failed.items() if not k.startswith("trainer-")}
        if others:
            self._replace(others)
        ctl.rewind_to_checkpoint()
        ctl.weights.forget_store()  # it lived in the old trainer 0
        self.resync()
        self.event("trainer", "restarted", f"group from step {ctl.step_idx} in {time.time() - t0:.1f}s ({why})")
        self.state = "running"

    def recover(self, err: BaseException, data_before: dict, step_before: int) -> None:
        """A step failed: restart trainers (rewind) or replace samplers and redo the step."""
        if self.monitor is None:
            raise err
        if isinstance(err, TrainerGroupFailed):
            return self.restart_trainers(str(err))
        self.state = "recovering"
        failed = self.find_failed(err)
        if not failed:
            raise err
        if any(k.startswith("trainer-") for k in failed):
            return self.restart_trainers("; ".join(f"{k}: {w}" for k, w in failed.items()))
        self._replace(failed)
        self.resync()
        if self.ctl.step_idx == step_before:  # the batch never reached the trainers: draw it again
            self.ctl.draws.rewind(data_before)
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
            print(f"rltpu: could not write health.json/trace.json ({err})", file=sys.stderr)
        if self.dashboard is not None:
            self.dashboard.shutdown()
            self.dashboard.server_close()
