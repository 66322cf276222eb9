"""Health pieces without Ray: deadlines, heartbeats, the monitor's fencing of old incarnations,
`rltpu status` exit codes, the prompt ledger, checkpoint fallback, trace format, loggers."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from learner.checkpoint import history, latest_valid, load_checkpoint, save_checkpoint
from rltpu.observe.health import Heartbeat, HealthMonitor, actor_rows, assess, decide, trace_events, write_health
from rltpu.observe.ledger import Ledger, check, effective, read_ledger

ROOT = Path(__file__).resolve().parents[1]
DEADLINES = {"compiling": 100.0, "sampling": 10.0, "syncing": 2.0, "training": 10.0}


def report(phase="idle", since=0.0, beat=0.0, inc=0, key=("sampler", 0)):
    return {"group": key[0], "rank": key[1], "incarnation": inc, "phase": phase, "phase_since": since,
            "time": beat, "received": beat, "last_progress": since, "pid": 1, "spans": []}


def test_decide_per_phase_deadlines_and_silence():
    now = 100.0
    reports = {"sampler-0": report("sampling", since=95.0, beat=99.5),     # 5 s of 10: fine
               "sampler-1": report("syncing", since=97.0, beat=99.5),      # 3 s of 2: hung
               "trainer-0": report("compiling", since=20.0, beat=99.0),    # 80 s of 100: fine
               "trainer-1": report("idle", since=0.0, beat=99.0),          # idle forever: fine
               "reward-0": report("idle", since=0.0, beat=80.0)}           # 20 s silent: hung
    v = decide(reports, now, DEADLINES, heartbeat_timeout_s=15.0)
    assert sorted(v) == ["reward-0", "sampler-1"]
    assert "syncing" in v["sampler-1"] and "deadline 2s" in v["sampler-1"]
    assert "no heartbeat" in v["reward-0"]
    assert decide(reports, now, DEADLINES, 15.0, skip={"sampler-1", "reward-0"}) == {}


@pytest.mark.parametrize("sampler, skip, want", [
    (report("sampling", since=95.0, beat=99.5), set(), ["trainer-1"]),          # samplers fine: the trainer is hung
    (report("idle", since=0.0, beat=80.0), set(), ["sampler-0"]),               # a stopped sampler: the sync waits on it
    (report("syncing", since=90.0, beat=99.5), set(), ["sampler-0"]),           # a sampler hung in the sync itself
    (report("idle", since=0.0, beat=80.0), {"sampler-0"}, []),                  # fenced, not yet replaced: still waiting
])
def test_a_trainer_waiting_in_a_sync_on_a_hung_sampler_is_not_judged_hung(sampler, skip, want):
    """The chaos run's second rollback: a sampler SIGSTOPped just before a sync; its heartbeat went
    quiet 1 s before the trainers passed their syncing deadline, and fencing a trainer as well
    restarted the group from a checkpoint. A trainer that is itself silent is still judged."""
    now = 100.0
    reports = {"sampler-0": sampler,
               "trainer-0": report("idle", since=0.0, beat=99.5, key=("trainer", 0)),
               "trainer-1": report("syncing", since=95.0, beat=99.5, key=("trainer", 1))}  # 5 s of 2
    assert sorted(decide(reports, now, DEADLINES, 15.0, skip=skip)) == want
    # a trainer past its syncing deadline and silent (stopped itself) is judged whatever the samplers do
    reports["trainer-0"] = report("syncing", since=95.0, beat=70.0, key=("trainer", 0))
    assert "trainer-0" in decide(reports, now, DEADLINES, 15.0, skip=skip)


@pytest.mark.parametrize("s1, skip, want", [
    (report("idle", since=0.0, beat=84.0, key=("sampler", 1)), set(), ["sampler-1"]),        # stopped before the sync
    (report("idle", since=0.0, beat=89.0, key=("sampler", 1)), set(), []),                   # 11 s quiet: not yet judged
    (report("syncing", since=90.0, beat=92.0, key=("sampler", 1)), set(), ["sampler-1"]),    # stopped in it, 8 s ago
    (report("idle", since=0.0, beat=84.0, key=("sampler", 1)), {"sampler-1"}, []),           # fenced, not yet replaced
    (report("sampling", since=60.0, beat=99.5, key=("sampler", 1)), set(), ["sampler-1"]),   # hung in another phase
    (report("syncing", since=90.0, beat=99.5, key=("sampler", 1)), set(), ["sampler-0", "sampler-1"]),  # no cause seen
])
def test_a_sampler_waiting_in_a_sync_on_another_hung_member_is_not_judged_hung(s1, skip, want):
    """The chaos run's failure after the trainer rule: sampler-1 SIGSTOPped just before a sync; in one
    poll its silence passed 10 s and sampler-0, waiting in the sync on it, passed its 10 s syncing
    deadline; both were fenced and the healthy one restarted for nothing. The trainers, waiting too,
    are excused whenever a sampler is judged; with waiters alone, the samplers go first."""
    now = 100.0
    reports = {"sampler-0": report("syncing", since=90.0, beat=99.5),                       # 10 s of 2, beating
               "sampler-1": s1,
               "trainer-0": report("syncing", since=90.0, beat=99.5, key=("trainer", 0)),
               "reward-0": report("idle", since=0.0, beat=99.5, key=("reward", 0))}
    assert sorted(decide(reports, now, DEADLINES, 15.0, skip=skip, heartbeat_s=1.0)) == want
    # without heartbeat_s a member counts as beating until heartbeat_timeout_s: the one stopped
    # 8 or 11 s ago is no cause yet, and the waiting sampler is judged as well
    if s1["time"] in (89.0, 92.0):
        assert "sampler-0" in decide(reports, now, DEADLINES, 15.0, skip=skip)
    # a silent reward worker is no member of the sync: it changes no sync verdict
    reports["reward-0"] = report("idle", since=0.0, beat=70.0, key=("reward", 0))
    assert sorted(decide(reports, now, DEADLINES, 15.0, skip=skip, heartbeat_s=1.0)) == sorted(want + ["reward-0"])


class FakeMonitor:
    """``beat.remote(report)`` like a Ray actor handle, into a real HealthMonitor."""

    def __init__(self):
        self.m = HealthMonitor()
        self.beat = type("M", (), {"remote": staticmethod(self.m.beat)})


def test_heartbeat_thread_reports_while_work_loop_blocks():
    mon = FakeMonitor()
    hb = Heartbeat("sampler", 1, stats=lambda: {"step": 7, "version": 3, "compiles": 2})
    hb.start(mon, 0.05, incarnation=0, identity={"chips": [1], "chip_ids": [1], "host": "h"})
    with hb.phase("sampling"):
        time.sleep(0.3)  # the "work": beats keep coming from the thread meanwhile
        r = mon.m.snapshot()["reports"]["sampler-1"]
        assert r["phase"] == "sampling" and r["step"] == 7 and r["version"] == 3 and r["rss_mb"] > 0
    time.sleep(0.15)
    hb.stop()
    snap = mon.m.snapshot()
    assert snap["reports"]["sampler-1"]["phase"] == "idle"
    spans = [s for s in snap["spans"] if s["phase"] == "sampling"]
    assert len(spans) == 1 and spans[0]["end"] - spans[0]["start"] >= 0.3


def test_monitor_ignores_fenced_incarnation():
    m = HealthMonitor()
    m.beat(report("sampling", beat=1.0, inc=0))
    m.expect("sampler-0", 1)  # incarnation 0 was fenced
    assert "sampler-0" not in m.snapshot()["reports"]
    m.beat(report("sampling", beat=2.0, inc=0))  # a late beat from the fenced process
    assert "sampler-0" not in m.snapshot()["reports"]
    m.beat(report("compiling", beat=3.0, inc=1))
    assert m.snapshot()["reports"]["sampler-0"]["phase"] == "compiling"


def _health_doc(tmp_path, state="running", fenced=None, restarts=None, now=None):
    now = now or time.time()
    reports = {"sampler-0": report("sampling", since=now - 1, beat=now - 0.5) | {"chip_ids": [2], "host": "h"},
               "trainer-0": report("idle", since=now - 1, beat=now - 0.5, key=("trainer", 0)) | {"chip_ids": [0]}}
    doc = {"time": now, "state": state, "run_dir": str(tmp_path), "step": 3, "steps": 10, "weight_version": 3,
           "heartbeat_timeout_s": 60, "stale_after_s": 30, "events": [],
           "actors": actor_rows(reports, ["trainer-0", "sampler-0"], restarts or {}, fenced or {}, now)}
    write_health(tmp_path / "health.json", doc)
    return doc


def status(run_dir):
    return subprocess.run([sys.executable, "-m", "rltpu.cli", "status", str(run_dir)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def test_status_table_and_exit_codes(tmp_path):
    _health_doc(tmp_path, restarts={"sampler-0": 1})
    res = status(tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert lines[1].split()[:4] == ["group", "rank", "chips", "host"]
    assert any(ln.split()[:2] == ["sampler", "0"] and ln.split()[-2:] == ["1", "restarted"] for ln in lines)
    _health_doc(tmp_path, fenced={"sampler-0": "hung in sampling for 31s > deadline 30s"})
    res = status(tmp_path)
    assert res.returncode == 1 and "hung in sampling" in res.stdout
    _health_doc(tmp_path, now=time.time() - 120)  # the driver stopped refreshing the file
    assert status(tmp_path).returncode == 1
    _health_doc(tmp_path, state="finished", now=time.time() - 3600)  # an old finished run is fine
    assert status(tmp_path).returncode == 0
    _health_doc(tmp_path, state="failed")
    assert status(tmp_path).returncode == 1
    res = status(tmp_path / "nope")
    assert res.returncode == 2 and res.stderr.startswith("rltpu: error: no health file")


def test_assess_flags_a_stale_heartbeat():
    now = time.time()
    doc = {"state": "running", "time": now, "heartbeat_timeout_s": 10,
           "actors": [{"key": "sampler-0", "state": "ok", "heartbeat": now - 30}]}
    ok, problems = assess(doc, now)
    assert not ok and "heartbeat 30s old" in problems[0]


def test_ledger_proves_no_skip_no_replay_across_rollback(tmp_path):
    led = Ledger(tmp_path / "ledger.jsonl")
    ids = lambda a, b: [f"0:{p}:{p * 7 % 11}" for p in range(a, b)]  # noqa: E731
    led.commit(1, ids(0, 2), 0)
    led.commit(2, ids(2, 4), 1)
    led.commit(3, ids(4, 6), 2)
    led.rollback(2, "trainer restarted from step 2")   # step 3 is void...
    led.commit(3, ids(4, 6), 2)                        # ...and drawn again
    led.commit(4, ids(6, 8), 3)
    lines = read_ledger(tmp_path / "ledger.jsonl")
    assert sorted(effective(lines)) == [1, 2, 3, 4]
    assert check(lines, 4, 2) == []
    assert check(lines, 5, 2)  # a missing step
    bad = lines + [{"rollback_to": 4}, {"step": 5, "prompts": ids(9, 11)}]  # skips position 8
    assert any("skipped" in p for p in check(bad, 5, 2))
    replay = lines + [{"rollback_to": 4}, {"step": 5, "prompts": ids(6, 8)}]
    assert any("replayed" in p for p in check(replay, 5, 2))
    with pytest.raises(ValueError, match="committed twice"):
        effective(lines + [{"step": 4, "prompts": []}])


def _ckpt(path, step, keep):
    model = {"w": torch.full((4, 4), float(step))}
    optim = {"state": {"w": {"exp_avg": torch.zeros(4, 4), "step": torch.tensor(float(step))}}}
    save_checkpoint(path, {"model": model, "optimizer": optim}, {"step": step}, keep=keep)


def test_keep_last_and_truncated_checkpoint_falls_back(tmp_path, capsys):
    ck = tmp_path / "checkpoint"
    for step in (1, 2, 3, 4):
        _ckpt(ck, step, keep=3)
    kept = [p for p in history(ck, 5) if p.exists()]
    assert [p.name for p in kept] == ["checkpoint", "checkpoint.prev", "checkpoint.prev2"]
    assert [json.loads((p / "trainer_state.json").read_text())["step"] for p in kept] == [4, 3, 2]
    f = ck / "model-rank00000.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])  # truncated
    warnings = []
    assert latest_valid(ck, 3, warnings.append) == ck.with_name("checkpoint.prev")
    assert "model-rank00000.safetensors is corrupt" in warnings[0] and "falling back" in warnings[0]
    with pytest.raises(ValueError, match="corrupt"):
        load_checkpoint(ck)
    _model, _optim, meta = load_checkpoint(ck.with_name("checkpoint.prev"))
    assert meta["step"] == 3
    (ck.with_name("checkpoint.prev") / "trainer_state.json").write_text("{")  # half-written JSON
    assert latest_valid(ck, 3) == ck.with_name("checkpoint.prev2")


def test_keep_one_removes_previous(tmp_path):
    ck = tmp_path / "checkpoint"
    _ckpt(ck, 1, keep=1)
    _ckpt(ck, 2, keep=1)
    assert not ck.with_name("checkpoint.prev").exists() and load_checkpoint(ck)[2]["step"] == 2


def test_trace_is_chrome_trace_format():
    spans = [{"actor": "sampler-0", "pid": 11, "phase": "sampling", "start": 10.5, "end": 11.0}]
    ctl = [{"actor": "controller", "pid": 1, "phase": "sample", "start": 10.4, "end": 11.1, "step": 1}]
    ev = trace_events(spans, ctl, t0=10.0)
    meta = [e for e in ev if e["ph"] == "M"]
    assert [m["args"]["name"] for m in meta] == ["controller (pid 1)", "sampler-0 (pid 11)"]
    x = [e for e in ev if e["ph"] == "X"]
    assert x[1] == {"name": "sampling", "ph": "X", "pid": 2, "tid": 0, "cat": "sampler", "ts": 500000,
                    "dur": 500000, "args": {}}
    assert x[0]["args"] == {"step": 1}


def test_loggers_jsonl_always_and_optional_ones_checked(tmp_path, monkeypatch):
    from rltpu.config import ConfigError, load_config
    from rltpu.observe import loggers
    from rltpu.observe.loggers import build_loggers, check_loggers

    cfg = load_config(ROOT / "configs" / "quickstart.yaml", ["progress=false"])
    lg = build_loggers(cfg, tmp_path, 2)
    lg.write({"step": 1, "reward_mean": 0.5, "sample_s": 0.1, "train_s": 0.1, "sync_s": 0.1, "versions": [0]})
    lg.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["reward_mean"] == 0.5
    # a configured logger whose package is missing: a one-line error before Ray starts (the extra is
    # installed in CI, so its absence is simulated)
    monkeypatch.setattr(loggers.importlib.util, "find_spec", lambda name: None)
    for name in ("tensorboard", "wandb", "mlflow"):
        c = load_config(ROOT / "configs" / "quickstart.yaml", [f"loggers.{name}=true"])
        with pytest.raises(ConfigError, match=f"loggers.{name}=true but the '{name}' package") as err:
            check_loggers(c)
        assert "\n" not in str(err.value) and f"pip install -e '.[{name}]'" in str(err.value)


# The `loggers` extra is installed by `make setup` (CI): these run there, and each reads back what it logged.
def _log_two_steps(tmp_path, key: str) -> None:
    from rltpu.config import load_config
    from rltpu.observe.loggers import build_loggers

    cfg = load_config(ROOT / "configs" / "quickstart.yaml", ["progress=false", f"loggers.{key}=true"])
    lg = build_loggers(cfg, tmp_path, 2)
    lg.write({"step": 1, "reward_mean": 0.25, "versions": [0]})
    lg.write({"step": 2, "reward_mean": 0.75, "versions": [1], "eval/accuracy": 0.5, "eval/pass@k": 0.625})
    lg.close()


def test_tensorboard_event_files(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _log_two_steps(tmp_path, "tensorboard")
    (events,) = (tmp_path / "tensorboard").glob("events.out.tfevents.*")
    acc = EventAccumulator(str(events))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("reward/mean")] == [(1, 0.25), (2, 0.75)]  # grouped
    assert [(e.step, e.value) for e in acc.Scalars("eval/pass@k")] == [(2, 0.625)]  # evaluation figures too


def test_mlflow_sqlite_store(tmp_path, monkeypatch):
    """MLflow 3 refuses the ./mlruns file store: the run logs to run_dir/mlflow.db, nothing in the cwd."""
    import mlflow

    from rltpu.observe.loggers import mlflow_tracking_uri

    monkeypatch.chdir(tmp_path)
    (tmp_path / "run").mkdir()
    _log_two_steps(tmp_path / "run", "mlflow")
    assert (tmp_path / "run" / "mlflow.db").is_file() and not (tmp_path / "mlruns").exists()
    client = mlflow.tracking.MlflowClient(tracking_uri=mlflow_tracking_uri(tmp_path / "run"))
    exp = client.get_experiment_by_name("rltpu")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.run_name == "quickstart" and run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "reward/mean")
    assert sorted((m.step, m.value) for m in history) == [(1, 0.25), (2, 0.75)]
    # MLflow names may not hold "@": eval/pass@k is logged as eval/pass_at_k
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "eval/pass_at_k")] == [(2, 0.625)]


def wandb_records(path) -> list:
    """Every record of an offline ``run-*.wandb`` file: W&B's record log (a 7-byte file header, 32 KiB
    blocks of records with a 7-byte header: crc32, length, type 1 full / 2 first / 3 middle / 4 last)."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data, pos, buf, out = Path(path).read_bytes(), 7, b"", []
    assert data[:4] == b":W&B", data[:7]
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        buf, pos = buf + data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(buf)
            out.append(rec)
            buf = b""
    return out


def wandb_history(records: list) -> list[dict]:
    """The history rows among ``records``, by metric name."""
    return [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            for r in records if r.WhichOneof("record_type") == "history"]


def _wandb_history(path) -> list[dict]:
    return wandb_history(wandb_records(path))


def test_wandb_offline(tmp_path, monkeypatch):
    """Offline: files under run_dir/wandb, nothing sent (no network on the test machines)."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    _log_two_steps(tmp_path, "wandb")
    (run,) = (tmp_path / "wandb").glob("offline-run-*")
    (history,) = run.glob("run-*.wandb")  # what `wandb sync` would upload
    rows = _wandb_history(history)
    assert [(r["_step"], r["reward/mean"]) for r in rows] == [(1, 0.25), (2, 0.75)]
    assert rows[1]["eval/pass@k"] == 0.625 and rows[1]["eval/accuracy"] == 0.5
