"""A run tracked in MLflow, written by the launching process (never by a worker), as TensorBoard is.

Params are the resolved config (flattened: ``optim.lr``), metrics the progress and evaluation
records (``loss``, ``lr``, ``samples_per_sec``, ``eval_*``, ``stage_ms.*``) by step, and at the end
the summary's numbers, the summary itself as an artifact and the last checkpoint's path as a
tag. The store is ``MLFLOW_TRACKING_URI`` where set, else an SQLite file beside the run
(``mlflow.db`` in the sweep's folder for a multirun, so that its jobs are one experiment's runs).

Tracking is best-effort: a store that cannot be reached or written is said once, in one warning
line, and the run goes on untracked, with its checkpoints, summary.json and weights as usual.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import time
import urllib.parse
from pathlib import Path
from typing import Any, Callable

from ..callbacks import Records

log = logging.getLogger(__name__)

TRAINING = ("loss", "lr", "samples_per_sec")
FLUSH_SECONDS = 10.0  # metrics wait at most this long in memory: each write to the store costs milliseconds of CPU
CONNECT_SECONDS = 5  # what a tracking server that is down from the start may cost the run, once
# MLflow's HTTP client retries for minutes by default (hosted servers rate-limit); a tracker that is
# best-effort gets seconds per call, so that a server gone mid-run stalls the launcher briefly, once.
# The user's own settings of these win.
HTTP_LIMITS = {"MLFLOW_HTTP_REQUEST_TIMEOUT": str(CONNECT_SECONDS), "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
               "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}


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


def unreachable(uri: str, seconds: float = CONNECT_SECONDS) -> str | None:
    """Why the tracking server at an http(s) ``uri`` takes no connection within ``seconds``;
    None when it does, or when ``uri`` names no server (a file, SQLite)."""
    parts = urllib.parse.urlsplit(uri)
    if parts.scheme not in ("http", "https"):
        return None
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        with socket.create_connection((parts.hostname, port), timeout=seconds):
            return None
    except (OSError, ValueError) as exc:  # refused, timed out, no such host, a port that is no number
        return str(exc) or type(exc).__name__


@contextlib.contextmanager
def _bounded_http():
    """For this block only: HTTP_LIMITS in the environment, where MLflow reads them at each request,
    and urllib3's line per retry held back (a failure is said once, by MLflowLog)."""
    unset = {name: value for name, value in HTTP_LIMITS.items() if name not in os.environ}
    retries = logging.getLogger("urllib3.connectionpool")
    level = retries.level
    os.environ.update(unset)
    retries.setLevel(logging.ERROR)
    try:
        yield
    finally:
        retries.setLevel(level)
        for name in unset:
            os.environ.pop(name, None)


def _shown(uri: str) -> str:
    """``uri`` as a log may show it: without the password of ``user:password@host``."""
    parts = urllib.parse.urlsplit(uri)
    if parts.password is None:
        return uri
    return urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@", 1)))


def _one_line(exc: BaseException, half: int = 300) -> str:
    """An error as one line; a long one keeps its first and last ``half`` characters: what failed,
    and the cause MLflow's HTTP errors end with (SQL errors carry whole statements between)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 2 * half else f"{text[:half]} ... {text[-half:]}"


class MLflowLog(Records):
    """A callback: one MLflow run in ``experiment`` named ``run_name``, with ``params``; untracked
    (``tracking`` false) from the first call to the store that fails."""

    def __init__(self, uri: str, experiment: str, run_name: str, params: dict[str, Any],
                 artifacts: str | Path | None = None):
        """``artifacts``: the folder a new experiment keeps its files in (None: the store's default)."""
        self.uri = uri
        self.tracking = True
        self._pending: list = []
        self._flushed = time.monotonic()
        problem = unreachable(uri)
        if problem:
            self.tracking = False
            log.warning("MLflow at %s is not reachable within %d s (%s); the run goes on untracked", _shown(uri),
                        CONNECT_SECONDS, problem)
            return
        self._store(self._start, experiment, run_name, params, artifacts)

    def _store(self, call: Callable[..., None], *args) -> None:
        """``call(*args)`` against the store while tracking; its failure is said once and ends tracking."""
        if not self.tracking:
            return
        try:
            with _bounded_http():
                call(*args)
        except Exception as exc:  # HTTP, SQL, a disk: whatever the store fails with, a tracker never stops training
            self.tracking, self._pending = False, []
            log.warning("MLflow at %s failed: %s; the run goes on untracked", _shown(self.uri), _one_line(exc))

    def _start(self, experiment: str, run_name: str, params: dict[str, Any], artifacts: str | Path | None) -> None:
        from mlflow import MlflowClient  # here: its import costs a second or two
        from mlflow.entities import Param

        self.client = MlflowClient(tracking_uri=self.uri)
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(
            experiment, artifact_location=Path(artifacts).resolve().as_uri() if artifacts else None)
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        params = [Param(k, v) for k, v in flatten(params).items()]
        for first in range(0, len(params), 100):  # a batch holds at most 100 params
            self.client.log_batch(self.run_id, params=params[first : first + 100])

    def _add(self, metrics: dict[str, Any], step: int, flush: bool = False) -> None:
        """Keep ``metrics`` of ``step``; write what is kept when ``flush``, or FLUSH_SECONDS after the last write."""
        if not self.tracking:
            return
        from mlflow.entities import Metric

        now = int(1000 * time.time())
        self._pending += [Metric(k, float(v), now, step) for k, v in metrics.items()
                          if v is not None and math.isfinite(float(v))]
        if flush or time.monotonic() - self._flushed >= FLUSH_SECONDS:
            self._store(self._write_pending)
            self._pending, self._flushed = [], time.monotonic()

    def _write_pending(self) -> None:
        for first in range(0, len(self._pending), 1000):  # a batch holds at most 1000 metrics
            self.client.log_batch(self.run_id, metrics=self._pending[first : first + 1000])

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
        self._store(self._finish, summary, failed)

    def _finish(self, summary: dict[str, Any] | None, failed: bool) -> None:
        if summary is not None:
            if summary.get("last_checkpoint"):
                self.client.set_tag(self.run_id, "last_checkpoint", str(summary["last_checkpoint"]))
            self.client.log_dict(self.run_id, summary, "summary.json")
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")
