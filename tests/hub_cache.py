"""A Hugging Face Hub cache built on disk, in the layout ``huggingface_hub`` reads offline.

    <HF_HOME>/hub/models--org--name/{blobs/<sha256>, snapshots/<rev>/<file> -> ../../blobs/<sha256>, refs/main}

(``datasets--org--name`` for a dataset repo). Tests put a tiny checkpoint written by ``transformers`` and
a tiny dataset written by the test there, then load them by id with ``HF_HUB_OFFLINE=1``: the code
path a user with a warm cache runs, with no network.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


def add_repo(hf_home: Path, repo_id: str, files: dict[str, bytes], repo_type: str = "model",
             revision: str = "0123456789abcdef0123456789abcdef01234567", ref: str = "main") -> Path:
    """Put ``files`` (path in repo -> bytes) into the cache under ``HF_HOME=hf_home`` as commit
    ``revision`` of ``repo_id``, with ``refs/<ref>`` pointing at it; returns the snapshot directory."""
    repo = Path(hf_home) / "hub" / f"{repo_type}s--{repo_id.replace('/', '--')}"
    snap = repo / "snapshots" / revision
    for rel, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snap / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / ref).write_text(revision)
    return snap


def add_model_dir(hf_home: Path, repo_id: str, directory: Path, **kw) -> Path:
    """A local model directory (config.json, safetensors, tokenizer) as a cached model repo."""
    files = {p.relative_to(directory).as_posix(): p.read_bytes() for p in Path(directory).rglob("*") if p.is_file()}
    return add_repo(hf_home, repo_id, files, "model", **kw)


def parquet_bytes(rows: list[dict]) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(rows), sink)
    return sink.getvalue().to_pybytes()


def add_gsm8k_like(hf_home: Path, repo_id: str, splits: dict[str, list[dict]], subset: str = "main", **kw) -> Path:
    """A dataset repo laid out as openai/gsm8k is: ``<subset>/<split>-00000-of-00001.parquet`` and a
    README.md whose YAML header maps the subset's splits to those files."""
    files = {f"{subset}/{split}-00000-of-00001.parquet": parquet_bytes(rows) for split, rows in splits.items()}
    card = ["---", "configs:", f"- config_name: {subset}", "  data_files:"]
    for split in splits:
        card += [f"  - split: {split}", f"    path: {subset}/{split}-*"]
    files["README.md"] = ("\n".join(card + ["---", f"# {repo_id}", ""])).encode()
    return add_repo(hf_home, repo_id, files, "dataset", **kw)
