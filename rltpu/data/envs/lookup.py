"""Bundled example 1, tool use: answer a code only a lookup tool knows.

    prompt       ?574=         what is the code of key 574?
    policy       <             a call (the tool reads the key from the question)
    environment  935=          the tool's answer: the key's code in its table
    policy       935           the answer

Reward: ``call_credit`` for a call ('<' alone), then ``1 - call_credit`` x the answer against the
code, character by character (``partial_credit``); a completion that is not a call ends the episode
at 0. The codes are hashes of the key (uniform digits, ``code``): no policy can guess them, so
without the environment's turn (``max_turns: 1``) the reward stays at the call's share and what the
policy learns is to read the tool's answer. Train with ``env.credit: turn``: with one advantage
per episode the call's reward also rewards whatever the answer turn wrote, and the policy learns to
write '<' again: ``rltpu train configs/env_lookup.yaml env.credit=episode trainer.steps=100`` (seed 0,
measured by hand) sat at exactly 0.200 from step 30 to 100, answering '<', entropy 0.03 by step 50;
the same config with per-turn credit reaches last-5 0.90 at step 100 (README, envs).

Why not the calculator (``rltpu.data.envs.calculator``): a product's digits are partly guessable from
its operands (leading digits, Benford), and every variant tried settled on guessed digits before
learning to copy the tool's (its docstring lists them).

Use with ``task.name: lookup`` (examples with ``prompt``, ``key`` and ``answer``) or any dataset whose
rows have those columns.
"""

from __future__ import annotations

import hashlib

from rltpu.data.rewards import partial_credit


def code(key: str, digits: int = 3, table: int = 0) -> str:
    """The tool's table: key -> a ``digits``-long code, uniform over its digits (a hash)."""
    h = int.from_bytes(hashlib.sha256(f"{table}:{key}".encode()).digest()[:8], "big")
    return str(h % 10 ** digits).zfill(digits)


class Lookup:
    observation_role = "tool"

    def __init__(self, call_credit: float = 0.2, digits: int = 3, table: int = 0):
        if not 0 <= call_credit < 1:
            raise ValueError(f"call_credit={call_credit} must be in [0, 1)")
        if not 1 <= digits <= 12:
            raise ValueError(f"digits={digits} must be in [1, 12]")
        self.call_credit, self.digits, self.table = float(call_credit), int(digits), int(table)
        self.example: dict = {}
        self.value: str | None = None  # the tool's answer, once called

    def reset(self, example: dict) -> str:
        self.example, self.value = example, None
        return example["prompt"]

    def step(self, messages: list[dict], completion: str) -> tuple[str | None, float, bool]:
        if self.value is None:
            if completion != "<":  # not a call: the episode ends unscored
                return None, 0.0, True
            self.value = code(str(self.example["key"]), self.digits, self.table)
            return f"{self.value}=", self.call_credit, False
        return None, (1 - self.call_credit) * partial_credit(completion, {"answer": self.value}), True
