"""The GSM8K recipe (issue 32): configs/gsm8k.yaml end to end at a tiny size from a Hub cache the test
builds (mechanics: ids, chat format with enable_thinking off, weighted math-verify rewards, test-split
eval), and its task in GSM8K format learning on a tiny model (configs/gsm8k_arith.yaml)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hub_cache import add_gsm8k_like, add_model_dir

ROOT = Path(__file__).resolve().parents[1]
# Qwen3's own switch: with enable_thinking false its template opens the answer with an empty think block
QWEN3_LIKE_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_"))}
    return env | {"RAY_AUTH_MODE": "disabled", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
                  "RAY_USAGE_STATS_ENABLED": "0"} | extra


@pytest.mark.slow
def test_gsm8k_recipe_end_to_end_from_a_hub_cache(tmp_path, shared_ray_head):
    """``rltpu train configs/gsm8k.yaml`` with the model and dataset given as Hub ids, offline: a tiny
    random Qwen3 (the recipe's architecture, written by transformers) and GSM8K-format rows in a cache
    built here. Two steps, eval after each on the test split; the recipe's rewards, plus a weight-0
    term that logs what the reward functions received."""
    from rltpu.models.hf.tiny import write_tiny_checkpoint
    from rltpu.observe.metrics import read_metrics

    model = write_tiny_checkpoint(tmp_path / "src", "qwen3", tied=True)
    tok_cfg = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps(tok_cfg | {"chat_template": QWEN3_LIKE_TEMPLATE}))
    home = tmp_path / "hf"
    add_model_dir(home, "tiny-org/tiny-qwen3", model)
    train = [{"question": f"Tom has {i} apples and buys {i + 2} more. How many?", "answer": f"{i} + {i + 2} = "
              f"{2 * i + 2}\n#### {2 * i + 2}"} for i in range(16)]
    test = [{"question": f"Ann has {i} pens and loses 1. How many?", "answer": f"#### {i - 1}"} for i in range(1, 5)]
    add_gsm8k_like(home, "tiny-org/gsm8k-like", {"train": train, "test": test})
    run_dir, log = tmp_path / "run", tmp_path / "rewards.jsonl"
    rewards = ("[{fn: rltpu.data.math_rewards:math_correct, weight: 1.0, kwargs: {column: answer}}, "
               "{fn: rltpu.data.math_rewards:gsm8k_format, weight: 0.1}, "
               "{fn: 'tests.hf_reward:logged_answer_reward', weight: 0.0}]")
    cmd = [sys.executable, "-m", "rltpu.cli", "train", str(ROOT / "configs" / "gsm8k.yaml"), f"run_dir={run_dir}",
           "progress=false", "model.path=tiny-org/tiny-qwen3", "task.dataset=tiny-org/gsm8k-like",
           "eval.dataset=tiny-org/gsm8k-like", f"task.rewards={rewards}", "task.reward_workers=1",
           # the tiny size: 1 sampler + 1 trainer on 4 emulated chips, short rows (the tiny BPE splits words finely)
           "cluster.topology=2x2", "placement.sampler_chips=1", "placement.trainer_chips=1", "trainer.steps=2",
           "trainer.prompts_per_step=4", "sampler.group_size=4", "sampler.max_new_tokens=16",
           "sampler.prompt_buckets=[240]", "sampler.batch_buckets=[16]", "sampler.slots=16",
           "trainer.micro_batch_tokens=0", "eval.every_steps=1", "eval.max_prompts=4",
           "--address", shared_ray_head]
    res = subprocess.run(cmd, cwd=ROOT, env=_env(HF_HOME=str(home), HF_HUB_OFFLINE="1",
                                                 RLTPU_TEST_HF_REWARD_LOG=str(log)),
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    assert "rltpu: model.path tiny-org/tiny-qwen3 -> " in res.stderr
    saved = (run_dir / "config.yaml").read_text()
    assert "models--tiny-org--tiny-qwen3/snapshots/" in saved  # resume reads the same commit, offline
    m = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in m] == [1, 2]
    assert all(r["eval/prompts"] == 4 and r["eval/k"] == 4 and r["eval/reward_failures"] == 0 for r in m)
    assert all(r["reward_errors"] == 0 and r["reward_timeouts"] == 0 for r in m)
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    by_answer = {r["answer"] for r in train} | {r["answer"] for r in test}
    assert len(calls) == 2 * 4 * 4 + 2 * (4 + 4 * 4)  # training rows + eval (greedy + 4 samples per prompt)
    for c in calls:
        assert c["answer"] in by_answer
        assert c["prompt"].startswith("<|im_start|>system\nYou are a careful math tutor.")
        assert "How many?\nLet's think step by step and output the final answer after \"####\".<|im_end|>" \
            in c["prompt"]
        assert c["prompt"].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # enable_thinking: false
    assert {c["answer"] for c in calls} & {r["answer"] for r in test}  # the test split reached the evaluator


@pytest.mark.slow
def test_gsm8k_format_arithmetic_learns_with_the_recipe_rewards(tmp_path, shared_ray_head):
    """configs/gsm8k_arith.yaml: sums in GSM8K's format, the recipe's weighted rewards (math-verify
    correctness + format bonus), a tiny random Llama: the first step's mean reward is at most 0.2 (the
    share of right answers is at most that: every weight is >= 0) and greedy accuracy on the held-out
    file reaches 0.8."""
    from rltpu.data.arithmetic import write_arithmetic_task
    from rltpu.models.hf.tiny import write_tiny_checkpoint
    from rltpu.observe.metrics import read_metrics

    made = write_arithmetic_task(tmp_path / "arith")
    # rltpu tiny-checkpoint DIR --arch llama --tokenizer arith --hidden-size 128 --init-std 0.02 (the config's header)
    model = write_tiny_checkpoint(tmp_path / "arith" / "model", "llama", tokenizer="arith", hidden_size=128,
                                  init_std=0.02)
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "rltpu.cli", "train", str(ROOT / "configs" / "gsm8k_arith.yaml"),
           f"run_dir={run_dir}", "progress=false", f"model.path={model}", f"task.dataset={made['train']}",
           f"eval.dataset={made['test']}", "--address", shared_ray_head]
    res = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=1500)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    m = read_metrics(run_dir / "metrics.jsonl")
    assert m[0]["reward_mean"] <= 0.2, m[0]["reward_mean"]
    final = [r for r in m if "eval/accuracy" in r][-1]
    assert final["step"] == m[-1]["step"] and final["eval/accuracy"] >= 0.8, final
    # each term's own mean every step; with no failed calls, weight . means is the step's mean reward
    for r in m:
        terms = r["reward_term_math_correct_mean"] + 0.1 * r["reward_term_gsm8k_format_mean"]
        assert r["reward_errors"] + r["reward_timeouts"] > 0 or abs(terms - r["reward_mean"]) <= 1e-4, r
    assert m[-1]["reward_term_math_correct_mean"] > m[0]["reward_term_math_correct_mean"] + 0.5
