"""Prompt datasets with a resumable cursor.

The built-in tasks (copy / reverse / sort digits) have answers that depend on the whole prompt,
so a policy cannot score by emitting a constant pattern. Examples are generated from
``(seed, index)`` alone, so the cursor (epoch, position) is all a checkpoint needs to resume
exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

TASK_PREFIX = {"copy": "c", "reverse": "r", "sort": "s"}
# tasks played through an environment (``rltpu.data.envs``): their examples carry what the environment needs
ENV_TASKS = ("calc", "guess", "lookup")
# their characters (the char tokenizer's alphabet): digits, the tool call '<' and '*', '=' before an
# answer; guesses, the feedback '<' (lower) / '>' (higher), '?' to start and '!' for an invalid guess
TASK_ALPHABET = {"calc": "0123456789*=<", "guess": "0123456789?<>!", "lookup": "0123456789?=<"}


def make_example(task: str, index: int, seed: int, min_digits: int, max_digits: int) -> dict:
    rng = np.random.default_rng([seed, index])
    if task == "calc":  # rltpu.data.envs.calculator: a product of two numbers of min..max digits, via the tool
        a, b = (_number(rng, int(rng.integers(min_digits, max_digits + 1))) for _ in range(2))
        return {"id": index, "prompt": f"{a}*{b}=", "expression": f"{a}*{b}", "answer": str(a * b)}
    if task == "lookup":  # rltpu.data.envs.lookup: a key's code, known only to the tool
        from rltpu.data.envs.lookup import code

        key = str(_number(rng, int(rng.integers(min_digits, max_digits + 1))))
        return {"id": index, "prompt": f"?{key}=", "key": key, "answer": code(key)}
    if task == "guess":  # rltpu.data.envs.guess: a secret digit found from higher/lower feedback
        secret = int(rng.integers(0, 10))
        return {"id": index, "prompt": "?", "secret": secret, "answer": str(secret)}
    n = int(rng.integers(min_digits, max_digits + 1))
    digits = "".join(str(d) for d in rng.integers(0, 10, size=n))
    if task == "copy":
        answer = digits
    elif task == "reverse":
        answer = digits[::-1]
    elif task == "sort":
        answer = "".join(sorted(digits))
    else:
        raise ValueError(f"unknown task {task!r}; allowed: {sorted(TASK_PREFIX)}")
    return {"id": index, "prompt": f"{TASK_PREFIX[task]}{digits}=", "answer": answer}


def _number(rng, digits: int) -> int:
    return int(rng.integers(10 ** (digits - 1) if digits > 1 else 0, 10 ** digits))


@dataclass
class Cursor:
    epoch: int = 0
    position: int = 0


class SyntheticPromptDataset:
    """An endless, epoch-shuffled stream over ``num_prompts`` generated examples."""

    def __init__(self, task: str, num_prompts: int, seed: int, min_digits: int, max_digits: int):
        self.task, self.num_prompts, self.seed = task, num_prompts, seed
        self.min_digits, self.max_digits = min_digits, max_digits
        self.cursor = Cursor()
        self._order = self._permutation(0)

    @classmethod
    def from_config(cls, task_cfg, seed: int) -> "SyntheticPromptDataset":
        return cls(task_cfg.name, task_cfg.num_prompts, seed, task_cfg.min_digits, task_cfg.max_digits)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, 1_000_003, epoch]).permutation(self.num_prompts)

    def next_batch(self, n: int) -> list[dict]:
        out = []
        while len(out) < n:
            if self.cursor.position >= self.num_prompts:
                self.cursor = Cursor(self.cursor.epoch + 1, 0)
                self._order = self._permutation(self.cursor.epoch)
            idx = int(self._order[self.cursor.position])
            self.cursor.position += 1
            out.append(make_example(self.task, idx, self.seed, self.min_digits, self.max_digits))
        return out

    def encode(self, example: dict, tokenizer) -> list[int]:
        """Prompt ids (same interface as ``rltpu.data.sources.PromptDataset``)."""
        return tokenizer.encode(example["prompt"])

    def probe_texts(self, n: int) -> list[tuple[str, bool]]:
        """``n`` fixed prompt+answer texts (from another seed) as (text, add_bos) for the sync probe."""
        other = SyntheticPromptDataset(self.task, self.num_prompts, 12345, self.min_digits, self.max_digits)
        return [(e["prompt"] + e["answer"], True) for e in other.next_batch(n)]

    def state_dict(self) -> dict:
        return {"epoch": self.cursor.epoch, "position": self.cursor.position}

    def load_state_dict(self, state: dict) -> None:
        self.cursor = Cursor(int(state["epoch"]), int(state["position"]))
        self._order = self._permutation(self.cursor.epoch)
