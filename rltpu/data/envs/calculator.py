"""Bundled example 1, tool use: multiply two numbers with a calculator the policy has to call.

    prompt       37*52=
    policy       <37*52        a call: '<' then the expression (ends at the stop token)
    environment  1924=         the tool's result
    policy       1924          the answer

Rewards (summed over the episode, at most 1): ``call_credit`` x the call against the expression,
operand by operand (``call_score``: a partly right call earns part, extra characters cost
credit, a call without the operator earns nothing), then ``1 - call_credit`` x the
answer against the true product, counted only when the tool computed the right product (the
answer is backed by a correct call). Why the two rules: graded without a call, or after a wrong
one, a policy from random init farms partial credit by writing digits that products often start
with ('1111...') and never learns the call; gated, the first steps' only signal is copying the
expression, and once calls are right the answer is a copy of the tool's result just before it.
A tiny model cannot learn to multiply two-digit numbers in a few minutes; it can learn both
copies, so what it reaches comes from the environment's turn: without that turn
(``max_turns: 1``) it can earn ``call_credit`` at most.

Use with ``task.name: calc`` (examples with ``prompt``, ``expression``, ``answer``) or any dataset
whose rows have those columns.
"""

from __future__ import annotations

from rltpu.data.rewards import partial_credit

MAX_CALL_CHARS = 16  # a longer "expression" is not evaluated (and big products cost nothing)


def call_score(call: str, expression: str) -> float:
    """The mean position-wise credit of the call's operands against the expression's, 0 unless the
    call has the expression's shape (as many '*'). Why operands: crediting characters in place, the
    fixed '*' is a free share and the policy collapsed onto '<**' (seen twice); crediting digits
    only, it wrote '688' for '6*8' (full credit, a call the tool cannot run)."""
    got, want = call.split("*"), expression.split("*")
    if len(got) != len(want):
        return 0.0
    return sum(partial_credit(g, {"answer": w}) for g, w in zip(got, want)) / len(want)


def evaluate(expression: str) -> int | None:
    """Integers joined by '*' (no ``eval``); None when it is anything else."""
    parts = expression.split("*")
    if len(expression) > MAX_CALL_CHARS or not all(p.isdigit() for p in parts):
        return None
    out = 1
    for p in parts:
        out *= int(p)
    return out


class Calculator:
    observation_role = "tool"

    def __init__(self, call_credit: float = 0.2):
        if not 0 <= call_credit < 1:
            raise ValueError(f"call_credit={call_credit} must be in [0, 1)")
        self.call_credit = float(call_credit)
        self.example: dict = {}
        self.called = False
        self.right = False  # the tool computed the true product

    def reset(self, example: dict) -> str:
        self.example, self.called, self.right = example, False, False
        return example["prompt"]

    def step(self, messages: list[dict], completion: str) -> tuple[str | None, float, bool]:
        if completion.startswith("<") and not self.called:
            self.called = True
            expression = completion[1:]
            reward = self.call_credit * call_score(expression, self.example["expression"])
            result = evaluate(expression)
            self.right = result is not None and str(result) == self.example["answer"]
            return ("" if result is None else str(result)) + "=", reward, False
        if not self.right:  # no call, or a call that did not compute the product
            return None, 0.0, True
        return None, (1 - self.call_credit) * partial_credit(completion, {"answer": self.example["answer"]}), True
