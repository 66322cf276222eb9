"""End to end through the CLI with a prompt file: a JSONL dataset of chat messages, a local
Hugging Face-format tokenizer (trained here) and the built-in random Llama sized to its vocab.

Asserts the run completes, the reward function received each row's ``answer`` column next to the
chat-rendered prompt, the tokenizer's extra EOS became a sampler stop token, and the checkpoint
holds the file's cursor. Slow (Ray + 4 actors): about a minute on 2 cores.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rltpu.data.rewards import exact_answer

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "chat_jsonl.yaml"
LOG_ENV = "RLTPU_TEST_REWARD_LOG"


def recording_reward(completion: str, example: dict, column: str = "") -> float:
    """exact_answer on ``column`` (bound from task.reward_kwargs), plus one JSON line per call (in
    the controller process) for the test to read."""
    with open(os.environ[LOG_ENV], "a") as f:
        f.write(json.dumps({"id": example["id"], "column": column, "answer": example[column],
                            "prompt": example["prompt"], "completion": completion}) + "\n")
    return exact_answer(completion, example, column)


def test_train_on_chat_jsonl_with_a_local_tokenizer(shared_ray_head, tmp_path):
    pytest.importorskip("transformers")
    from learner.checkpoint import load_checkpoint
    from rltpu.data.chat_example import write_chat_example
    from rltpu.data.hf_tokenizer import HFTokenizer
    from rltpu.observe.metrics import read_metrics

    made = write_chat_example(tmp_path / "data", num_rows=40)
    rows = {json.loads(line)["id"]: json.loads(line) for line in Path(made["dataset"]).read_text().splitlines()}
    log, run_dir = tmp_path / "rewards.jsonl", tmp_path / "run"
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
               RAY_USAGE_STATS_ENABLED="0", **{LOG_ENV: str(log)})
    cmd = [sys.executable, "-m", "rltpu.cli", "train", str(CONFIG), f"run_dir={run_dir}", "progress=false",
           f"task.dataset={made['dataset']}", f"task.tokenizer={made['tokenizer']}",
           "task.reward_fn=tests.test_e2e_data:recording_reward", "trainer.steps=3", "sync.verify_every=1", "--address", shared_ray_head]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=480)
    assert res.returncode == 0, res.stderr[-3000:]

    m = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in m] == [1, 2, 3]
    assert all(r["sync_probe_max_diff"] is not None and r["sync_probe_max_diff"] <= 1e-4 for r in m)
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(calls) == 3 * 16 * 8  # steps x prompts x group
    tok = HFTokenizer(made["tokenizer"])
    for c in calls:  # each completion was scored against its own row's answer column
        row = rows[c["id"]]
        assert c["column"] == "answer" and c["answer"] == row["answer"]
        assert c["prompt"] == tok.apply_chat_template(row["messages"])
    assert len({c["id"] for c in calls}) == 40  # 48 prompts from 40 rows: all of epoch 0 seen

    cfg_text = (run_dir / "config.yaml").read_text()
    assert f"stop_token_ids:\n  - {tok.pad_id}\n" in cfg_text  # generation_config's second EOS
    *_, meta = load_checkpoint(run_dir / "checkpoint")
    assert meta["data"] == {"epoch": 1, "position": 8, "rows": 40}
