"""Bundled example 1, tool use: multiply two numbers with a calculator the policy has to call.

    prompt       37*52=
    policy       <37*52        a call: '<' then the expression (ends at the stop token)
    environment  1924=         the tool's result
    policy       1924          the answer

Rewards (summed over the episode, at most 1): ``call_credit`` x the call (a quarter for making one,
three quarters for its expression against the prompt's: ``call_score``), then ``1 - call_credit`` x
the answer against the true product, counted only when the tool computed it; a call that does not
ends the episode. A tiny model cannot learn to multiply in a few minutes; it can learn to copy the
expression into the call and the tool's result into its answer (each a copy at one fixed distance,
which a rotary-attention head learns as in the quickstart), so what it reaches comes from the
environment's turn: without that turn (``max_turns: 1``) it earns ``call_credit`` at most.

Why these rules, each from a run that failed to learn:
- an answer graded without a right call let a policy farm partial credit with digits products
  often start with ('1111...') and never learn the call;
- with the operator credited like a digit it was learned first (finding '*' is content-based, not
  a copy at a distance) and written everywhere ('<****'), so it counts only once every digit is
  in place;
- without a share for the '<' about 1 first turn in 50 scored anything from random init; paid for
  any call, the '<' was written everywhere ('<4<1<'), so it is paid only to a call with one '<';
- an answer after a wrong call could score nothing, and its tokens were trained on the call's
  advantage alone (noise that collapsed their entropy), so the episode ends there;
- with one-digit operands a policy wrote either prompt digit everywhere ('<999' for '7*9': finding
  "a digit of the prompt" is content-based too), so the bundled config uses two-digit operands.

Not yet shown to learn: with these rules (seed 0, two-digit operands) the call's four digits were in
place by about step 100 ('<695515' for '69*51'), but the operator's position had collapsed onto a
digit before it was credited, no call was right and the reward stayed at 0.15 to step 150
(entropy 0.01). A call of the operands' digits only ('<3752' for 37 x 52, the tool splitting them
in halves; tried, not bundled) got further: right calls from about step 60, then a mean reward of
0.37-0.47 from step 100 to 180 with the policy's entropy at 0.02-0.04 (it had settled on a wrong
fourth digit for half the prompts and on answers with extra digits). The same with
``trainer.kl_coef=0.05`` (a KL to the initial policy) kept the entropy near 1.0: 83% of calls right
by step 130, the answer copy still being learned (0.36 at step 172, rising about 0.06 per 50 steps),
too slow for the quickstart's time budget. Two more, tried and not bundled (seed 0, 2.1-3.1 s a step, so
about 125 steps fit the 5-minute budget):
- operands-only calls with the answer credited against whatever the tool returned (half weight after a
  wrong call), so that copying the result is learned beside the call: 0.36 at step 96, entropy 0.15;
- a call without arguments ('<' alone; the tool reads the question): with a direct answer credited the
  policy never called (it farmed leading digits, 0.17 at step 84); uncredited, calls were learned by
  step 15, then the answers settled on the leading digits products often have ('20000', '11111'; Benford):
  0.42 at step 82, entropy 0.13; with ``trainer.kl_coef=0.05`` 0.40 at step 78, entropy 0.95.
Two more on 2026-12-02 (not bundled): a call without arguments ('<'; the tool reads the question) and
the product zero-padded to four digits, so the answer copies the result at one fixed distance as in
the quickstart: 0.47 at step 130 with one advantage per episode, 0.49 at step 120 with per-turn credit
(``env.credit: turn``); both answered the result's first one or two digits and repeated them
('2214' -> '2211'). The same machinery on codes with uniform digits learns (``rltpu.data.envs.lookup``,
the bundled tool-use example), which points at the products' guessable digits.
What is open is faster exploration of the answer (per-token credit instead of per episode, an answer
whose digits cannot be guessed, a stronger model) without the collapse.

Use with ``task.name: calc`` (examples with ``prompt``, ``expression``, ``answer``) or any dataset
whose rows have those columns.
"""

from __future__ import annotations

from rltpu.data.rewards import partial_credit

MAX_CALL_CHARS = 16  # a longer "expression" is not evaluated (and big products cost nothing)
CALL_SHARE = 0.25  # of the call's credit, for making a call (the first signal from random init)


def call_score(call: str, expression: str) -> float:
    """The call's characters in place against the expression's, over the longer of the two (extra
    characters cost credit, so the policy learns to stop); an operator counts only once every digit
    is in place."""
    digits = [i for i, ch in enumerate(expression) if ch.isdigit()]
    hits = [i < len(call) and call[i] == ch for i, ch in enumerate(expression)]
    score = sum(hits[i] for i in digits)
    if all(hits[i] for i in digits):
        score += sum(hits) - len(digits)
    return score / max(len(call), len(expression), 1)


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
            share = CALL_SHARE if "<" not in expression else 0.0
            reward = self.call_credit * (share + (1 - CALL_SHARE) * call_score(expression, self.example["expression"]))
            result = evaluate(expression)
            self.right = result is not None and str(result) == self.example["answer"]
            if not self.right:  # a wrong call ends the episode: no answer could score after it
                return None, reward, True
            return f"{result}=", reward, False
        if not self.right:  # an answer without a call
            return None, 0.0, True
        return None, (1 - self.call_credit) * partial_credit(completion, {"answer": self.example["answer"]}), True
