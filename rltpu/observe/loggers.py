"""Where step metrics go, behind one interface (``write(record)``, ``close()``).

``metrics.jsonl`` is always written (``rltpu.observe.metrics.MetricsWriter``), with the record's own flat
names. TensorBoard event files, Weights & Biases and MLflow are added when ``loggers.*`` asks for them;
each library is its own extra (``pip install -e '.[wandb]'``, ``[mlflow]``, ``[tensorboard]``; ``[loggers]``
is all three) imported only then, and a configured but missing one is a one-line error naming the fix.
Every numeric field of a record is logged at ``step`` under a grouped name (``group_key``: ``reward/mean``,
``timing/sample_s``, ``sync/bytes``, ``train/loss`` ...), so the W&B / TensorBoard / MLflow pages show one
panel group per part; lists and strings stay in the JSONL. Evaluation figures are ``eval/...`` already;
MLflow, whose names may not hold ``@``, gets ``eval/pass_at_k``.

W&B: ``loggers.wandb_*`` keys, else the usual ``WANDB_*`` variables (mode, project, entity, name, tags,
run id, resume, dir), else offline files under ``run_dir/wandb`` in project ``rltpu``. MLflow:
``loggers.mlflow_tracking_uri`` / ``mlflow_experiment``, else ``MLFLOW_TRACKING_URI`` /
``MLFLOW_EXPERIMENT_NAME``, else a SQLite store in the run dir and experiment ``rltpu``. Each tracker's run
id is kept in ``run_dir/trackers.json``: ``rltpu train --resume`` continues the same W&B and MLflow run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path

from rltpu.config import ConfigError
from rltpu.observe.metrics import MetricsWriter

PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}

# a record's flat name -> its group in the trackers (first rule that matches; a name with "/" is kept)
TRAIN_KEYS = ("loss", "kl", "entropy", "clip_frac", "logp_gap", "is_weight_mean", "is_truncated_frac", "grad_norm",
              "lr", "micro_batches", "train_padding_frac", "value_mse", "value_mean", "kl_in_reward",
              "weight_version")
SAMPLER_KEYS = ("response_len", "new_tokens_per_s", "padding_frac", "compiles")
PREFIX_GROUPS = (("reward_", "reward"), ("sync_", "sync"), ("sampler_", "sampler"), ("env_", "env"),
                 ("data_", "data"), ("ds_", "dynamic_sampling"), ("train_", "train"))


def group_key(key: str) -> str:
    """``reward_mean`` -> ``reward/mean``, ``sample_s`` -> ``timing/sample_s``, ``sync_bytes`` -> ``sync/bytes``,
    ``loss`` -> ``train/loss``; a name already grouped (``eval/accuracy``) or unknown is kept."""
    if "/" in key:
        return key
    if key.endswith("_s") and not key.endswith("_per_s"):
        return f"timing/{key}"
    if key in TRAIN_KEYS:
        return f"train/{key.removeprefix('train_')}"
    if key in SAMPLER_KEYS:
        return f"sampler/{key}"
    if key == "policy_tokens_mean":
        return "env/policy_tokens_mean"
    for prefix, group in PREFIX_GROUPS:
        if key.startswith(prefix):
            return f"{group}/{key[len(prefix):]}"
    return key


def scalars(record: dict) -> dict[str, float]:
    """The record's numeric fields under their grouped names (``group_key``), ``step`` aside."""
    return {group_key(k): float(v) for k, v in record.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}


class TrackerIds:
    """``run_dir/trackers.json``: the W&B and MLflow run ids of this run dir, so a resumed run logs to the
    same tracker run (a ``--new-run`` moves the file away with the rest of the old run)."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / "trackers.json"

    def get(self, name: str) -> str | None:
        try:
            value = json.loads(self.path.read_text()).get(name)
        except (OSError, ValueError, AttributeError):
            return None
        return value if isinstance(value, str) else None

    def set(self, name: str, value: str) -> None:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            data = {}
        data = dict(data if isinstance(data, dict) else {}, **{name: value})
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(self.path)


class TensorBoardLogger:
    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.w = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))

    def write(self, record: dict) -> None:
        for k, v in scalars(record).items():
            self.w.add_scalar(k, v, record["step"])
        self.w.flush()

    def close(self) -> None:
        self.w.close()


def wandb_settings(lc, run_dir: Path, name: str, env=None) -> dict:
    """``wandb.init`` keyword arguments: each ``loggers.wandb_*`` key, else its ``WANDB_*`` variable, else
    rltpu's default (offline, project ``rltpu``, the config's name, this run dir's saved run id)."""
    env = os.environ if env is None else env
    tags = list(lc.wandb_tags) if lc.wandb_tags is not None else \
        [t.strip() for t in env.get("WANDB_TAGS", "").split(",") if t.strip()]
    run_id = lc.wandb_id or env.get("WANDB_RUN_ID") or TrackerIds(run_dir).get("wandb")
    return {"mode": lc.wandb_mode or env.get("WANDB_MODE") or "offline",
            "project": lc.wandb_project or env.get("WANDB_PROJECT") or "rltpu",
            "entity": lc.wandb_entity or env.get("WANDB_ENTITY") or None,
            "name": lc.wandb_name or env.get("WANDB_NAME") or name,
            "tags": tags or None, "id": run_id,
            "resume": lc.wandb_resume or env.get("WANDB_RESUME") or ("allow" if run_id else None),
            "dir": env.get("WANDB_DIR") or str(run_dir)}


class WandbLogger:
    def __init__(self, run_dir: Path, cfg):
        import wandb

        self.settings = wandb_settings(cfg.loggers, run_dir, cfg.name)
        self.run = wandb.init(config=cfg.to_dict(), reinit=True, **self.settings)
        TrackerIds(run_dir).set("wandb", self.run.id)

    def write(self, record: dict) -> None:
        self.run.log(scalars(record), step=record["step"])

    def close(self) -> None:
        """``finish`` hands the last records to W&B's service process, which may still be writing the
        offline ``run-*.wandb`` file when it returns; ``teardown`` waits for the service to exit, so
        the file is complete (what ``wandb sync`` uploads) before the run reports done."""
        import wandb

        self.run.finish()
        wandb.teardown()


def mlflow_tracking_uri(run_dir: Path) -> str:
    """The run's own MLflow store when no tracking URI is given: a SQLite database in the run dir (MLflow 3
    refuses the old ``./mlruns`` file store). ``mlflow ui --backend-store-uri <this>`` browses it."""
    return f"sqlite:///{(Path(run_dir) / 'mlflow.db').resolve()}"


def mlflow_key(key: str) -> str:
    """MLflow allows alphanumerics, ``_ - . / :`` and spaces in metric names."""
    return key.replace("@", "_at_")


def _flat(d: dict, prefix: str = "") -> dict[str, str]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = json.dumps(v) if not isinstance(v, str) else v
    return out


def mlflow_settings(lc, run_dir: Path, env=None) -> dict:
    """Tracking URI and experiment: each ``loggers.mlflow_*`` key, else ``MLFLOW_TRACKING_URI`` /
    ``MLFLOW_EXPERIMENT_NAME``, else the run dir's SQLite store and ``rltpu``; ``given``: a store was named."""
    env = os.environ if env is None else env
    given = lc.mlflow_tracking_uri or env.get("MLFLOW_TRACKING_URI") or None
    return {"uri": given or mlflow_tracking_uri(run_dir), "given": given is not None,
            "experiment": lc.mlflow_experiment or env.get("MLFLOW_EXPERIMENT_NAME") or "rltpu",
            "run_id": env.get("MLFLOW_RUN_ID") or TrackerIds(run_dir).get("mlflow")}


class MLflowLogger:
    def __init__(self, run_dir: Path, cfg):
        import mlflow
        from mlflow.entities import Param

        st = mlflow_settings(cfg.loggers, run_dir)
        given, self.uri, self.experiment = st["given"], st["uri"], st["experiment"]
        self.client = mlflow.tracking.MlflowClient(tracking_uri=self.uri)
        exp = self.client.get_experiment_by_name(self.experiment)
        # the run dir's own store keeps artifacts beside it (not ./mlruns in the cwd); a given store decides
        exp_id = exp.experiment_id if exp else self.client.create_experiment(
            self.experiment, artifact_location=None if given else (Path(run_dir) / "mlartifacts").resolve().as_uri())
        self.run_id = self._resumed(st["run_id"], exp_id)
        if self.run_id is None:
            self.run_id = self.client.create_run(exp_id, run_name=cfg.name).info.run_id
            params = [Param(k, v[:6000]) for k, v in _flat(cfg.to_dict()).items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
                self.client.log_batch(self.run_id, params=params[i:i + 100])
        TrackerIds(run_dir).set("mlflow", self.run_id)

    def _resumed(self, run_id: str | None, exp_id: str) -> str | None:
        """The saved run when this store has it in this experiment (then RUNNING again), else None."""
        if not run_id:
            return None
        try:
            run = self.client.get_run(run_id)
        except Exception:  # noqa: BLE001 - MlflowException: not in this store
            return None
        if run.info.experiment_id != exp_id:
            return None
        self.client.update_run(run_id, status="RUNNING")
        return run_id

    def write(self, record: dict) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        metrics = [Metric(mlflow_key(k), v, ts, record["step"]) for k, v in scalars(record).items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class Loggers:
    """Fans a record out to every configured logger; JSONL first, so it is never lost."""

    def __init__(self, loggers: list):
        self.loggers = loggers

    def write(self, record: dict) -> None:
        for lg in self.loggers:
            lg.write(record)

    def close(self) -> None:
        for lg in self.loggers:
            lg.close()


def check_loggers(cfg) -> None:
    """Fail before Ray starts when a configured logger's library is missing."""
    for key, pkg in PACKAGES.items():
        if getattr(cfg.loggers, key) and importlib.util.find_spec(pkg) is None:
            raise ConfigError(f"loggers.{key}=true but the '{pkg}' package is not installed; "
                              f"pip install -e '.[{key}]' (or '.[loggers]' for all three) or set loggers.{key}=false")


def build_loggers(cfg, run_dir: Path, total_steps: int) -> Loggers:
    check_loggers(cfg)
    out = [MetricsWriter(Path(run_dir) / "metrics.jsonl", total_steps, cfg.progress)]
    if cfg.loggers.tensorboard:
        out.append(TensorBoardLogger(run_dir))
    if cfg.loggers.wandb:
        out.append(WandbLogger(run_dir, cfg))
    if cfg.loggers.mlflow:
        out.append(MLflowLogger(run_dir, cfg))
    return Loggers(out)
