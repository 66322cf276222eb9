"""A Hugging Face tokenizer from a local directory, behind the engines' small tokenizer surface.

``HFTokenizer(dir)`` offers what ``CharTokenizer`` offers (``encode(text, add_bos)``,
``decode(ids)``, ``pad_id``, ``eos_id``, ``bos_id``, ``vocab_size``) plus ``stop_ids`` and
``apply_chat_template(messages)``, so the controller, sampler and rewards use either unchanged.

Loading is strictly offline: ``HF_HUB_OFFLINE=1`` and ``local_files_only=True``, so a path typo
is an error here instead of a silent download attempt. ``transformers`` is an optional extra
(``pip install 'rltpu[hf]'``), imported only when a directory is actually loaded.

Special ids, in order of precedence:
  - eos: the tokenizer's ``eos_token``, else the first ``eos_token_id`` in ``generation_config.json``;
  - stop ids: eos plus every ``eos_token_id`` in ``generation_config.json`` (chat models list
    both their end-of-turn and end-of-text tokens there);
  - pad: the tokenizer's ``pad_token``, else ``generation_config.json``'s ``pad_token_id``, else eos;
  - bos: the tokenizer's ``bos_token`` (may be None, e.g. Qwen2).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from rltpu.config import ConfigError

# files that make up a tokenizer in a Hugging Face directory (copied verbatim by ``save``)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")


class TokenizerError(ConfigError):
    """A tokenizer directory that cannot be used: one line naming the file and the fix."""


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]


def read_generation_config(directory: Path) -> dict:
    """``generation_config.json`` as a dict ({} when absent); bad JSON is a one-line error."""
    path = Path(directory) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise TokenizerError(f"{path}: not valid JSON at line {err.lineno} column {err.colno} ({err.msg}); "
                             f"fix or delete the file") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: must hold a JSON object, got {type(data).__name__}")
    return data


class HFTokenizer:
    def __init__(self, directory: str | Path):
        d = Path(directory)
        self.directory = d
        if not d.is_dir():
            raise TokenizerError(f"tokenizer directory '{d}' does not exist (set task.tokenizer or model.path to "
                                 f"a local Hugging Face model/tokenizer directory)")
        if not any((d / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
            raise TokenizerError(f"'{d}' has no tokenizer.json or tokenizer_config.json; point task.tokenizer at "
                                 f"a Hugging Face directory that holds its tokenizer files")
        # never contact the hub: set before transformers / huggingface_hub read it at import
        os.environ["HF_HUB_OFFLINE"] = "1"
        os.environ["TRANSFORMERS_OFFLINE"] = "1"
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise TokenizerError("a Hugging Face tokenizer needs transformers: pip install 'rltpu[hf]' "
                                 "(or run make setup)") from None
        try:
            self._tok = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
        except Exception as err:  # noqa: BLE001 - transformers raises many types; report one line
            raise TokenizerError(f"cannot load the tokenizer in '{d}': {_first_line(err)} (it needs tokenizer.json "
                                 f"and tokenizer_config.json from the model's Hugging Face directory)") from None
        gen = read_generation_config(d)
        gen_eos = _ids(gen.get("eos_token_id"))
        eos = self._tok.eos_token_id if self._tok.eos_token_id is not None else (gen_eos[0] if gen_eos else None)
        if eos is None:
            raise TokenizerError(f"the tokenizer in '{d}' defines no EOS token; set eos_token in tokenizer_config.json "
                                 f"or eos_token_id in generation_config.json")
        self.eos_id = int(eos)
        self.stop_ids = tuple(dict.fromkeys([self.eos_id, *gen_eos]))
        pad = self._tok.pad_token_id
        if pad is None:
            pad = gen.get("pad_token_id")
        self.pad_id = int(pad) if pad is not None else self.eos_id
        self.bos_id = self._tok.bos_token_id  # None when the model uses no BOS
        self.vocab_size = len(self._tok)  # includes added (special) tokens
        for name, i in (("eos", self.eos_id), ("pad", self.pad_id), *(("stop", s) for s in self.stop_ids)):
            if not 0 <= i < self.vocab_size:
                raise TokenizerError(f"'{d}': {name} token id {i} is outside the tokenizer's {self.vocab_size} ids; "
                                     f"fix the id in tokenizer_config.json / generation_config.json")

    @property
    def chat_template(self) -> str | None:
        return getattr(self._tok, "chat_template", None)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Text -> ids without the tokenizer's own post-processing; BOS prepended when asked for,
        the tokenizer has one and the text does not already start with it (chat templates often
        write it themselves)."""
        ids = list(self._tok.encode(text, add_special_tokens=False))
        if add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids.insert(0, int(self.bos_id))
        return ids

    def decode(self, ids, stop_at_eos: bool = True, show_special: bool = True) -> str:
        """Ids -> text, cut at the first stop token. Other special tokens stay visible by default,
        so a reward function sees them (as ``CharTokenizer`` shows pad/bos)."""
        ids = [int(i) for i in ids]
        if stop_at_eos:
            stops = set(self.stop_ids)
            cut = next((k for k, i in enumerate(ids) if i in stops), len(ids))
            ids = ids[:cut]
        return self._tok.decode(ids, skip_special_tokens=not show_special)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs) -> str:
        """Chat messages -> the prompt text, ending with the assistant turn's header (unless
        ``add_generation_prompt`` is False: multi-turn rendering compares the two). ``template_kwargs``
        are the template's own variables (``task.chat_template_kwargs``: Qwen3's ``enable_thinking``)."""
        if not self.chat_template:
            raise TokenizerError(f"the tokenizer in '{self.directory}' has no chat_template; add one to "
                                 f"tokenizer_config.json (or chat_template.jinja), or give the dataset a "
                                 f"'prompt' text column instead of 'messages'")
        return self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             **template_kwargs)

    def save(self, directory: str | Path) -> None:
        """Copy the tokenizer's files (and generation_config.json) verbatim into ``directory``."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        for name in (*TOKENIZER_FILES, "generation_config.json"):
            src = self.directory / name
            if src.is_file() and src.resolve() != (out / name).resolve():
                shutil.copyfile(src, out / name)

    def __repr__(self) -> str:
        return (f"HFTokenizer('{self.directory}', vocab_size={self.vocab_size}, bos={self.bos_id}, "
                f"eos={self.eos_id}, pad={self.pad_id}, stop={list(self.stop_ids)})")
