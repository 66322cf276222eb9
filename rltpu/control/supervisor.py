"""The controller's fault handling: watch, fence, replace, rewind (a mixin of ``Controller``).

Deciding is ``rltpu.observe.health.decide``; acting is here, and only the controller acts:
  * a sampler (or reward actor) that died or hung is fenced, a new process starts on the same
    placement-group bundle (so the same chips), claims and compiles (from the JAX disk cache),
    every actor joins the next weight-sync generation (``Controller._join_sync``) and gets the
    current weight version; the interrupted call is re-issued with the same seed;
  * a trainer that died or hung takes the whole trainer group down: new trainer processes on the
    same bundles, the newest checkpoint that verifies, and step / weight version / data cursor
    rewound to it (the ledger records the rollback); with no checkpoint yet, back to step 0;
  * past ``health.max_restarts`` failures of one actor the job stops with ``HealthError``.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time

from rltpu.observe.health import HealthError, HealthMonitor, Watchdog, actor_rows, trace_events, write_health, write_trace
from rltpu.observe.ledger import Ledger
from rltpu.chips.topology import Role


class TrainerGroupFailed(RuntimeError):
    """A trainer rank died or hung: the group restarts from the last checkpoint."""


def _error_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[-1][:200] if text else ''}"


class Supervision:
    # -- state ----------------------------------------------------------------------------------
    def _init_supervision(self) -> None:
        self.monitor = self.watch = self.dashboard = None
        self.restarts: dict[str, int] = {}
        self.incarnation: dict[str, int] = {}
        self.events: list[dict] = []
        self.state = "starting"
        self.error: str | None = None
        self.t0 = time.time()
        self._ctl_spans: list[dict] = []
        self._drawn: list[str] = []
        self.ledger = Ledger(self.run_dir / "ledger.jsonl")
        self._data_initial = self.data.state_dict()

    @property
    def _phase(self) -> str:
        return self.__dict__.get("_phase_name", "idle")

    @_phase.setter
    def _phase(self, name: str) -> None:
        """The driver's phase; every change closes a span of ``trace.json``'s controller track."""
        now, prev = time.time(), self.__dict__.get("_phase_name")
        if prev not in (None, "idle") and prev != name and hasattr(self, "_ctl_spans"):
            self._ctl_spans.append({"actor": "controller", "pid": os.getpid(), "phase": prev,
                                    "start": self.__dict__["_phase_since"], "end": now,
                                    "step": self.step_idx + (prev == "sample")})  # sample precedes the increment
        if prev != name:
            self.__dict__["_phase_since"] = now
        self.__dict__["_phase_name"] = name

    def _keys(self) -> dict[str, tuple[Role, int]]:
        groups = [(Role.TRAINER, self.trainers), (Role.SAMPLER, self.samplers), (Role.REWARD, self.rewarders)]
        if getattr(self, "colocated", False):  # the samplers are the trainer processes: key them once
            groups.pop(1)
        return {f"{role.value}-{r}": (role, r) for role, group in groups for r in range(len(group))}

    def _group(self, role: Role) -> list:
        return {Role.TRAINER: self.trainers, Role.SAMPLER: self.samplers, Role.REWARD: self.rewarders}[role]

    # -- start ----------------------------------------------------------------------------------
    def _start_health(self) -> None:
        """The monitor actor (no CPU, no chips), every actor's heartbeat thread, the watchdog."""
        ray, hc = self._ray, self.cfg.health
        if getattr(self, "on_sigterm", None) and threading.current_thread() is threading.main_thread():
            # ray.init replaces SIGTERM's handler (sys.exit): put the CLI's back (stop + checkpoint)
            signal.signal(signal.SIGTERM, self.on_sigterm)
        if not hc.enabled:
            return
        self.monitor = ray.remote(HealthMonitor).options(
            name=f"rltpu-health-{os.getpid()}", num_cpus=0, max_concurrency=4).remote()
        for key, (role, rank) in self._keys().items():
            self.incarnation[key] = 0
            self._group(role)[rank].start_heartbeat.remote(self.monitor, hc.heartbeat_s, 0)
        self.watch = Watchdog(self.monitor, hc, self._fence, self._write_health, hc.poll_s)
        self.watch.start()

    def _start_dashboard(self) -> None:
        if not self.cfg.dashboard.enabled:
            return
        from rltpu.observe.dashboard import serve

        self.dashboard = serve(self.run_dir, self.cfg.dashboard.host, self.cfg.dashboard.port)
        host, port = self.dashboard.server_address[:2]
        print(f"rltpu: dashboard at http://{host}:{port}/", file=sys.stderr, flush=True)

    # -- the files ------------------------------------------------------------------------------
    def _write_health(self) -> None:
        watch = self.watch
        reports, fenced = (dict(watch.reports), dict(watch.fenced)) if watch else ({}, {})
        now = time.time()
        doc = {"time": now, "state": self.state, "error": self.error, "run_dir": str(self.run_dir),
               "step": self.step_idx, "steps": self.cfg.trainer.steps, "weight_version": self.version,
               "phase": self._phase, "emulated": getattr(self, "emulated", None), "pod_type": self.table.pod_type,
               # colocated: each trainer-<rank> process also runs that chip's sampler
               "mode": self.cfg.placement.mode, "staleness": self.cfg.placement.staleness,
               "heartbeat_timeout_s": self.cfg.health.heartbeat_timeout_s,
               "stale_after_s": max(30.0, 10 * self.cfg.health.poll_s),
               "chips": self.table.to_rows(),
               "actors": actor_rows(reports, list(self._keys()), self.restarts, fenced, now),
               "restarts": dict(self.restarts), "events": self.events[-200:],
               "deadlines": self.cfg.health.deadlines.model_dump(), "max_restarts": self.cfg.health.max_restarts}
        write_health(self.run_dir / "health.json", doc)

    def _write_trace(self) -> None:
        if self.watch is not None:
            with self.watch.lock:
                spans = list(self.watch.spans[-20000:])
        else:
            spans = []
        write_trace(self.run_dir / "trace.json", trace_events(spans, self._ctl_spans[-5000:], self.t0))

    # -- the ledger -----------------------------------------------------------------------------
    def _draw(self, n: int) -> list[dict]:
        """``data.next_batch(n)`` one prompt at a time, remembering each one's (epoch, position, id)."""
        out = []
        for _ in range(n):
            (ex,) = self.data.next_batch(1)
            c = self.data.cursor
            self._drawn.append(f"{c.epoch}:{c.position - 1}:{ex.get('id', '?')}")
            out.append(ex)
        return out

    def _commit_ledger(self, behaviour_version: int | None = None) -> None:
        """Called when a step's batch is handed to the trainers (its update will land)."""
        self.ledger.commit(self.step_idx, self._drawn, self.version, behaviour_version)
        self._drawn = []

    # -- fencing --------------------------------------------------------------------------------
    def _fence(self, key: str, why: str, incarnation: int | None = None) -> None:
        """Make ``key``'s current process unable to act again: Ray kill, plus SIGKILL of its pid when
        it runs on this host (a SIGSTOPped process cannot run Ray's own exit path). A verdict about
        an incarnation already replaced is dropped."""
        if incarnation is not None and incarnation != self.incarnation.get(key, 0):
            with self.watch.lock:
                self.watch.fenced.pop(key, None)
            return
        role, rank = self._keys()[key]
        handle = self._group(role)[rank]
        report = (self.watch.reports.get(key) if self.watch else None) or {}
        try:
            self._ray.kill(handle, no_restart=True)
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
        self._event(key, "fenced", why)

    def _event(self, key: str, what: str, why: str) -> None:
        ev = {"time": time.time(), "actor": key, "what": what, "why": why, "step": self.step_idx}
        self.events.append(ev)
        print(f"rltpu: health: {key} {what}: {why}", file=sys.stderr, flush=True)

    def _find_failed(self, err: BaseException | None = None) -> dict[str, str]:
        """Actors that are dead (their calls fail) or fenced; waits for busy ones to answer."""
        ray = self._ray
        failed = dict(self.watch.fenced) if self.watch else {}
        pending = {key: self._group(role)[rank].report.remote()
                   for key, (role, rank) in self._keys().items() if key not in failed}
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
                elif self.watch and key in self.watch.fenced:
                    failed[key] = self.watch.fenced[key]
                    del pending[key]
            if any(k.startswith("trainer-") for k in failed):
                # the trainer group restarts as a whole: a rank blocked in a collective with the
                # dead one cannot answer and need not (``_restart_trainers`` fences every rank)
                for key in [k for k in pending if k.startswith("trainer-")]:
                    del pending[key]
        failed |= {key: "unresponsive" for key in pending}
        return failed

    def _count_restart(self, key: str, why: str) -> None:
        self.restarts[key] = self.restarts.get(key, 0) + 1
        if self.restarts[key] > self.cfg.health.max_restarts:
            self.state, self.error = "failed", (
                f"{key} failed {self.restarts[key]} times (last: {why}); health.max_restarts="
                f"{self.cfg.health.max_restarts} reached; events in {self.run_dir / 'health.json'}")
            self._write_health()
            raise HealthError(self.error)

    # -- replacing ------------------------------------------------------------------------------
    def _respawn(self, key: str) -> None:
        """A new process for ``key`` on its old bundle: same chips, checked; heartbeat started."""
        ray = self._ray
        role, rank = self._keys()[key]
        old = self._group(role)[rank]
        try:
            ray.kill(old, no_restart=True)
        except Exception:  # noqa: BLE001
            pass
        inc = self.incarnation.get(key, 0) + 1
        self.incarnation[key] = inc
        if self.monitor is not None:
            ray.get(self.monitor.expect.remote(key, inc))
        new = self._new_actor(role, rank, inc)
        ident = ray.get(new.identity.remote(), timeout=300)
        chips = self._chips_for(ident)
        planned = self.bundles[(role, rank)][1]
        if [c.global_id for c in chips] != [c.global_id for c in planned]:
            raise HealthError(f"replacement for {key} got chips {[c.global_id for c in chips]}, not its own "
                              f"{[c.global_id for c in planned]}; another job took them")
        report = ray.get(new.claim.remote(chips, ident, self.emulated))
        self._group(role)[rank] = new
        self.reports = [report if (r["group"], r["rank"]) == (role.value, rank) else r for r in self.reports]
        if self.monitor is not None:
            new.start_heartbeat.remote(self.monitor, self.cfg.health.heartbeat_s, inc)
        if self.watch is not None:
            with self.watch.lock:
                self.watch.fenced.pop(key, None)

    def _replace(self, failed: dict[str, str]) -> None:
        """Samplers / reward actors in ``failed``: fence, respawn, build (no weights yet)."""
        ray = self._ray
        t0 = time.time()
        for key, why in failed.items():
            self._count_restart(key, why)
            if not (self.watch and key in self.watch.fenced):
                self._fence(key, why)
            self._respawn(key)
        builds = []
        for key in failed:
            role, rank = self._keys()[key]
            if role == Role.SAMPLER:
                cache = str((self.run_dir / "jax_cache").resolve()) if self.cfg.sampler.compile_cache else None
                builds.append(self.samplers[rank].build.remote(self.vocab, self.tokenizer.pad_id,
                                                               self.tokenizer.eos_id, self.spec, cache))
            elif role == Role.REWARD:
                builds.append(self.rewarders[rank].build.remote())
        ray.get(builds)
        for key in failed:
            self._event(key, "replaced", f"new process on the same chips in {time.time() - t0:.1f}s")

    def _heal(self, err: BaseException) -> bool:
        """After a failed call: replace dead/hung samplers and reward actors and bring every sampler
        to the current weight version. False when no actor failed (the error is not ours)."""
        if self.monitor is None:
            return False
        self.state = "recovering"
        failed = self._find_failed(err)
        if not failed:
            self.state = "running"
            return False
        if any(k.startswith("trainer-") for k in failed):
            raise TrainerGroupFailed("; ".join(f"{k}: {w}" for k, w in failed.items()))
        self._replace(failed)
        self._resync()
        self.state = "running"
        return True

    def _resync(self) -> None:
        """Next sync generation for everyone, then the current version (the weight-sync re-join)."""
        while True:
            try:
                self._join_sync()
                self._sync(self.version)
                return
            except Exception as err:  # noqa: BLE001 - another actor failed meanwhile
                failed = self._find_failed(err)
                if not failed:
                    raise
                if any(k.startswith("trainer-") for k in failed):
                    raise TrainerGroupFailed("; ".join(f"{k}: {w}" for k, w in failed.items())) from err
                self._replace(failed)

    def _generate(self, shards: list, G: int, seed: int, submitted: dict | None = None) -> list[dict]:
        """Every sampler's shard (seed + rank); a shard whose sampler failed is redone, with the same
        seed, on its replacement. ``submitted``: rank -> (handle, ref) of calls already issued (async
        mode); one made on a process since replaced is redone without another recovery."""
        outs: list = [None] * len(shards)
        todo = list(range(len(shards)))
        while todo:
            calls = submitted or {r: (self.samplers[r], self.samplers[r].generate.remote(shards[r], G, seed + r))
                                  for r in todo}
            submitted, errors, stale = None, [], False
            for r, (handle, ref) in calls.items():
                try:
                    outs[r] = self._ray.get(ref)
                except Exception as err:  # noqa: BLE001
                    errors.append(err)
                    stale |= handle is not self.samplers[r]  # already replaced after an earlier failure
            todo = [r for r in todo if outs[r] is None]
            if errors and not self._heal(errors[0]) and not stale:
                raise errors[0]
        return outs

    def _sync_healing(self, version: int) -> dict:
        try:
            return self._sync(version)
        except Exception as err:  # noqa: BLE001
            if not self._heal(err):
                raise
            return self._sync(version)

    def _restart_trainers(self, why: str) -> None:
        """Fence every trainer rank, start the group again on its bundles and rewind the job to the
        newest valid checkpoint (step, weight version, data cursor; ledger rollback)."""
        ray = self._ray
        self.state, t0 = "recovering", time.time()
        failed = self._find_failed()
        for key in [k for k in failed if k.startswith("trainer-")] or ["trainer-0"]:
            self._count_restart(key, failed.get(key, why))
        for key in self._keys():
            if key.startswith("trainer-") and not (self.watch and key in self.watch.fenced):
                self._fence(key, failed.get(key, f"restarting the trainer group ({why})"))
        n_t = len(self.trainers)
        for r in range(n_t):
            self._respawn(f"trainer-{r}")
        master, port = ray.get(self.trainers[0].rendezvous.remote())
        ray.get([t.init_process_groups.remote(master, port, n_t, r, n_t, self.cfg.sync.timeout_s)
                 for r, t in enumerate(self.trainers)])
        ray.get(self._build_trainers())
        others = {k: w for k, w in failed.items() if not k.startswith("trainer-")}
        if others:
            self._replace(others)
        if not self._load_checkpoint(required=False):
            self.step_idx, self.version = 0, 0
            self.data.load_state_dict(self._data_initial)
            self.ledger.rollback(0, "trainer group restarted with no checkpoint yet")
        self._drawn = []
        del self._sync_store  # it lived in the old trainer 0
        self._resync()
        self._event("trainer", "restarted", f"group from step {self.step_idx} in {time.time() - t0:.1f}s ({why})")
        self.state = "running"

    def _recover(self, err: BaseException, data_before: dict, step_before: int) -> None:
        """A step failed: restart trainers (rewind) or replace samplers and redo the step."""
        if self.monitor is None:
            raise err
        if isinstance(err, TrainerGroupFailed):
            return self._restart_trainers(str(err))
        self.state = "recovering"
        failed = self._find_failed(err)
        if not failed:
            raise err
        if any(k.startswith("trainer-") for k in failed):
            return self._restart_trainers("; ".join(f"{k}: {w}" for k, w in failed.items()))
        self._replace(failed)
        self._resync()
        if self.step_idx == step_before:  # the batch never reached the trainers: draw it again
            self.data.load_state_dict(data_before)
            self._drawn = []
        self.state = "running"

    def _saved_final(self) -> bool:
        """Write the end-of-run checkpoint; False (after recovering) when a trainer failed during it
        and the job was rewound, so the loop runs the lost steps again."""
        try:
            self._phase = "checkpoint"
            self.save_checkpoint()
            return True
        except (HealthError, KeyboardInterrupt):
            raise
        except Exception as err:  # noqa: BLE001
            self._recover(err, self.data.state_dict(), self.step_idx)
            return self.step_idx >= self.cfg.trainer.steps and self._saved_final()
        finally:
            self._phase = "idle"

    def _stop_supervision(self, state: str) -> None:
        if self.state != "failed":
            self.state = state
        if self.watch is not None:
            self.watch.stop()
            try:
                self.watch.poll(act=False)  # the actors' last reports, nobody fenced at shutdown
            except Exception:  # noqa: BLE001 - Ray may already be down
                pass
        try:
            self._write_health()
            self._write_trace()
        except Exception as err:  # noqa: BLE001
            print(f"rltpu: could not write health.json/trace.json ({err})", file=sys.stderr)
        if self.dashboard is not None:
            self.dashboard.shutdown()
            self.dashboard.server_close()
