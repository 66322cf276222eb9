"""A synthetic arithmetic task in GSM8K's format, with a tiny model that learns it on CPU in minutes.

    python -m rltpu.data.arithmetic data/arith      # then: rltpu train configs/gsm8k_arith.yaml

writes ``train.jsonl`` and ``test.jsonl`` (rows like GSM8K's: ``question`` "3 + 4 = ?", ``answer``
"3 + 4 = 7\\n#### 7") and ``model/``: a tiny random Llama written by ``transformers`` with a word-level
tokenizer (one id per word of the task, ChatML chat template). ``configs/gsm8k_arith.yaml`` trains it
with GSM8K's own rewards (``rltpu.data.math_rewards``: math-verify correctness against the ``####``
answer, plus the format bonus) and evaluates greedy accuracy on ``test.jsonl``.

What it shows: the recipe's data path (a question column, a prompt template in a chat turn after a
system prompt), its weighted rewards and its evaluation make a policy learn, here from near 0 to
near 1. What it does not: the sums come from one table of 100 (a and b in 0..9) in both files, so a
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
    """``n`` GSM8K-format rows ``a + b`` with a, b in 0..max_operand, drawn from ``(seed, split)``."""
    rng = np.random.default_rng([seed, 0 if split == "train" else 1])
    rows = []
    for i in range(n):
        a, b = (int(x) for x in rng.integers(0, max_operand + 1, size=2))
        rows.append({"id": f"{split}-{i}", "question": f"{a} + {b} = ?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"})
    return rows


def corpus(max_operand: int = 9) -> list[str]:
    """Every word the task's prompts and answers use (the word-level tokenizer's vocabulary)."""
    words = [str(k) for k in range(2 * max_operand + 1)] + ["+", "=", "?", "####"]
    return [" ".join(words), SYSTEM_PROMPT, "user assistant system"]


def write_arithmetic_task(directory: str | Path, train_rows: int = 2000, test_rows: int = 200, seed: int = 0,
                          max_operand: int = 4, hidden_size: int = 128, num_layers: int = 2) -> dict:
    """Write ``train.jsonl``, ``test.jsonl`` and ``model/`` under ``directory``; returns their paths."""
    from rltpu.data.chat_example import make_tiny_tokenizer
    from rltpu.models.hf.tiny import write_tiny_checkpoint

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, n in (("train", train_rows), ("test", test_rows)):
        rows = arithmetic_rows(n, seed, max_operand, split)
        paths[split] = out / f"{split}.jsonl"
        paths[split].write_text("".join(json.dumps(r) + "\n" for r in rows))
    model = out / "model"
    make_tiny_tokenizer(model, corpus(max_operand), kind="words")
    vocab = len(json.loads((model / "tokenizer.json").read_text())["model"]["vocab"])
    write_tiny_checkpoint(model, "llama", with_tokenizer=False, vocab_size=vocab, hidden_size=hidden_size,
                          intermediate_size=2 * hidden_size, num_layers=num_layers, max_position_embeddings=64,
                          init_std=0.02, seed=seed)
    make_tiny_tokenizer(model, corpus(max_operand), kind="words")  # save_pretrained replaced generation_config.json
    return {"train": str(paths["train"]), "test": str(paths["test"]), "model": str(model), "vocab": vocab}


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
