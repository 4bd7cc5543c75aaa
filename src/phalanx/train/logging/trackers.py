"""Experiment trackers through their own clients: Weights & Biases and MLflow.

Rank 0 alone makes them (metrics.py's rule), and the numbers it hands them are
already reduced over ranks: one run per job, not one per rank. Names follow
Hugging Face's integrations, so dashboards built for its Trainer keep working:
W&B and TensorBoard get `train/loss`, `eval/loss` (`rewrite_logs`); MLflow
gets the keys as logged. Both record the TrainingArguments as the run's
config / params. Each package is optional (`pip install wandb`, `pip install
mlflow-skinny`); naming one that is missing is a ConfigurationError when the
arguments are made.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from phalanx.errors import ConfigurationError

MLFLOW_DIR = "mlruns"
MLFLOW_PARAM_LIMIT = 500
"""MLflow refuses parameter values longer than this (its own limit, in characters)."""


def rewrite_logs(metrics: Mapping[str, float]) -> dict[str, float]:
    """Hugging Face's names: `eval_x` -> `eval/x`, `test_x` -> `test/x`, else `train/x`."""
    out: dict[str, float] = {}
    for name, value in metrics.items():
        for prefix in ("eval_", "test_"):
            if name.startswith(prefix):
                out[f"{prefix[:-1]}/{name[len(prefix) :]}"] = value
                break
        else:
            out[f"train/{name}"] = value
    return out


class WandbSink:
    """A W&B run (project: WANDB_PROJECT, else "phalanx"); its files go under
    output_dir/wandb. Offline (WANDB_MODE=offline) the run stays there for `wandb sync`."""

    def __init__(self, output_dir: Path, config: Mapping[str, Any], run_name: str) -> None:
        import wandb

        try:
            self._run = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "phalanx"),
                name=run_name,
                dir=str(output_dir),
                config=dict(config),
                reinit="create_new",
            )
        except Exception as exc:  # no login, no network: wandb's own error says which
            raise ConfigurationError(
                f"wandb could not start a run ({type(exc).__name__}: {str(exc).splitlines()[0]}) "
                "— log in (wandb login), set WANDB_MODE=offline, or drop wandb from report_to"
            ) from None
        self.path = Path(self._run.dir)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self._run.log(rewrite_logs(metrics), step=step)

    def close(self) -> None:
        self._run.finish()


class MlflowSink:
    """An MLflow run in experiment MLFLOW_EXPERIMENT_NAME (else "phalanx") on the tracking
    server MLFLOW_TRACKING_URI names, else in the local store output_dir/mlruns."""

    def __init__(self, output_dir: Path, config: Mapping[str, Any], run_name: str) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or (output_dir / MLFLOW_DIR).resolve().as_uri()
        if uri.startswith("file:"):
            # MLflow 3 keeps its file store (what a local run without a server uses) behind
            # this switch; a tracking server or database is chosen with MLFLOW_TRACKING_URI.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.uri = uri
        self._client = MlflowClient(uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "phalanx")
        experiment = self._client.get_experiment_by_name(name)
        experiment_id = (
            experiment.experiment_id if experiment else self._client.create_experiment(name)
        )
        self.run_id: str = self._client.create_run(experiment_id, run_name=run_name).info.run_id
        params = [Param(k, str(v)[:MLFLOW_PARAM_LIMIT]) for k, v in config.items()]
        self._client.log_batch(self.run_id, params=params)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v in metrics.items()]
        self._client.log_batch(self.run_id, metrics=batch)

    def close(self) -> None:
        self._client.set_terminated(self.run_id)
