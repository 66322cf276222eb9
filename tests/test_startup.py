"""Time to the first step by phase (issue 35): the launch clock and the report's sums, by hand.

The real run's report (trace.json spans and the done line) is checked on the quickstart in
tests/test_e2e.py::test_first_step_reported_by_phase.
"""

import subprocess
import sys
from pathlib import Path

import pytest

from rltpu.observe.startup import STARTUP, actor_waits, first_step_report, report_line

ROOT = Path(__file__).resolve().parents[1]


def test_launch_time_is_the_process_start_not_the_import():
    """A child that sleeps 1.5 s before importing the module: its launch lies at least that far back."""
    code = ("import time; time.sleep(1.5); from rltpu.observe.startup import launch_time; "
            "print(time.time() - launch_time())")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert 1.5 <= float(res.stdout) < 60, res.stdout


def test_first_step_report_adds_up_the_spans():
    def span(phase, start, end, step=0, actor="controller"):
        return {"actor": actor, "phase": phase, "start": start, "end": end, "step": step}

    launch = 100.0
    ctl = [span(p, 100.0 + 2 * i, 102.0 + 2 * i) for i, p in enumerate(STARTUP)]  # 2 s each: 100..114
    ctl += [span("sample", 114.0, 114.5, 1), span("train", 114.5, 115.25, 1), span("sync", 115.25, 115.5, 1),
            span("sample", 115.5, 116.0, 2)]  # step 2 is not the first step's
    actors = [span("compiling", 110.2, 111.9, actor="sampler-0"), span("compiling", 110.1, 111.4, actor="sampler-1"),
              span("loading", 110.5, 111.0, actor="trainer-0"), span("compiling", 120.0, 125.0, actor="sampler-0")]
    rep = first_step_report(ctl, actors, launch, 115.5, 1)
    assert rep["first_step_s"] == pytest.approx(15.5)
    assert rep["startup_s"] == {p: pytest.approx(2.0) for p in STARTUP}
    assert rep["step_s"] == {"sample": pytest.approx(0.5), "train": pytest.approx(0.75), "sync": pytest.approx(0.25)}
    # the slowest sampler's compile and the trainer's load; the later recompile is not start-up's
    assert rep["actors_s"] == {"compiling": pytest.approx(1.7), "loading": pytest.approx(0.5)}
    line = report_line(rep)
    assert line.startswith("first step 15.5 s after launch (imports 2.0, prepare 2.0, ray_start 2.0,")
    assert "build 2.0 [compile 1.7, load 0.5]" in line and line.endswith("step 1: sample 0.5, train 0.8, sync 0.2)")
    assert actor_waits([], 1.0) == {"compiling": None, "loading": None}


def _ray_children() -> list[str]:
    """Names of this process's live child processes (Ray's GCS and raylet are children of the driver)."""
    import os

    names = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        name, rest = text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 2:].split()
        if int(rest[1]) == os.getpid() and rest[0] != "Z":
            names.append(name)
    return names


def test_ray_starts_while_the_driver_prepares_and_a_failed_check_stops_it(tmp_path, monkeypatch):
    """Ray starts in a thread once the chip plan holds (``ClusterStart``), beside the tokenizer and
    data loads; a check in that slow part failing (a vocabulary smaller than the tokenizer's) waits
    for the start, stops it, and leaves no Ray process and no /tmp/rltpu-ray-* directory."""
    import glob
    import threading

    import ray

    import rltpu.chips.cluster as cluster
    from rltpu.config import ConfigError
    from rltpu.control.controller import Controller
    from tests.test_controller_fakes import make_cfg

    started = []
    real = cluster.start_or_join

    def recording(*args):
        started.append(threading.current_thread().name)
        return real(*args)

    monkeypatch.setattr(cluster, "start_or_join", recording)
    before = set(glob.glob("/tmp/rltpu-ray-*"))
    cfg = make_cfg(tmp_path, model__vocab_size=4)
    with pytest.raises(ConfigError, match="model.vocab_size=4 is smaller than the tokenizer"):
        Controller(cfg)
    assert started == ["rltpu-ray-start"]  # it did start, off the main thread
    assert not ray.is_initialized()
    assert not [n for n in _ray_children() if "gcs" in n or "raylet" in n]
    assert set(glob.glob("/tmp/rltpu-ray-*")) - before == set()
    assert not [t for t in threading.enumerate() if t.name == "rltpu-ray-start"]  # released, not parked


def test_the_driver_never_autoloads_torch_tpu_even_when_its_parent_did():
    """torch writes TORCH_DEVICE_BACKEND_AUTOLOAD=1 into the environment of a process that autoloaded
    its device backends; a driver started from such a launcher must still not import torch_tpu (it
    owns no chip, and the import alone cost 3-4 s of its start-up)."""
    import os

    code = "import sys, rltpu.cli, torch; print('torch_tpu' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="1"))
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "False"


def test_a_stop_before_ray_is_taken_over_stops_the_background_start(tmp_path):
    """Ctrl-C while ``start`` waits for Ray's background start (phase ``ray_start``) ends in
    ``Controller.shutdown`` with ``self.ray`` unset: the start is waited for and stopped, its
    /tmp/rltpu-ray-* removed (it was left behind, the processes dying with the driver)."""
    import glob
    import threading

    import ray

    from rltpu.control.controller import Controller
    from tests.test_controller_fakes import make_cfg

    before = set(glob.glob("/tmp/rltpu-ray-*"))
    ctl = Controller(make_cfg(tmp_path))
    assert ctl.ray is None and [t for t in threading.enumerate() if t.name == "rltpu-ray-start"]
    assert "(ray_start)" not in ctl.stop_on_interrupt()  # not started: "before Ray" until start() waits on it
    ctl.shutdown("stopped")
    assert not ray.is_initialized()
    assert not [n for n in _ray_children() if "gcs" in n or "raylet" in n]
    assert set(glob.glob("/tmp/rltpu-ray-*")) - before == set()
    assert not [t for t in threading.enumerate() if t.name == "rltpu-ray-start"]
