"""A synthetic arithmetic task in GSM8K's format, with a tiny model that learns it on CPU in minutes.

    python -m rltpu.data.arithmetic data/arith
    rltpu tiny-checkpoint data/arith/model --arch llama --tokenizer arith --hidden-size 128 --init-std 0.02
    rltpu train configs/gsm8k_arith.yaml

writes ``train.jsonl`` and ``test.jsonl`` (rows like GSM8K's: ``question`` "3 + 4 = ?", ``answer``
"3 + 4 = 7\\n#### 7"); ``rltpu tiny-checkpoint --tokenizer arith`` writes a tiny random Llama with a
word-level tokenizer over :func:`corpus` (one id per word of the task, ChatML chat template).
``configs/gsm8k_arith.yaml`` trains it with GSM8K's own rewards (``rltpu.data.math_rewards``: math-verify correctness against the ``####``
answer, plus the format bonus) and evaluates greedy accuracy on ``test.jsonl``.

What it shows: the recipe's data path (a question column, a prompt template in a chat turn after a
system prompt), its weighted rewards and its evaluation make a policy learn. What it does not: the
sums come from one small table (a and b in 0..max_operand: 25 sums by default) in both files, so a
tiny model can memorise them; it says nothing about reasoning. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

SYSTEM_PROMPT = "Answer with #### and the number ."  # words the tokenizer knows (configs/gsm8k_arith.yaml)


def arithmetic_rows(n: int, seed: int = 0, max_operand: int = 9, split: str = "train") -> list[dict]:
    """``n`` GSM8K-format rows ``a + b`` with a, b in 0..max_operand, drawn from ``(seed, split)``.

    The sum is drawn uniformly, then a split of it: with uniform operands the rare sums (0, 1, 2m-1,
    2m) are a few rows in 25, and a policy collapsed onto the common answers before it tried them."""
    rng = np.random.default_rng([seed, 0 if split == "train" else 1])
    rows = []
    for i in range(n):
        total = int(rng.integers(0, 2 * max_operand + 1))
        a = int(rng.integers(max(0, total - max_operand), min(total, max_operand) + 1))
        b = total - a
        rows.append({"id": f"{split}-{i}", "question": f"{a} + {b} = ?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"})
    return rows


def corpus(max_operand: int = 9) -> list[str]:  # 9: one tokenizer serves every --max-operand up to 9
    """Every word the task's prompts and answers use (the word-level tokenizer's vocabulary)."""
    words = [str(k) for k in range(2 * max_operand + 1)] + ["+", "=", "?", "####"]
    return [" ".join(words), SYSTEM_PROMPT, "user assistant system"]


def write_arithmetic_task(directory: str | Path, train_rows: int = 2000, test_rows: int = 200, seed: int = 0,
                          max_operand: int = 4) -> dict:
    """Write ``train.jsonl`` and ``test.jsonl`` under ``directory``; returns their paths."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, n in (("train", train_rows), ("test", test_rows)):
        paths[split] = out / f"{split}.jsonl"
        paths[split].write_text("".join(json.dumps(r) + "\n" for r in arithmetic_rows(n, seed, max_operand, split)))
    return {"train": str(paths["train"]), "test": str(paths["test"])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rltpu.data.arithmetic", description=__doc__.splitlines()[0])
    parser.add_argument("directory", nargs="?", default="data/arith")
    parser.add_argument("--train-rows", type=int, default=2000)
    parser.add_argument("--test-rows", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-operand", type=int, default=4, help="a and b are drawn from 0..max-operand")
    args = parser.parse_args(argv)
    print(json.dumps(write_arithmetic_task(args.directory, args.train_rows, args.test_rows, args.seed,
                                           args.max_operand)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
