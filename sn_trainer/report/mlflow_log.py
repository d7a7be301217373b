"""A run tracked in MLflow, written by the launching process (never by a worker), as TensorBoard is.

Params are the resolved config (flattened: ``optim.lr``), metrics the progress and evaluation
records (``loss``, ``lr``, ``samples_per_sec``, ``eval_*``, ``stage_ms.*``) by step, and at the end
the summary's numbers, the summary itself as an artifact and the last checkpoint's path as a
tag. The store is ``MLFLOW_TRACKING_URI`` where set, else an SQLite file beside the run
(``mlflow.db`` in the sweep's folder for a multirun, so that its jobs are one experiment's runs).
"""
from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

from ..callbacks import Records

TRAINING = ("loss", "lr", "samples_per_sec")
FLUSH_SECONDS = 10.0  # metrics wait at most this long in memory: each write to the store costs milliseconds of CPU


def default_uri(store_dir: str | Path) -> str:
    """Where runs go: MLFLOW_TRACKING_URI, else ``store_dir/mlflow.db``."""
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    return f"sqlite:///{Path(store_dir).resolve() / 'mlflow.db'}"


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested sections as dotted keys, values as MLflow keeps params (strings, at most 6000 long)."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = str(value)[:6000]
    return flat


class MLflowLog(Records):
    """A callback: one MLflow run in ``experiment`` named ``run_name``, with ``params``."""

    def __init__(self, uri: str, experiment: str, run_name: str, params: dict[str, Any],
                 artifacts: str | Path | None = None):
        """``artifacts``: the folder a new experiment keeps its files in (None: the store's default)."""
        from mlflow import MlflowClient  # here: its import costs a second or two

        self.client = MlflowClient(tracking_uri=uri)
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(
            experiment, artifact_location=Path(artifacts).resolve().as_uri() if artifacts else None)
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        from mlflow.entities import Param

        params = [Param(k, v) for k, v in flatten(params).items()]
        for first in range(0, len(params), 100):  # a batch holds at most 100 params
            self.client.log_batch(self.run_id, params=params[first : first + 100])
        self._pending: list = []
        self._flushed = time.monotonic()

    def _add(self, metrics: dict[str, Any], step: int, flush: bool = False) -> None:
        """Keep ``metrics`` of ``step``; write what is kept when ``flush``, or FLUSH_SECONDS after the last write."""
        from mlflow.entities import Metric

        now = int(1000 * time.time())
        self._pending += [Metric(k, float(v), now, step) for k, v in metrics.items()
                          if v is not None and math.isfinite(float(v))]
        if flush or time.monotonic() - self._flushed >= FLUSH_SECONDS:
            for first in range(0, len(self._pending), 1000):  # a batch holds at most 1000 metrics
                self.client.log_batch(self.run_id, metrics=self._pending[first : first + 1000])
            self._pending, self._flushed = [], time.monotonic()

    def on_eval_end(self, trainer, evaluation) -> None:
        self.write(evaluation.record(), flush=True)  # an evaluation is what a sweep's watcher waits for

    def write(self, record: dict[str, Any], flush: bool = False) -> None:
        metrics = {k: record[k] for k in TRAINING if record.get(k) is not None}
        metrics.update({k: v for k, v in record.items()
                        if k.startswith("eval_") and k != "eval_samples" and isinstance(v, (int, float))})
        metrics.update({f"stage_ms.{stage}": ms for stage, ms in (record.get("stage_ms") or {}).items()})
        self._add(metrics, int(record["step"]), flush)

    def close(self, summary: dict[str, Any] | None = None, failed: bool = False) -> None:
        """End the run: the summary's numbers as final metrics, the summary as ``summary.json``."""
        if summary is not None:
            numbers = {f"final.{k}": v for k, v in summary.items()
                       if isinstance(v, (int, float)) and not isinstance(v, bool)}
            self._add(numbers, int(summary.get("steps") or 0))
        self._add({}, 0, flush=True)
        if summary is not None:
            if summary.get("last_checkpoint"):
                self.client.set_tag(self.run_id, "last_checkpoint", str(summary["last_checkpoint"]))
            self.client.log_dict(self.run_id, summary, "summary.json")
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")
