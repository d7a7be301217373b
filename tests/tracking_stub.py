"""A stand-in MLflow tracking server that can go away: it answers the REST calls of a run's start
(experiment, run, params) and its metrics, and ``go_away()`` drops every connection from then on
and closes its socket, as a server that dies mid-run. For the tests and scripts/chaos.py, which
have no MLflow server (MLflow's own needs Flask) and must not need the network.

    python tests/tracking_stub.py        # serves on a free port of 127.0.0.1, printed
"""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer


class _Handler(BaseHTTPRequestHandler):
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
                if self.server.leaves_after_metrics:
                    self.server._gone.set()  # no call after this one is answered
                self.server.metrics_seen.set()
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


class TrackingStub(HTTPServer):
    """Serves from a thread of its own once started; ``calls`` lists the endpoints posted to, and
    ``metrics_seen`` is set by the first batch that carries metrics (after which, with
    ``leaves_after_metrics``, nothing more is answered)."""

    def __init__(self, leaves_after_metrics: bool = False):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.leaves_after_metrics = leaves_after_metrics
        self.calls: list[str] = []
        self.metrics_seen = threading.Event()
        self._gone = threading.Event()

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def start(self) -> "TrackingStub":
        threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def verify_request(self, request, client_address) -> bool:
        return not self._gone.is_set()  # until the socket is closed, a connection is dropped unanswered

    def go_away(self) -> None:
        self._gone.set()
        self.shutdown()
        self.server_close()


if __name__ == "__main__":
    stub = TrackingStub()
    print(stub.uri, flush=True)
    stub.serve_forever()
