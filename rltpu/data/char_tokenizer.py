"""A character-level tokenizer for the built-in synthetic tasks (no download needed).

Ids 0..2 are special (pad, bos, eos); every other id is one character of ``alphabet``.
It has the small surface the engines use (``encode``, ``decode``, ``pad_id``, ``eos_id``,
``vocab_size``) so a real tokenizer can stand in later.
"""

from __future__ import annotations

import json
from pathlib import Path

DEFAULT_ALPHABET = "0123456789crs="


class CharTokenizer:
    PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"

    def __init__(self, alphabet: str = DEFAULT_ALPHABET):
        if len(set(alphabet)) != len(alphabet):
            raise ValueError(f"tokenizer alphabet has repeated characters: {alphabet!r}")
        self.alphabet = alphabet
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2
        self._to_id = {c: i + 3 for i, c in enumerate(alphabet)}

    @property
    def vocab_size(self) -> int:
        return len(self.alphabet) + 3

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        try:
            ids = [self._to_id[c] for c in text]
        except KeyError as err:
            raise ValueError(f"character {err.args[0]!r} is not in the tokenizer alphabet {self.alphabet!r}") from None
        return [self.bos_id, *ids] if add_bos else ids

    def decode(self, ids, stop_at_eos: bool = True, show_special: bool = True) -> str:
        """Ids -> text, stopping at EOS. Pad/BOS inside a completion are shown as ``_``/``^`` so a
        reward function sees them (a policy must not shorten its answer by emitting them)."""
        out = []
        for i in ids:
            i = int(i)
            if i == self.eos_id and stop_at_eos:
                break
            if i >= 3:
                out.append(self.alphabet[i - 3])
            elif show_special and i != self.eos_id:
                out.append("_" if i == self.pad_id else "^")
        return "".join(out)

    def save(self, directory: Path) -> None:
        (Path(directory) / "tokenizer.json").write_text(json.dumps({"type": "char", "alphabet": self.alphabet}))

    @classmethod
    def load(cls, directory: Path) -> "CharTokenizer":
        data = json.loads((Path(directory) / "tokenizer.json").read_text())
        return cls(data["alphabet"])
