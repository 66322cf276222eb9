"""Checkpoints from the driver's side and ``checkpoint.hf_export`` (``rltpu.control.checkpoints``,
``learner/checkpoint.py``): the periodic cadence, ``--resume PATH``, and the Hugging Face directory each
trainer rank writes its share of, which ``transformers`` loads with the policy's logits."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from learner.checkpoint import verify_checkpoint
from learner.trainer import TrainerEngine
from procs import join_gloo, spawn_ranks
from rltpu.config import ConfigError, RunConfig, load_config
from rltpu.control.checkpoints import Checkpoints, named_checkpoint, set_aside_newer
from rltpu.models.hf.export import hf_shares
from test_trainer_fsdp import MCFG, SEED, TCFG, TEMPERATURE, V, _global, synthetic_batch

transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)
torch.set_float32_matmul_precision("highest")
ROOT = Path(__file__).resolve().parents[1]
RUN = RunConfig(model=MCFG, trainer=TCFG)
META = {"step": 1, "weight_version": 1, "config": RUN.to_dict()}


def _engine(mesh=None) -> TrainerEngine:
    return TrainerEngine(MCFG, TCFG, V, SEED, TEMPERATURE, mesh=mesh)


def _probe():
    ids = np.random.default_rng(3).integers(2, V, (2, 12))
    return ids, np.tile(np.arange(12), (2, 1)), np.ones_like(ids)


def _hf_logits(hf_dir: Path) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        return model(torch.as_tensor(_probe()[0])).logits.float().numpy()


# -- the cadence ----------------------------------------------------------------------------------


def _cadence(**ckpt) -> Checkpoints:
    cfg = load_config(ROOT / "configs" / "quickstart.yaml", [f"checkpoint.{k}={v}" for k, v in ckpt.items()])
    return Checkpoints(None, None, cfg, Path("unused"))


def test_default_cadence_is_every_10_steps_or_30_minutes():
    c = _cadence()
    start = c.last_saved
    assert [s for s in range(1, 31) if c.due(s, now=start)] == [10, 20, 30]
    assert c.due(7, now=start + 30 * 60 + 0.01) and not c.due(7, now=start + 29.9 * 60)
    minutes_only = _cadence(every_steps=0, every_minutes=0.5)
    t = minutes_only.last_saved
    assert not minutes_only.due(10, now=t + 29.9) and minutes_only.due(3, now=t + 30.01)
    off = _cadence(every_steps=0, every_minutes=0)
    assert not any(off.due(s, now=off.last_saved + 1e6) for s in range(1, 50))


# -- checkpoint.hf_export ----------------------------------------------------------------------------


def test_hf_export_one_rank_loads_in_transformers_with_the_policys_logits(tmp_path):
    eng = _engine()
    eng.train_step(_global(synthetic_batch(1)))
    ckpt = eng.save_checkpoint(tmp_path / "checkpoint", dict(META, hf_export=True))
    meta = verify_checkpoint(ckpt)  # the checkpoint itself is unchanged: every listed file verifies
    assert "hf_export" not in meta
    hf = ckpt / "hf"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {f.name for f in hf.iterdir()}
    assert not (hf / "model.safetensors.index.json").exists()
    got = _hf_logits(hf)
    assert np.abs(got - eng.probe_logits(*_probe())).max() <= 1e-4
    # it moves with its checkpoint when the next one lands (the kept ones keep theirs)
    eng.train_step(_global(synthetic_batch(2)))
    eng.save_checkpoint(tmp_path / "checkpoint", dict(META, step=2, hf_export=True), keep=2)
    prev = tmp_path / "checkpoint.prev" / "hf"
    assert np.abs(_hf_logits(prev) - got).max() == 0
    assert np.abs(_hf_logits(tmp_path / "checkpoint" / "hf") - eng.probe_logits(*_probe())).max() <= 1e-4


def _two_rank_worker(rank: int, world: int, port: int, tmp: str, q) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    try:
        join_gloo(rank, world, port)
        eng = _engine(init_device_mesh("cpu", (world,)))
        eng.load_checkpoint(Path(tmp) / "one" / "checkpoint")
        eng.save_checkpoint(Path(tmp) / "two" / "checkpoint", dict(META, hf_export=True))
        q.put((rank, {"ok": True}))
    except Exception as e:  # noqa: BLE001 - reported to the parent
        q.put((rank, {"error": f"{type(e).__name__}: {e}"}))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_hf_export_two_ranks_each_write_a_share(tmp_path):
    ref = _engine()
    ref.train_step(_global(synthetic_batch(1)))
    ref.save_checkpoint(tmp_path / "one" / "checkpoint", META)
    res = spawn_ranks(_two_rank_worker, 2, (str(tmp_path),), 120, "hf export")
    assert all("error" not in r for r in res.values()), res
    hf = tmp_path / "two" / "checkpoint" / "hf"
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    # contiguous runs of about equal bytes, in the model's parameter order
    spec = [(n, tuple(t.shape), "float32") for n, t in ref.full_state_dict().items()]
    shares = hf_shares(spec, 2)
    assert [[n for n, _, _ in sh] for sh in shares] == [
        [n for n, f in index["weight_map"].items() if f == name] for name in files]
    sizes = [sum(int(np.prod(s)) for _, s, _ in sh) for sh in shares]
    assert max(sizes) < 0.75 * sum(sizes), sizes
    assert np.abs(_hf_logits(hf) - ref.probe_logits(*_probe())).max() <= 1e-4


def test_hf_export_is_refused_with_lora():
    with pytest.raises(ConfigError, match="checkpoint.hf_export with trainer.lora"):
        load_config(ROOT / "configs" / "quickstart.yaml", ["checkpoint.hf_export=true", "trainer.lora.rank=4"])


# -- --resume PATH ------------------------------------------------------------------------------------


def _fake_checkpoint(path: Path, step: int) -> Path:
    """A checkpoint the verifier accepts: the JSON and one listed file with its sha256."""
    from rltpu.models.hf.shards import sha256_file

    path.mkdir(parents=True)
    (path / "model.index.json").write_text(json.dumps({"tensors": {}, "files": {}, "world": 1}))
    meta = {"step": step, "layout": {"format": "sharded", "parts": ["model"], "world": 1},
            "sha256": {"model.index.json": sha256_file(path / "model.index.json")}}
    (path / "trainer_state.json").write_text(json.dumps(meta))
    verify_checkpoint(path)
    return path


def test_resume_path_checks_and_sets_the_newer_aside(tmp_path):
    run = tmp_path / "run"
    for i, name in enumerate(("checkpoint.prev2", "checkpoint.prev", "checkpoint")):
        _fake_checkpoint(run / name, i + 1)
    with pytest.raises(ConfigError, match="not a checkpoint directory"):
        named_checkpoint(tmp_path / "nowhere", run)
    (run / "checkpoint.prev2" / "model.index.json").write_text("{}")  # corrupt
    with pytest.raises(ConfigError, match="corrupt .*name another checkpoint"):
        named_checkpoint(run / "checkpoint.prev2", run)
    other = _fake_checkpoint(tmp_path / "other" / "checkpoint", 7)
    with pytest.raises(ConfigError, match="not a checkpoint of run_dir .* already holds a run"):
        named_checkpoint(other, run)
    assert named_checkpoint(other, tmp_path / "fresh") == other.resolve()  # another run's, into a new run dir
    got = named_checkpoint(run / "checkpoint.prev", run)
    set_aside_newer(got, run)
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint.prev", "checkpoint.prev2", "checkpoint.superseded"]


class _Trainer:
    def __init__(self, loaded: list):
        self.load_checkpoint = SimpleNamespace(remote=lambda p: loaded.append(Path(p)) or {"step": Path(p).name})


def test_a_named_checkpoint_is_the_first_load_and_the_fallback(tmp_path):
    loaded: list[Path] = []
    cfg = load_config(ROOT / "configs" / "quickstart.yaml")
    ray = SimpleNamespace(get=lambda refs, timeout=None: refs)
    other = _fake_checkpoint(tmp_path / "other" / "checkpoint", 7)
    ck = Checkpoints(ray, SimpleNamespace(trainers=[_Trainer(loaded)]), cfg, tmp_path / "run", source=other)
    assert ck.load_latest()[0] == other  # the resume itself
    assert ck.load_latest(required=False)[0] == other  # a trainer restart before this run saved
    own = _fake_checkpoint(tmp_path / "run" / "checkpoint", 9)
    assert ck.load_latest(required=False)[0] == own  # after its first save: its own
    assert loaded == [other, other, own]


def test_resume_takes_an_optional_path_and_leaves_overrides_alone(tmp_path, monkeypatch):
    from rltpu import cli

    seen = []
    monkeypatch.setattr(cli, "cmd_train", lambda args: seen.append((args.resume, args.overrides)) or 0)
    monkeypatch.delenv("RLTPU_LOG_LEVEL", raising=False)
    q = str(ROOT / "configs" / "quickstart.yaml")
    cli.main(["train", q, "--resume"])
    cli.main(["train", q, "--resume", "trainer.steps=9"])
    cli.main(["train", q, "--resume", str(tmp_path), "trainer.steps=9"])
    assert seen == [(True, []), (True, ["trainer.steps=9"]), (str(tmp_path), ["trainer.steps=9"])]
