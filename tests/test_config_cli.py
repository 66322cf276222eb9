"""Bad input: one line on stderr, exit code 2, no traceback, nothing started."""

import subprocess
import sys
from pathlib import Path

import pytest

from rltpu.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"


def run_cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "rltpu.cli", "train", *map(str, args)],
                          cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("overrides, fragment", [
    (["placement.sampler_chips=4", "placement.trainer_chips=2"], "6 chips"),  # more chips than exist
    (["trainer.lrr=1e-3"], "unknown config key 'trainer.lrr'"),
    (["trainer.lr=fast"], "'trainer.lr' has bad value 'fast'"),
    (["trainer.steps=0"], "'trainer.steps' has bad value 0"),
    (["cluster.generation=v9"], "'cluster.generation' has bad value 'v9'"),
    (["cluster.topology=2x2x2"], "3 dims but v5e slices are 2D"),
    (["sampler.batch_buckets=[64,8]"], "strictly increasing"),
    (["placement.sampler_chip_ids=[0,1]", "placement.trainer_chip_ids=[1,2]"], "chip 1"),  # overlapping chips
    (["task.reward_fn=nosuchmodule:fn"], "cannot import module 'nosuchmodule'"),
    # read by the controller before Ray starts (eval.k > eval.samples, task.reward_timeout_s <= 0: schema
    # errors, tests/test_rewards.py)
    (["eval.dataset=missing/held.jsonl"], "eval.dataset 'missing/held.jsonl' does not exist"),
    (["trainer"], "not key=value"),
    # k chips per process where the runtime would leave k - 1 idle: refused (issue 16)
    (["placement.mode=colocated", "placement.chips_per_sampler=2", "placement.chips_per_trainer=2",
      "sampler.batch_buckets=[1024]"], "tensor parallelism inside colocated processes is not implemented"),
    (["placement.chips_per_trainer=2", "model.num_key_value_heads=1"],
     "placement.chips_per_trainer=2: model.num_key_value_heads=1 is not divisible by 2"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, overrides, fragment):
    run_dir = tmp_path / "run"
    res = run_cli(QUICKSTART, *overrides, f"run_dir={run_dir}", cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("rltpu: error:"), res.stderr
    assert fragment in lines[0]
    assert "Traceback" not in res.stderr
    assert not run_dir.exists()  # nothing started: not even the run directory


def test_missing_config_file(tmp_path):
    res = run_cli(tmp_path / "nope.yaml", cwd=tmp_path)
    assert res.returncode == 2 and "does not exist" in res.stderr


def test_overrides_parse_types():
    cfg = load_config(QUICKSTART, ["trainer.lr=3e-6", "sampler.prompt_buckets=[8,16]", "progress=false"])
    assert cfg.trainer.lr == 3e-6 and cfg.sampler.prompt_buckets == (8, 16) and cfg.progress is False
    with pytest.raises(ConfigError, match="divisible"):
        load_config(QUICKSTART, ["trainer.prompts_per_step=3"])
