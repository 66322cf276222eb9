"""Every algorithm preset learns the quickstart task through the real CLI (shortened runs).

The suite's Ray head (``ray start --head --block``, emulated TPU resources; tests/conftest.py) is shared
by all presets, so each run pays for its actors but not for a cluster start. Full-length figures per
preset: ``benchmarks/algorithms.py``. GRPO itself is covered by ``test_e2e.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from procs import SMALL_BATCH

from rltpu.observe.ledger import read_ledger
from rltpu.observe.metrics import read_metrics

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from algorithms import PRESETS  # noqa: E402  (the presets the benchmark documents)

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0")
pytestmark = pytest.mark.slow
STEPS = 30
TARGET = 0.3
# half the quickstart's prompts a step at 3x its lr (a preset's own lr, RLOO's, still wins): the quickstart
# reaches the 0.3 target in 20 steps of 512 rows instead of 30 of 1,024 (5.7 s of steps instead of 20.3,
# measured by hand on GRPO, seed 0, 2 samplers + 2 trainers); the learning claim is the same. One sampler
# and one trainer chip: an algorithm's loss does not depend on the FSDP degree (two trainer ranks:
# tests/test_e2e.py, test_e2e_modes.py)
PROMPTS = 32
FAST = [f"trainer.prompts_per_step={PROMPTS}", "trainer.lr=3e-3", "placement.sampler_chips=1",
        "placement.trainer_chips=1"]


@pytest.fixture()
def ray_head(shared_ray_head):
    return shared_ray_head


@pytest.mark.parametrize("preset", [p for p in PRESETS if p != "grpo"])
def test_preset_learns(preset, ray_head, tmp_path):
    run_dir = tmp_path / "run"
    # stop once the claim is shown (last-5 mean >= 0.3 > first 5 + 0.1; first 5 is ~0.08), except where
    # the checks below need the whole run (DAPO's refill rounds, PPO's critic following the returns)
    whole = preset in ("dapo", "ppo")
    stop = ["trainer.target_reward=null"] if whole else [f"trainer.target_reward={TARGET}"]
    cmd = [sys.executable, "-m", "rltpu.cli", "train", str(ROOT / "configs" / "quickstart.yaml"), f"run_dir={run_dir}",
           "progress=false", f"trainer.steps={STEPS}", *FAST, *PRESETS[preset], *stop, "--address", ray_head]
    res = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    m = read_metrics(run_dir / "metrics.jsonl")
    assert len(m) == STEPS or (not whole and 5 < len(m) < STEPS and f"target_reward={TARGET} reached" in res.stderr)
    first5 = sum(r["reward_mean"] for r in m[:5]) / 5
    last5 = sum(r["reward_mean"] for r in m[-5:]) / 5
    assert last5 > first5 + 0.1, (preset, first5, last5)
    if preset == "dapo":  # dynamic sampling: uniform groups are dropped and refilled from more rounds
        for r in m:  # each round draws a fresh 32 prompts; the trained batch is 32 groups, informative first
            assert 1 <= r["ds_rounds"] <= 4 and r["ds_prompts_sampled"] == PROMPTS * r["ds_rounds"], r
            assert r["ds_informative_groups"] + r["ds_filler_groups"] == PROMPTS, r
            # it stops as soon as 32 groups with differing rewards are in hand; filler only after the last round
            assert r["ds_filler_groups"] == 0 or r["ds_rounds"] == 4, r
        assert any(r["ds_rounds"] > 1 for r in m), "no step needed a second round: the filter dropped nothing"
        # the refill rounds drew fresh prompts: the ledger holds every prompt a step sampled, none twice
        ledger = [ln for ln in read_ledger(run_dir / "ledger.jsonl") if "step" in ln]
        assert [len(ln["prompts"]) for ln in ledger] == [r["ds_prompts_sampled"] for r in m]
        drawn = [p for ln in ledger for p in ln["prompts"]]
        assert len(set(drawn)) == len(drawn) == sum(r["ds_prompts_sampled"] for r in m)
    if preset == "ppo":  # the critic starts at 0 (zero head) and follows the rising returns
        assert m[0]["value_mean"] == 0 and m[-1]["value_mean"] > 0.05, (m[0]["value_mean"], m[-1]["value_mean"])
    if preset == "grpo_kl_in_reward":
        assert m[0]["kl_in_reward"] == pytest.approx(0, abs=1e-5) and m[-1]["kl_in_reward"] != 0


def test_rlhf_with_reward_model_group(ray_head, tmp_path):
    """A reward-model group on its own chip: 2 samplers + 1 trainer + 1 reward actor on 4 chips."""
    import json

    from test_reward_model import write_reward_model

    write_reward_model(tmp_path / "rm")
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "rltpu.cli", "train", str(ROOT / "configs" / "quickstart.yaml"), f"run_dir={run_dir}",
           "progress=false", "trainer.steps=3", "placement.trainer_chips=1", "placement.reward_chips=1",
           f"reward_model.path={tmp_path / 'rm'}", "reward_model.weight=0.5", *SMALL_BATCH, "--address", ray_head]
    res = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    actors = json.loads((run_dir / "placement.json").read_text())["actors"]
    assert sorted(a["group"] for a in actors) == ["reward", "sampler", "sampler", "trainer"]
    chips = [c for a in actors for c in a["chip_ids"]]
    assert sorted(chips) == [0, 1, 2, 3]  # every role on its own chip, none shared
    m = read_metrics(run_dir / "metrics.jsonl")
    assert len(m) == 3
    for r in m:  # the step's reward is rule + 0.5 x model score, per row, so also in the mean
        assert r["reward_model_mean"] is not None
        assert r["reward_mean"] == pytest.approx(r["reward_rule_mean"] + 0.5 * r["reward_model_mean"], abs=1e-4)
