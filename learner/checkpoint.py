"""Checkpoints as safetensors + JSON (never pickle), written atomically.

Layout of ``<run_dir>/checkpoint/``:
    model.safetensors        policy weights in Hugging Face names
    optimizer.safetensors    AdamW state, keys ``state.<param>.<exp_avg|exp_avg_sq|step>``
    critic.safetensors, critic_optimizer.safetensors   PPO's value model and its AdamW state (if any)
    trainer_state.json       step, weight version, data cursor, torch RNG state, optimizer param groups,
                             scheduler, sha256 of each file
A checkpoint is written to ``checkpoint.tmp``, fsynced, then renamed over the old one (the old
one shifts to ``checkpoint.prev``, older ones to ``.prev2``... up to ``checkpoint.keep_last``), so a
crash at any point leaves a complete checkpoint on disk, and ``latest_valid`` skips a corrupt one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _flatten_optimizer(optim_sd: dict) -> tuple[dict[str, torch.Tensor], list]:
    tensors = {}
    for pname, state in optim_sd["state"].items():
        for key, value in state.items():
            t = value if isinstance(value, torch.Tensor) else torch.tensor(value)
            tensors[f"state.{pname}.{key}"] = t.detach().cpu().contiguous()
    return tensors, optim_sd["param_groups"]


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], param_groups: list) -> dict:
    state: dict = {}
    for key, value in tensors.items():
        _, rest = key.split(".", 1)
        pname, field = rest.rsplit(".", 1)
        state.setdefault(pname, {})[field] = value
    return {"state": state, "param_groups": param_groups}


def history(directory: Path, keep: int) -> list[Path]:
    """``checkpoint``, ``checkpoint.prev``, ``checkpoint.prev2``, ...: newest first, ``keep`` long."""
    directory = Path(directory)
    return [directory] + [directory.with_name(directory.name + (".prev" if i == 1 else f".prev{i}"))
                          for i in range(1, keep)]


def save_checkpoint(directory: Path, model_sd: dict, optim_sd: dict, meta: dict,
                    extra: dict[str, tuple[dict, dict]] | None = None, keep: int = 1) -> Path:
    """``extra``: more trained modules by name (e.g. PPO's ``critic``), each (state dict, optimizer
    state), written as ``<name>.safetensors`` and ``<name>_optimizer.safetensors``.
    ``keep``: checkpoints kept after this one lands (older ones shift to ``.prev``, ``.prev2``...)."""
    directory = Path(directory)
    tmp = directory.with_name(directory.name + ".tmp")
    prev = directory.with_name(directory.name + ".prev")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    groups = {}
    for name, (msd, osd) in {"model": (model_sd, optim_sd), **(extra or {})}.items():
        save_file({k: v.detach().cpu().contiguous() for k, v in msd.items()}, tmp / f"{name}.safetensors")
        opt_tensors, groups[name] = _flatten_optimizer(osd)
        save_file(opt_tensors, tmp / ("optimizer.safetensors" if name == "model" else f"{name}_optimizer.safetensors"))
    files = {f.name: _sha256(f) for f in sorted(tmp.glob("*.safetensors"))}
    state = dict(meta, optimizer_param_groups=groups.pop("model"), extra_param_groups=groups, sha256=files)
    (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1))
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    _fsync_dir(tmp)
    chain = history(directory, max(keep, 2))
    shutil.rmtree(chain[-1], ignore_errors=True)
    for older, newer in zip(reversed(chain[1:]), reversed(chain[:-1])):  # prev -> prev2, latest -> prev
        if newer.exists():
            newer.rename(older)
    tmp.rename(directory)
    _fsync_dir(directory.parent)
    if keep < 2:
        shutil.rmtree(prev, ignore_errors=True)
    return directory


def verify_checkpoint(directory: Path) -> dict:
    """The checkpoint's JSON if every file it lists exists with its sha256, else ValueError naming
    the first bad file (a truncated or half-written file fails here)."""
    directory = Path(directory)
    try:
        meta = json.loads((directory / "trainer_state.json").read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"checkpoint {directory}: unreadable trainer_state.json ({err})") from None
    for name, digest in meta.get("sha256", {}).items():
        if not (directory / name).exists() or _sha256(directory / name) != digest:
            raise ValueError(f"checkpoint file {directory / name} is corrupt (sha256 mismatch)")
    return meta


def latest_valid(directory: Path, keep: int = 8, warn=None) -> Path | None:
    """The newest checkpoint in ``history(directory)`` that verifies; each skipped one is reported
    through ``warn(message)``. None when there is no valid checkpoint at all."""
    for path in history(directory, keep):
        if not (path / "trainer_state.json").exists():
            continue
        try:
            verify_checkpoint(path)
            return path
        except ValueError as err:
            if warn:
                warn(f"{err}; falling back to the previous checkpoint")
    return None


def load_checkpoint(directory: Path) -> tuple[dict, dict, dict]:
    """Returns ``(model_sd, optim_sd, meta)``; verifies checksums; falls back to ``.prev``."""
    directory = Path(directory)
    if not (directory / "trainer_state.json").exists():
        prev = directory.with_name(directory.name + ".prev")
        if (prev / "trainer_state.json").exists():
            directory = prev
        else:
            raise FileNotFoundError(f"no checkpoint at {directory} (expected trainer_state.json)")
    meta = verify_checkpoint(directory)
    model_sd = load_file(directory / "model.safetensors")
    optim_sd = _unflatten_optimizer(load_file(directory / "optimizer.safetensors"), meta.pop("optimizer_param_groups"))
    meta["extra"] = {name: (load_file(directory / f"{name}.safetensors"),
                            _unflatten_optimizer(load_file(directory / f"{name}_optimizer.safetensors"), groups))
                     for name, groups in meta.pop("extra_param_groups", {}).items()}
    return model_sd, optim_sd, meta
