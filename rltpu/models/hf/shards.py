"""A sharded run checkpoint's files, read and written without torch.distributed.

Each part of a run checkpoint (``model``, ``optimizer``, ``critic``, ``critic_optimizer``) is
``<part>.index.json`` plus one ``<part>-rank<r>.safetensors`` per trainer rank that held data:

    {"format": FORMAT, "world": 2,
     "tensors": {name: {"dtype": "float32", "shape": [17, 32],
                        "chunks": [{"offsets": [0, 0], "sizes": [9, 32], "file": "model-rank00000.safetensors",
                                    "key": name}, ...]}},
     "files": {"model-rank00000.safetensors": "<sha256>", ...}}

``learner.checkpoint`` writes them (torch.distributed.checkpoint through a safetensors storage
writer, every rank its own chunks); ``rltpu export`` and the loader read them here, one region of
one chunk at a time (``SafetensorsFile``: ``readinto``, no memory map). JSON and safetensors
only: nothing on disk is a pickle.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

from rltpu.models.hf.weights import CheckpointError, SafetensorsFile

FORMAT = "rltpu-sharded-safetensors/1"
STATE_FILE = "trainer_state.json"  # a run checkpoint's JSON: step, config, layout, sha256 of every file
_ST = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64", "int64": "I64", "int32": "I32",
       "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}


def dtype_name(dtype) -> str:
    """``torch.float32`` -> ``"float32"``; a dtype safetensors cannot hold is a one-line error."""
    name = str(dtype).removeprefix("torch.")
    if name not in _ST:
        raise CheckpointError(f"checkpoint: dtype {name} has no safetensors encoding (supported: {', '.join(_ST)})")
    return name


def write_chunks(path: Path, tensors: list[tuple[str, object]], metadata: dict | None = None) -> str:
    """Stream ``[(key, tensor)]`` into one safetensors file, one tensor copied to host at a time;
    fsynced; returns the file's sha256 (hashed while writing, so it is never read back)."""
    import torch

    header: dict = {"__metadata__": {"format": "pt", **{str(k): str(v) for k, v in (metadata or {}).items()}}}
    offset = 0
    for key, t in tensors:
        nbytes = t.numel() * t.element_size()
        header[key] = {"dtype": _ST[dtype_name(t.dtype)], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
    h = hashlib.sha256()
    with open(path, "wb") as f:
        for block in (len(raw).to_bytes(8, "little"), raw):
            f.write(block)
            h.update(block)
        for _key, t in tensors:
            if t.numel() == 0:
                continue
            host = t.detach().to("cpu").contiguous()
            view = memoryview(host.reshape(-1).view(torch.uint8).numpy())
            f.write(view)
            h.update(view)
            del host, view
        f.flush()
        os.fsync(f.fileno())
    return h.hexdigest()


def write_index(path: Path, tensors: dict, files: dict[str, str], world: int) -> None:
    """``<part>.index.json``, written to a temporary name, fsynced and renamed."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"format": FORMAT, "world": world, "tensors": tensors, "files": files}, f)
        f.flush()
        os.fsync(f.fileno())
    tmp.rename(path)


def _ints(v) -> bool:
    return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)


def _entry_ok(e) -> bool:
    """One tensor of an index: a dtype torch has, a shape of non-negative ints, and chunks whose
    offsets and sizes match its rank and name a file and a key."""
    if not isinstance(e, dict) or not isinstance(e.get("dtype"), str) or e["dtype"] not in _ST \
            or not _ints(e.get("shape")) or not isinstance(e.get("chunks"), list):
        return False
    return all(isinstance(c, dict) and _ints(c.get("offsets")) and _ints(c.get("sizes"))
               and len(c["offsets"]) == len(c["sizes"]) == len(e["shape"])
               and isinstance(c.get("file"), str) and isinstance(c.get("key"), str) for c in e["chunks"])


class ShardedPart:
    """One part of a sharded checkpoint: names, global shapes and dtypes, and reads of a region of a
    stored chunk or of a whole tensor (assembled from its chunks; ``rltpu export`` streams these)."""

    def __init__(self, directory: str | Path, part: str):
        self.dir = Path(directory)
        self.path = self.dir / f"{part}.index.json"
        try:
            index = json.loads(self.path.read_text())
        except OSError as err:
            raise CheckpointError(f"{self.path}: cannot read ({err.strerror or err})") from None
        except (ValueError, RecursionError):
            raise CheckpointError(f"{self.path}: corrupt (not JSON, or nested too deeply)") from None
        if not isinstance(index, dict) or index.get("format") != FORMAT:
            raise CheckpointError(f"{self.path}: not an rltpu sharded checkpoint index (format "
                                  f"{str(index.get('format'))[:40] if isinstance(index, dict) else None!r}, "
                                  f"expected {FORMAT})")
        if not isinstance(index.get("files"), dict) or not isinstance(index.get("tensors"), dict) or not all(
                _entry_ok(e) for e in index["tensors"].values()):
            raise CheckpointError(f"{self.path}: corrupt index (needs files: {{name: sha256}} and tensors: "
                                  f"{{name: {{dtype, shape, chunks: [{{offsets, sizes, file, key}}]}}}})")
        self.world = index.get("world")
        self.files: dict[str, str] = index["files"]
        self.entries: dict[str, dict] = index["tensors"]
        self._open: dict[str, SafetensorsFile] = {}

    def names(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name]["shape"])

    def dtype(self, name: str) -> str:
        return self.entries[name]["dtype"]

    def chunks(self, name: str) -> list[dict]:
        return self.entries[name]["chunks"]

    def _file(self, file: str) -> SafetensorsFile:
        if file not in self._open:
            self._open[file] = SafetensorsFile(self.dir / file)
        return self._open[file]

    def read_region(self, chunk: dict, offsets, lengths):
        """``lengths`` elements per dim from ``offsets`` inside the stored ``chunk``: only its rows
        ``[offsets[0], offsets[0] + lengths[0])`` are read from disk, then the other dims narrowed."""
        f = self._file(chunk["file"])
        key = chunk["key"]
        if key not in f.entries:
            raise CheckpointError(f"{f.path}: tensor {key} is listed in {self.path.name} but not in the file")
        if tuple(f.shape(key)) != tuple(chunk["sizes"]):
            raise CheckpointError(f"{f.path}: tensor {key} has shape {list(f.shape(key))} but {self.path.name} "
                                  f"says {chunk['sizes']}")
        if not chunk["sizes"]:  # a scalar (an optimizer's step)
            return f.read(key)
        t = f.read(key, (int(offsets[0]), int(offsets[0]) + int(lengths[0])))
        for d in range(1, len(lengths)):
            if int(lengths[d]) != t.shape[d]:
                t = t.narrow(d, int(offsets[d]), int(lengths[d]))
        return t

    def read(self, name: str):
        """The whole tensor ``name``: every chunk copied into place (one chunk in flight)."""
        import torch

        e = self.entries[name]
        out = torch.empty(e["shape"], dtype=getattr(torch, e["dtype"]))
        covered = 0
        for c in e["chunks"]:
            region = self.read_region(c, [0] * len(c["sizes"]), c["sizes"])
            dst = out
            for d, (o, n) in enumerate(zip(c["offsets"], c["sizes"])):
                dst = dst.narrow(d, o, n)
            dst.copy_(region)
            covered += math.prod(c["sizes"])
        if covered != math.prod(e["shape"]):
            raise CheckpointError(f"{self.path}: tensor {name}: its chunks cover {covered} of "
                                  f"{math.prod(e['shape'])} elements")
        return out


# -- a run checkpoint's integrity (learner.checkpoint writes it; resume and `rltpu export` check it) --


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _plain_name(directory: Path, name) -> str:
    """A file name the map may list: one path component inside the checkpoint, never a directory."""
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name:
        raise ValueError(f"checkpoint {directory}: {STATE_FILE} lists {name!r}, not a file name in the checkpoint")
    return name


def _listed_files(directory: Path, meta: dict) -> set[str]:
    """Every file the layout and the part indexes name (each must be in the sha256 map): the sharded
    layout's ``<part>.index.json`` and the chunk files each index lists; the full-file layout's
    ``<part>.safetensors`` files (model, optimizer, and each extra part and its optimizer)."""
    layout = meta.get("layout")
    if layout is None:  # the earlier full-file layout
        extra = meta.get("extra_param_groups") or {}
        if not isinstance(extra, dict):
            raise ValueError(f"checkpoint {directory}: extra_param_groups is not a mapping")
        policy = "adapters" if (directory / "adapters.safetensors").exists() else "model"
        return {f"{p}.safetensors" for p in (policy, "optimizer", *extra, *(f"{n}_optimizer" for n in extra))}
    if not isinstance(layout, dict) or layout.get("format") != "sharded" or not isinstance(layout.get("parts"), list) \
            or not layout["parts"]:
        raise ValueError(f"checkpoint {directory}: {STATE_FILE} has no valid 'layout' (format sharded, parts)")
    names = set()
    for part in layout["parts"]:
        index = _plain_name(directory, f"{part}.index.json" if isinstance(part, str) else part)
        names.add(index)
        doc = json.loads((directory / index).read_text())
        if not isinstance(doc, dict) or not isinstance(doc.get("files"), dict) or not isinstance(doc.get("tensors"), dict):
            raise ValueError(f"checkpoint {directory}: {index} is not a part index (files, tensors)")
        names.update(doc["files"])
        names.update(c["file"] for e in doc["tensors"].values() for c in e["chunks"])
    return names


def verify_checkpoint(directory: Path) -> dict:
    """The checkpoint's JSON if it is complete: a non-empty sha256 map that names every file the
    layout and indexes list, each present with its digest; else ValueError naming the first
    problem. Any error while checking (a malformed JSON, a directory where a file belongs) counts
    as invalid: a checkpoint is trusted only when every check passed."""
    directory = Path(directory)
    try:
        return _verify(directory)
    except ValueError as err:
        raise ValueError(str(err).splitlines()[0] if str(err) else f"checkpoint {directory} is invalid") from None
    except Exception as err:  # noqa: BLE001 - anything unexpected means "not verified"
        raise ValueError(f"checkpoint {directory} is invalid ({type(err).__name__}: "
                         f"{(str(err).splitlines() or [''])[0][:200]})") from None


def _verify(directory: Path) -> dict:
    try:
        meta = json.loads((directory / STATE_FILE).read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"checkpoint {directory}: unreadable {STATE_FILE} ({err})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"checkpoint {directory}: {STATE_FILE} holds a {type(meta).__name__}, not an object")
    digests = meta.get("sha256")
    if not isinstance(digests, dict) or not digests:
        raise ValueError(f"checkpoint {directory}: {STATE_FILE} has no sha256 map (an incomplete checkpoint)")
    for name, digest in digests.items():
        path = directory / _plain_name(directory, name)
        if not path.is_file() or not isinstance(digest, str) or sha256_file(path) != digest:
            raise ValueError(f"checkpoint file {path} is corrupt (sha256 mismatch)")
    missing = sorted(_listed_files(directory, meta) - set(digests))
    if missing:
        raise ValueError(f"checkpoint {directory}: {missing[0]} is listed by the layout but has no sha256 "
                         f"(an incomplete checkpoint)")
    return meta
