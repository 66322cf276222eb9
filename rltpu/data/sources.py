"""Prompt datasets from files, and the one factory the controller uses for tokenizer and data.

    build_tokenizer(cfg)        -> CharTokenizer | HFTokenizer
    build_dataset(cfg, tok)     -> SyntheticPromptDataset | PromptDataset

A prompt file is JSON Lines (``.jsonl``), a JSON list of objects (``.json``) or Parquet
(``.parquet``, needs ``pip install 'rltpu[data]'``), read here. A CSV file, a glob of files, a
directory or a Hub dataset id (resolved to its snapshot directory by ``rltpu.data.hub``) is read by
``datasets.load_dataset`` (``task.subset``, ``task.split``; the ``data`` extra). Each row has a text prompt
(``task.prompt_key``, default ``prompt``) or chat messages (``task.messages_key``, default
``messages``: a list of ``{"role", "content"}``, rendered with the tokenizer's chat template and
``add_generation_prompt=True``; messages win when a row has both). Every other column is passed
through to the reward function in ``example`` (e.g. a reference ``answer``); ``example["prompt"]``
is always the text the policy saw, ``example["id"]`` the row index unless the file has an ``id``.

A :class:`PromptFormat` (``task.prompt_template``, ``chat_template``, ``system_prompt``,
``chat_template_kwargs``) turns a row into the prompt text: ``prompt_template.format(**row)`` or the
prompt column, rendered as a user turn after the system prompt when ``chat_template`` is on
(GSM8K: ``{question}`` plus an instruction, Qwen3's ``enable_thinking: false``).

Both dataset kinds share one interface: ``next_batch(n)``, ``encode(example, tokenizer)``,
``probe_texts(n)``, ``cursor`` and ``state_dict``/``load_state_dict`` (epoch, position), so the
controller and its checkpoints treat them alike. The order within an epoch is a permutation drawn
from ``(seed, epoch)`` alone, so the cursor is all a resume needs.

Every problem with a file is a :class:`DatasetError`: one line with the file, line/row and the fix.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from rltpu.config import ConfigError
from rltpu.data.synthetic import TASK_ALPHABET, Cursor, SyntheticPromptDataset
from rltpu.data.char_tokenizer import DEFAULT_ALPHABET, CharTokenizer


class DatasetError(ConfigError):
    """A prompt file that cannot be used: one line naming the file, the line/row and the fix."""


# ---------------------------------------------------------------------------------------------
# Tokenizer


def tokenizer_dir(cfg) -> str | None:
    """The tokenizer directory: ``task.tokenizer``, else ``model.path`` once models load from
    Hugging Face directories (read with getattr so this works before that field exists)."""
    return cfg.task.tokenizer or getattr(cfg.model, "path", None)


def build_tokenizer(cfg):
    """``HFTokenizer`` from :func:`tokenizer_dir`, or the built-in ``CharTokenizer`` when none is set."""
    directory = tokenizer_dir(cfg)
    if directory is None:
        return CharTokenizer(cfg.task.alphabet or TASK_ALPHABET.get(cfg.task.name, DEFAULT_ALPHABET))
    from rltpu.data.hf_tokenizer import HFTokenizer

    return HFTokenizer(directory)


def resolve_vocab(cfg, tokenizer) -> int:
    """The model's vocabulary: ``model.vocab_size`` (may exceed the tokenizer, as in padded HF
    checkpoints) or the tokenizer's size; smaller than the tokenizer is a config error."""
    vocab = cfg.model.vocab_size or tokenizer.vocab_size
    if vocab < tokenizer.vocab_size:
        raise ConfigError(f"model.vocab_size={vocab} is smaller than the tokenizer's {tokenizer.vocab_size} ids; "
                          f"raise it or leave it unset to take the tokenizer's size")
    return vocab


def with_tokenizer_stops(cfg, tokenizer):
    """``cfg`` with the tokenizer's extra stop ids (``generation_config.json`` EOS list) appended to
    ``sampler.stop_token_ids``, so every sampler actor stops on them (idempotent on resume)."""
    extra = [i for i in getattr(tokenizer, "stop_ids", ()) if i != tokenizer.eos_id]
    merged = tuple(dict.fromkeys((*cfg.sampler.stop_token_ids, *extra)))
    if merged == tuple(cfg.sampler.stop_token_ids):
        return cfg
    return cfg.model_copy(update={"sampler": cfg.sampler.model_copy(update={"stop_token_ids": merged})})


def check_prompt_lengths(prompt_ids: list[list[int]], examples: list[dict], sampler_cfg) -> None:
    """Fail before sampling when a prompt exceeds the largest ``sampler.prompt_buckets`` entry
    and ``sampler.truncate_prompts`` is off (the sampler would raise the same inside an actor)."""
    limit = max(sampler_cfg.prompt_buckets)
    if sampler_cfg.truncate_prompts:
        return
    for ids, ex in zip(prompt_ids, examples):
        if len(ids) > limit:
            head = ex.get("prompt", "")[:40]
            raise DatasetError(
                f"prompt {ex.get('id')!r} ({head!r}...) is {len(ids)} tokens but the largest sampler.prompt_buckets "
                f"entry is {limit}; add a bucket >= {len(ids)} or set sampler.truncate_prompts=true"
            )


# ---------------------------------------------------------------------------------------------
# Reading files


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} overflows to {value}")
    return value


def _loads(text: str, at: str, what: str):
    """``json.loads`` that refuses NaN/Infinity and overflowing numbers, and turns too-deep nesting
    into a one-line error naming ``at`` (file:line)."""
    try:
        return json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
    except json.JSONDecodeError as err:
        raise DatasetError(f"{at}: malformed JSON at column {err.colno} ({err.msg}); {what}") from None
    except ValueError as err:  # NaN, Infinity, 1e999
        raise DatasetError(f"{at}: {err}; every number in a dataset must be finite") from None
    except RecursionError:
        raise DatasetError(f"{at}: JSON nested too deeply; {what}") from None


def _read_jsonl(path: Path) -> tuple[list[dict], list[str]]:
    rows, where = [], []
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DatasetError(f"{path}:{lineno}: not UTF-8 (byte 0x{raw[err.start]:02x} at column "
                                   f"{err.start + 1}); save the file as UTF-8") from None
            if not line.strip():
                continue
            row = _loads(line, f"{path}:{lineno}", "each line must be one JSON object")
            if not isinstance(row, dict):
                raise DatasetError(f"{path}:{lineno}: a line is a JSON {type(row).__name__}, expected an object "
                                   f"like {{\"prompt\": \"...\"}}")
            rows.append(row)
            where.append(f"{path}:{lineno}")
    return rows, where


def _read_json(path: Path) -> tuple[list[dict], list[str]]:
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        raise DatasetError(f"{path}:{line}: not UTF-8 (byte 0x{raw[err.start]:02x}); save the file as UTF-8") from None
    try:
        data = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
    except json.JSONDecodeError as err:
        raise DatasetError(f"{path}:{err.lineno}: malformed JSON at column {err.colno} ({err.msg}); a .json dataset "
                           f"is one list of objects (use .jsonl for one object per line)") from None
    except ValueError as err:
        raise DatasetError(f"{path}: {err}; every number in a dataset must be finite") from None
    except RecursionError:
        raise DatasetError(f"{path}: JSON nested too deeply; a .json dataset is one list of objects") from None
    if not isinstance(data, list):
        raise DatasetError(f"{path}: holds a JSON {type(data).__name__}; a .json dataset is a list of objects "
                           f"(use .jsonl for one object per line)")
    for i, row in enumerate(data):
        if not isinstance(row, dict):
            raise DatasetError(f"{path}: item {i} is a JSON {type(row).__name__}, expected an object")
    return data, [f"{path} item {i}" for i in range(len(data))]


def _read_parquet(path: Path, prompt_key: str, messages_key: str) -> tuple[list[dict], list[str]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError(f"reading {path} needs pyarrow: pip install 'rltpu[data]' (or run make setup)") from None
    try:
        table = pq.read_table(path)
    except Exception as err:  # noqa: BLE001 - pyarrow raises several types for a bad file
        raise DatasetError(f"{path}: not a readable Parquet file ({str(err).splitlines()[0]}); re-export it "
                           f"with pyarrow or pandas.to_parquet") from None
    if prompt_key not in table.column_names and messages_key not in table.column_names:
        raise DatasetError(f"{path}: no '{prompt_key}' or '{messages_key}' column (columns: "
                           f"{', '.join(table.column_names)}); rename one or set task.prompt_key / task.messages_key")
    rows = table.to_pylist()
    return rows, [f"{path} row {i}" for i in range(len(rows))]


FILE_READERS = (".jsonl", ".json", ".parquet")  # read here; everything else goes through datasets.load_dataset
BUILDERS = {".csv": "csv", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}  # datasets' builder by suffix


def read_with_datasets(spec: str, subset: str | None, split: str) -> tuple[list[dict], list[str]]:
    """Rows of a CSV file, a glob (its suffix picks the reader) or a directory (a Hub snapshot: its README's
    configs name the subsets and splits) through ``datasets.load_dataset``; one-line errors."""
    import glob as globlib

    is_glob = any(c in spec for c in "*?[")
    p = Path(spec)
    if is_glob or p.is_file():
        suffix = next((s for s in BUILDERS if spec.lower().endswith(s)), None)
        if suffix is None:
            raise DatasetError(f"dataset '{spec}': unknown file type; use {', '.join(BUILDERS)} files")
        if is_glob and not globlib.glob(spec, recursive=True):
            raise DatasetError(f"dataset glob '{spec}' matches no file (relative paths are from the current directory)")
        args, kwargs, split = (BUILDERS[suffix],), {"data_files": spec}, "train"  # files are one split
    elif p.is_dir():
        args, kwargs = (spec, subset), {}
    else:
        raise DatasetError(f"dataset '{spec}' does not exist (a file, a glob, a directory, or a Hugging Face Hub id "
                           f"org/name, which rltpu train resolves; relative paths are from the current directory)")
    try:
        import datasets
    except ImportError:
        raise DatasetError(f"reading {spec} needs datasets: pip install 'rltpu[data]' (or run make setup)") from None
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    try:
        ds = datasets.load_dataset(*args, split=split, **kwargs)
    except Exception as err:  # noqa: BLE001 - datasets raises many types for a bad subset, split or file
        text = str(err).strip().splitlines()
        raise DatasetError(f"dataset '{spec}' (subset {subset!r}, split {split!r}): {text[0][:300] if text else type(err).__name__}"
                           f"; set task.subset / task.split (eval.subset / eval.split) to one it has") from None
    rows = ds.to_list()
    return rows, [f"{spec} [{split}] row {i}" for i in range(len(rows))]


def read_rows(spec: str, subset: str | None = None, split: str = "train", prompt_key: str = "prompt",
              messages_key: str = "messages") -> tuple[list, list]:
    """Rows of any dataset ``task.dataset`` names (validated as :func:`read_prompt_file`'s are)."""
    if spec.lower().endswith(FILE_READERS) and not any(c in spec for c in "*?["):
        return read_prompt_file(spec, prompt_key, messages_key)
    rows, where = read_with_datasets(spec, subset, split)
    if not rows:
        raise DatasetError(f"dataset '{spec}' [{split}] has no rows")
    for row, at in zip(rows, where):
        _check_row(row, at, prompt_key, messages_key)
    return rows, where


def read_prompt_file(path: str | Path, prompt_key: str = "prompt", messages_key: str = "messages") -> tuple[list, list]:
    """Rows of a prompt file and, per row, where it is (``file:line`` or ``file row N``), validated:
    each row has a string prompt or a list of ``{role, content}`` messages."""
    p = Path(path)
    if not p.is_file():
        raise DatasetError(f"dataset file '{p}' does not exist (task.dataset; relative paths are from the "
                           f"current directory)")
    suffix = p.suffix.lower()
    if suffix == ".jsonl":
        rows, where = _read_jsonl(p)
    elif suffix == ".json":
        rows, where = _read_json(p)
    elif suffix == ".parquet":
        rows, where = _read_parquet(p, prompt_key, messages_key)
    else:
        raise DatasetError(f"dataset file '{p}' has an unknown format '{suffix}'; use .jsonl, .json or .parquet")
    if not rows:
        raise DatasetError(f"dataset file '{p}' has no rows; add at least one {{\"{prompt_key}\": ...}} row")
    for row, at in zip(rows, where):
        _check_row(row, at, prompt_key, messages_key)
    return rows, where


def _nonfinite(node, depth: int = 0) -> str | None:
    """The path of a NaN/inf value in a row (Parquet float columns), or None."""
    if isinstance(node, float) and not math.isfinite(node):
        return ""
    if depth < 16 and isinstance(node, dict):
        for k, v in node.items():
            sub = _nonfinite(v, depth + 1)
            if sub is not None:
                return f".{k}{sub}"
    if depth < 16 and isinstance(node, list):
        for i, v in enumerate(node):
            sub = _nonfinite(v, depth + 1)
            if sub is not None:
                return f"[{i}]{sub}"
    return None


def _check_row(row: dict, at: str, prompt_key: str, messages_key: str) -> None:
    bad = _nonfinite(row)
    if bad is not None:
        raise DatasetError(f"{at}: column {bad[1:]} is NaN or infinite; every number in a dataset must be finite")
    messages = row.get(messages_key)
    if messages is not None:
        ok = isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages)
        if not ok:
            raise DatasetError(f"{at}: '{messages_key}' must be a non-empty list of {{\"role\": str, \"content\": str}} "
                               f"objects")
        return
    prompt = row.get(prompt_key)
    if prompt is None:
        raise DatasetError(f"{at}: row has neither '{prompt_key}' nor '{messages_key}' (keys: {', '.join(row)}); "
                           f"add one, or set task.prompt_key / task.messages_key to your column names")
    if not isinstance(prompt, str):
        raise DatasetError(f"{at}: '{prompt_key}' must be a string, got {type(prompt).__name__}")


# ---------------------------------------------------------------------------------------------
# Prompt format


@dataclass(frozen=True)
class PromptFormat:
    """How a row becomes the prompt text (``task.prompt_template`` ... ``chat_template_kwargs``)."""

    template: str | None = None
    chat: bool = False
    system: str | None = None
    chat_kwargs: dict = field(default_factory=dict)

    @classmethod
    def from_config(cls, section) -> "PromptFormat":
        """From ``cfg.task`` or ``cfg.eval`` (both carry the four keys)."""
        return cls(section.prompt_template, section.chat_template, section.system_prompt,
                   dict(section.chat_template_kwargs))

    def text(self, row: dict, prompt_key: str) -> str:
        if self.template is None:
            return row[prompt_key]
        try:
            return self.template.format_map(row)
        except KeyError as err:
            raise DatasetError(f"task.prompt_template names column {err} but the row has only "
                               f"{', '.join(map(str, row))}") from None
        except (ValueError, IndexError) as err:
            raise DatasetError(f"task.prompt_template {self.template[:40]!r} is not a format string ({err}); "
                               f"write columns as {{name}} and literal braces as {{{{ }}}}") from None

    def messages(self, row: dict, prompt_key: str, messages_key: str) -> list[dict] | None:
        """The chat turns of ``row`` (None: a plain text prompt, no template)."""
        if row.get(messages_key) is not None:
            turns = list(row[messages_key])
        elif self.chat:
            turns = [{"role": "user", "content": self.text(row, prompt_key)}]
        else:
            return None
        if self.system is not None and turns[0].get("role") != "system":
            turns.insert(0, {"role": "system", "content": self.system})
        return turns


# ---------------------------------------------------------------------------------------------
# The file-backed dataset


class PromptDataset:
    """An endless, epoch-shuffled stream over the rows of a prompt file (held in memory)."""

    def __init__(self, rows: list[dict], where: list[str], seed: int, shuffle: bool = True, tokenizer=None,
                 prompt_key: str = "prompt", messages_key: str = "messages", source: str = "<rows>",
                 fmt: PromptFormat | None = None):
        self.rows, self.where, self.seed, self.shuffle = rows, where, seed, shuffle
        self.prompt_key, self.messages_key, self.source = prompt_key, messages_key, source
        self.fmt = fmt or PromptFormat()
        self.tokenizer = tokenizer
        self.cursor = Cursor()
        self._order = self._permutation(0)
        if rows and self.fmt.template is not None:
            self.fmt.text(rows[0], prompt_key)  # a column the template names is missing: fail at start
        first_chat = next((i for i, r in enumerate(rows) if self._is_chat(r)), None)
        if first_chat is not None:
            if not hasattr(tokenizer, "apply_chat_template"):
                raise DatasetError(f"{where[first_chat]}: chat '{messages_key}' need a tokenizer with a chat template; "
                                   f"set task.tokenizer to a Hugging Face tokenizer directory")
            self._render(first_chat)  # a broken template fails at start, not mid-run

    @classmethod
    def from_file(cls, path, seed: int, shuffle: bool = True, tokenizer=None, prompt_key: str = "prompt",
                  messages_key: str = "messages") -> "PromptDataset":
        rows, where = read_prompt_file(path, prompt_key, messages_key)
        return cls(rows, where, seed, shuffle, tokenizer, prompt_key, messages_key, source=str(path))

    @classmethod
    def from_config(cls, section, seed: int, tokenizer, shuffle: bool | None = None) -> "PromptDataset":
        """From ``cfg.task`` (or ``cfg.eval``: the same dataset, subset, split and format keys)."""
        rows, where = read_rows(section.dataset, section.subset, section.split, section.prompt_key,
                                section.messages_key)
        shuffle = getattr(section, "shuffle", False) if shuffle is None else shuffle
        return cls(rows, where, seed, shuffle, tokenizer, section.prompt_key, section.messages_key,
                   source=section.dataset, fmt=PromptFormat.from_config(section))

    def __len__(self) -> int:
        return len(self.rows)

    def _permutation(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.rows))
        return np.random.default_rng([self.seed, 1_000_003, epoch]).permutation(len(self.rows))

    def _is_chat(self, row: dict) -> bool:
        return row.get(self.messages_key) is not None or self.fmt.chat

    def _render(self, index: int) -> str:
        turns = self.fmt.messages(self.rows[index], self.prompt_key, self.messages_key)
        try:
            return self.tokenizer.apply_chat_template(turns, **self.fmt.chat_kwargs)
        except ConfigError:
            raise
        except Exception as err:  # noqa: BLE001 - jinja raises many types
            raise DatasetError(f"{self.where[index]}: the chat template failed on these messages "
                               f"({str(err).splitlines()[0] if str(err) else type(err).__name__}); "
                               f"check the roles/content or the template") from None

    def example(self, index: int) -> dict:
        """Row ``index`` as the reward function sees it: every column, plus ``prompt`` (the text
        the policy is given) and ``id`` (the row index unless the file has an ``id`` column)."""
        row = self.rows[index]
        ex = dict(row)
        ex.setdefault("id", index)
        if self._is_chat(row):
            ex["prompt"] = self._render(index)
        else:
            ex["prompt"] = self.fmt.text(row, self.prompt_key)
        return ex

    def next_batch(self, n: int) -> list[dict]:
        out = []
        while len(out) < n:
            if self.cursor.position >= len(self.rows):
                self.cursor = Cursor(self.cursor.epoch + 1, 0)
                self._order = self._permutation(self.cursor.epoch)
            idx = int(self._order[self.cursor.position])
            self.cursor.position += 1
            out.append(self.example(idx))
        return out

    def encode(self, example: dict, tokenizer) -> list[int]:
        """Prompt ids. A rendered chat template already holds whatever BOS the model wants, so
        BOS is added only to plain text prompts."""
        chat = example.get(self.messages_key) is not None or self.fmt.chat
        return tokenizer.encode(example["prompt"], add_bos=not chat)

    def probe_texts(self, n: int) -> list[tuple[str, bool]]:
        """The first ``n`` rows in file order as (text, add_bos), for the sync logit probe; does
        not move the cursor."""
        exs = [self.example(i) for i in range(min(n, len(self.rows)))]
        return [(e["prompt"], not self._is_chat(e)) for e in exs]

    def check_lengths(self, tokenizer, sampler_cfg) -> dict:
        """Encode every row once at start-up: prompt-token stats, and a one-line error naming the
        first row (file:line) longer than the largest prompt bucket unless truncation is on."""
        lengths = np.array([len(self.encode(self.example(i), tokenizer)) for i in range(len(self.rows))])
        limit = max(sampler_cfg.prompt_buckets)
        over = np.flatnonzero(lengths > limit)
        if len(over) and not sampler_cfg.truncate_prompts:
            i = int(over[0])
            raise DatasetError(f"{self.where[i]}: prompt is {lengths[i]} tokens ({len(over)} of {len(lengths)} rows "
                               f"exceed the largest sampler.prompt_buckets entry {limit}); add a bucket >= "
                               f"{int(lengths.max())} or set sampler.truncate_prompts=true")
        return {"rows": len(lengths), "prompt_tokens_min": int(lengths.min()),
                "prompt_tokens_mean": float(lengths.mean()), "prompt_tokens_max": int(lengths.max()),
                "truncated_rows": int(len(over))}

    def state_dict(self) -> dict:
        return {"epoch": self.cursor.epoch, "position": self.cursor.position, "rows": len(self.rows)}

    def load_state_dict(self, state: dict) -> None:
        rows = state.get("rows")
        if rows is not None and int(rows) != len(self.rows):
            raise DatasetError(f"the checkpoint's data cursor is for a dataset of {rows} rows but {self.source} has "
                               f"{len(self.rows)}; resume with the original file or start a new run_dir")
        self.cursor = Cursor(int(state["epoch"]), int(state["position"]))
        self._order = self._permutation(self.cursor.epoch)


def build_dataset(cfg, tokenizer=None):
    """The prompt stream for ``cfg.task``: the file in ``task.dataset``, else the synthetic task."""
    if cfg.task.dataset is None:
        return SyntheticPromptDataset.from_config(cfg.task, cfg.seed)
    return PromptDataset.from_config(cfg.task, cfg.seed, tokenizer if tokenizer is not None else build_tokenizer(cfg))
