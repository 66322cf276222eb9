"""Rule rewards off the driver: a pool of CPU-only reward workers, deadlines, defaults, counters.

    pool.begin_step(step)
    batch = pool.submit(texts, examples)     # as soon as a sampler's rows arrive; returns at once
    rewards = pool.collect(batch)            # (rows,) float32; failed calls score task.reward_default
    pool.check()                             # more than task.reward_max_failure_frac failed: RewardFailureError
    pool.step_metrics()                      # reward_errors, reward_timeouts, each task.rewards term's mean, ...

Where time goes: each worker runs its chunk's calls on threads, each call under
``task.reward_timeout_s`` (``rltpu.data.rewards.DeadlineRunner``), so a hanging call costs its own
deadline, overlapped with the others. The pool adds a deadline per chunk (the calls' waves plus a
grace): a worker that misses it is wedged (a hang holding the GIL, a stopped process), and is killed
(``ray.kill``, asynchronous: its results are simply never read) and replaced; its chunk's rows score
the default as timeouts. A worker that dies is replaced and its chunk sent once more to the
replacement. A worker whose detached (timed-out, still running) calls pile up is replaced too.

Nothing here touches the prompt ledger: a failed call changes a reward, never which prompts a step
trained on. The transport is Ray's own actor calls; nothing is pickled here.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from rltpu.data.rewards import WEIGHTED_SUM, term_metric_names
from rltpu.observe.health import HealthError
from rltpu.observe.log import get_logger

logger = get_logger(__name__)

# failure kind -> (metrics counter, words for the one warning line per kind per step)
KINDS = {"error": ("reward_errors", "raised"), "nonfinite": ("reward_errors", "returned a non-finite value"),
         "lost": ("reward_errors", "was lost with its worker (died twice)"),
         "timeout": ("reward_timeouts", "timed out")}
GRACE_S = 5.0  # beyond the calls' own deadlines: Ray's round trip and the worker's bookkeeping
ABANDONED_PER_SLOT = 4  # detached calls per concurrency slot before a worker is replaced


class RewardFailureError(HealthError):
    """More than ``task.reward_max_failure_frac`` of a step's reward calls failed: the job stops with
    one line naming the function (a health stop: exit 3, the last checkpoint kept)."""


def decode_completions(out: dict, tokenizer) -> list[str]:
    """Each row's completion text, up to and including its stop token (what the reward sees)."""
    return [tokenizer.decode(out["tokens"][r, : out["lengths"][r]]) for r in range(len(out["lengths"]))]


def driver_env() -> dict[str, str]:
    """The driver's environment for the workers, so the function sees what it saw when it ran in the
    driver (paths, keys for a verifier), minus Ray's own and per-process accelerator variables."""
    skip = ("RAY_", "TPU_", "JAX_", "XLA_", "LIBTPU", "CUDA_", "OMP_NUM_THREADS")
    return {k: v for k, v in os.environ.items() if not k.startswith(skip)}


class RayRewardWorkers:
    """How the pool reaches its workers on Ray (tests use a fake with the same five methods)."""

    def __init__(self, ray, task_cfg, env: dict[str, str] | None = None):
        self.ray, self.task = ray, task_cfg
        self.env = driver_env() if env is None else env

    def spawn(self, slot: int, incarnation: int):
        from actors.reward_fn_worker import RewardFnWorker

        t = self.task
        return self.ray.remote(RewardFnWorker).options(
            name=f"rltpu-reward-worker-{slot}-{os.getpid()}-{incarnation}", num_cpus=0,
            max_concurrency=8,  # chunks of several samplers share the worker's call threads
            runtime_env={"env_vars": self.env | {"OMP_NUM_THREADS": "1"}},
        ).remote(slot, t.reward_fn, dict(t.reward_kwargs), t.reward_timeout_s, t.reward_concurrency)

    def call(self, handle, texts: list[str], examples: list[dict]):
        return handle.score.remote(texts, examples)

    def wait(self, refs: list, timeout: float) -> list:
        ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=timeout)
        return ready

    def get(self, ref) -> dict:
        return self.ray.get(ref, timeout=0)

    def kill(self, handle) -> None:
        try:
            self.ray.kill(handle, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass


@dataclass
class _Chunk:
    slot: int
    handle: Any
    ref: Any
    rows: np.ndarray
    deadline: float
    sent: float
    retried: bool = False


@dataclass
class RewardBatch:
    """Rows submitted together (one sampler's shard): their texts, examples and outcomes."""

    texts: list[str]
    examples: list[dict]
    values: np.ndarray  # (rows,) float32, NaN until scored
    kinds: list[str | None]
    details: list[str]
    pending: list[_Chunk] = field(default_factory=list)
    terms: dict[int, list[float]] = field(default_factory=dict)  # row -> task.rewards' term values (ok rows)


class RewardPool:
    def __init__(self, task_cfg, workers, run_dir: Path | None = None, clock: Callable[[], float] = time.monotonic,
                 startup_s: float = 300.0, log: Callable[[str], None] | None = None, grace_s: float = GRACE_S,
                 label: str | None = None):
        """``workers``: ``RayRewardWorkers`` or a fake; ``startup_s`` is added to the first chunk's
        deadline of a worker not yet heard from (its process start and imports); ``label`` names
        what is scored in warnings and the stop line (default ``task.reward_fn <path>``; an
        environment's episodes: ``env.path <path>``)."""
        self.label = label or f"task.reward_fn {task_cfg.reward_fn}"
        self.task, self.workers, self.clock, self.startup_s = task_cfg, workers, clock, startup_s
        self.grace_s = grace_s
        self.failures_path = Path(run_dir) / "reward_failures.jsonl" if run_dir is not None else None
        self.log = log or logger.warning  # its lines are warnings (a worker replaced, failed calls)
        self.handles: list = []
        self.incarnation: list[int] = []
        self.ready: list[bool] = []
        self.in_flight: list[int] = []  # rows sent to each slot and not yet answered
        self.replaced_total = 0
        self.totals = {"reward_calls": 0, "reward_errors": 0, "reward_timeouts": 0}
        terms = (getattr(task_cfg, "reward_kwargs", None) or {}).get("terms") \
            if getattr(task_cfg, "reward_fn", None) == WEIGHTED_SUM else None
        self.term_names = term_metric_names(terms) if terms else []  # a mean per task.rewards term per step
        self.step = 0
        self.last: dict | None = None  # the newest step's counters (health.json)
        self._reset_step()

    # -- workers ------------------------------------------------------------------------------------
    def start(self) -> None:
        for slot in range(self.task.reward_workers):
            self.handles.append(self.workers.spawn(slot, 0))
            self.incarnation.append(0)
            self.ready.append(False)
            self.in_flight.append(0)

    def _replace(self, slot: int, why: str) -> None:
        self.workers.kill(self.handles[slot])
        self.incarnation[slot] += 1
        self.handles[slot] = self.workers.spawn(slot, self.incarnation[slot])
        self.ready[slot], self.in_flight[slot] = False, 0
        self.replaced_total += 1
        self._step["reward_workers_replaced"] += 1
        self.log(f"rltpu: warning: reward worker {slot} {why}; replaced (incarnation {self.incarnation[slot]})")

    def shutdown(self) -> None:
        for h in self.handles:
            self.workers.kill(h)
        self.handles = []

    # -- scoring ------------------------------------------------------------------------------------
    def _send(self, batch: RewardBatch, slot: int, rows: np.ndarray, retried: bool = False) -> None:
        t = self.task
        self.in_flight[slot] += len(rows)
        waves = math.ceil(self.in_flight[slot] / t.reward_concurrency)
        now = self.clock()
        deadline = now + waves * t.reward_timeout_s + self.grace_s + (0 if self.ready[slot] else self.startup_s)
        ref = self.workers.call(self.handles[slot], [batch.texts[i] for i in rows], [batch.examples[i] for i in rows])
        batch.pending.append(_Chunk(slot, self.handles[slot], ref, rows, deadline, now, retried))

    def submit(self, texts: list[str], examples: list[dict]) -> RewardBatch:
        """Hand ``texts`` (one per row, ``examples[i]`` its example) to the workers; returns at once."""
        n = len(texts)
        batch = RewardBatch(list(texts), list(examples), np.full(n, np.nan, np.float32), [None] * n, [""] * n)
        for slot, rows in enumerate(np.array_split(np.arange(n), len(self.handles))):
            if len(rows):
                self._send(batch, slot, rows)
        return batch

    def record(self, values, kinds: list[str], details: list[str], examples: list[dict]) -> RewardBatch:
        """Outcomes scored elsewhere (an environment's episodes, ``rltpu.control.environments``): a
        batch already settled, counted like reward calls when collected (same counters, same stop)."""
        return RewardBatch([""] * len(kinds), list(examples), np.asarray(values, np.float32).copy(), list(kinds),
                           list(details))

    def _fill(self, batch: RewardBatch, rows, values, kinds, details, terms=None) -> None:
        for j, (i, v, k, d) in enumerate(zip(rows, values, kinds, details)):
            batch.values[i] = v if k == "ok" else self.task.reward_default
            batch.kinds[i], batch.details[i] = k, d
            if k == "ok" and terms is not None and terms[j] is not None:
                batch.terms[int(i)] = terms[j]

    def _settle(self, batch: RewardBatch, c: _Chunk) -> None:
        """One chunk answered, died or missed its deadline."""
        current = c.handle is self.handles[c.slot]
        try:
            res = self.workers.get(c.ref)
        except Exception as err:  # noqa: BLE001 - the worker process is gone
            if current:
                self._replace(c.slot, f"died ({type(err).__name__})")
            if not c.retried:  # once more on the replacement: a dead process is not the rows' fault
                self._send(batch, c.slot, c.rows, retried=True)
            else:
                self._fill(batch, c.rows, [None] * len(c.rows), ["lost"] * len(c.rows),
                           [f"reward worker died twice ({type(err).__name__})"] * len(c.rows))
            return
        if current:
            self.ready[c.slot] = True
            self.in_flight[c.slot] = max(self.in_flight[c.slot] - len(c.rows), 0)
        self._fill(batch, c.rows, res["values"], res["kinds"], res["details"], res.get("terms"))
        if current and res.get("abandoned", 0) > ABANDONED_PER_SLOT * self.task.reward_concurrency:
            self._replace(c.slot, f"holds {res['abandoned']} calls still running past their deadline")

    def collect(self, batch: RewardBatch, count: bool = True) -> np.ndarray:
        """Wait for ``batch`` (never past its chunks' deadlines); ``count``: add its outcomes to the
        step's counters (evaluation rows are scored but not counted against the step)."""
        t0 = self.clock()
        while batch.pending:
            now = self.clock()
            first = min(c.deadline for c in batch.pending)
            ready = self.workers.wait([c.ref for c in batch.pending], max(min(first - now, 1.0), 0.0))
            now = self.clock()
            for c in list(batch.pending):
                if c.ref in ready:
                    batch.pending.remove(c)
                    self._settle(batch, c)
                elif now >= c.deadline:  # wedged: kill, replace, its rows time out
                    batch.pending.remove(c)
                    if c.handle is self.handles[c.slot]:
                        self._replace(c.slot, f"gave no answer in {now - c.sent:.1f}s (hung)")
                    self._fill(batch, c.rows, [None] * len(c.rows), ["timeout"] * len(c.rows),
                               [f"reward worker hung past task.reward_timeout_s={self.task.reward_timeout_s:g}"]
                               * len(c.rows))
        if count:
            self._count(batch)
            self._step["reward_wait_s"] += self.clock() - t0
        return batch.values

    # -- accounting ---------------------------------------------------------------------------------
    def _reset_step(self) -> None:
        self._step = {"reward_calls": 0, "reward_errors": 0, "reward_timeouts": 0, "reward_workers_replaced": 0,
                      "reward_wait_s": 0.0}
        self._term_sums, self._term_rows = [0.0] * len(self.term_names), 0
        self._failed: dict[str, list[tuple[Any, str]]] = {k: [] for k in KINDS}

    def begin_step(self, step: int) -> None:
        """A step (or a redo of one) starts: its counters start at zero, and rows of an attempt that
        failed before collecting (a sampler died mid-step) no longer stretch the chunk deadlines."""
        self.step = step
        self.in_flight = [0] * len(self.handles)
        self._reset_step()

    def _count(self, batch: RewardBatch) -> None:
        self._step["reward_calls"] += len(batch.kinds)
        for parts in batch.terms.values():
            if len(parts) == len(self.term_names):
                self._term_sums = [a + float(b) for a, b in zip(self._term_sums, parts)]
                self._term_rows += 1
        rows = []
        for i, kind in enumerate(batch.kinds):
            if kind in KINDS:
                self._step[KINDS[kind][0]] += 1
                ex_id = batch.examples[i].get("id") if isinstance(batch.examples[i], dict) else None
                self._failed[kind].append((ex_id, batch.details[i]))
                rows.append({"step": self.step, "id": ex_id, "kind": kind, "detail": batch.details[i]})
        if rows and self.failures_path is not None:
            try:
                with open(self.failures_path, "a") as f:
                    f.writelines(json.dumps(r, default=str) + "\n" for r in rows)
            except OSError:  # a debug record: the warning lines below still say what failed
                pass

    def failures(self) -> int:
        return self._step["reward_errors"] + self._step["reward_timeouts"]

    def check(self) -> None:
        """Stop the job (one line) when more than ``task.reward_max_failure_frac`` of the step's calls failed."""
        calls, failed, t = self._step["reward_calls"], self.failures(), self.task
        if calls and failed > t.reward_max_failure_frac * calls:
            parts = [f"{len(v)} {KINDS[k][1]}" for k, v in self._failed.items() if v]
            kind = next(k for k, v in self._failed.items() if v)
            ex_id, detail = self._failed[kind][0]
            raise RewardFailureError(
                f"{self.label} failed on {failed} of {calls} calls at step {self.step} "
                f"({', '.join(parts)}; first: {detail} on example id={ex_id!r}), more than "
                f"task.reward_max_failure_frac={t.reward_max_failure_frac:g}; fix the function, or raise "
                f"task.reward_timeout_s / task.reward_max_failure_frac")

    def step_metrics(self) -> dict:
        """This step's counters, once per step, plus one warning line per failure kind (not one per call)."""
        t = self.task
        for kind, failed in self._failed.items():
            if failed:
                ids = ", ".join(repr(i) for i, _ in failed[:5]) + (", ..." if len(failed) > 5 else "")
                self.log(f"rltpu: warning: step {self.step}: {self.label} {KINDS[kind][1]} on "
                         f"{len(failed)} of {self._step['reward_calls']} calls (example ids {ids}; first: "
                         f"{failed[0][1]}); scored task.reward_default={t.reward_default:g}"
                         + (f"; all in {self.failures_path.name}" if self.failures_path else ""))
        for k in ("reward_calls", "reward_errors", "reward_timeouts"):
            self.totals[k] += self._step[k]
        out = dict(self._step)
        self.last = {"step": self.step, **out}
        if self._term_rows:  # each term's own (unweighted) mean over the step's scored rows
            out |= {name: total / self._term_rows for name, total in zip(self.term_names, self._term_sums)}
        return out

    def health(self) -> dict:
        """For ``health.json`` (``rltpu status``, the dashboard): the pool and its running totals."""
        return {"workers": len(self.handles), "replaced": self.replaced_total, **self.totals,
                "timeout_s": self.task.reward_timeout_s, "fn": self.task.reward_fn, "last_step": self.last}
