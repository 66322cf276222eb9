"""Multi-turn environments through the CLI (issue 18, points 1-2): the guess-the-number example.

* async (``placement.staleness=1``) with held-out evaluation episodes: every step trains on
  multi-turn rows that lag at most one weight version, the ledger holds every prompt once, eval
  prompts never reach it, evaluation runs greedy and sampled episodes;
* the environment's turn removed (``env.max_turns=1``): the reward stays at the 1 in 10 a single
  guess can get. That the examples learn from random init with the turn (first-5 <= 0.2, last-5 >=
  0.8) is a measured figure, not a test: ``benchmarks/envs.py`` (results in benchmarks/results/).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rltpu.observe.ledger import check, read_ledger
from rltpu.observe.metrics import read_metrics

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0")
# neither claim is learning: a quarter of the example's batch (16 prompts x 16 samples, 128 rows per sampler)
PROMPTS = 16
SMALL = (f"trainer.prompts_per_step={PROMPTS}", "sampler.batch_buckets=[128]")


def _train(run_dir: Path, address: str, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rltpu.cli", "train", str(ROOT / "configs/env_guess.yaml"),
                           f"run_dir={run_dir}", "progress=false", *SMALL, *overrides, "--address", address],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=1800)


def _mean(rs, key="reward_mean"):
    return sum(r[key] for r in rs) / len(rs)


def test_async_multi_turn_steps_with_eval_keep_the_ledger_and_the_staleness_bound(tmp_path, shared_ray_head):
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({"prompt": "?", "secret": s}) + "\n" for s in range(10)))
    run = tmp_path / "run"
    steps = 6
    res = _train(run, shared_ray_head, "placement.staleness=1", "trainer.off_policy_correction=tis", f"trainer.steps={steps}",
                 "trainer.target_reward=null", f"eval.dataset={held}", "eval.every_steps=3", "eval.samples=4",
                 "eval.k=2", "loggers.samples=2")
    assert res.returncode == 0, res.stderr[-3000:]
    m = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in m] == list(range(1, steps + 1))
    assert all(r["staleness"] <= 1 for r in m) and any(r["staleness"] == 1 for r in m)
    # a sync can land between two turns of one episode: some rows then hold two weight versions
    assert all(0 <= r["env_mixed_version_frac"] <= 1 for r in m)
    assert _mean(m[:5]) <= 0.2  # random init: a single digit then the stop token is rare
    # episodes run several turns (an invalid guess gets '!' and another turn), observations are masked
    assert all(r["env_turns_mean"] > 1.5 and r["policy_tokens_mean"] < r["response_len"] for r in m)
    assert all(r["reward_calls"] == PROMPTS * 16 and r["reward_errors"] == r["reward_timeouts"] == 0 for r in m)
    assert check(read_ledger(run / "ledger.jsonl"), steps, PROMPTS) == []
    # loggers.samples: two rows a step as text, the environment's tokens marked
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert [x["step"] for x in samples] == [s for s in range(1, steps + 1) for _ in range(2)]
    assert all(x["prompt"].endswith("?") and len(x["policy_mask"]) == x["response_tokens"] for x in samples)
    assert any("e" in x["policy_mask"] for x in samples) and all(x["policy_mask"].startswith("p") for x in samples)
    evals = [r for r in m if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [3, 6]
    for r in evals:
        assert r["eval/prompts"] == 10 and 0 <= r["eval/mean@k"] <= r["eval/pass@k"] <= 1
        assert 0 <= r["eval/accuracy"] <= 1 and r["eval/reward_failures"] == 0


def test_without_the_environments_turn_the_reward_stays_low(tmp_path, shared_ray_head):
    res = _train(tmp_path / "run", shared_ray_head, "env.max_turns=1", "trainer.steps=20", "trainer.target_reward=null",
                 "placement.sampler_chips=1", "placement.trainer_chips=1", "sampler.batch_buckets=[256]")
    assert res.returncode == 0, res.stderr[-3000:]
    m = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert len(m) == 20 and all(r["env_turns_mean"] == 1.0 for r in m)
    assert _mean(m[-5:]) <= 0.15  # one guess finds a uniform secret digit 1 time in 10
