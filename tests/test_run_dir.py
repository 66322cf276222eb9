"""One run per run directory (issue 34): a fresh run where a run already is (ledger or checkpoint) is
refused in one line unless ``--resume`` or ``--new-run``; ``--new-run`` moves the old run aside; two
processes never hold one directory. In-process, plus one CLI check that stops before Ray."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rltpu.config import ConfigError
from rltpu.control import rundir

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _release():
    yield
    rundir.release()


def _used(tmp_path: Path, what: str) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("name: x\n")
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    if what == "ledger":
        (run / "ledger.jsonl").write_text(json.dumps({"step": 1, "prompts": ["0:0:a"]}) + "\n")
    else:
        (run / what).mkdir()
        (run / what / "trainer_state.json").write_text("{}")
    (run / "jax_cache").mkdir()
    return run


@pytest.mark.parametrize("what", ["ledger", "checkpoint", "checkpoint.prev"])
def test_a_fresh_run_in_a_used_dir_is_refused(tmp_path, what):
    run = _used(tmp_path, what)
    with pytest.raises(ConfigError) as err:
        rundir.check_fresh(run, resume=False, new_run=False)
    msg = str(err.value)
    assert "\n" not in msg and str(run) in msg and "--resume" in msg and "--new-run" in msg
    rundir.check_fresh(run, resume=True, new_run=False)  # continuing it is what --resume is for
    with pytest.raises(ConfigError, match="contradict"):
        rundir.check_fresh(run, resume=True, new_run=True)
    # a directory only started (config.yaml, stopped before any step) or never made: a fresh run is fine
    started = tmp_path / "started"
    started.mkdir()
    (started / "config.yaml").write_text("name: x\n")
    (started / "ledger.jsonl").write_text("")
    rundir.check_fresh(started, resume=False, new_run=False)
    rundir.check_fresh(tmp_path / "never", resume=False, new_run=False)


def test_new_run_moves_the_old_run_aside(tmp_path):
    run = _used(tmp_path, "checkpoint")
    moved = rundir.claim(run, resume=False, new_run=True)
    assert moved is not None and moved.parent == run and moved.name.startswith("previous-")
    assert sorted(p.name for p in moved.iterdir()) == ["checkpoint", "config.yaml", "metrics.jsonl"]
    assert sorted(p.name for p in run.iterdir()) == sorted(["jax_cache", "rltpu.lock", moved.name])
    assert rundir.used_by(run) is None  # the archive does not make the directory "used"
    rundir.release()
    rundir.claim(run, resume=False, new_run=False)  # and a plain run may now start there


def test_two_runs_in_one_dir_are_refused(tmp_path):
    run = tmp_path / "run"
    rundir.claim(run, resume=False, new_run=False)
    assert (run / "rltpu.lock").read_text().strip() == str(__import__("os").getpid())
    with pytest.raises(ConfigError) as err:  # a second claim (its own open file) conflicts like another process
        rundir.claim(run, resume=True, new_run=False)
    assert "\n" not in str(err.value) and "in use by another rltpu train" in str(err.value)
    rundir.release()
    # a process that holds it and is then killed leaves no stale lock
    holder = subprocess.Popen([sys.executable, "-c", f"from rltpu.control import rundir; import time; "
                               f"rundir.claim({str(run)!r}, True, False); print('held', flush=True); time.sleep(60)"],
                              cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match=f"pid {holder.pid}"):
            rundir.claim(run, resume=True, new_run=False)
    finally:
        holder.kill()
        holder.wait(10)
    rundir.claim(run, resume=True, new_run=False)


def test_cli_refuses_a_fresh_run_in_a_used_dir_before_anything_starts(tmp_path):
    run = _used(tmp_path, "ledger")
    before = sorted(p.name for p in run.iterdir())
    t0 = time.time()
    res = subprocess.run([sys.executable, "-m", "rltpu.cli", "train", str(ROOT / "configs" / "quickstart.yaml"),
                          f"run_dir={run}", "progress=false"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2 and len(lines) == 1 and "already holds a run" in lines[0], res.stderr[-2000:]
    assert "Traceback" not in res.stderr and sorted(p.name for p in run.iterdir()) == before  # nothing touched
    assert time.time() - t0 < 60  # refused before Ray (a started cluster alone takes longer on this machine)


def test_resume_finds_an_older_checkpoint_when_newer_ones_were_set_aside(tmp_path, capsys):
    """After ``latest_valid(set_aside=True)`` moved a corrupt checkpoint/ and checkpoint.prev/ aside,
    the valid checkpoint.prev2/ is still something to resume from (not "nothing trained")."""
    from rltpu.cli import resume_from
    from rltpu.observe.ledger import Ledger

    run = tmp_path / "run"
    (run / "checkpoint.prev2").mkdir(parents=True)
    (run / "checkpoint.prev2" / "trainer_state.json").write_text("{}")
    Ledger(run / "ledger.jsonl").commit(1, ["0:0:a"], 0)
    assert resume_from(run) is True
