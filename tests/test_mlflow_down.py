"""A tracker is best-effort: an MLflow store that is down from the start, goes away mid-run or
cannot be written is said once, in one warning line, and the run trains on untracked, with its
checkpoints, summary.json and weights, and exits 0."""
import json
import socket
import threading
import time
from pathlib import Path

import pytest

from test_cli import TINY, sn_train
from tracking_stub import TrackingStub  # a stand-in server that can go away, shared with scripts/chaos.py

pytestmark = pytest.mark.timeout(180)

RUN = [*TINY, "max_steps=6", "eval_every=2", "workers=1", "logger=mlflow"]


def about(out: Path, store: str) -> list[str]:
    """The run log's lines that name the tracking store at ``store`` (its host, its path)."""
    return [line for line in (out / "__main__.log").read_text().splitlines() if store in line]


def assert_trained(proc, out: Path) -> None:
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["weights"] == ["model.safetensors"]
    assert Path(summary["last_checkpoint"]).is_file() and (out / "model.safetensors").stat().st_size > 0


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize("user", [pytest.param("", marks=pytest.mark.quick), "ann:secret@"])
def test_a_server_down_from_the_start_costs_seconds_and_the_run_trains_untracked(tmp_path, user):
    uri = f"http://{user}127.0.0.1:{closed_port()}"
    started = time.monotonic()
    # MLflow's HTTP client alone retries a refused connection for minutes
    proc = sn_train([*RUN, f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, env={"MLFLOW_TRACKING_URI": uri},
                    timeout=60)
    assert time.monotonic() - started < 60
    assert_trained(proc, tmp_path / "run")
    [line] = about(tmp_path / "run", "127.0.0.1")
    shown = uri.replace(":secret@", ":***@")  # a password is never logged
    assert "[WARNING]" in line and f"MLflow at {shown} is not reachable" in line and "refused" in line
    assert line.endswith("the run goes on untracked")


def test_a_server_gone_mid_run_is_said_once_and_the_run_finishes(tmp_path):
    server = TrackingStub(leaves_after_metrics=True).start()

    def leave_once_metrics_came():
        server.metrics_seen.wait()  # the run has started: from now on there is no server
        server.go_away()

    leaving = threading.Thread(target=leave_once_metrics_came, daemon=True)
    leaving.start()
    uri = server.uri
    try:
        proc = sn_train([*RUN, f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, env={"MLFLOW_TRACKING_URI": uri},
                        timeout=90)
    finally:
        server.metrics_seen.set()
        leaving.join(timeout=10)
    assert server.calls == ["experiments/create", "runs/create", "runs/log-batch", "runs/log-batch"]  # params, metrics
    assert_trained(proc, tmp_path / "run")
    [line] = about(tmp_path / "run", "127.0.0.1")  # and no line per retry
    assert "[WARNING]" in line and f"MLflow at {uri} failed: " in line
    assert line.endswith("the run goes on untracked")
    log = (tmp_path / "run" / "__main__.log").read_text()
    assert log.index("step 2 ") < log.index(line) < log.index("step 6 ")  # said mid-run; training went on


def test_an_unwritable_store_is_said_once_and_the_run_finishes(tmp_path):
    proc = sn_train([*RUN, f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path,
                    env={"MLFLOW_TRACKING_URI": "sqlite:////proc/nonexistent/mlflow.db"}, timeout=90)
    assert_trained(proc, tmp_path / "run")
    [line] = about(tmp_path / "run", "/proc/nonexistent")
    assert "[WARNING]" in line and "MLflow at sqlite:////proc/nonexistent/mlflow.db failed: " in line
    assert "No such file or directory" in line and line.endswith("the run goes on untracked")
