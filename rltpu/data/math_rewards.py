"""Math answer rewards for GSM8K-style data: a verifier built on ``math-verify``, a format reward, and
the same verifier in verl's ``compute_score`` shape.

    task:
      rewards:
        - {fn: rltpu.data.math_rewards:math_correct, weight: 1.0}   # the answer is right
        - {fn: rltpu.data.math_rewards:gsm8k_format, weight: 0.1}   # it ends with "#### <number>"

A GSM8K reference is worked reasoning ending in ``#### 72``; only the part after the last ``####`` is
the answer. A completion's answer is likewise the text after its last ``####`` when it has one, else the
whole completion (math-verify then takes its last number or ``\\boxed{}``). ``math_verify.parse`` turns
both into sympy values and ``math_verify.verify`` compares them: equivalent forms (``0.5`` = ``1/2``,
``18.00`` = ``18``), thousands separators, dollar signs and units (``$1,000``, ``18 dollars``) all match;
a different number does not. ``math-verify`` is the ``math`` extra (``pip install 'rltpu[math]'``).

Why no timeouts of math-verify's own: they use ``signal.alarm``, which works only on a process's main
thread, and reward workers call these functions on threads; each call already runs under
``task.reward_timeout_s`` (``rltpu.data.rewards.DeadlineRunner``).
"""

from __future__ import annotations

import functools
import re

from rltpu.config import ConfigError

ANSWER_MARK = "####"
# "#### 1,234.5" (sign, $, thousands commas, decimals) closing the completion: GSM8K's own answer format
_FORMAT = re.compile(r"(?<!#)####[ \t]*\$?[ \t]*-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?[ \t]*\.?\s*\Z")


@functools.cache
def _math_verify():
    try:
        import logging

        import math_verify
    except ImportError:
        raise ConfigError("rltpu.data.math_rewards needs math-verify: pip install 'rltpu[math]' (or run make "
                          "setup)") from None
    # it warns on every call that its signal timeouts are off (they are: see the module docstring)
    for name in ("math_verify", "math_verify.parser", "math_verify.grader", "math_verify.utils"):
        logging.getLogger(name).setLevel(logging.ERROR)
    return math_verify


def after_mark(text: str) -> str:
    """The text after the last ``####`` (stripped), or all of ``text`` when it has none."""
    text = str(text)
    return text.rpartition(ANSWER_MARK)[2].strip() if ANSWER_MARK in text else text.strip()


def parse_answer(text: str) -> list:
    """math-verify's parse of ``text`` (``[]`` when it finds no answer in it)."""
    return list(_parse(text))


@functools.lru_cache(maxsize=4096)
def _parse(text: str) -> tuple:
    return tuple(_math_verify().parse(text, parsing_timeout=None))


@functools.lru_cache(maxsize=4096)
def answers_match(reference: str, answer: str) -> bool:
    """Whether ``answer`` states the same value as ``reference`` (both as math-verify parses them).
    Cached: a group's samples often end in the same answer, and sympy's parse costs milliseconds."""
    gold, pred = parse_answer(reference), parse_answer(answer)
    if not gold or not pred:
        return False
    return bool(_math_verify().verify(gold, pred, timeout_seconds=None))


def math_correct(completion: str, example: dict, column: str = "answer") -> float:
    """1.0 when the completion's answer equals the reference in ``example[column]`` (a GSM8K answer
    with ``#### N``, or a bare value), else 0.0."""
    if column not in example:
        raise ConfigError(f"rltpu.data.math_rewards:math_correct: the example has no '{column}' column (it has: "
                          f"{', '.join(map(str, example))}); set task.rewards[].kwargs.column to the reference column")
    return float(answers_match(after_mark(example[column]), after_mark(completion)))


def gsm8k_format(completion: str, example: dict | None = None) -> float:
    """1.0 when the completion ends with a ``#### <number>`` line (GSM8K's answer format), else 0.0."""
    return float(bool(_FORMAT.search(completion)))


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """``math_correct`` in verl's reward shape, so a verl user's ``custom_reward_function`` can call it
    (and ``rltpu.data.rewards:verl_score`` can run it like any verl function)."""
    return float(answers_match(after_mark(ground_truth), after_mark(solution_str)))
