"""A run's progress as TensorBoard scalars, written by the launching process (never by a worker).

``tensorboard --logdir outputs/`` (or ``multirun/...``) shows every run under it; each multirun
job also records its hyper-parameters, so TensorBoard's HParams view compares a sweep.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import psutil

from ..callbacks import Records

SCALARS = {"loss": "train/loss", "lr": "train/lr", "samples_per_sec": "speed/samples_per_sec",
           "tokens_per_sec": "speed/tokens_per_sec"}


class TensorBoardLog(Records):
    """A callback: the progress and evaluations worker 0 sends, as events in ``out_dir``."""

    def __init__(self, out_dir: str | Path, tokens_per_sample: int | None = None):
        from torch.utils.tensorboard import SummaryWriter  # here: its import costs a second or two

        self.writer = SummaryWriter(log_dir=str(out_dir))
        self.tokens_per_sample = tokens_per_sample
        psutil.cpu_percent(percpu=True)  # starts the first per-core interval

    def write(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        for key, value in record.items():
            if value is None:
                continue
            if key in SCALARS:
                self.writer.add_scalar(SCALARS[key], value, step)
            elif key == "eval_error":  # a failed evaluation: its traceback, as text
                self.writer.add_text("eval/error", f"```\n{value}\n```", step)
            elif key.startswith("eval_") and key != "eval_samples":
                self.writer.add_scalar(f"eval/{key[5:]}", value, step)
            elif key == "stage_ms":
                for stage, ms in value.items():
                    self.writer.add_scalar(f"stage_ms/{stage}", ms, step)
        if "samples_per_sec" in record and self.tokens_per_sample:
            self.writer.add_scalar(SCALARS["tokens_per_sec"], record["samples_per_sec"] * self.tokens_per_sample, step)
        if "loss" in record:  # a training record: the machine's cores since the last one
            for core, percent in enumerate(psutil.cpu_percent(percpu=True)):
                self.writer.add_scalar(f"cpu_percent/core{core}", percent, step)

    def close(self, hparams: dict[str, Any] | None = None, metrics: dict[str, float] | None = None) -> None:
        if hparams and metrics:
            self.writer.add_hparams(_plain(hparams), {f"hparam/{k}": v for k, v in metrics.items() if v is not None},
                                    run_name=".")
        self.writer.close()


def _plain(values: dict[str, Any]) -> dict[str, Any]:
    """Hyper-parameters as TensorBoard takes them: numbers, strings and booleans."""
    return {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in values.items()}
