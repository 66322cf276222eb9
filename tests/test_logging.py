"""rltpu's stderr lines go through ``logging``: the same text at the default level, ``-q`` keeps only
warnings and errors, ``-v`` adds debug lines; the flags work before or after the command."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = {k: v for k, v in os.environ.items() if k != "RLTPU_LOG_LEVEL"}


def _plan(tmp_path, before=(), after=()):
    res = subprocess.run([sys.executable, "-m", "rltpu.cli", *before, "plan", "configs/quickstart.yaml",
                          "--out", str(tmp_path), *after], cwd=ROOT, env=ENV, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    return res.stderr.splitlines()


def test_levels(tmp_path):
    wrote = f"rltpu: wrote {tmp_path}/plan.md, plan.html, plan.json, ranks.csv"
    assert _plan(tmp_path) == [wrote]  # the default: the line as it always was, nothing else
    assert _plan(tmp_path, before=["-q"]) == [] and _plan(tmp_path, after=["--quiet"]) == []
    verbose = _plan(tmp_path, after=["-v"])
    assert verbose[-1] == wrote and verbose[0] == "rltpu: plan: configs/quickstart.yaml on auto figures"
    res = subprocess.run([sys.executable, "-m", "rltpu.cli", "-q", "train", "configs/quickstart.yaml",
                          "trainer.lrr=1"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and res.stderr == ("rltpu: error: unknown config key 'trainer.lrr'; did you mean "
                                                  "'trainer.lr'? (docs/config.md lists every key)\n")
