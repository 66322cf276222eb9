"""Checkpoint verification trusts nothing by accident (issue 34): a checkpoint is valid only when its
sha256 map covers every file the layout and indexes list; any error while checking means invalid;
a corrupt newest is moved aside so the next save keeps the valid ``.prev``; ``rltpu export`` checks
the digests; the safetensors reader turns odd headers into one-line errors. All in-process, tiny."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from learner.checkpoint import history, latest_valid, save_checkpoint, verify_checkpoint
from rltpu.models.hf.shards import ShardedPart
from rltpu.models.hf.weights import CheckpointError, SafetensorsFile

STATE = "trainer_state.json"


def _ckpt(path: Path, step: int, keep: int = 2) -> Path:
    model = {"w": torch.full((4, 4), float(step))}
    optim = {"state": {"w": {"exp_avg": torch.zeros(4, 4), "step": torch.tensor(float(step))}}}
    return save_checkpoint(path, {"model": model, "optimizer": optim}, {"step": step}, keep=keep)


def _edit_state(ck: Path, fn) -> None:
    meta = json.loads((ck / STATE).read_text())
    (ck / STATE).write_text(json.dumps(fn(meta)))


def _truncate(f: Path) -> None:
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


@pytest.mark.parametrize("edit", ["no map", "empty map", "map not a dict", "file left out of the map",
                                  "index left out of the map"])
def test_a_map_that_does_not_cover_the_layout_is_invalid(tmp_path, edit):
    """A truncated file whose digest is missing from the map (or the whole map gone) used to verify."""
    ck = _ckpt(tmp_path / "checkpoint", 1)
    if edit == "index left out of the map":  # an index edited after the fact: its chunk list is not to be trusted
        (ck / "model.index.json").write_text((ck / "model.index.json").read_text() + " ")
    else:
        _truncate(ck / "model-rank00000.safetensors")
    drop = {"no map": lambda m: {k: v for k, v in m.items() if k != "sha256"},
            "empty map": lambda m: m | {"sha256": {}},
            "map not a dict": lambda m: m | {"sha256": ["x"]},
            "file left out of the map": lambda m: m | {"sha256": {k: v for k, v in m["sha256"].items()
                                                                  if k != "model-rank00000.safetensors"}},
            "index left out of the map": lambda m: m | {"sha256": {k: v for k, v in m["sha256"].items()
                                                                   if k != "model.index.json"}}}[edit]
    _edit_state(ck, drop)
    with pytest.raises(ValueError) as err:
        verify_checkpoint(ck)
    assert "\n" not in str(err.value) and str(ck) in str(err.value)
    assert latest_valid(ck) is None


@pytest.mark.parametrize("state", ["[]", '"x"', "null", '{"sha256": {"sub": "0"}}', '{"sha256": {"../x": "0"}}',
                                   '{"sha256": {"model.index.json": 5}}', "[" * 100_000 + "]" * 100_000,
                                   '{"sha256": {"a": "b"}, "layout": {"format": "sharded", "parts": [[1]]}}'],
                         ids=["list", "str", "null", "dir", "path", "digest-int", "deep", "parts-list"])
def test_any_error_while_verifying_means_invalid(tmp_path, state):
    """A trainer_state.json of ``[]``, a directory or a path in the map, deep JSON: invalid, and
    ``latest_valid`` falls back to the previous checkpoint instead of raising."""
    ck = tmp_path / "checkpoint"
    _ckpt(ck, 1)
    _ckpt(ck, 2)
    (ck / "sub").mkdir()
    (ck / STATE).write_text(state)
    with pytest.raises(ValueError) as err:
        verify_checkpoint(ck)
    assert "\n" not in str(err.value)
    seen = []
    assert latest_valid(ck, 2, seen.append) == ck.with_name("checkpoint.prev") and "falling back" in seen[0]


def test_a_corrupt_newest_is_moved_aside_so_the_valid_prev_survives(tmp_path):
    """Resume from ``.prev`` after the newest went bad, save twice, corrupt the newest again: a valid
    checkpoint is still there (before, the first save rotated the corrupt one into ``.prev`` and
    deleted the valid one)."""
    ck = tmp_path / "checkpoint"
    _ckpt(ck, 1)
    _ckpt(ck, 2)
    _truncate(ck / "optimizer-rank00000.safetensors")
    seen = []
    assert latest_valid(ck, 2, seen.append, set_aside=True) == ck.with_name("checkpoint.prev")
    assert ck.with_name("checkpoint.corrupt").is_dir() and not ck.exists()
    assert any("moved the corrupt checkpoint aside" in m for m in seen)
    _ckpt(ck, 2)  # the resumed run saves step 2 again
    assert [verify_checkpoint(p)["step"] for p in history(ck, 2)] == [2, 1]
    _truncate(ck / "model-rank00000.safetensors")  # and the newest goes bad once more
    found = latest_valid(ck, 2, set_aside=True)
    assert found is not None and verify_checkpoint(found)["step"] == 1
    # a plain query (tests, benchmarks) moves nothing
    _ckpt(ck, 3)
    _truncate(ck / "model-rank00000.safetensors")
    assert latest_valid(ck, 2) == ck.with_name("checkpoint.prev") and ck.is_dir()


def test_driver_resume_sets_the_corrupt_newest_aside(tmp_path):
    """``Checkpoints.load_latest`` (resume and trainer-restart rewind) is where the driver moves it."""
    from rltpu.config import RunConfig
    from rltpu.control.checkpoints import Checkpoints

    class Trainer:
        class load_checkpoint:  # noqa: N801 - mimics a Ray actor method
            @staticmethod
            def remote(path):
                return json.loads((Path(path) / STATE).read_text())

    class Ray:
        get = staticmethod(lambda refs, **kw: refs)

    groups = type("G", (), {"trainers": [Trainer()]})()
    ck = tmp_path / "checkpoint"
    _ckpt(ck, 1)
    _ckpt(ck, 2)
    _truncate(ck / "model-rank00000.safetensors")
    path, meta = Checkpoints(Ray(), groups, RunConfig(), tmp_path).load_latest()
    assert path == ck.with_name("checkpoint.prev") and meta["step"] == 1
    assert ck.with_name("checkpoint.corrupt").is_dir() and not ck.exists()


def test_export_verifies_the_checkpoint(tmp_path):
    """A flipped byte inside a weight file (header intact, so the reader would not notice) is refused
    by ``rltpu export`` in one line; before, the export wrote the corrupt weights."""
    from learner.trainer import TrainerEngine
    from rltpu.cli import main
    from rltpu.config import RunConfig
    from rltpu.data.char_tokenizer import CharTokenizer
    from rltpu.models.hf.export import export_checkpoint

    run = RunConfig.model_validate({"model": {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1}})
    eng = TrainerEngine(run.model, run.trainer, CharTokenizer().vocab_size, run.seed)
    ck = eng.save_checkpoint(tmp_path / "checkpoint", {"step": 1, "weight_version": 1, "config": run.to_dict()})
    assert export_checkpoint(ck, tmp_path / "ok")["tensors"] > 0
    f = ck / "model-rank00000.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-3] ^= 0xFF
    f.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError) as err:
        export_checkpoint(ck, tmp_path / "bad")
    assert "corrupt" in str(err.value) and "\n" not in str(err.value) and not (tmp_path / "bad").exists()
    assert main(["export", str(ck), str(tmp_path / "bad2")]) == 2


def _safetensors(path: Path, header) -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 64)
    return path


@pytest.mark.parametrize("header", [
    {"t": {"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8]}},      # a list where a name belongs
    {"t": {"dtype": {"a": 1}, "shape": [2], "data_offsets": [0, 8]}},
    {"t": {"dtype": "F32", "shape": [-2, -2], "data_offsets": [0, 16]}},  # negative dims, product positive
    {"t": {"dtype": "F32", "shape": [2], "data_offsets": "ab"}},
    {"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8, 9]}},
    {"t": {"dtype": "F32", "shape": [True, 2], "data_offsets": [0, 8]}},
    {"t": {"dtype": "F32", "shape": "22", "data_offsets": [0, 8]}},
    {"t": {"dtype": "F32", "shape": [2.5], "data_offsets": [0, 8]}},
    {"t": ["F32"]},
    {"t": 7},
    b"[" * 200_000 + b"]" * 200_000,                                      # deep JSON
    b'{"t": ' + b"[" * 200_000 + b"]" * 200_000 + b"}",
], ids=["dtype-list", "dtype-dict", "negative-dims", "offsets-str", "offsets-3", "shape-bool", "shape-str",
        "shape-float", "entry-list", "entry-int", "deep", "deep-entry"])
def test_safetensors_reader_odd_headers_are_one_line_errors(tmp_path, header):
    with pytest.raises(CheckpointError) as err:
        SafetensorsFile(_safetensors(tmp_path / "x.safetensors", header))
    assert "\n" not in str(err.value) and "x.safetensors" in str(err.value)


@pytest.mark.parametrize("index", [
    b"[" * 200_000 + b"]" * 200_000,
    {"format": "rltpu-sharded-safetensors/1", "world": 1},
    {"format": "rltpu-sharded-safetensors/1", "files": [], "tensors": {}},
    {"format": "rltpu-sharded-safetensors/1", "files": {}, "tensors": {"w": {"dtype": "float32", "shape": [-1],
                                                                             "chunks": []}}},
    {"format": "rltpu-sharded-safetensors/1", "files": {}, "tensors": {"w": {"dtype": [1], "shape": [2],
                                                                             "chunks": []}}},
    {"format": "rltpu-sharded-safetensors/1", "files": {}, "tensors": {"w": {
        "dtype": "float32", "shape": [2], "chunks": [{"offsets": [0, 0], "sizes": [2], "file": "f", "key": "w"}]}}},
    {"format": ["x"]},
], ids=["deep", "no-files", "files-list", "negative-shape", "dtype-list", "chunk-rank", "format-list"])
def test_sharded_index_odd_contents_are_one_line_errors(tmp_path, index):
    (tmp_path / "model.index.json").write_bytes(index if isinstance(index, bytes) else json.dumps(index).encode())
    with pytest.raises(CheckpointError) as err:
        ShardedPart(tmp_path, "model")
    assert "\n" not in str(err.value) and "model.index.json" in str(err.value)
