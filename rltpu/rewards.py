"""Reward functions: ``fn(completion: str, example: dict) -> float in [0, 1]``.

Pluggable by import path (``task.reward_fn: "my_pkg.rewards:exact"``); the example dict carries the
prompt and any extra fields (here ``answer``).
"""

from __future__ import annotations

import importlib
from typing import Callable

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


def load_reward_fn(path: str) -> RewardFn:
    """Import ``module:function``; a bad path is a one-line error naming it."""
    module_name, _, fn_name = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"task.reward_fn={path!r}: cannot import module {module_name!r} ({err})") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ValueError(f"task.reward_fn={path!r}: module {module_name!r} has no function {fn_name!r}")
    return fn
