"""Hydra callbacks: after a multirun, say how to turn its jobs into a report."""
from __future__ import annotations

from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig


class ReportHint(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        print(f"sweep done; report: python -m sn_trainer.report {config.hydra.sweep.dir}", flush=True)
