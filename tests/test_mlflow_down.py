"""A tracker is best-effort: an MLflow store that is down from the start, goes away mid-run or
cannot be written is said once, in one warning line, and the run trains on untracked, with its
checkpoints, summary.json and weights, and exits 0."""
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from test_cli import TINY, sn_train

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


def test_a_server_down_from_the_start_costs_seconds_and_the_run_trains_untracked(tmp_path):
    uri = f"http://127.0.0.1:{closed_port()}"
    started = time.monotonic()
    # MLflow's HTTP client alone retries a refused connection for minutes
    proc = sn_train([*RUN, f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, env={"MLFLOW_TRACKING_URI": uri},
                    timeout=60)
    assert time.monotonic() - started < 60
    assert_trained(proc, tmp_path / "run")
    [line] = about(tmp_path / "run", "127.0.0.1")
    assert "[WARNING]" in line and f"MLflow at {uri} is not reachable" in line and "refused" in line
    assert line.endswith("the run goes on untracked")


class FakeTracking(BaseHTTPRequestHandler):
    """The REST calls of a run's start (experiment, run, params) and its first batch of metrics."""

    def do_GET(self):
        if self.path.startswith("/api/2.0/mlflow/experiments/get-by-name"):
            self.reply(404, {"error_code": "RESOURCE_DOES_NOT_EXIST", "message": "no such experiment"})
        else:
            self.reply(404, {"error_code": "ENDPOINT_NOT_FOUND", "message": self.path})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        endpoint = self.path.removeprefix("/api/2.0/mlflow/")
        self.server.calls.append(endpoint)
        if endpoint == "experiments/create":
            self.reply(200, {"experiment_id": "1"})
        elif endpoint == "runs/create":
            self.reply(200, {"run": {"info": {"run_id": "r1", "experiment_id": "1", "status": "RUNNING"}, "data": {}}})
        elif endpoint == "runs/log-batch":
            self.reply(200, {})
            if body.get("metrics"):
                self.server.gone.set()  # the run has started: from now on there is no server
        else:
            self.reply(404, {"error_code": "ENDPOINT_NOT_FOUND", "message": self.path})

    def reply(self, status: int, answer: dict) -> None:
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


class GoingAway(HTTPServer):
    """A tracking server that goes away once it has answered a run's first batch of metrics."""

    def __init__(self):
        super().__init__(("127.0.0.1", 0), FakeTracking)
        self.calls: list[str] = []
        self.gone = threading.Event()

    def verify_request(self, request, client_address) -> bool:
        return not self.gone.is_set()  # until the socket is closed, a connection is dropped unanswered

    def go_away(self) -> None:
        self.gone.wait()
        self.shutdown()
        self.server_close()


def test_a_server_gone_mid_run_is_said_once_and_the_run_finishes(tmp_path):
    server = GoingAway()
    uri = f"http://127.0.0.1:{server.server_address[1]}"
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    leaving = threading.Thread(target=server.go_away, daemon=True)
    leaving.start()
    try:
        proc = sn_train([*RUN, f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, env={"MLFLOW_TRACKING_URI": uri},
                        timeout=90)
    finally:
        server.gone.set()
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
