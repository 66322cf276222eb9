"""W&B and MLflow settings reach their clients (offline W&B files, a local MLflow SQLite store, read back):
config keys, else the usual WANDB_* / MLFLOW_* variables; a resumed run dir continues the same tracker
run; the trackers see grouped names (reward/mean, timing/...) while metrics.jsonl keeps the flat ones."""

from __future__ import annotations

import json
from pathlib import Path

from rltpu.config import load_config
from rltpu.observe.loggers import build_loggers, group_key, mlflow_settings, wandb_settings
from test_health import wandb_history, wandb_records

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
REC1 = {"step": 1, "reward_mean": 0.25, "sample_s": 1.5, "sync_bytes": 1024, "loss": -0.1, "versions": [0]}
REC2 = {"step": 2, "reward_mean": 0.75, "sample_s": 1.25, "sync_bytes": 1024, "loss": -0.2, "versions": [1]}


def _log(run_dir: Path, *overrides: str, records=(REC1,)):
    cfg = load_config(QUICKSTART, ["progress=false", *overrides])
    lg = build_loggers(cfg, run_dir, 2)
    for r in records:
        lg.write(r)
    lg.close()
    return cfg


def test_metric_groups():
    got = {k: group_key(k) for k in ("reward_mean", "reward_rule_mean", "sample_s", "reward_wait_s", "sync_bytes",
                                     "loss", "grad_norm", "train_padding_frac", "response_len", "new_tokens_per_s",
                                     "sampler_occupancy", "env_turns_mean", "data_position", "eval/pass@k")}
    assert got == {"reward_mean": "reward/mean", "reward_rule_mean": "reward/rule_mean", "sample_s": "timing/sample_s",
                   "reward_wait_s": "timing/reward_wait_s", "sync_bytes": "sync/bytes", "loss": "train/loss",
                   "grad_norm": "train/grad_norm", "train_padding_frac": "train/padding_frac",
                   "response_len": "sampler/response_len", "new_tokens_per_s": "sampler/new_tokens_per_s",
                   "sampler_occupancy": "sampler/occupancy", "env_turns_mean": "env/turns_mean",
                   "data_position": "data/position", "eval/pass@k": "eval/pass@k"}


def test_wandb_settings_config_over_env_over_defaults(tmp_path):
    lc = load_config(QUICKSTART).loggers
    assert wandb_settings(lc, tmp_path, "quickstart", env={}) == {
        "mode": "offline", "project": "rltpu", "entity": None, "name": "quickstart", "tags": None, "id": None,
        "resume": None, "dir": str(tmp_path)}
    env = {"WANDB_MODE": "online", "WANDB_PROJECT": "p-env", "WANDB_ENTITY": "team", "WANDB_NAME": "n-env",
           "WANDB_TAGS": "a, b", "WANDB_RUN_ID": "r123", "WANDB_RESUME": "must", "WANDB_DIR": "/tmp/wb"}
    assert wandb_settings(lc, tmp_path, "quickstart", env=env) == {
        "mode": "online", "project": "p-env", "entity": "team", "name": "n-env", "tags": ["a", "b"], "id": "r123",
        "resume": "must", "dir": "/tmp/wb"}
    lc = load_config(QUICKSTART, ["loggers.wandb_mode=disabled", "loggers.wandb_project=p-cfg",
                                  "loggers.wandb_tags=[x]", "loggers.wandb_name=n-cfg"]).loggers
    got = wandb_settings(lc, tmp_path, "quickstart", env=env)
    assert (got["mode"], got["project"], got["tags"], got["name"]) == ("disabled", "p-cfg", ["x"], "n-cfg")


def _wandb_run(run_dir: Path, i: int):
    runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    (file,) = runs[i].glob("run-*.wandb")
    recs = wandb_records(file)
    (run,) = [r.run for r in recs if r.WhichOneof("record_type") == "run"]
    return run, wandb_history(recs)


def test_wandb_offline_gets_the_settings_and_a_resume_continues_the_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_PROJECT", "from-env")  # the config's project wins over it
    monkeypatch.setenv("WANDB_TAGS", "env-tag")
    for k in ("WANDB_MODE", "WANDB_RUN_ID", "WANDB_RESUME", "WANDB_DIR", "WANDB_NAME"):
        monkeypatch.delenv(k, raising=False)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    keys = ["loggers.wandb=true", "loggers.wandb_project=proj-cfg", "loggers.wandb_name=my-run"]
    _log(run_dir, *keys)
    run, rows = _wandb_run(run_dir, 0)
    assert (run.project, run.display_name, list(run.tags)) == ("proj-cfg", "my-run", ["env-tag"])
    assert rows[0]["reward/mean"] == 0.25 and rows[0]["timing/sample_s"] == 1.5 and rows[0]["train/loss"] == -0.1
    saved = json.loads((run_dir / "trackers.json").read_text())["wandb"]
    assert saved == run.run_id
    _log(run_dir, *keys, records=(REC2,))  # the same run dir again (--resume): the same W&B run
    again, rows2 = _wandb_run(run_dir, 1)
    assert again.run_id == run.run_id and rows2[0]["reward/mean"] == 0.75
    assert json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[1])["reward_mean"] == 0.75  # flat names


def test_mlflow_from_the_environment_and_config_and_a_resume_continues_the_run(tmp_path, monkeypatch):
    import mlflow

    store = f"sqlite:///{tmp_path / 'shared.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "exp-env")
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    _log(run_dir, "loggers.mlflow=true")
    _log(run_dir, "loggers.mlflow=true", records=(REC2,))  # resumed: the same MLflow run
    assert not (run_dir / "mlflow.db").exists()  # the given store, not the run dir's
    client = mlflow.tracking.MlflowClient(tracking_uri=store)
    exp = client.get_experiment_by_name("exp-env")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.run_name == "quickstart" and run.info.status == "FINISHED"
    assert run.data.params["trainer.lr"] == "0.001" and run.data.params["task.name"] == "copy"
    hist = client.get_metric_history(run.info.run_id, "reward/mean")
    assert sorted((m.step, m.value) for m in hist) == [(1, 0.25), (2, 0.75)]
    assert [m.value for m in client.get_metric_history(run.info.run_id, "sync/bytes")] == [1024, 1024]
    assert json.loads((run_dir / "trackers.json").read_text())["mlflow"] == run.info.run_id


def test_mlflow_settings_config_over_env_over_defaults(tmp_path):
    lc = load_config(QUICKSTART).loggers
    assert mlflow_settings(lc, tmp_path, env={}) == {
        "uri": f"sqlite:///{(tmp_path / 'mlflow.db').resolve()}", "given": False, "experiment": "rltpu", "run_id": None}
    env = {"MLFLOW_TRACKING_URI": "http://127.0.0.1:5000", "MLFLOW_EXPERIMENT_NAME": "exp-env", "MLFLOW_RUN_ID": "abc"}
    assert mlflow_settings(lc, tmp_path, env=env) == {
        "uri": "http://127.0.0.1:5000", "given": True, "experiment": "exp-env", "run_id": "abc"}
    lc = load_config(QUICKSTART, ["loggers.mlflow_tracking_uri=sqlite:///x.db", "loggers.mlflow_experiment=e"]).loggers
    got = mlflow_settings(lc, tmp_path, env=env)
    assert (got["uri"], got["experiment"]) == ("sqlite:///x.db", "e")
