"""Issue 19 (preemption-safe, secure by default, bounded), the parts that need no Ray cluster:
the handshake wire is JSON (a malicious pickle is never deserialised), bounded in-memory history,
torn-tail-tolerant readers, the progress display off a terminal, the dashboard's Host check,
status of a finished run, and one-line errors from a failing reward function."""

from __future__ import annotations

import json
import os
import pickle
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from rltpu.sync import collective
from rltpu.sync.collective import Route, WeightSyncError, handshake


class _Boom:
    """Deserialising this runs code: it creates a marker file."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _FakeFabric:
    """A two-member 'ctl' group whose peer (sync rank 1) sends ``peer_details`` raw bytes."""

    def __init__(self, peer_details: bytes):
        self.route = Route(n_trainers=1, slices=[0, 0])
        self.peer = peer_details

    def allgather(self, t: torch.Tensor, what: str) -> list[torch.Tensor]:
        if what == "the handshake":  # the peer's digest differs: the details exchange follows
            return [t.clone(), t.clone() + 1]
        if t.dtype == torch.int64:  # the sizes
            return [t.clone(), torch.tensor([len(self.peer)], dtype=torch.int64)]
        peer = torch.zeros_like(t) if len(t) >= len(self.peer) else torch.zeros(len(self.peer), dtype=torch.uint8)
        peer[: len(self.peer)] = torch.frombuffer(bytearray(self.peer), dtype=torch.uint8)
        return [t.clone(), peer]


SPEC = [("embed.weight", (8, 4), "float32"), ("head.weight", (8, 4), "float32")]


def test_handshake_never_unpickles_peer_bytes(tmp_path):
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Boom(str(marker)))
    with pytest.raises(WeightSyncError) as err:
        handshake(_FakeFabric(payload), 3, SPEC, 1 << 20, "float32")
    assert not marker.exists(), "the peer's pickle was deserialised"
    assert "sampler 0 (sync rank 1) disagrees with trainer 0" in str(err.value)
    assert "unreadable handshake details" in str(err.value) and "\n" not in str(err.value)
    pickle.loads(payload)  # the payload is live: unpickling it really would have run code
    assert marker.exists()
    assert "pickle" not in Path(collective.__file__).read_text().split('"""', 2)[2].replace(
        "never pickle", "")


def test_handshake_details_are_json_and_name_the_difference():
    peer = json.dumps([3, 1, 1 << 20, "float32", [["embed.weight", [8, 4], "float32"],
                                                   ["head.weight", [8, 5], "float32"]]]).encode()
    with pytest.raises(WeightSyncError, match=r"first differing tensor 'head.weight': head.weight \(8, 5\)"):
        handshake(_FakeFabric(peer), 3, SPEC, 1 << 20, "float32")


# -- torn tails, fsynced commits ------------------------------------------------------------------
def test_torn_last_line_is_reported_dropped_and_cut_before_the_next_append(tmp_path, capsys):
    from rltpu.observe.ledger import Ledger, effective, read_ledger
    from rltpu.observe.metrics import MetricsWriter, read_metrics

    led = tmp_path / "ledger.jsonl"
    led.write_text(json.dumps({"step": 1, "weight_version": 0, "prompts": ["0:0:a"]}) + "\n" + '{"step": 2, "wei')
    assert effective(read_ledger(led)) == {1: ["0:0:a"]}
    assert "ledger.jsonl: dropped a torn last line" in capsys.readouterr().err
    Ledger(led).commit(2, ["0:1:b"], 1)  # --resume appends: the torn half is cut, the new line whole
    assert effective(read_ledger(led)) == {1: ["0:0:a"], 2: ["0:1:b"]}
    assert led.read_text().count("\n") == 2

    met = tmp_path / "metrics.jsonl"
    met.write_text(json.dumps({"step": 1}) + "\n" + '{"step": 2, "rew')
    assert read_metrics(met) == [{"step": 1}]
    w = MetricsWriter(met, 3, progress=False)
    w.write({"step": 2})
    w.close()
    assert read_metrics(met) == [{"step": 1}, {"step": 2}]
    met.write_text('{"step": 1}\nnot json\n{"step": 3}\n')  # corruption in the middle is not a torn tail
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        read_metrics(met)


def test_ledger_commit_is_fsynced(tmp_path, monkeypatch):
    from rltpu.observe import jsonl
    from rltpu.observe.ledger import Ledger

    synced = []
    real = os.fsync
    monkeypatch.setattr(jsonl.os, "fsync", lambda fd: (synced.append(fd), real(fd)))
    Ledger(tmp_path / "ledger.jsonl").commit(1, ["0:0:a"], 0)
    assert synced


def test_resume_starts_from_step_0_only_where_nothing_was_trained(tmp_path, capsys):
    """A scheduler passes --resume on every launch: a run dir stopped before it existed, or before any
    step, starts from step 0 (said in a line); trained steps without a checkpoint are an error."""
    from rltpu.cli import resume_from
    from rltpu.config import ConfigError
    from rltpu.observe.ledger import Ledger

    fresh = tmp_path / "never-created"
    assert resume_from(fresh) is False and not fresh.exists()
    assert "starting from step 0" in capsys.readouterr().err
    trained = tmp_path / "trained"
    trained.mkdir()
    Ledger(trained / "ledger.jsonl").commit(1, ["0:0:a"], 0)
    with pytest.raises(ConfigError, match="ledger has trained steps"):
        resume_from(trained)
    Ledger(trained / "ledger.jsonl").rollback(0, "test")  # every trained step voided: nothing to lose
    assert resume_from(trained) is False
    (trained / "checkpoint.prev").mkdir()
    (trained / "checkpoint.prev" / "trainer_state.json").write_text("{}")
    assert resume_from(trained) is True


# -- the progress display -------------------------------------------------------------------------
class _Stream:
    def __init__(self, tty: bool):
        self.tty, self.text = tty, ""

    def isatty(self):
        return self.tty

    def write(self, s):
        self.text += s

    def flush(self):
        pass


def test_progress_formats_missing_figures_and_prints_plain_lines_off_a_terminal(tmp_path):
    from rltpu.observe.metrics import MetricsWriter, summary

    interrupted = {"step": 4, "reward_mean": 0.5, "sample_s": 0.1, "train_s": 0.2, "sync_s": None}
    assert summary(interrupted) == "reward=0.500 sample=0.10s train=0.20s sync=-"
    for tty in (True, False):  # the bug: the tqdm path formatted None with .2f -> TypeError, no checkpoint
        out = _Stream(tty)
        w = MetricsWriter(tmp_path / f"m{tty}.jsonl", 5, progress=True, stream=out)
        for k in range(1, 6):
            w.write(dict(interrupted, step=k))
        w.close()
        if tty:
            assert "\r" in out.text
        else:
            assert "\r" not in out.text
            lines = out.text.splitlines()
            assert lines[0].startswith("rltpu: step 1 (1/5) reward=0.500") and lines[-1].startswith("rltpu: step 5 (5/5)")
            assert len(lines) == 2  # first and last; in between only every PLAIN_EVERY_S seconds


# -- bounded in-memory history --------------------------------------------------------------------
def test_watchdog_and_supervisor_history_is_bounded_by_config(tmp_path):
    from types import SimpleNamespace

    from rltpu.config import load_config
    from rltpu.control.supervisor import Supervisor
    from rltpu.observe.health import Watchdog

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml",
                      ["progress=false", "health.trace_max_spans=100", "health.max_events=7"])

    class Monitor:
        class snapshot:  # noqa: N801 - mimics an actor method
            @staticmethod
            def remote():
                return "ref"

    wd = Watchdog(Monitor, cfg.health, on_hung=None, write=lambda: None)
    ray_stub = SimpleNamespace(get=lambda ref, timeout=None: {"reports": {}, "spans": [
        {"actor": "sampler-0", "pid": 1, "phase": "sampling", "start": 0.0, "end": 1.0}] * 40})
    import ray

    real_get = ray.get
    ray.get = ray_stub.get
    try:
        for _ in range(10):
            wd.poll(act=False)
    finally:
        ray.get = real_get
    assert len(wd.spans) == 100
    sup = Supervisor(cfg, tmp_path, None, SimpleNamespace(progress=lambda: (0, 0)))
    for k in range(50):
        sup.event(f"sampler-{k % 2}", "replaced", "test")
        sup.set_phase("sample" if k % 2 else "train", k)
    assert len(sup.events) == 7 and sup.spans.maxlen == 25


def test_failed_trace_write_is_a_warning_not_the_end(tmp_path, capsys):
    from types import SimpleNamespace

    from rltpu.config import load_config
    from rltpu.control.supervisor import Supervisor

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml", ["health.trace_every_s=0"])
    sup = Supervisor(cfg, tmp_path / "missing" / "dir", None, SimpleNamespace(progress=lambda: (0, 0)))
    sup.maybe_write_trace()  # the directory does not exist: OSError
    assert "could not write trace.json" in capsys.readouterr().err


# -- status of a finished run ---------------------------------------------------------------------
def test_status_of_a_finished_run_shows_no_actor_training(tmp_path):
    from types import SimpleNamespace

    from rltpu.config import load_config
    from rltpu.control.supervisor import Supervisor
    from rltpu.observe.health import format_status, read_health

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml", [])
    groups = SimpleNamespace(keys=lambda: {"trainer-0": ("trainer", 0), "sampler-0": ("sampler", 0)})
    table = SimpleNamespace(pod_type="v5litepod-4", to_rows=lambda: [])
    sup = Supervisor(cfg, tmp_path, SimpleNamespace(groups=groups, table=table, emulated=True),
                     SimpleNamespace(progress=lambda: (10, 10), reward_health=lambda: None))
    now = __import__("time").time()
    beat = {"phase": "training", "step": 9, "version": 9, "incarnation": 0, "time": now, "received": now,
            "phase_since": now, "last_progress": now, "pid": 1}
    sup.watch = SimpleNamespace(reports={"trainer-0": dict(beat), "sampler-0": dict(beat, phase="syncing")},
                                lock=__import__("threading").Lock(), stop=lambda: None,
                                poll=lambda act: None, spans=[])
    sup.state = "finished"
    sup.write_health()
    doc = read_health(tmp_path)
    text = format_status(doc)
    assert "training" not in text and "syncing" not in text, text
    rows = {a["key"]: a for a in doc["actors"]}
    assert rows["trainer-0"]["phase"] == "exited" and rows["trainer-0"]["step"] == 10


# -- the reward function ----------------------------------------------------------------------------
def test_an_exception_in_the_reward_function_is_counted_and_too_many_stop_in_one_line():
    """With reward workers a raising call scores ``task.reward_default`` and is counted; past
    ``task.reward_max_failure_frac`` of a step the job stops with one line naming the function (a
    health stop, exit 3), never a traceback or a silent run on defaults."""
    from rltpu.config import TaskConfig
    from rltpu.control.rewards import RewardFailureError, RewardPool
    from rltpu.data.rewards import DeadlineRunner
    from rltpu.observe.health import HealthError

    def reward(text, example):
        return float(example["answer"] == text)

    runner = DeadlineRunner(reward, 5.0, 2)

    class InProcess:  # RayRewardWorkers' surface, the calls run here
        def spawn(self, slot, incarnation):
            return slot

        def call(self, handle, texts, examples):
            out = runner.run(list(zip(texts, examples)))
            return {"values": [v for v, _, _ in out], "kinds": [k for _, k, _ in out],
                    "details": [d for _, _, d in out], "abandoned": 0}

        def wait(self, refs, timeout):
            return refs

        def get(self, ref):
            return ref

        def kill(self, handle):
            pass

    task = TaskConfig(reward_fn="mymod:reward", reward_workers=1, reward_default=0.25, reward_max_failure_frac=0.4)
    pool = RewardPool(task, InProcess(), log=lambda line: None)
    pool.start()
    pool.begin_step(2)
    got = pool.collect(pool.submit(["1", "12"], [{"id": 3, "answer": "1"}, {"id": 7, "prompt": "x"}]))
    assert list(got) == [1.0, 0.25] and pool.step_metrics()["reward_errors"] == 1  # 1 of 2 raised
    with pytest.raises(RewardFailureError) as err:
        pool.check()
    msg = str(err.value)
    assert isinstance(err.value, HealthError) and "\n" not in msg
    assert msg.startswith("task.reward_fn mymod:reward failed on 1 of 2 calls at step 2 (1 raised; first: "
                          "KeyError: 'answer' on example id=7)"), msg


# -- dashboard: loopback unless told, Host header checked ---------------------------------------------
def test_dashboard_refuses_foreign_host_headers_and_remote_binds_need_a_flag(tmp_path):
    import http.client
    import subprocess

    from rltpu.observe.dashboard import serve

    (tmp_path / "health.json").write_text("{}")
    server = serve(tmp_path, "127.0.0.1", 0)
    port = server.server_address[1]
    try:
        def get(host):
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            c.request("GET", "/health.json", headers={"Host": host})
            return c.getresponse().status

        assert get(f"127.0.0.1:{port}") == 200 and get(f"localhost:{port}") == 200
        assert get("evil.example.com") == 403 and get(f"attacker.test:{port}") == 403
    finally:
        server.shutdown()
        server.server_close()
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-m", "rltpu.cli", "dashboard", str(tmp_path), "--host", "0.0.0.0"],
                       cwd=root, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--allow-remote" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_remote_binds_in_the_config_need_allow_remote():
    from rltpu.config import ConfigError, load_config

    q = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"
    for key in ("dashboard.host=0.0.0.0", "cluster.bind_host=10.1.2.3"):
        with pytest.raises(ConfigError, match="allow_remote=true"):
            load_config(q, [key])
        section = key.split(".")[0]
        assert load_config(q, [key, f"{section}.allow_remote=true"])


def test_remote_binds_with_the_flag_print_a_warning(tmp_path, monkeypatch, capsys):
    """The flag lets a non-loopback bind through, never silently: the dashboard and the embedded
    cluster each print a one-line warning."""
    from rltpu.chips import cluster
    from rltpu.config import load_config
    from rltpu.observe.dashboard import serve

    server = serve(tmp_path, "0.0.0.0", 0)
    server.shutdown()
    server.server_close()
    err = capsys.readouterr().err
    assert "rltpu: warning: the dashboard listens on 0.0.0.0:" in err and "no authentication" in err
    for var in [*cluster.RAY_ENV, "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "HOME"]:
        monkeypatch.setenv(var, "x")  # recorded, so whatever start_or_join sets is undone
        monkeypatch.delenv(var)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setattr(cluster, "_start_or_join", lambda *a, **k: {})  # no Ray: the warning comes first
    q = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"
    cfg = load_config(q, ["cluster.bind_host=10.1.2.3", "cluster.allow_remote=true"])
    cluster.start_or_join(cfg.cluster, None, 0, None, tmp_path / "run")
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rltpu: warning: the embedded Ray cluster binds 10.1.2.3"), err


def test_a_swallowed_interrupt_is_raised_again_at_the_next_check():
    """A KeyboardInterrupt raised inside a finalizer or an import hook is printed as "Exception
    ignored" and lost (seen with Ctrl-C during start-up): ``check`` raises it again."""
    import signal

    from rltpu.control.interrupts import Interrupts

    it = Interrupts()
    it.check()  # nothing received: no-op
    try:
        it.handler(signal.SIGINT, None)
    except KeyboardInterrupt:
        pass  # swallowed, as Python does in a __del__
    with pytest.raises(KeyboardInterrupt):
        it.check()
    it.acknowledge()
    it.check()
    assert it.exit_code() == 130
    it2 = Interrupts()
    with pytest.raises(KeyboardInterrupt):
        with it2.deferred():
            it2.handler(signal.SIGTERM, None)  # held, not raised here
            held = True
    assert held and it2.exit_code() == 143


_LATE_CHILD = """
import os, signal, sys, time
from rltpu.control.interrupts import Interrupts
it = Interrupts()
it.install()
it.hold()  # a shutdown after a finished run: a signal is remembered, not raised
os.kill(os.getpid(), signal.SIGINT)
time.sleep(0.2)
print("held", it.late == [signal.SIGINT], it.late_exit_code(), flush=True)
it.exit_on_signal("while exiting")  # the last moments: a signal ends the process with its line
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(5)
print("not reached", flush=True)
"""


def test_a_signal_as_a_run_ends_is_answered_with_its_exit_code_and_one_line():
    """Seen in the interrupt fuzz when a signal landed as a 4-step run ended: SIGINT during the shutdown
    was ignored (exit 0, no line), SIGTERM after the command returned killed the driver (exit -15, no
    line). Now the shutdown remembers it and the last moments answer it: 143 and one line."""
    import subprocess

    res = subprocess.run([sys.executable, "-c", _LATE_CHILD], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parents[1])
    assert res.stdout.splitlines() == ["held True 130"], res.stdout + res.stderr
    assert res.returncode == 143, res.stderr
    assert res.stderr.strip().splitlines() == ["rltpu: stopped by SIGTERM while exiting"], res.stderr


def test_rays_processes_start_with_sighup_ignored():
    """A closed terminal sends SIGHUP to the whole foreground process group: Ray's processes (started
    during ray.init, and the workers their raylet starts) died of it before the driver could
    checkpoint, and ray.shutdown then hung (seen in tmux). They now inherit SIGHUP as ignored; the
    driver's own handler is back afterwards."""
    import re
    import signal
    import subprocess

    from rltpu.chips.cluster import _keep_sigterm_handler

    before = signal.getsignal(signal.SIGHUP)
    with _keep_sigterm_handler():  # what ray.init runs inside
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        status = Path(f"/proc/{child.pid}/status").read_text()
    finally:
        child.kill()
        child.wait()
    ignored = int(re.search(r"SigIgn:\s*([0-9a-f]+)", status).group(1), 16)
    assert ignored & (1 << (signal.SIGHUP - 1))
    assert signal.getsignal(signal.SIGHUP) == before


_HANGUP_CHILD = """
import os, signal, sys, time
from rltpu.control.interrupts import Interrupts
it = Interrupts()
it.install()
try:
    print("ready", flush=True)
    while True:
        time.sleep(0.05)
except KeyboardInterrupt:
    it.acknowledge()
    it.ignore()
    for _ in range(200):  # the stop path keeps printing to the terminal that is gone
        print("rltpu: stopped by " + it.name() + " " + "x" * 200, file=sys.stderr, flush=True)
    with open(sys.argv[1], "w") as f:  # stands in for the checkpoint the stop path writes
        f.write(it.name())
    it.restore()
    sys.exit(it.exit_code())
"""


@pytest.mark.parametrize("nohup", [False, True])
def test_a_closed_terminal_stops_like_sigterm_and_nohup_keeps_running(tmp_path, nohup):
    """SIGHUP (terminal closed, SSH dropped) takes the interrupt path: exit 129 after the stop path ran,
    although every write to the hung-up terminal would raise EIO. Under ``nohup`` (SIGHUP inherited
    as ignored) the run goes on."""
    import pty
    import signal
    import subprocess
    import time

    master, slave = pty.openpty()
    done = tmp_path / "stopped"
    # the child's SIGHUP disposition is set either way: a suite started under nohup (or a CI runner that
    # ignores SIGHUP) would otherwise hand the "terminal" child an ignored SIGHUP
    pre = lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN if nohup else signal.SIG_DFL)  # noqa: E731
    proc = subprocess.Popen([sys.executable, "-c", _HANGUP_CHILD, str(done)], stdin=subprocess.DEVNULL, stdout=slave,
                            stderr=slave, cwd=Path(__file__).resolve().parents[1], start_new_session=True,
                            preexec_fn=pre, env=dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0"))
    os.close(slave)
    seen = b""
    while b"ready\r\n" not in seen:  # the whole line, so the child is not writing when the terminal goes
        seen += os.read(master, 100)
    os.close(master)  # the terminal goes away: writes to it now fail with EIO
    os.killpg(proc.pid, signal.SIGHUP)
    if nohup:
        time.sleep(1.0)
        assert proc.poll() is None and not done.exists()
        proc.kill()
        proc.wait()
        return
    assert proc.wait(timeout=60) == 129
    assert done.read_text() == "SIGHUP"
