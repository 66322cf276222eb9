"""Issue 19's headline bug, end to end: SIGTERM with the progress bar on (a real pseudo-terminal, so
tqdm draws) after a step's update used to format ``None`` sync figures -> traceback, exit 1, no
checkpoint. Now: exit 143, one stop line, a checkpoint that verifies, a ``--resume`` whose ledger
has no prompt lost or replayed. Also a Ctrl-C (SIGINT to the process group) during start-up.
Slow (a few minutes on 2 cores); the randomised version is ``benchmarks/interrupt_fuzz.py``.
"""

import importlib.util
import os
import re
import signal
import time
from pathlib import Path

import pytest
from procs import MECHANICS, MECHANICS_PROMPTS

from rltpu.observe.ledger import check, read_ledger

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("interrupt_fuzz", ROOT / "benchmarks" / "interrupt_fuzz.py")
fuzz = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fuzz)
pytestmark = pytest.mark.slow


def _stop_lines(text: str) -> list[str]:
    return [ln.strip() for ln in re.split(r"[\r\n]", text) if "rltpu: stopped by" in ln]


@pytest.mark.xdist_group("quickstart")  # one worker runs the session runs these tests share (--dist loadgroup)
def test_sigterm_with_progress_bar_after_an_update_checkpoints_and_resumes(sigterm_resumed_run):
    # the run (tests/conftest.py, shared with test_fault_tolerance.py's resume-equals-uninterrupted check):
    # fuzz.launch with progress=True on a pseudo-terminal, SIGTERM to the driver once >= 4 steps are logged
    run = sigterm_resumed_run
    stopped, text = run.stopped, run.stopped.text
    assert stopped.returncode == 143, text[-3000:]
    assert stopped.logged_at_signal >= 2  # after an update
    assert "Traceback" not in text and "\r" in text  # the bar was really drawn (a terminal)
    assert len(_stop_lines(text)) == 1, text[-3000:]
    meta = stopped.meta  # verify_checkpoint(latest_valid(run_dir / "checkpoint")), read before the resume
    assert meta["step"] >= 2
    assert stopped.metrics_steps[-1] == meta["step"]  # metrics and checkpoint agree
    assert run.resumed.returncode == 0, run.resumed.text[-3000:]
    assert check(read_ledger(run.run_dir / "ledger.jsonl"), run.steps, 64) == []


def test_ctrl_c_during_start_up_is_one_line_and_the_run_can_resume(tmp_path):
    run_dir = tmp_path / "run"
    proc, output = fuzz.launch(run_dir, 2, progress=False, extra=MECHANICS)
    deadline = time.time() + 300
    while time.time() < deadline and not (run_dir / "config.yaml").exists():  # inside start(): Ray starting
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGINT)
    proc.wait(timeout=300)
    text = output()
    assert proc.returncode == 130, text[-3000:]
    assert "Traceback" not in text and len(_stop_lines(text)) == 1, text[-3000:]
    resume, out2 = fuzz.launch(run_dir, 2, progress=False, resume=True, extra=MECHANICS)
    assert resume.wait(timeout=1200) == 0, out2()[-3000:]
    assert check(read_ledger(run_dir / "ledger.jsonl"), 2, MECHANICS_PROMPTS) == []


# the CLI with one change: the ledger commit of step AT (inside the train dispatch's deferred section, where a
# signal is held and raised as the section ends) sends the driver SIGTERM; runs on the suite's Ray head
_SIGTERM_IN_DISPATCH = """
import os, signal, sys
from rltpu.control import rollouts
AT, orig = int(sys.argv[1]), rollouts.PromptDraws.commit
def commit(self, step, version, behaviour_version=None):
    orig(self, step, version, behaviour_version)
    if step == AT:
        os.kill(os.getpid(), signal.SIGTERM)
rollouts.PromptDraws.commit = commit
from rltpu.cli import main
sys.exit(main(sys.argv[2:]))
"""


def test_a_signal_during_the_train_dispatch_counts_the_dispatched_update(shared_ray_head, tmp_path):
    """The batch reached the trainers, so the update lands: the checkpoint is step 2 with weight version 2
    and step 2 has its metrics line (a signal raised as the dispatch section ended used to skip both:
    checkpoint step 2 with version 1, no line for step 2, every later version one short)."""
    import json
    import subprocess
    import sys

    from rltpu.observe.metrics import read_metrics

    run_dir = tmp_path / "run"
    args = ["train", str(ROOT / "configs" / "quickstart.yaml"), f"run_dir={run_dir}", "progress=false",
            "trainer.steps=3", "trainer.target_reward=null", "sync.verify_every=0", *MECHANICS, "--address", shared_ray_head]
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    res = subprocess.run([sys.executable, "-c", _SIGTERM_IN_DISPATCH, "2", *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 143 and _stop_lines(res.stderr) == [
        f"rltpu: stopped by SIGTERM at step 2 (in train); checkpoint in {run_dir / 'checkpoint'} (continue with --resume)"
    ], res.stderr[-3000:]
    state = json.loads((run_dir / "checkpoint" / "trainer_state.json").read_text())
    assert (state["step"], state["weight_version"]) == (2, 2)
    assert [(r["step"], r["weight_version"]) for r in read_metrics(run_dir / "metrics.jsonl")] == [(1, 1), (2, 2)]
    res = subprocess.run([sys.executable, "-m", "rltpu.cli", *args, "--resume"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert [(r["step"], r["weight_version"]) for r in read_metrics(run_dir / "metrics.jsonl")] == [(1, 1), (2, 2), (3, 3)]
    assert check(read_ledger(run_dir / "ledger.jsonl"), 3, MECHANICS_PROMPTS) == []
