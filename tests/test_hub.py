"""Hub ids for model.path and task.dataset (issue 32, acceptance 1), loaded offline from a Hugging Face
cache the test builds in huggingface_hub's own layout (tests/hub_cache.py); a missing id is one line,
exit 2, before Ray starts. Each check runs in a fresh process with HF_HOME / HF_HUB_OFFLINE set, as
a user's shell sets them (huggingface_hub reads both at import)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hub_cache import add_gsm8k_like, add_model_dir

ROOT = Path(__file__).resolve().parents[1]
REV = "feedfacefeedfacefeedfacefeedfacefeedface"


def _env(hf_home: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_"))}
    return env | {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
                  "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"} | extra


def gsm8k_rows(n: int, split: str) -> list[dict]:
    return [{"question": f"{split} question {i}: what is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"}
            for i in range(n)]


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """HF_HOME with a tiny Qwen3 (written by transformers) as tiny-org/tiny-qwen3 and a GSM8K-shaped
    dataset (subset main, splits train/test) as tiny-org/gsm8k-like."""
    from rltpu.models.hf.tiny import write_tiny_checkpoint

    base = tmp_path_factory.mktemp("hub")
    model = write_tiny_checkpoint(base / "src-qwen3", "qwen3", tied=True)
    home = base / "hf"
    snap = add_model_dir(home, "tiny-org/tiny-qwen3", model, revision=REV)
    data = add_gsm8k_like(home, "tiny-org/gsm8k-like", {"train": gsm8k_rows(12, "train"),
                                                          "test": gsm8k_rows(5, "test")})
    return {"home": home, "model": model, "snapshot": snap, "data": data}


DRIVER = """
import json, sys
from rltpu.cli import _hub_ids
from rltpu.config import load_config
from rltpu.data.sources import build_dataset, build_tokenizer
from rltpu.control.evaluation import Evaluator
cfg = load_config(sys.argv[1], sys.argv[2:], prepare=_hub_ids(weights=True))
tok = build_tokenizer(cfg)
data = build_dataset(cfg, tok)
ev = Evaluator(cfg.eval, cfg.sampler, tok, cfg.seed)
ex = data.next_batch(3)
print(json.dumps({"model": cfg.model.path, "arch": cfg.model.architecture, "hidden": cfg.model.hidden_size,
                  "dataset": cfg.task.dataset, "rows": len(data), "example": ex[0], "eval_rows": len(ev.examples),
                  "eval_first": ev.examples[0]}))
"""


def test_model_and_dataset_ids_load_offline_from_the_hub_cache(hub, tmp_path):
    """configs/gsm8k.yaml with model.path / task.dataset / eval.dataset given as ids: the driver turns
    them into the cached snapshot directories, the schema reads the checkpoint's sizes from there, the
    train split feeds training and the test split evaluation, in the recipe's chat format."""
    res = subprocess.run([sys.executable, "-c", DRIVER, str(ROOT / "configs" / "gsm8k.yaml"),
                          "model.path=tiny-org/tiny-qwen3", "model.dtype=float32", "task.dataset=tiny-org/gsm8k-like",
                          "eval.dataset=tiny-org/gsm8k-like", "sampler.prompt_buckets=[224]",
                          "sampler.max_new_tokens=32"],
                         cwd=ROOT, env=_env(hub["home"]), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert Path(out["model"]) == hub["snapshot"] and out["arch"] == "qwen3" and out["hidden"] == 64
    assert Path(out["dataset"]) == hub["data"] and out["rows"] == 12 and out["eval_rows"] == 5
    ex = out["example"]
    assert ex["question"].startswith("train question") and ex["answer"].endswith(f"#### {2 * int(ex['question'].split()[2][:-1])}")
    # the recipe's format: system prompt, then the question and verl's instruction, as the user's turn
    assert ex["prompt"].startswith("<|im_start|>system\nYou are a careful math tutor.")
    assert f"<|im_start|>user\n{ex['question']}\nLet's think step by step" in ex["prompt"]
    assert ex["prompt"].endswith("<|im_start|>assistant\n")
    assert out["eval_first"]["question"] == "test question 0: what is 0 + 0?"  # the test split, in file order
    # one line per id on stderr names what it resolved to
    assert f"rltpu: model.path tiny-org/tiny-qwen3 -> {hub['snapshot']}" in res.stderr
    assert f"rltpu: task.dataset tiny-org/gsm8k-like -> {hub['data']}" in res.stderr


def test_a_revision_picks_that_commit(hub, tmp_path):
    """model.revision=<commit> reads snapshots/<commit> (a second commit of the repo, refs/main unmoved)."""
    from hub_cache import add_model_dir as add

    other = "0" * 40
    home = tmp_path / "hf"
    add(home, "tiny-org/tiny-qwen3", hub["model"], revision=REV)
    snap = add(home, "tiny-org/tiny-qwen3", hub["model"], revision=other, ref="v2")
    code = ("from rltpu.cli import _hub_ids; from rltpu.config import load_config; "
            "print(load_config(None, ['model.path=tiny-org/tiny-qwen3', 'model.revision=v2'], "
            "prepare=_hub_ids(True)).model.path)")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(home), capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert Path(res.stdout.strip().splitlines()[-1]) == snap


@pytest.mark.parametrize("override,names", [
    ("model.path=nobody/missing-model", ["model.path=nobody/missing-model", "not in the Hugging Face cache",
                                         "HF_HUB_OFFLINE=1", "hf download nobody/missing-model"]),
    ("task.dataset=nobody/missing-data", ["task.dataset=nobody/missing-data", "--repo-type dataset"]),
])
def test_a_missing_id_is_one_line_exit_2_before_ray_starts(hub, tmp_path, override, names):
    run_dir = tmp_path / "run"
    # a stand-in `ray` first on the path: importing it (a step before starting Ray) leaves a mark and fails
    (tmp_path / "noray" / "ray").mkdir(parents=True)
    mark = tmp_path / "ray-imported"
    (tmp_path / "noray" / "ray" / "__init__.py").write_text(
        f"open({str(mark)!r}, 'w').close()\nraise ImportError('ray imported before the id was resolved')\n")
    path = os.pathsep.join([str(tmp_path / "noray"), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "rltpu.cli", "train", str(ROOT / "configs" / "gsm8k.yaml"),
                          "model.path=tiny-org/tiny-qwen3", override, f"run_dir={run_dir}"],
                         cwd=ROOT, env=_env(hub["home"], PYTHONPATH=path), capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 2, (res.stdout + res.stderr)[-2000:]
    errors = [line for line in res.stderr.splitlines() if line.startswith("rltpu: error:")]
    assert len(errors) == 1 and all(n in errors[0] for n in names), res.stderr
    assert "Traceback" not in res.stderr and not run_dir.exists()  # nothing started, nothing written
    assert not mark.exists(), "ray was imported before the missing id was reported"
    assert time.monotonic() - t0 < 120


def test_gated_and_unknown_repos_say_what_to_do(monkeypatch):
    """The online answers (no network here): huggingface_hub's gated / not-found errors become one line."""
    import huggingface_hub
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    from rltpu.config import ConfigError
    from rltpu.data.hub import resolve

    import httpx

    def response(code: int):
        return httpx.Response(code, request=httpx.Request("GET", "https://huggingface.co/api/models/x"))

    for exc, want in ((GatedRepoError("403 gated", response=response(403)),
                       "is a gated model on the Hugging Face Hub: accept its terms at "
                       "https://huggingface.co/meta-llama/Llama-3.2-1B, then log in"),
                      (RepositoryNotFoundError("404", response=response(404)),
                       "is neither a local path nor a model on the Hugging Face Hub")):
        def boom(*a, exc=exc, **k):
            raise exc
        monkeypatch.setattr(huggingface_hub, "snapshot_download", boom)
        with pytest.raises(ConfigError, match=want) as err:
            resolve("meta-llama/Llama-3.2-1B", "model.path")
        assert "\n" not in str(err.value) and "model.path='meta-llama/Llama-3.2-1B'" in str(err.value)


def test_local_paths_win_over_ids_and_csv_globs_directories_load(tmp_path, monkeypatch):
    """A local directory named like an id is local; CSV files, globs and directories go through
    datasets.load_dataset (no Hub involved)."""
    from rltpu.data.hub import is_hub_id, resolve_ids
    from rltpu.data.sources import read_rows

    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not is_hub_id("org/name") and is_hub_id("org/other") and not is_hub_id("a/b/c")
    assert is_hub_id("org/held.jsonl") and not is_hub_id("org/held.jsonl", "dataset")  # a (missing) file
    data = {"model": {"path": "org/name"}, "task": {"dataset": "rows.csv"}}
    assert resolve_ids(data, log=lambda line: None) == {"model": {"path": "org/name"}, "task": {"dataset": "rows.csv"}}
    (tmp_path / "rows.csv").write_text("question,answer\nwhat is 1+1?,#### 2\n\"a, b?\",#### 3\n")
    rows, where = read_rows("rows.csv", prompt_key="question")
    assert rows == [{"question": "what is 1+1?", "answer": "#### 2"}, {"question": "a, b?", "answer": "#### 3"}]
    assert where[1] == "rows.csv [train] row 1"
    parts = tmp_path / "parts"
    parts.mkdir()
    for i in range(2):
        (parts / f"p{i}.jsonl").write_text(json.dumps({"question": f"q{i}", "answer": str(i)}) + "\n")
    rows, _ = read_rows(str(parts / "*.jsonl"), prompt_key="question")
    assert sorted(r["question"] for r in rows) == ["q0", "q1"]
    from rltpu.data.sources import DatasetError

    with pytest.raises(DatasetError, match="matches no file"):
        read_rows(str(parts / "*.csv"), prompt_key="question")
    with pytest.raises(DatasetError, match="split 'validation'.*set task.subset / task.split"):
        from hub_cache import add_gsm8k_like

        snap = add_gsm8k_like(tmp_path / "hf", "o/d", {"train": gsm8k_rows(2, "train")})
        read_rows(str(snap), "main", "validation", prompt_key="question")
