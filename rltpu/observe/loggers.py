"""Where step metrics go, behind one interface (``write(record)``, ``close()``).

``metrics.jsonl`` is always written (``rltpu.observe.metrics.MetricsWriter``). TensorBoard event files,
Weights & Biases (offline mode, files only) and MLflow (a SQLite store, ``run_dir/mlflow.db``) are added when
``loggers.*`` asks for them; each library is an optional extra (``pip install -e '.[loggers]'``)
imported only then, and a configured but missing one is a one-line error naming the fix.
Every numeric field of a record is logged at ``step``; lists and strings stay in the JSONL. Evaluation
figures are ``eval/...`` keys (``eval/accuracy``, ``eval/pass@k``, ``eval/mean@k``): TensorBoard and
W&B group them under ``eval``; MLflow, whose names may not hold ``@``, gets ``eval/pass_at_k``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from rltpu.config import ConfigError
from rltpu.observe.metrics import MetricsWriter

PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


def scalars(record: dict) -> dict[str, float]:
    return {k: float(v) for k, v in record.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}


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


class WandbLogger:
    def __init__(self, run_dir: Path, name: str, config: dict):
        import wandb

        self.run = wandb.init(project="rltpu", name=name, dir=str(run_dir), mode="offline", config=config,
                              reinit=True)

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
    """The run's own MLflow store: a SQLite database in the run dir (MLflow 3 refuses the old
    ``./mlruns`` file store). ``mlflow ui --backend-store-uri <this>`` browses it."""
    return f"sqlite:///{(Path(run_dir) / 'mlflow.db').resolve()}"


def mlflow_key(key: str) -> str:
    """MLflow allows alphanumerics, ``_ - . / :`` and spaces in metric names."""
    return key.replace("@", "_at_")


class MLflowLogger:
    def __init__(self, run_dir: Path, name: str):
        import mlflow

        self.client = mlflow.tracking.MlflowClient(tracking_uri=mlflow_tracking_uri(run_dir))
        exp = self.client.get_experiment_by_name("rltpu")
        exp_id = exp.experiment_id if exp else self.client.create_experiment(
            "rltpu", artifact_location=(Path(run_dir) / "mlartifacts").resolve().as_uri())  # not ./mlruns in the cwd
        self.run_id = self.client.create_run(exp_id, run_name=name).info.run_id

    def write(self, record: dict) -> None:
        for k, v in scalars(record).items():
            self.client.log_metric(self.run_id, mlflow_key(k), v, step=record["step"])

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
                              f"pip install -e '.[loggers]' or set loggers.{key}=false")


def build_loggers(cfg, run_dir: Path, total_steps: int) -> Loggers:
    check_loggers(cfg)
    out = [MetricsWriter(Path(run_dir) / "metrics.jsonl", total_steps, cfg.progress)]
    if cfg.loggers.tensorboard:
        out.append(TensorBoardLogger(run_dir))
    if cfg.loggers.wandb:
        out.append(WandbLogger(run_dir, cfg.name, cfg.to_dict()))
    if cfg.loggers.mlflow:
        out.append(MLflowLogger(run_dir, cfg.name))
    return Loggers(out)
