"""Interrupt corners (issue 34): metrics lines are fsynced like ledger commits; the watchdog thread
and the main thread never share a temp name for health.json; no wait on the step or checkpoint path
is unbounded (a hang with ``health.enabled=false`` ends in one line); the run's own Ray temp
directory is removed at exit. In-process, plus one check on the suite's SIGTERM + resume run."""

from __future__ import annotations

import ast
import json
import os
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_metrics_lines_are_fsynced(tmp_path, monkeypatch):
    from rltpu.observe import metrics

    synced = []
    real = os.fsync
    monkeypatch.setattr(metrics.os, "fsync", lambda fd: (synced.append(fd), real(fd))[1])
    w = metrics.MetricsWriter(tmp_path / "metrics.jsonl", 2, progress=False)
    w.write({"step": 1, "reward_mean": 0.5})
    assert synced and synced[-1] == w._fh.fileno()
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["step"] == 1  # on disk, not in a buffer
    w.close()


def test_health_json_writers_in_two_threads_use_distinct_temp_names(tmp_path, monkeypatch):
    from rltpu.observe import health

    used: dict[int, set[str]] = {}
    real = os.replace
    lock = threading.Lock()

    def replace(src, dst):
        with lock:
            used.setdefault(threading.get_ident(), set()).add(str(src))
        return real(src, dst)

    monkeypatch.setattr(health.os, "replace", replace)
    go = threading.Barrier(2)

    def writer(n):
        go.wait()
        for i in range(20):
            health.write_health(tmp_path / "health.json", {"writer": n, "i": i, "pad": "x" * 10_000})
            health.write_trace(tmp_path / "trace.json", [{"writer": n}])

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    a, b = used.values()
    assert not a & b, f"both threads wrote through {a & b}"
    assert json.loads((tmp_path / "health.json").read_text())["i"] == 19
    assert not list(tmp_path.glob("*.tmp"))


def _unbounded_waits(path: Path) -> list[str]:
    """``ray.get`` / ``ray.wait`` calls (on ``ray`` or ``self.ray``) without a ``timeout``."""
    bad = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("get", "wait"):
            owner = ast.unparse(node.func.value)
            if owner in ("ray", "self.ray") and not any(k.arg == "timeout" for k in node.keywords):
                bad.append(f"{path.name}:{node.lineno}: {ast.unparse(node)[:80]}")
    return bad


def test_no_unbounded_waits_on_the_step_and_checkpoint_paths():
    bad = [b for f in ("rltpu/control/controller.py", "rltpu/control/checkpoints.py") for b in
           _unbounded_waits(ROOT / f)]
    assert not bad, bad


def test_a_hung_checkpoint_save_ends_in_one_line_with_health_off(tmp_path):
    """The trainers never answer and no watchdog fences them: the save still ends, naming the setting."""
    import ray.exceptions

    from rltpu.config import build_config
    from rltpu.control.checkpoints import Checkpoints
    from rltpu.observe.health import PhaseTimeout

    class HungRay:
        exceptions = ray.exceptions
        waited: list = []

        @classmethod
        def get(cls, refs, timeout=None):
            assert timeout is not None, "an unbounded ray.get would hang here forever"
            cls.waited.append(timeout)
            raise ray.exceptions.GetTimeoutError("hung")

    class Trainer:
        class save_checkpoint:  # noqa: N801 - mimics a Ray actor method
            @staticmethod
            def remote(path, meta):
                return "ref"

    cfg = build_config({"health": {"enabled": False, "deadlines": {"checkpointing": 5}, "heartbeat_timeout_s": 2}})
    ck = Checkpoints(HungRay, type("G", (), {"trainers": [Trainer()]})(), cfg, tmp_path)
    with pytest.raises(PhaseTimeout) as err:
        ck.save(1, 1, {}, [])
    assert "health.deadlines.checkpointing=5s" in str(err.value) and "\n" not in str(err.value)
    assert HungRay.waited == [7.0]


def test_the_runs_own_ray_temp_dir_is_removed_and_no_other(tmp_path):
    import tempfile

    from rltpu.config import build_config
    from rltpu.control.controller import owned_ray_temp_dir, remove_ray_temp

    ours = Path(tempfile.mkdtemp(prefix="rltpu-ray-", dir="/tmp"))
    (ours / "session_latest" / "logs").mkdir(parents=True)
    node = type("Node", (), {"get_temp_dir_path": lambda self: str(ours)})()
    fake_ray = type("R", (), {"_private": type("P", (), {"worker": type("W", (), {"_global_node": node})})})
    cfg = build_config({})
    try:
        assert owned_ray_temp_dir(fake_ray, cfg, "127.0.0.1:6379") is None  # a joined cluster's: not ours
        assert owned_ray_temp_dir(fake_ray, build_config({"cluster": {"ray_temp_dir": str(ours)}}), None) is None
        node.get_temp_dir_path = lambda: str(tmp_path)  # not a /tmp/rltpu-ray-* directory: never removed
        assert owned_ray_temp_dir(fake_ray, cfg, None) is None
        node.get_temp_dir_path = lambda: str(ours)
        assert owned_ray_temp_dir(fake_ray, cfg, None) == ours
        remove_ray_temp(ours)
        assert not ours.exists()
    finally:
        remove_ray_temp(ours)


@pytest.mark.slow
@pytest.mark.xdist_group("quickstart")  # the suite's SIGTERM + resume session run (tests/conftest.py)
def test_a_real_run_leaves_no_ray_temp_dir_and_ran_in_token_mode(sigterm_resumed_run):
    from rltpu.chips.cluster import TOKEN_FILE, user_has_token

    run = sigterm_resumed_run
    assert run.resumed is not None and run.resumed.returncode == 0, run.stopped.text[-2000:]
    temp = json.loads((run.run_dir / "placement.json").read_text())["ray_temp_dir"]
    assert temp and Path(temp).name.startswith("rltpu-ray-") and not Path(temp).exists()
    # the launch leaves RAY_AUTH_MODE unset, as a user's shell does: token mode, with the run's own token
    token = run.run_dir / TOKEN_FILE
    assert user_has_token() or (token.is_file() and token.stat().st_mode & 0o777 == 0o600)


def test_a_signal_between_the_update_and_the_metrics_line_keeps_the_line(tmp_path, monkeypatch):
    """Step 2's update lands, then SIGTERM arrives while its record is built (or at the next phase
    change): the stop path's checkpoint says step 2 and metrics.jsonl gets step 2's line, once."""
    import signal
    from collections import deque
    from types import SimpleNamespace

    from rltpu.config import build_config
    from rltpu.control import controller as ctl_mod
    from rltpu.control.interrupts import Interrupts
    from rltpu.control.modes import mode_for
    from rltpu.observe.metrics import read_metrics

    sig = Interrupts()
    monkeypatch.setattr(ctl_mod, "INTERRUPTS", sig)
    saved = []
    c = ctl_mod.Controller.__new__(ctl_mod.Controller)
    c.cfg = build_config({"trainer": {"steps": 5}, "progress": False})
    c.run_dir, c.evaluator, c.handle_signals, c.started = tmp_path, None, True, True
    c.mode = mode_for(c.cfg.placement)
    c.step_idx, c.version, c.steps_run, c.interrupted_record, c.writer = 0, 0, 0, None, None
    c.recent, c.data_before = deque(maxlen=5), None
    c.first_step = {}  # the first step's start-up report is another test's (tests/test_startup.py)
    c.data = SimpleNamespace(state_dict=lambda: {"pos": c.step_idx})
    c.draws = SimpleNamespace(pending=[])
    c.rewards = SimpleNamespace(begin_step=lambda k: None)
    c.rollouts = SimpleNamespace(prompts_in_flight=lambda: [])
    c.checkpoints = SimpleNamespace(save=lambda step, *a: saved.append(step), due=lambda step: False)
    c.supervisor = SimpleNamespace(phase="idle", set_phase=lambda name, step: None, maybe_write_trace=lambda: None)

    def step():
        c.step_idx += 1  # the update landed
        def record():
            if c.step_idx == 2:
                sig.handler(signal.SIGTERM, None)  # deferred: raised as the record is kept
            return {"step": c.step_idx, "reward_mean": 0.5}
        return c._recorded(record)

    c.step = step
    with pytest.raises(KeyboardInterrupt):
        c.run()
    sig.acknowledge()
    c.stop_on_interrupt()
    assert saved == [2]
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]


def test_shutdown_does_not_wait_for_a_ray_the_process_group_signal_stopped(monkeypatch):
    """``kill -TERM -- -PGID`` stops Ray's own processes too; the driver then waited 60 s in
    ``placement.shutdown`` for a GCS that was gone and exited 1 (measured: 60.5 s; now 6.4 s, 143).
    A process of the embedded Ray that has exited means: kill what is left, do not call into Ray."""
    import subprocess
    import sys
    from types import SimpleNamespace

    from rltpu.control import controller as ctl_mod

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    killed = []
    try:
        node = SimpleNamespace(all_processes={"gcs_server": [SimpleNamespace(process=alive)]},
                               kill_all_processes=lambda **kw: killed.append(kw))
        ray = SimpleNamespace(_private=SimpleNamespace(worker=SimpleNamespace(_global_node=node)))
        assert not ctl_mod.control_plane_dead(ray)
        assert not ctl_mod.control_plane_dead(SimpleNamespace())  # a joined cluster: nothing of ours to watch
        node.all_processes["log_monitor"] = [SimpleNamespace(process=gone)]
        assert ctl_mod.control_plane_dead(ray)

        c = ctl_mod.Controller.__new__(ctl_mod.Controller)
        c.writer, c.rewards, c.envs, c.ray, c._ray_temp = None, None, None, ray, None
        c.supervisor = SimpleNamespace(stop=lambda state: None)
        c.placement = SimpleNamespace(shutdown=lambda: pytest.fail("would wait 60 s for a GCS that is gone"))
        c.shutdown("stopped")
        assert killed == [{"check_alive": False, "allow_graceful": False}]
        node.all_processes.pop("log_monitor")  # a healthy Ray: the normal, graceful shutdown
        called = []
        c.placement = SimpleNamespace(shutdown=lambda: called.append(1))
        c.shutdown("finished")
        assert called == [1]
    finally:
        alive.kill()
        alive.wait()
