"""Reward functions: ``fn(completion: str, example: dict) -> float in [0, 1]``.

Pluggable by import path (``task.reward_fn: "my_pkg.rewards:exact"``); the example dict carries the
prompt and any extra fields (the synthetic tasks' ``answer``, or every extra column of a dataset
file). ``task.reward_kwargs`` binds keyword arguments (e.g. ``{column: reference}``). Several
functions, weighted (TRL's ``reward_funcs`` + ``reward_weights``): ``task.rewards: [{fn, weight,
kwargs}, ...]``, run as one call of :func:`weighted_sum`. A verl ``compute_score(data_source,
solution_str, ground_truth, extra_info)`` runs through :func:`verl_score`.

``DeadlineRunner`` is what a reward worker (``actors/reward_fn_worker.py``) runs the function with:
calls overlap on threads, each under ``task.reward_timeout_s``; a call that raises, returns a
non-finite number or misses its deadline is reported as such (the driver scores it
``task.reward_default`` and counts it), never raised.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import queue
import threading
import time
import unicodedata
from typing import Callable

from rltpu.config import ConfigError

RewardFn = Callable[[str, dict], float]


def partial_credit(completion: str, example: dict) -> float:
    """Fraction of answer positions right, divided by the longer of answer and completion.

    A random string scores near 0, the exact answer 1; extra or missing characters cost credit, so
    the policy must also learn to stop (emit EOS) at the right length.
    """
    answer = example["answer"]
    hits = sum(a == b for a, b in zip(completion, answer))
    return hits / max(len(answer), len(completion), 1)


def word_credit(completion: str, example: dict, column: str = "answer") -> float:
    """``partial_credit`` over whitespace-separated words against ``example[column]``: the fraction
    of answer words in place, divided by the longer of answer and completion.

    Dense where ``exact_answer`` is all-or-nothing: a random-init policy's first samples already
    score (a word right here and there), so GRPO has a signal from step 1; only the exact answer
    (and nothing after it) scores 1.
    """
    want = _column(example, column, "word_credit")
    return partial_credit(completion.split(), {"answer": str(want).split()})


def exact_match(completion: str, example: dict) -> float:
    return float(completion == example["answer"])


def normalize_answer(text) -> str:
    """Unicode-NFKC, case-folded, whitespace collapsed, surrounding punctuation/quotes stripped:
    ``"  The Answer is 42. "`` and ``"the answer is 42"`` compare equal."""
    text = " ".join(unicodedata.normalize("NFKC", str(text)).casefold().split())
    return text.strip(" .,!?;:\"'`")


def exact_answer(completion: str, example: dict, column: str = "answer") -> float:
    """1.0 when the normalised completion equals the normalised ``example[column]`` (a dataset
    column; a list there means any of its entries is accepted), else 0.0.

    Use with a dataset file: ``task.reward_fn: rltpu.data.rewards:exact_answer`` and, for a column not
    called ``answer``, ``task.reward_kwargs: {column: reference}``.
    """
    value = _column(example, column, "exact_answer")
    refs = value if isinstance(value, (list, tuple)) else [value]
    got = normalize_answer(completion)
    return float(any(got == normalize_answer(r) for r in refs))


WEIGHTED_SUM = "rltpu.data.rewards:weighted_sum"  # what task.rewards runs as (rltpu.config.TaskConfig)


@functools.lru_cache(maxsize=64)
def _terms(key: str) -> tuple[tuple[str, RewardFn, float], ...]:
    import json

    return tuple((t["fn"], load_reward_fn(t["fn"], t.get("kwargs") or {}), float(t.get("weight", 1.0)))
                 for t in json.loads(key))


def _terms_key(terms: list[dict]) -> str:
    import json

    return json.dumps([{"fn": t["fn"], "weight": t.get("weight", 1.0), "kwargs": t.get("kwargs") or {}}
                       for t in terms], sort_keys=True)


def weighted_sum(completion: str, example: dict, terms: list[dict]) -> float:
    """``sum(weight * fn(completion, example))`` over ``terms`` (``[{fn, weight, kwargs}, ...]``, from
    ``task.rewards``); each function is imported once per process. A term that raises fails the call,
    named by its function."""
    return weighted_terms(completion, example, terms)[0]


def weighted_terms(completion: str, example: dict, terms: list[dict]) -> tuple[float, list[float]]:
    """``weighted_sum`` and each term's own (unweighted) value, in ``terms`` order: the reward workers
    return both, so a step logs every term's mean beside the sum (``term_metric_names``)."""
    total, parts = 0.0, []
    for path, fn, weight in _terms(_terms_key(terms)):
        try:
            value = float(fn(completion, example))
        except Exception as err:  # noqa: BLE001 - one line naming the term (the runner reports it)
            raise RuntimeError(f"{path}: {_first_line(err)}") from None
        total += weight * value
        parts.append(value)
    return total, parts


def term_metric_names(terms: list[dict]) -> list[str]:
    """The metrics.jsonl name of each term's step mean: ``reward_term_<function>_mean`` (the trackers'
    ``reward/term_<function>_mean``); a function used twice gets ``_2``, ``_3``, ... after its name."""
    names, seen = [], {}
    for t in terms:
        base = str(t["fn"]).rpartition(":")[2] or str(t["fn"])
        seen[base] = seen.get(base, 0) + 1
        names.append(f"reward_term_{base}{'' if seen[base] == 1 else '_' + str(seen[base])}_mean")
    return names


def finite_terms(result) -> tuple[tuple[float, list[float]] | None, str, str]:
    """``DeadlineRunner``'s check for ``weighted_terms``: the sum must be a finite number (as
    ``finite_reward``); an ok value is ``(sum, parts)``."""
    total, parts = result
    value, kind, detail = finite_reward(total)
    return ((value, list(parts)) if kind == "ok" else None), kind, detail


def _dig(example: dict, key: str):
    """``example[key]``; a dotted key reads nested columns (verl parquet: ``reward_model.ground_truth``)."""
    node = example
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            raise ConfigError(f"rltpu.data.rewards:verl_score: the example has no '{key}' column (it has: "
                              f"{', '.join(map(str, example))}); set the term's kwargs ground_truth / data_source")
        node = node[part]
    return node


def verl_score(completion: str, example: dict, fn: str, ground_truth: str = "answer",
               data_source: str | None = "data_source") -> float:
    """Run a verl reward function ``fn`` (``module:function`` with verl's signature
    ``compute_score(data_source, solution_str, ground_truth, extra_info)``) on an rltpu call: the
    ground truth and data source come from those columns (dotted for nested ones; a missing data
    source column passes ``""``), ``extra_info`` is the whole example, and a dict result (verl's
    ``{"score": ...}``) gives its ``score``."""
    score_fn = load_reward_fn(fn)
    source = ""
    if data_source is not None:
        try:
            source = _dig(example, data_source)
        except ConfigError:
            pass
    out = score_fn(data_source=source, solution_str=completion, ground_truth=_dig(example, ground_truth),
                   extra_info=example)
    return float(out["score"] if isinstance(out, dict) else out)


def _column(example: dict, column: str, fn: str):
    """``example[column]``, or a one-line error naming the reward function and the fix."""
    if column not in example:
        raise ConfigError(f"rltpu.data.rewards:{fn}: the example has no '{column}' column (it has: "
                          f"{', '.join(map(str, example))}); add it to the dataset or set task.reward_kwargs.column")
    return example[column]


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:200]}" if text else type(err).__name__


def load_reward_fn(path: str, kwargs: dict | None = None) -> RewardFn:
    """Import ``module:function`` and bind ``kwargs``; a bad path or keyword is a one-line error."""
    module_name, _, fn_name = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"task.reward_fn={path!r}: cannot import module {module_name!r} ({err})") from None
    except BaseException as err:  # noqa: BLE001 - the module's own code raised (or a SyntaxError): one line
        if isinstance(err, KeyboardInterrupt):
            raise
        raise ValueError(f"task.reward_fn={path!r}: importing module {module_name!r} raised {_first_line(err)}; "
                         f"fix the module (it runs as trusted code in every reward worker)") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ValueError(f"task.reward_fn={path!r}: module {module_name!r} has no function {fn_name!r}")
    if not kwargs:
        return fn
    try:
        inspect.signature(fn).bind_partial("", {}, **kwargs)
    except TypeError as err:
        raise ValueError(f"task.reward_kwargs {sorted(kwargs)} do not fit {path} ({err}); "
                         f"use the function's keyword parameters") from None
    if fn is weighted_sum:  # task.rewards: import every term now (the driver's check before Ray starts)
        _terms(_terms_key(kwargs["terms"]))
    elif fn is verl_score and "fn" in kwargs:
        load_reward_fn(kwargs["fn"])
    return functools.partial(fn, **kwargs)


FAILURE_KINDS = ("error", "timeout", "nonfinite")  # what a failed call scores as task.reward_default


def finite_reward(result) -> tuple[float | None, str, str]:
    """A reward call's result: a finite number (``float`` raises on anything else: an error)."""
    value = float(result)
    if not math.isfinite(value):
        return None, "nonfinite", f"returned {value}"
    return value, "ok", ""


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}{': ' + text[0][:200] if text else ''}"


class DeadlineRunner:
    """Calls ``fn(text, example)`` on up to ``concurrency`` threads, each call under its own deadline.

    Why threads: a reward that hangs (a verifier, a sandbox) must cost its own deadline, not the
    deadline of every call queued behind it, so calls overlap; and a call that misses its deadline
    is abandoned (Python cannot kill a thread): its thread keeps running detached, a fresh thread
    takes its place, and ``abandoned`` counts the detached ones still alive (the owning process is
    replaced when they pile up). The function may therefore run on several threads at once;
    ``concurrency=1`` serialises the calls (a hang then still costs only its deadline).

    ``run(items)`` returns one ``(value, kind, detail)`` per item: kind ``ok``, or one of
    ``FAILURE_KINDS`` with ``value`` None and a one-line ``detail``.
    """

    def __init__(self, fn: Callable, timeout_s: float, concurrency: int,
                 check: Callable[[object], tuple] | None = None):
        """``check(result) -> (value, kind, detail)`` judges a returned result; the default wants a
        finite number (a reward). Environments pass their own (``rltpu.data.envs.episodes``)."""
        self.fn, self.timeout_s, self.concurrency = fn, float(timeout_s), int(concurrency)
        self.check = check or finite_reward
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._running: dict[int, tuple] = {}  # runner id -> (job, index, start)
        self._detached: set[int] = set()  # runner ids whose call missed its deadline
        self._live = 0  # runners not detached
        self._next_id = 0

    @property
    def abandoned(self) -> int:
        with self._cond:
            return len(self._detached)

    def _spawn(self) -> None:
        rid, self._next_id = self._next_id, self._next_id + 1
        self._live += 1
        threading.Thread(target=self._loop, args=(rid,), name=f"reward-call-{rid}", daemon=True).start()

    def _loop(self, rid: int) -> None:
        while True:
            job, i, item = self._tasks.get()
            with self._cond:
                self._running[rid] = (job, i, time.monotonic())
            try:
                value, kind, detail = self.check(self.fn(*item))
            except Exception as err:  # noqa: BLE001 - any exception in user code is the call's outcome
                value, kind, detail = None, "error", _one_line(err)
            with self._cond:
                self._running.pop(rid, None)
                if rid in self._detached:  # too late: the caller already scored it as a timeout
                    self._detached.discard(rid)
                    return
                job[i] = (value, kind, detail)
                self._cond.notify_all()

    def run(self, items: list[tuple[str, dict]]) -> list[tuple[float | None, str, str]]:
        job: list = [None] * len(items)
        with self._cond:
            while self._live < self.concurrency:
                self._spawn()
        for i, item in enumerate(items):
            self._tasks.put((job, i, item))
        with self._cond:
            while any(r is None for r in job):
                now = time.monotonic()
                wake = now + 0.25
                for rid, (owner, i, start) in list(self._running.items()):
                    if owner is not job:
                        continue
                    if now - start >= self.timeout_s:
                        job[i] = (None, "timeout", f"no result within task.reward_timeout_s={self.timeout_s:g}")
                        del self._running[rid]
                        self._detached.add(rid)
                        self._live -= 1
                        self._spawn()  # the queue behind it keeps moving
                    else:
                        wake = min(wake, start + self.timeout_s)
                self._cond.wait(max(wake - now, 0.001))
        return job
