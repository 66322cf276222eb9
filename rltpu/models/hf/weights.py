"""Streaming safetensors: a checkpoint directory read one tensor (or one row range) at a time.

Why not ``safetensors.safe_open``: it memory-maps the file, and every page a rank touches then
counts in its resident memory until the file is closed, so two FSDP ranks reading their halves
of a shard would together hold the shard twice (their parameters plus the mapped pages). Here
the 8-byte length + JSON header is parsed once and tensor bytes are ``readinto`` a buffer of
exactly the rows asked for, so a rank's peak is its own shard plus one tensor slice.

The header is checked before any data is read: every entry's dtype, shape and byte range must be
consistent and inside the file, so a corrupt or truncated file is a one-line error naming the
file and the tensor, never a crash halfway through loading.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Iterator

import numpy as np

from rltpu.config import ConfigError

# safetensors dtype -> (torch dtype name, bytes per element)
_ST_DTYPES = {"F32": ("float32", 4), "BF16": ("bfloat16", 2), "F16": ("float16", 2), "F64": ("float64", 8),
              "I64": ("int64", 8), "I32": ("int32", 4), "I16": ("int16", 2), "I8": ("int8", 1), "U8": ("uint8", 1),
              "BOOL": ("bool", 1)}
_ST_OF = {v[0]: k for k, v in _ST_DTYPES.items()}
# tensors a checkpoint may hold that the model does not use (old Llama exports kept the RoPE table)
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
_MAX_HEADER = 100 * 2**20


class CheckpointError(ConfigError):
    """A checkpoint directory that cannot be loaded: one line naming the file and the tensor."""


def _int_list(v) -> bool:
    """A JSON list of plain integers (not bools, floats or strings)."""
    return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)


class SafetensorsFile:
    """The header of one ``.safetensors`` file, and reads of whole tensors or row ranges."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise CheckpointError(f"{self.path}: not a safetensors file ({size} bytes, no header)")
                n = int.from_bytes(head, "little")
                if n <= 0 or n > min(_MAX_HEADER, size - 8):
                    raise CheckpointError(f"{self.path}: not a safetensors file or truncated (header length {n}, "
                                          f"file {size} bytes)")
                raw = f.read(n)
        except OSError as err:
            raise CheckpointError(f"{self.path}: cannot read ({err.strerror or err})") from None
        try:
            header = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise CheckpointError(f"{self.path}: corrupt safetensors header (not JSON)") from None
        except RecursionError:  # deeply nested JSON: no real header is
            raise CheckpointError(f"{self.path}: corrupt safetensors header (JSON nested too deeply)") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path}: corrupt safetensors header (not an object)")
        meta = header.pop("__metadata__", None) or {}
        self.metadata = meta if isinstance(meta, dict) else {}
        self.data_start = 8 + n
        self.entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}  # name -> (dtype, shape, begin, end)
        for name, e in header.items():
            st, shape, offsets = (e.get("dtype"), e.get("shape"), e.get("data_offsets")) if isinstance(e, dict) else \
                (None, None, None)
            if not isinstance(st, str) or not _int_list(shape) or not _int_list(offsets) or len(offsets) != 2:
                raise CheckpointError(f"{self.path}: tensor {str(name)[:100]}: corrupt header entry (needs dtype: "
                                      f"str, shape: [int], data_offsets: [int, int])")
            if any(d < 0 for d in shape):
                raise CheckpointError(f"{self.path}: tensor {name}: corrupt header (negative dimension in "
                                      f"shape {shape})")
            shape, (b, end) = tuple(shape), offsets
            if st not in _ST_DTYPES:
                raise CheckpointError(f"{self.path}: tensor {name}: unsupported dtype {st[:20]!r}")
            nbytes = math.prod(shape) * _ST_DTYPES[st][1]
            if not (0 <= b <= end) or end - b != nbytes:
                raise CheckpointError(f"{self.path}: tensor {name}: corrupt header (byte range {b}..{end} does not "
                                      f"hold shape {list(shape)} {st})")
            if self.data_start + end > size:
                raise CheckpointError(f"{self.path}: truncated: tensor {name} ends at byte {self.data_start + end} "
                                      f"but the file has {size} bytes")
            self.entries[name] = (_ST_DTYPES[st][0], shape, b, end)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name][1]

    def dtype(self, name: str) -> str:
        return self.entries[name][0]

    def read(self, name: str, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None):
        """Tensor ``name`` (torch, its stored dtype), or only rows ``[a, b)`` of dim 0 (and of a 2-D
        tensor only columns ``[c, d)``: a tensor-parallel rank's block of a row-split projection)."""
        import torch

        dtype, shape, begin, end = self.entries[name]
        if cols is not None:
            return self._read_block(name, rows or (0, shape[0]), cols)
        if rows is not None:
            a, b = rows
            row_bytes = (end - begin) // shape[0] if shape and shape[0] else 0
            begin, end, shape = begin + a * row_bytes, begin + b * row_bytes, (b - a, *shape[1:])
        buf = torch.empty(end - begin, dtype=torch.uint8)
        with open(self.path, "rb", buffering=0) as f:
            f.seek(self.data_start + begin)
            got = f.readinto(memoryview(buf.numpy()))
        if got != end - begin:
            raise CheckpointError(f"{self.path}: truncated while reading tensor {name}")
        return buf.view(getattr(torch, dtype)).reshape(shape)

    def _read_block(self, name: str, rows: tuple[int, int], cols: tuple[int, int]):
        """Rows ``[a, b)`` x columns ``[c, d)`` of a 2-D tensor: one positioned read per row of exactly
        its ``d - c`` columns, so only the block's bytes are read (never the full rows)."""
        import torch

        dtype, shape, begin, end = self.entries[name]
        if len(shape) != 2:
            raise CheckpointError(f"{self.path}: tensor {name} has shape {list(shape)}; a column block needs 2-D")
        (a, b), (c, d) = rows, cols
        item = (end - begin) // max(1, math.prod(shape))
        width, row_bytes = (d - c) * item, shape[1] * item
        buf = torch.empty((b - a) * width, dtype=torch.uint8)
        view = memoryview(buf.numpy())
        fd = os.open(self.path, os.O_RDONLY)
        try:
            for i in range(b - a):
                at = self.data_start + begin + (a + i) * row_bytes + c * item
                if os.preadv(fd, [view[i * width:(i + 1) * width]], at) != width:
                    raise CheckpointError(f"{self.path}: truncated while reading tensor {name}")
        finally:
            os.close(fd)
        return buf.view(getattr(torch, dtype)).reshape(b - a, d - c)

    def read_numpy(self, name: str) -> np.ndarray:
        """Tensor ``name`` as numpy; bf16 comes back as ``ml_dtypes.bfloat16`` (JAX's bfloat16)."""
        t = self.read(name)
        if self.dtype(name) == "bfloat16":
            import jax.numpy as jnp
            import torch

            return t.view(torch.uint16).numpy().view(jnp.bfloat16)
        return t.numpy()


class CheckpointDir:
    """The weights of a Hugging Face directory: ``model.safetensors`` or shards with an index."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        index = self.dir / "model.safetensors.index.json"
        single = self.dir / "model.safetensors"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                self.where = {str(k): self.dir / str(v) for k, v in weight_map.items()}
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError):
                raise CheckpointError(f"{index}: not a safetensors index (needs a JSON 'weight_map')") from None
            for name, f in self.where.items():
                if not f.is_file():
                    raise CheckpointError(f"{index}: tensor {name} is mapped to {f.name}, which does not exist")
        elif single.is_file():
            self.where = None
        else:
            raise CheckpointError(f"{self.dir} has no model.safetensors or model.safetensors.index.json "
                                  f"(only safetensors weights are loaded)")
        self._files: dict[Path, SafetensorsFile] = {}
        if self.where is None:
            f = self.file(single)
            self.where = {name: single for name in f.entries}
        else:
            for path in dict.fromkeys(self.where.values()):
                f = self.file(path)
                for name in (n for n, p in self.where.items() if p == path):
                    if name not in f.entries:
                        raise CheckpointError(f"{path}: tensor {name} is listed in the index but not in the file")

    def file(self, path: Path) -> SafetensorsFile:
        if path not in self._files:
            self._files[path] = SafetensorsFile(path)
        return self._files[path]

    def names(self) -> list[str]:
        return list(self.where)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.file(self.where[name]).shape(name)

    def check(self, cfg, vocab_size: int | None = None) -> dict[str, tuple[int, ...]]:
        """Every parameter of ``cfg`` is present with its shape, and nothing unknown is: one line
        naming the file and the tensor otherwise. Returns the expected shapes. A family only
        transformers implements (``architecture: other``) is checked for float tensors alone:
        transformers maps its names on load (``trainer.model_impl: hf``)."""
        from rltpu.models.spec import param_shapes

        if cfg.architecture == "other":
            for name in self.where:
                if self.file(self.where[name]).dtype(name) not in ("float32", "bfloat16", "float16"):
                    raise CheckpointError(f"{self.where[name]}: tensor {name} has dtype "
                                          f"{self.file(self.where[name]).dtype(name)}, expected a float type")
            return {name: tuple(self.shape(name)) for name in self.where}
        want = param_shapes(cfg, vocab_size)
        for name, shape in want.items():
            if name not in self.where:
                raise CheckpointError(f"{self.dir}: tensor {name} is missing (config.json implies shape {list(shape)})")
            got = self.shape(name)
            if tuple(got) != tuple(shape):
                raise CheckpointError(f"{self.where[name]}: tensor {name} has shape {list(got)} but config.json "
                                      f"implies {list(shape)}")
            if self.file(self.where[name]).dtype(name) not in ("float32", "bfloat16", "float16"):
                raise CheckpointError(f"{self.where[name]}: tensor {name} has dtype "
                                      f"{self.file(self.where[name]).dtype(name)}, expected a float type")
        for name in self.where:
            tied_head = name == "lm_head.weight" and cfg.tie_word_embeddings
            if name not in want and not tied_head and not name.endswith(_IGNORED_SUFFIXES):
                raise CheckpointError(f"{self.where[name]}: unexpected tensor {name} (config.json describes a "
                                      f"{cfg.architecture} model without it)")
        return want

    def read(self, name: str, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None):
        return self.file(self.where[name]).read(name, rows, cols)

    def read_numpy(self, name: str) -> np.ndarray:
        return self.file(self.where[name]).read_numpy(name)

    def by_file(self, names) -> Iterator[str]:
        """``names`` grouped file by file (shard order), so reads stream through one shard at a time."""
        order = {p: i for i, p in enumerate(dict.fromkeys(self.where.values()))}
        yield from sorted(names, key=lambda n: order[self.where[n]])


def write_safetensors(path: str | Path, spec: list[tuple[str, tuple[int, ...], str]], read,
                      metadata: dict | None = None) -> None:
    """Write tensors ``spec`` = [(name, shape, torch dtype name)], fetching each with ``read(name)``
    just before it is written: one tensor in memory at a time. Written to ``path.tmp``, renamed."""
    import torch

    header: dict = {"__metadata__": {str(k): str(v) for k, v in (metadata or {}).items()}}
    offset = 0
    for name, shape, dtype in spec:
        nbytes = math.prod(shape) * _ST_DTYPES[_ST_OF[dtype]][1]
        header[name] = {"dtype": _ST_OF[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
    tmp = Path(str(path) + ".tmp")
    with open(tmp, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name, shape, dtype in spec:
            t = read(name).detach().to("cpu", getattr(torch, dtype)).contiguous()
            if tuple(t.shape) != tuple(shape):
                raise CheckpointError(f"{path}: tensor {name} has shape {list(t.shape)}, expected {list(shape)}")
            f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        f.flush()
        os.fsync(f.fileno())
    tmp.rename(path)
