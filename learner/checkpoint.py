"""Sharded checkpoints: every trainer rank writes and reads only its own shards; safetensors + JSON,
never pickle; written atomically; resumable on another trainer count or mesh.

Layout of ``<run_dir>/checkpoint/`` (``rltpu.models.hf.shards`` describes the index):
    model.index.json, model-rank<r>.safetensors          policy weights (HF names), each rank's chunks
    optimizer.index.json, optimizer-rank<r>.safetensors  AdamW state, keys ``state.<param>.<exp_avg|...>``
    critic*, critic_optimizer*                           PPO's value model and its AdamW state (if any)
    trainer_state.json   step, weight version, data cursor, RNG, optimizer param groups, schedulers,
                         the run config, and the sha256 of every other file

Saving is a collective over the trainer ranks: rank 0 empties ``checkpoint.tmp``; each part goes
through ``torch.distributed.checkpoint.save`` with ``SafetensorsWriter`` (each rank streams its
own DTensor chunks into its file; the coordinator writes the index); rank 0 writes the JSON and
renames ``checkpoint.tmp`` over ``checkpoint`` (the old one shifts to ``checkpoint.prev``... up to
``checkpoint.keep_last``); every rank then learns whether that worked. A crash at any point leaves
the previous checkpoint complete, and ``latest_valid`` skips a corrupt one.

Loading builds the engine's own sharded state dicts (whatever its mesh) and
``torch.distributed.checkpoint.load`` fills them through ``SafetensorsReader``: each rank reads
just the regions of the stored chunks that overlap its shards, so 2 ranks resume from 1 or 1 from 2.
Checkpoints of the earlier full-file layout (``model.safetensors``) still load, every rank reading
the full files as before; the next save writes the sharded layout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import warnings
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, WriteItemType
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from rltpu.models.hf.shards import (STATE_FILE, ShardedPart, dtype_name, sha256_file, verify_checkpoint,  # noqa: F401
                                    write_chunks, write_index)
from rltpu.models.hf.weights import CheckpointError



# -- torch.distributed.checkpoint storage: safetensors chunks + a JSON index ----------------------


def _done(value) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut


class SafetensorsWriter(StorageWriter):
    """DCP storage writer: rank r streams its chunks into ``<part>-rank<r>.safetensors`` (sha256 taken
    while writing); the coordinator writes ``<part>.index.json``. A non-tensor value is refused:
    DCP would pickle it."""

    def __init__(self, directory: Path, part: str):
        super().__init__()
        self.dir, self.part = Path(directory), part

    def reset(self, checkpoint_id=None) -> None:
        pass

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        pass

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                raise CheckpointError(f"checkpoint part {self.part}: {item.index.fqn} is not a tensor (it would need "
                                      f"pickle); keep non-tensor state in the checkpoint's JSON")
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        self.world = len(plans)
        return [dataclasses.replace(p, storage_data=f"{self.part}-rank{i:05d}.safetensors") for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner) -> Future:
        if not plan.items:
            return _done([])
        file, keys, tensors = plan.storage_data, {}, []
        for item in plan.items:
            fqn = item.index.fqn
            key = fqn if fqn not in keys.values() else f"{fqn}@{','.join(map(str, item.index.offset))}"
            keys[item.index] = key
            tensors.append((key, planner.resolve_data(item)))
        digest = write_chunks(self.dir / file, tensors)
        return _done([WriteResult(index=item.index, size_in_bytes=t.numel() * t.element_size(),
                                  storage_data={"file": file, "key": keys[item.index], "sha256": digest,
                                                "sizes": list(item.tensor_data.chunk.sizes)})
                      for item, (_, t) in zip(plan.items, tensors)])

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        tensors, files = {}, {}
        for fqn, md in metadata.state_dict_metadata.items():
            tensors[fqn] = {"dtype": dtype_name(md.properties.dtype), "shape": list(md.size), "chunks": []}
        for wr in (wr for rank in results for wr in rank):
            s = wr.storage_data
            files[s["file"]] = s["sha256"]
            tensors[wr.index.fqn]["chunks"].append({"offsets": list(wr.index.offset), "sizes": s["sizes"],
                                                    "file": s["file"], "key": s["key"]})
        write_index(self.dir / f"{self.part}.index.json", tensors, files, getattr(self, "world", len(results)))

    def storage_meta(self):
        return None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True


class SafetensorsReader(StorageReader):
    """DCP storage reader over ``<part>.index.json``: each read request is one region of one stored
    chunk, read by rows (``readinto``, no memory map) and copied into the rank's own shard."""

    def __init__(self, directory: Path, part: str):
        super().__init__()
        self.part = ShardedPart(directory, part)

    def reset(self, checkpoint_id=None) -> None:
        pass

    def read_metadata(self, *args, **kwargs) -> Metadata:
        state, storage = {}, {}
        for name, e in self.part.entries.items():
            chunks = [ChunkStorageMetadata(torch.Size(c["offsets"]), torch.Size(c["sizes"])) for c in e["chunks"]]
            state[name] = TensorStorageMetadata(TensorProperties(dtype=getattr(torch, e["dtype"])),
                                                torch.Size(e["shape"]), chunks)
            for c in e["chunks"]:
                storage[MetadataIndex(name, c["offsets"])] = c
        return Metadata(state_dict_metadata=state, storage_data=storage)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        self.storage = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner) -> Future:
        for req in sorted(plan.items, key=lambda r: self.storage[r.storage_index]["file"]):
            region = self.part.read_region(self.storage[req.storage_index], req.storage_offsets, req.lengths)
            target = planner.resolve_tensor(req).detach()
            if target.shape != region.shape:
                raise CheckpointError(f"{self.part.path}: {req.storage_index.fqn}: region {list(region.shape)} does "
                                      f"not fit the shard {list(target.shape)}")
            target.copy_(region)
            planner.commit_tensor(req, target)
            del region
        return _done(None)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True


# -- directories: atomic write, checksums, history ------------------------------------------------


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def history(directory: Path, keep: int) -> list[Path]:
    """``checkpoint``, ``checkpoint.prev``, ``checkpoint.prev2``, ...: newest first, ``keep`` long."""
    directory = Path(directory)
    return [directory] + [directory.with_name(directory.name + (".prev" if i == 1 else f".prev{i}"))
                          for i in range(1, keep)]


def _group_of(engine, group=None):
    """The process group spanning every trainer rank, None for one process. Not the default group:
    under Ray the samplers share it, and DCP's collectives must not wait for them."""
    mesh = engine.mesh
    if mesh is None or mesh.size() == 1:
        return None
    if group is not None:
        return group
    if mesh.ndim == 1:
        return mesh.get_group()
    if torch.distributed.get_world_size() == mesh.size():
        return torch.distributed.group.WORLD
    raise ValueError(f"checkpoint: a {mesh.ndim}-D trainer mesh inside a larger world needs the trainer group "
                     f"(pass group= to save_checkpoint / load_checkpoint)")


def _rank(group) -> int:
    return torch.distributed.get_rank(group) if group is not None else 0


@contextlib.contextmanager
def _quiet(group):
    """One process: DCP warns that it assumes a single process, which is what we asked for."""
    with warnings.catch_warnings():
        if group is None:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _agree(group, error: str | None) -> None:
    """Every rank learns rank 0's outcome (an error message or None) and raises the same error."""
    if group is not None:
        box = [error]
        torch.distributed.broadcast_object_list(box, group_src=0, group=group)
        error = box[0]
    if error:
        raise CheckpointError(error)


def _agree_all(group, error: str | None) -> None:
    """Every rank learns whether any rank failed (the first error in rank order) and raises it."""
    if group is not None:
        box = [None] * torch.distributed.get_world_size(group)
        torch.distributed.all_gather_object(box, error, group=group)
        error = next((e for e in box if e), None)
    if error:
        raise CheckpointError(error)


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0][:300] if text else type(err).__name__


def save_checkpoint(directory: Path, parts: dict[str, dict], meta: dict, keep: int = 1, group=None,
                    also=None) -> Path:
    """Write ``parts`` (name -> state dict of tensors or DTensors, collective over ``group``) and
    ``meta`` (JSON) as a checkpoint at ``directory``. ``keep``: checkpoints kept after this one lands.
    ``also(tmp, rank, world)``: more files every rank writes into the checkpoint once the parts are on
    disk (``checkpoint.hf_export``); the checkpoint lands only if it worked on every rank."""
    import torch.distributed.checkpoint as dcp

    directory = Path(directory)
    tmp = directory.with_name(directory.name + ".tmp")
    rank = _rank(group)
    error = None
    if rank == 0:
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        except OSError as err:
            error = f"checkpoint: cannot create {tmp} ({err.strerror or err}); check the run directory"
    _agree(group, error)
    for name, state in parts.items():
        with _quiet(group):
            dcp.save(state, storage_writer=SafetensorsWriter(tmp, name), process_group=group, no_dist=group is None)
    if also is not None:
        try:
            also(tmp, rank, torch.distributed.get_world_size(group) if group is not None else 1)
        except (OSError, ValueError) as err:
            error = f"checkpoint: {_one_line(err)}; the previous checkpoint is kept"
        _agree_all(group, error)
    if rank == 0:
        try:
            _commit(directory, tmp, list(parts), meta, keep, world=torch.distributed.get_world_size(group)
                    if group is not None else 1)
        except OSError as err:
            error = f"checkpoint: writing {directory} failed ({err.strerror or err}); the previous one is kept"
    _agree(group, error)
    return directory


def _commit(directory: Path, tmp: Path, parts: list[str], meta: dict, keep: int, world: int) -> None:
    """Rank 0, after every rank's files are written: the JSON (sha256 of every file), fsync, rename."""
    files = {}
    for name in parts:
        index = tmp / f"{name}.index.json"
        files.update(json.loads(index.read_text())["files"])
        files[index.name] = sha256_file(index)
    state = dict(meta, layout={"format": "sharded", "parts": parts, "world": world}, sha256=dict(sorted(files.items())))
    with open(tmp / STATE_FILE, "w") as f:
        f.write(json.dumps(state, indent=1))
        f.flush()
        os.fsync(f.fileno())
    _fsync(tmp)
    chain = history(directory, max(keep, 2))
    if directory.exists():  # after a crash mid-rename only .prev may exist: keep it until the new one lands
        shutil.rmtree(chain[-1], ignore_errors=True)
        for older, newer in zip(reversed(chain[1:]), reversed(chain[:-1])):  # prev -> prev2, latest -> prev
            if newer.exists():
                newer.rename(older)
    tmp.rename(directory)
    _fsync(directory.parent)
    if keep < 2:
        shutil.rmtree(chain[1], ignore_errors=True)


def latest_valid(directory: Path, keep: int = 8, warn=None, set_aside: bool = False) -> Path | None:
    """The newest checkpoint in ``history(directory)`` that verifies; each skipped one is reported
    through ``warn(message)``. None when there is no valid checkpoint at all.

    ``set_aside`` (the driver, before it loads): each corrupt checkpoint newer than the one returned
    is renamed ``<name>.corrupt``, so the next save's rotation (newest -> ``.prev``, the oldest
    dropped) never deletes the valid one in favour of the corrupt one."""
    corrupt = []
    for path in history(directory, keep):
        if not path.exists():
            continue
        try:
            verify_checkpoint(path)
        except ValueError as err:
            corrupt.append(path)
            if warn:
                warn(f"{err}; falling back to the previous checkpoint")
            continue
        if set_aside:
            for bad in corrupt:
                aside = bad.with_name(bad.name + ".corrupt")
                shutil.rmtree(aside, ignore_errors=True)
                bad.rename(aside)
                if warn:
                    warn(f"moved the corrupt {bad.name} aside to {aside.name} (kept for inspection; safe to delete)")
        return path
    return None


def is_sharded(directory: Path) -> bool:
    return any((Path(directory) / f"{p}.index.json").is_file() for p in ("model", "adapters"))


def load_checkpoint(directory: Path) -> tuple[dict, dict, dict]:
    """The whole checkpoint in one process, either layout: ``(model_sd, optim_sd, meta)`` with
    ``meta["extra"]`` = {name: (state dict, optimizer state)}; checksums verified. For tools and
    tests: a trainer rank loads only its shards (``load_engine``)."""
    from safetensors.torch import load_file

    directory = Path(directory)
    if not (directory / STATE_FILE).exists():
        raise FileNotFoundError(f"no checkpoint at {directory} (expected {STATE_FILE})")
    meta = verify_checkpoint(directory)
    sharded = is_sharded(directory)

    def tensors(part: str) -> dict:
        if sharded:
            p = ShardedPart(directory, part)
            return {name: p.read(name) for name in p.names()}
        return load_file(directory / f"{part}.safetensors")

    def optim(part: str, groups) -> dict:
        state: dict = {}
        for key, value in tensors(part).items():
            pname, field = key.split(".", 1)[1].rsplit(".", 1)  # state.<param>.<field>
            state.setdefault(pname, {})[field] = value
        return {"state": state, "param_groups": groups}

    extra_groups = meta.pop("extra_param_groups", {})
    policy = "adapters" if (directory / "adapters.index.json").is_file() else "model"  # LoRA: adapters only
    model_sd, optim_sd = tensors(policy), optim("optimizer", meta.pop("optimizer_param_groups", []))
    meta["extra"] = {name: (tensors(name), optim(f"{name}_optimizer", groups)) for name, groups in extra_groups.items()}
    return model_sd, optim_sd, meta


# -- a TrainerEngine's state in and out ------------------------------------------------------------


def _modules(engine) -> list[tuple[str, torch.nn.Module, torch.optim.Optimizer]]:
    # LoRA: the part is the adapters alone (the frozen base is model.path or the seeded init, never copied)
    out = [("adapters" if getattr(engine, "lora", None) is not None else "model", engine.model, engine.optimizer)]
    if engine.critic is not None:
        out.append(("critic", engine.critic, engine.critic_optimizer))
    return out


def _optim_part(name: str) -> str:
    return "optimizer" if name in ("model", "adapters") else f"{name}_optimizer"


def _policy_state(name: str, module: torch.nn.Module) -> dict:
    """The policy part's sharded state dict: everything, or (``adapters``) the LoRA tensors only."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from rltpu.models.spec import is_adapter

    sd = get_model_state_dict(module)  # sharded: this rank's DTensor shards, no copy
    return {k: v for k, v in sd.items() if is_adapter(k)} if name == "adapters" else sd


def save_engine(engine, directory: Path, meta: dict, keep: int = 1, group=None) -> Path:
    """Collective over the engine's trainer ranks: each writes its own shards of the policy, the
    critic and their AdamW states; the step, schedulers, RNG and param groups go into the JSON."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    parts, groups = {}, {}
    for name, module, optim in _modules(engine):
        parts[name] = _policy_state(name, module) if name in ("model", "adapters") else get_model_state_dict(module)
        osd = get_optimizer_state_dict(module, optim)
        parts[_optim_part(name)] = {"state": osd["state"]}
        groups[name] = osd["param_groups"]
    also = None
    if meta.get("hf_export"):  # checkpoint.hf_export: each rank writes its share of <checkpoint>/hf
        if _modules(engine)[0][0] == "adapters":
            raise ValueError("checkpoint.hf_export with trainer.lora is not supported; use rltpu export --adapters")
        from rltpu.models.hf.export import write_hf_share

        also = lambda tmp, rank, world: write_hf_share(tmp, meta, rank, world)  # noqa: E731
    meta = {k: v for k, v in meta.items() if k != "hf_export"}
    meta = dict(meta, trainer_step=engine.step, scheduler=engine.scheduler.state_dict(),
                critic_scheduler=engine.critic_scheduler.state_dict() if engine.critic is not None else None,
                rng={"torch_cpu": torch.get_rng_state().numpy().tobytes().hex()},
                optimizer_param_groups=groups.pop(_modules(engine)[0][0]), extra_param_groups=groups,
                lora=_lora_meta(engine))
    return save_checkpoint(directory, parts, meta, keep, _group_of(engine, group), also)


def _lora_meta(engine) -> dict | None:
    """What names the frozen base of a LoRA checkpoint (never copied into it): ``model.path``, or
    the seeded init (seed, vocabulary) that ``rltpu export`` rebuilds."""
    if getattr(engine, "lora", None) is None:
        return None
    return {**engine.lora.model_dump(mode="json"), "base_seed": engine.init_seed, "vocab_size": engine.vocab_size}


def _zero_adam_state(optim: torch.optim.Optimizer) -> None:
    """AdamW's state as zeros shaped like each (sharded) parameter, for DCP to load into. torch's own
    initialisation (a step on zero gradients) would also allocate a gradient per parameter."""
    if optim.state or not isinstance(optim, torch.optim.Adam):
        return
    for group in optim.param_groups:
        for p in group["params"]:
            st = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
            if group.get("amsgrad"):
                st["max_exp_avg_sq"] = torch.zeros_like(p)
            optim.state[p] = st


def load_engine(engine, directory: Path, group=None) -> dict:
    """Collective over the engine's trainer ranks: fill its sharded weights and optimizer states from
    the checkpoint (resharded to this mesh), restore step, schedulers and RNG; returns the JSON meta."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
        set_optimizer_state_dict)

    directory = Path(directory)
    meta = json.loads((directory / STATE_FILE).read_text())  # the driver verified the checksums
    if not is_sharded(directory):
        return _load_full_files(engine, directory)
    group = _group_of(engine, group)
    extra_groups = meta.get("extra_param_groups") or {}
    if engine.critic is not None and "critic" not in extra_groups:
        raise ValueError(f"checkpoint {directory} has no critic (critic.index.json) but trainer.algorithm=ppo needs one")
    first = _modules(engine)[0][0]
    parts = (meta.get("layout") or {}).get("parts") or []
    if (first == "adapters") != ("adapters" in parts):
        raise ValueError(f"checkpoint {directory} holds {'LoRA adapters' if 'adapters' in parts else 'a full model'} "
                         f"but this run {'sets' if first == 'adapters' else 'does not set'} trainer.lora; resume "
                         f"with the config that wrote it")
    groups = {first: meta["optimizer_param_groups"], **extra_groups}
    for name, module, optim in _modules(engine):
        msd = _policy_state(name, module) if name in ("model", "adapters") else get_model_state_dict(module)
        with _quiet(group):
            dcp.load(msd, storage_reader=SafetensorsReader(directory, name), process_group=group, no_dist=group is None)
        set_model_state_dict(module, msd, options=StateDictOptions(strict=name != "adapters"))
        _zero_adam_state(optim)
        osd = get_optimizer_state_dict(module, optim)
        state = {"state": osd["state"]}
        with _quiet(group):
            dcp.load(state, storage_reader=SafetensorsReader(directory, _optim_part(name)), process_group=group,
                     no_dist=group is None)
        set_optimizer_state_dict(module, optim, {"state": state["state"], "param_groups": groups[name]})
    _restore_counters(engine, meta)
    return meta


def _restore_counters(engine, meta: dict) -> None:
    if meta.get("scheduler"):
        engine.scheduler.load_state_dict(meta["scheduler"])
    if engine.critic is not None and meta.get("critic_scheduler"):
        engine.critic_scheduler.load_state_dict(meta["critic_scheduler"])
    rng = meta.get("rng") or {}
    if "torch_cpu" in rng:
        torch.set_rng_state(torch.frombuffer(bytearray.fromhex(rng["torch_cpu"]), dtype=torch.uint8))
    engine.step = meta["trainer_step"]


def _load_full_files(engine, directory: Path) -> dict:
    """A checkpoint of the earlier layout (``model.safetensors``...): every rank reads the full files."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, set_model_state_dict, set_optimizer_state_dict)

    model_sd, optim_sd, meta = load_checkpoint(directory)
    extra = meta.pop("extra")
    opts = StateDictOptions(full_state_dict=True)
    if engine.critic is not None and "critic" not in extra:
        raise ValueError(f"checkpoint {directory} has no critic (critic.safetensors) but trainer.algorithm=ppo needs one")
    for name, module, optim in _modules(engine):
        msd, osd = (model_sd, optim_sd) if name == "model" else extra[name]
        set_model_state_dict(module, msd, options=opts)
        set_optimizer_state_dict(module, optim, osd, options=opts)
    _restore_counters(engine, meta)
    return meta
