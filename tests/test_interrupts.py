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

from learner.checkpoint import latest_valid, verify_checkpoint
from rltpu.observe.ledger import check, read_ledger
from rltpu.observe.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("interrupt_fuzz", ROOT / "benchmarks" / "interrupt_fuzz.py")
fuzz = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fuzz)
pytestmark = pytest.mark.slow
STEPS = 4


def _stop_lines(text: str) -> list[str]:
    return [ln.strip() for ln in re.split(r"[\r\n]", text) if "rltpu: stopped by" in ln]


def test_sigterm_with_progress_bar_after_an_update_checkpoints_and_resumes(tmp_path):
    run_dir = tmp_path / "run"
    proc, output = fuzz.launch(run_dir, STEPS, progress=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None and len(read_metrics(metrics)) < 2:
        time.sleep(0.1)
    os.kill(proc.pid, signal.SIGTERM)
    proc.wait(timeout=600)
    text = output()
    assert proc.returncode == 143, text[-3000:]
    assert "Traceback" not in text and "\r" in text  # the bar was really drawn (a terminal)
    assert len(_stop_lines(text)) == 1, text[-3000:]
    meta = verify_checkpoint(latest_valid(run_dir / "checkpoint"))
    assert meta["step"] >= 2
    assert [r["step"] for r in read_metrics(metrics)][-1] == meta["step"]  # metrics and checkpoint agree
    resume, out2 = fuzz.launch(run_dir, STEPS, progress=False, resume=True)
    assert resume.wait(timeout=1200) == 0, out2()[-3000:]
    assert check(read_ledger(run_dir / "ledger.jsonl"), STEPS, 64) == []


def test_ctrl_c_during_start_up_is_one_line_and_the_run_can_resume(tmp_path):
    run_dir = tmp_path / "run"
    proc, output = fuzz.launch(run_dir, 2, progress=False)
    deadline = time.time() + 300
    while time.time() < deadline and not (run_dir / "config.yaml").exists():  # inside start(): Ray starting
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGINT)
    proc.wait(timeout=300)
    text = output()
    assert proc.returncode == 130, text[-3000:]
    assert "Traceback" not in text and len(_stop_lines(text)) == 1, text[-3000:]
    resume, out2 = fuzz.launch(run_dir, 2, progress=False, resume=True)
    assert resume.wait(timeout=1200) == 0, out2()[-3000:]
    assert check(read_ledger(run_dir / "ledger.jsonl"), 2, 64) == []
