"""A local chat tokenizer and a JSONL chat dataset, for dry-running the dataset path offline.

    python -m rltpu.data.chat_example data/chat_example     # then: rltpu train configs/chat_jsonl.yaml

writes ``data/chat_example/tokenizer/`` (a byte-level BPE trained on the task's own text with
the ``tokenizers`` library, a ChatML-style Jinja ``chat_template`` in ``tokenizer_config.json``,
``generation_config.json`` listing two EOS ids) and ``data/chat_example/train.jsonl`` (rows of
``messages`` plus a reference ``answer`` column for ``rltpu.data.rewards:exact_answer``).
Nothing is downloaded. Tests build their tokenizers with :func:`make_tiny_tokenizer` too.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tiny_tokenizer(directory: str | Path, corpus: list[str], vocab_size: int = 320,
                        chat_template: str | None = CHATML_TEMPLATE, bos_token: str | None = None,
                        eos_token: str | None = "<|im_end|>", pad_token: str | None = "<|endoftext|>",
                        generation_eos: list[str] | None = ("<|im_end|>", "<|endoftext|>"),
                        kind: str = "bpe") -> Path:
    """Train a tokenizer on ``corpus`` and write it as a Hugging Face tokenizer directory.

    ``kind="bpe"``: a byte-level BPE, so any text round-trips exactly. ``kind="words"``: one id per
    word or punctuation mark of the corpus (a ``WordLevel`` model, ``<unk>`` for the rest), decoded
    joined by spaces: a vocabulary of a few dozen ids, small enough that a random-init model's
    first samples already hit the answer's tokens (the learning example, ``configs/hf_chat.yaml``).
    Files are written by hand (not
    ``save_pretrained``) to match what checkpoints on the hub ship: ``tokenizer.json``,
    ``tokenizer_config.json`` (with ``chat_template``), ``special_tokens_map.json`` and, when
    ``generation_eos`` is given, ``generation_config.json``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if kind not in ("bpe", "words"):
        raise ValueError(f"tokenizer kind {kind!r} is not supported (bpe or words)")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    specials = list(dict.fromkeys([*SPECIALS, *(t for t in (bos_token, eos_token, pad_token) if t)]))
    if kind == "words":
        tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        trainer = trainers.WordLevelTrainer(special_tokens=[*specials, "<unk>"], show_progress=False)
    else:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(corpus), trainer)
    tok.save(str(out / "tokenizer.json"))
    named = {"bos_token": bos_token, "eos_token": eos_token, "pad_token": pad_token}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096, "clean_up_tokenization_spaces": False,
              **named}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    (out / "special_tokens_map.json").write_text(json.dumps({k: v for k, v in named.items() if v}, indent=1))
    if generation_eos:
        gen = {"eos_token_id": [tok.token_to_id(t) for t in generation_eos]}
        if pad_token:
            gen["pad_token_id"] = tok.token_to_id(pad_token)
        (out / "generation_config.json").write_text(json.dumps(gen, indent=1))
    return out


def repeat_rows(n: int, seed: int = 0, min_digits: int = 2, max_digits: int = 4) -> list[dict]:
    """Chat rows asking to repeat a few digits; ``answer`` is the reference for the reward."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        digits = " ".join(str(d) for d in rng.integers(0, 10, size=int(rng.integers(min_digits, max_digits + 1))))
        rows.append({
            "id": f"repeat-{i}",
            "messages": [{"role": "system", "content": "Reply with the digits only."},
                         {"role": "user", "content": f"Repeat: {digits}"}],
            "answer": digits,
        })
    return rows


def write_chat_example(directory: str | Path, num_rows: int = 512, seed: int = 0, min_digits: int = 2,
                       max_digits: int = 4) -> dict:
    """Write ``tokenizer/`` and ``train.jsonl`` under ``directory``; returns their paths."""
    if not 1 <= min_digits <= max_digits:
        raise ValueError(f"digits {min_digits}..{max_digits}: need 1 <= --min-digits <= --max-digits")
    out = Path(directory)
    rows = repeat_rows(num_rows, seed, min_digits, max_digits)
    corpus = [m["content"] for r in rows[:64] for m in r["messages"]] + [r["answer"] for r in rows[:64]]
    tok_dir = make_tiny_tokenizer(out / "tokenizer", corpus + ["user assistant system"])
    data = out / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"tokenizer": str(tok_dir), "dataset": str(data), "rows": len(rows)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rltpu.data.chat_example", description=__doc__.splitlines()[0])
    parser.add_argument("directory", nargs="?", default="data/chat_example")
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-digits", type=int, default=2, help="shortest answer (digits)")
    parser.add_argument("--max-digits", type=int, default=4, help="longest answer (digits)")
    args = parser.parse_args(argv)
    try:
        made = write_chat_example(args.directory, args.rows, args.seed, args.min_digits, args.max_digits)
    except ValueError as err:
        parser.error(str(err))
    print(json.dumps(made))
    return 0


if __name__ == "__main__":
    sys.exit(main())
