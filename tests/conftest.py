"""Suite-wide fixtures.

``shared_ray_head``: one Ray head with 4 emulated TPU chips for every end-to-end module that joins
a cluster with ``--address`` (each run still starts its own actors and compiles; the cluster start
is paid once per session instead of once per module). Token auth is off for it (as in every test
env here) because the test processes join it without the token a fresh cluster would mint.
"""

from __future__ import annotations

import os
import sys

import pytest

import procs

# as the CLI and the actors do: no device backend at ``import torch`` in test processes either;
# tests of the TPU path import torch_tpu themselves
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

# one persistent JAX compile cache for every `rltpu train` the suite starts (the sampler programs of the
# quickstart grid are compiled once, not once per run); a test of the cache itself uses its own dir
if "RLTPU_COMPILE_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["RLTPU_COMPILE_CACHE_DIR"] = tempfile.mkdtemp(prefix="rltpu-suite-jax-cache-")
    atexit.register(shutil.rmtree, os.environ["RLTPU_COMPILE_CACHE_DIR"], True)

RAY_ENV = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
               RAY_USAGE_STATS_ENABLED="0")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """``--dist loadgroup`` really groups: an ``xdist_group`` test whose node id lacks its group suffix would
    run on any worker, and the session runs its group shares would be made once per worker (pytest 9.2 with
    pytest-xdist 3.8 did that silently: the quickstart and SIGTERM runs twice, ≈ 115 s of worker time). Only
    xdist workers set ``option.loadgroup``."""
    if getattr(config.option, "loadgroup", False):
        lost = [i.nodeid for i in items if i.get_closest_marker("xdist_group") and "@" not in i.nodeid]
        if lost:  # printed too: xdist shows a worker's collection error as an INTERNALERROR without its text
            msg = (f"--dist loadgroup did not group {lost[0]} (pytest {pytest.__version__} with this pytest-xdist); "
                   "install the pytest that pyproject.toml pins")
            print(f"conftest: {msg}", file=sys.stderr, flush=True)
            raise pytest.UsageError(msg)


@pytest.fixture(scope="session")
def shared_ray_head():
    with procs.ray_head("suite", RAY_ENV) as address:
        yield address


@pytest.fixture(scope="session")
def joined_quickstart_run(shared_ray_head, tmp_path_factory):
    """One `rltpu train` of the quickstart joined to the shared head (``--address``), read by the tests of
    several claims instead of one run each: tests/test_e2e_rewards.py (faulty rewards counted and bounded,
    held-out eval every 2 steps: issue 18) and tests/test_e2e.py::test_joins_existing_ray_cluster (the run
    joined the cluster instead of starting one; the KL-to-reference path, ``trainer.kl_coef=0.05``).
    Returns the run directory, the finished process, its wall time and the held-out digits."""
    import json
    import subprocess
    import sys
    import time
    from pathlib import Path
    from types import SimpleNamespace

    root = Path(__file__).resolve().parents[1]
    tmp = tmp_path_factory.mktemp("joined")
    digits = ["4821", "1234", "9075", "3366", "5150", "7002", "8888", "2468"]
    held = tmp / "held.jsonl"
    held.write_text("".join(json.dumps({"id": f"eval-{i}", "prompt": f"c{d}=", "answer": d}) + "\n"
                            for i, d in enumerate(digits)))
    run_dir, steps, timeout_s = tmp / "run", 4, 1.0
    cmd = [sys.executable, "-m", "rltpu.cli", "train", str(root / "configs" / "quickstart.yaml"), f"run_dir={run_dir}",
           "progress=false", f"trainer.steps={steps}", "trainer.target_reward=null", "sync.verify_every=0",
           "task.reward_fn=tests.reward_faults:faulty_partial_credit", f"task.reward_timeout_s={timeout_s}",
           "task.reward_max_failure_frac=0.5", f"eval.dataset={held}", "eval.every_steps=2", "eval.samples=4",
           "eval.k=2", "trainer.kl_coef=0.05", "--address", shared_ray_head]
    t0 = time.time()
    res = subprocess.run(cmd, cwd=root, env=RAY_ENV, capture_output=True, text=True, timeout=300)
    return SimpleNamespace(run_dir=run_dir, res=res, wall=time.time() - t0, steps=steps, timeout_s=timeout_s,
                           digits=digits)


@pytest.fixture(scope="session")
def quickstart_run(tmp_path_factory):
    """`rltpu train configs/quickstart.yaml` as a user runs it (embedded Ray), with a probe every 4 steps,
    stopped once its learning claim is shown (last-5 mean reward >= 0.8). Read by
    tests/test_e2e.py::test_quickstart_learns_with_chip_owning_actors (its claims) and by
    tests/test_fault_tolerance.py::test_sigterm_resume_matches_uninterrupted_run (the uninterrupted run
    its first steps are compared with). Returns the run directory, the finished process and its wall time."""
    import subprocess
    import sys
    import time
    from pathlib import Path
    from types import SimpleNamespace

    root = Path(__file__).resolve().parents[1]
    run_dir = tmp_path_factory.mktemp("quickstart") / "run"
    cmd = [sys.executable, "-m", "rltpu.cli", "train", str(root / "configs" / "quickstart.yaml"), f"run_dir={run_dir}",
           "progress=false", "sync.verify_every=4", "trainer.target_reward=0.8"]
    t0 = time.time()
    # a hang guard only: the learning test bounds the wall time itself (< 300 s)
    res = subprocess.run(cmd, cwd=root, env=RAY_ENV, capture_output=True, text=True, timeout=900)
    return SimpleNamespace(run_dir=run_dir, res=res, wall=time.time() - t0, verify_every=4)


@pytest.fixture(scope="session")
def sigterm_resumed_run(tmp_path_factory):
    """One SIGTERM + ``--resume`` of the quickstart, read by two tests instead of a pair of runs each:
    tests/test_interrupts.py (issue 19: SIGTERM to the driver with the progress bar drawn on a real
    pseudo-terminal after an update: exit 143, one stop line, a checkpoint that verifies, a clean resume) and
    tests/test_fault_tolerance.py::test_sigterm_resume_matches_uninterrupted_run (the resumed run's ledger
    and rewards equal an uninterrupted run's). ``benchmarks/interrupt_fuzz.py``'s launch: 10 steps,
    probe and checkpoint every 2 steps; the signal lands once at least 4 steps are logged. What the tests
    check after the stop (health, checkpoint, metrics) is read before the resume overwrites it."""
    import importlib.util
    import signal
    import time
    from pathlib import Path
    from types import SimpleNamespace

    from learner.checkpoint import latest_valid, verify_checkpoint
    from rltpu.observe.health import read_health
    from rltpu.observe.metrics import read_metrics

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("interrupt_fuzz", root / "benchmarks" / "interrupt_fuzz.py")
    fuzz = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fuzz)
    steps, at = 10, 4
    run_dir = tmp_path_factory.mktemp("sigterm") / "run"
    metrics = run_dir / "metrics.jsonl"
    proc, output = fuzz.launch(run_dir, steps, progress=True)
    try:
        deadline = time.time() + 600
        while time.time() < deadline and proc.poll() is None and (not metrics.exists() or len(read_metrics(metrics)) < at):
            time.sleep(0.1)
        logged_at_signal = len(read_metrics(metrics)) if metrics.exists() else 0
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)  # the driver only, as a scheduler or `kill` would
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    stopped = SimpleNamespace(returncode=proc.returncode, text=output(), logged_at_signal=logged_at_signal)
    if stopped.returncode == 143:
        stopped.health_state = read_health(run_dir)["state"]
        stopped.meta = verify_checkpoint(latest_valid(run_dir / "checkpoint"))
        stopped.metrics_steps = [r["step"] for r in read_metrics(metrics)]
        resume, out2 = fuzz.launch(run_dir, steps, progress=False, resume=True)
        resumed = SimpleNamespace(returncode=resume.wait(timeout=1200), text=out2())
    else:
        resumed = None
    return SimpleNamespace(run_dir=run_dir, steps=steps, at=at, stopped=stopped, resumed=resumed)
