"""Reward functions: ``fn(completion: str, example: dict) -> float in [0, 1]``.

Pluggable by import path (``task.reward_fn: "my_pkg.rewards:exact"``); the example dict carries the
prompt and any extra fields (the synthetic tasks' ``answer``, or every extra column of a dataset
file). ``task.reward_kwargs`` binds keyword arguments (e.g. ``{column: reference}``).
"""

from __future__ import annotations

import functools
import importlib
import inspect
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
    if column not in example:
        raise ConfigError(f"rltpu.data.rewards:exact_answer: the example has no '{column}' column (it has: "
                          f"{', '.join(map(str, example))}); add it to the dataset or set task.reward_kwargs.column")
    refs = example[column] if isinstance(example[column], (list, tuple)) else [example[column]]
    got = normalize_answer(completion)
    return float(any(got == normalize_answer(r) for r in refs))


def load_reward_fn(path: str, kwargs: dict | None = None) -> RewardFn:
    """Import ``module:function`` and bind ``kwargs``; a bad path or keyword is a one-line error."""
    module_name, _, fn_name = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"task.reward_fn={path!r}: cannot import module {module_name!r} ({err})") from None
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
    return functools.partial(fn, **kwargs)


class RewardFunctionError(ConfigError):
    """The user's reward function raised (or returned no number): the run stops with one line that
    names the function, the exception and the example; the last checkpoint is kept."""


def guard_reward_fn(fn: RewardFn, path: str) -> RewardFn:
    """``fn`` whose exceptions become one ``RewardFunctionError`` line (no traceback, exit 2).

    Chosen over a default score: a reward that silently turns a bug into zeros trains on noise."""

    def call(text: str, example: dict) -> float:
        try:
            return float(fn(text, example))
        except Exception as err:  # noqa: BLE001 - any exception in user code
            ex_id = example.get("id") if isinstance(example, dict) else None
            msg = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
            raise RewardFunctionError(
                f"task.reward_fn {path} raised {type(err).__name__}{': ' + msg if msg else ''} on example "
                f"id={ex_id!r} (completion {text[:40]!r}); fix the function or task.reward_kwargs") from None

    call.__wrapped__ = fn
    return call
