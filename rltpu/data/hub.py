"""Hugging Face Hub ids in the config, resolved once, in the driver, to local snapshot directories.

    rltpu train configs/gsm8k.yaml model.path=Qwen/Qwen2.5-0.5B-Instruct task.dataset=openai/gsm8k

:func:`resolve_ids` runs on the raw config (``rltpu.config.load_config``'s ``prepare`` hook, from the
CLI) before it is validated: each of ``model.path``, ``reward_model.path``, ``task.tokenizer``,
``task.dataset`` and ``eval.dataset`` that is not a local path but reads ``org/name`` is fetched with
``huggingface_hub.snapshot_download`` (at its ``revision``) and replaced by the snapshot directory.
So the schema reads config.json from a directory, every actor gets the same local path, and the run
dir's config.yaml names one commit: ``--resume`` reads the same files, offline.

``huggingface_hub`` does the caching: ``HF_HOME`` / ``HF_HUB_CACHE`` say where, ``HF_HUB_OFFLINE=1``
uses the cache alone, ``HF_TOKEN`` (or ``hf auth login``) opens gated and private repos. A dataset
snapshot is then read by ``datasets.load_dataset`` from that directory (its README's configs give
``task.subset`` and ``task.split``; ``rltpu.data.sources``). A missing, gated or uncached id is one
line naming the key, the id and what to do (a ``ConfigError``: exit 2, before Ray starts).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from rltpu.config import DATASET_SUFFIXES, HUB_ID, ConfigError
from rltpu.observe.log import get_logger

logger = get_logger(__name__)

# what a model snapshot needs: config, safetensors (+ index), tokenizer files, chat templates. Not *.bin,
# *.pth, ONNX or GGUF copies, which many repos ship beside the safetensors
MODEL_FILES = ("*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.tiktoken")
PLAN_FILES = ("*.json", "*.jinja", "*.model", "*.txt", "*.tiktoken")  # rltpu plan / doctor: sizes, tokenizer


def is_hub_id(value, repo_type: str = "model") -> bool:
    """``org/name`` that is not a local path (a local file or directory of that name wins); a dataset
    name ending in a file suffix (``data/train.jsonl``) is a file, missing or not."""
    if repo_type == "dataset" and isinstance(value, str) and value.lower().endswith(DATASET_SUFFIXES):
        return False
    return isinstance(value, str) and bool(HUB_ID.fullmatch(value)) and ".." not in value \
        and "--" not in value and not Path(value).exists()


def resolve(repo_id: str, key: str, repo_type: str = "model", revision: str | None = None,
            allow_patterns: tuple[str, ...] | None = None) -> str:
    """The local snapshot directory of ``repo_id`` (downloaded unless cached or offline); one-line
    ``ConfigError`` naming ``key`` when it cannot be had."""
    kind = "dataset" if repo_type == "dataset" else "model"
    page = f"https://huggingface.co/{'datasets/' if repo_type == 'dataset' else ''}{repo_id}"
    try:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import (GatedRepoError, HFValidationError, LocalEntryNotFoundError,
                                            RepositoryNotFoundError, RevisionNotFoundError)
    except ImportError:
        raise ConfigError(f"{key}={repo_id!r} is a Hugging Face Hub id, which needs huggingface_hub: pip install "
                          f"'rltpu[data]' (or give a local directory)") from None
    at = f"@{revision}" if revision else ""
    try:
        return snapshot_download(repo_id, repo_type=repo_type, revision=revision,
                                 allow_patterns=list(allow_patterns) if allow_patterns else None)
    except GatedRepoError:
        raise ConfigError(f"{key}={repo_id!r} is a gated {kind} on the Hugging Face Hub: accept its terms at {page}, "
                          f"then log in (hf auth login, or set HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise ConfigError(f"{key}={repo_id!r} is neither a local path nor a {kind} on the Hugging Face Hub; check "
                          f"the id (a private repo needs hf auth login or HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise ConfigError(f"{key}={repo_id!r}: revision {revision!r} does not exist in that {kind}; fix the "
                          f"revision (a branch, tag or commit of {page})") from None
    except HFValidationError as err:
        raise ConfigError(f"{key}={repo_id!r} is not a valid Hugging Face Hub id ({str(err).splitlines()[0]})") \
            from None
    except LocalEntryNotFoundError:
        where = f"the Hugging Face cache ({constants.HF_HUB_CACHE})"
        why = "HF_HUB_OFFLINE=1 forbids downloading it" if constants.HF_HUB_OFFLINE else "the Hub could not be reached"
        get = f"hf download {repo_id}{' --repo-type dataset' if repo_type == 'dataset' else ''}" \
              f"{f' --revision {revision}' if revision else ''}"
        raise ConfigError(f"{key}={repo_id}{at} is not in {where} and {why}; run `{get}` on a machine with network "
                          f"and the same HF_HOME, or give a local directory") from None
    except OSError as err:  # HTTP errors, disk: one line
        raise ConfigError(f"{key}={repo_id}{at}: fetching from the Hugging Face Hub failed "
                          f"({type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''})") from None


def _log(line: str) -> None:
    logger.info(line)


def resolve_ids(data: dict, weights: bool = True, log: Callable[[str], None] = _log) -> dict:
    """Replace the Hub ids of a raw config (dict, before validation) by local snapshot directories.

    ``weights=False`` (``rltpu plan``, ``doctor``: nothing is trained) fetches a model's config and
    tokenizer files, not its weights, and leaves dataset ids as they are. Returns ``data`` (changed in place)."""
    model_files = MODEL_FILES if weights else PLAN_FILES
    places = [("model", "path", "model", model_files), ("reward_model", "path", "model", model_files),
              ("task", "tokenizer", "model", PLAN_FILES),
              *([("task", "dataset", "dataset", None), ("eval", "dataset", "dataset", None)] if weights else [])]
    for section, field, repo_type, patterns in places:
        node = data.get(section)
        if not isinstance(node, dict) or not is_hub_id(node.get(field), repo_type):
            continue
        revision = node.get("revision") if field != "tokenizer" else None
        if revision is not None and not isinstance(revision, str):
            raise ConfigError(f"config key '{section}.revision' has bad value {revision!r}: a branch, tag or commit")
        repo_id = node[field]
        local = resolve(repo_id, f"{section}.{field}", repo_type, revision, patterns)
        log(f"rltpu: {section}.{field} {repo_id}{f'@{revision}' if revision else ''} -> {local}")
        node[field] = local
    return data
