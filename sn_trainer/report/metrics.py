"""Progress of a run as it happens: metrics.csv, a progress bar on a terminal, log lines on a pipe."""
from __future__ import annotations

import csv
import logging
import shutil
import sys
from pathlib import Path
from typing import Any

from ..callbacks import Records

log = logging.getLogger("sn_trainer")

COLUMNS = ("step", "epoch", "loss", "lr", "samples_per_sec", "eval_loss", "eval_accuracy", "eval_ema_loss",
           "eval_ema_accuracy")


class ProgressLog(Records):
    """A callback: the progress and evaluations worker 0 sends, as they arrive, in the launching process."""

    def __init__(self, out_dir: str | Path, total_steps: int, show_bar: bool | None = None):
        self.path = Path(out_dir) / "metrics.csv"
        self._file = open(self.path, "w", newline="")
        self._csv = csv.DictWriter(self._file, fieldnames=COLUMNS, extrasaction="ignore")
        self._csv.writeheader()
        self._bar = None
        if show_bar if show_bar is not None else sys.stdout.isatty():
            from tqdm import tqdm

            # A terminal that reports no width (some ptys) would get an empty bar from tqdm.
            width = shutil.get_terminal_size((100, 24)).columns
            self._bar = tqdm(total=total_steps, unit="step", ncols=width)
        self._step = 0

    def write(self, record: dict[str, Any]) -> None:
        if "eval_error" in record:  # the evaluation failed; training goes on, and so does this log
            last = record["eval_error"].strip().splitlines()[-1] if record["eval_error"].strip() else "?"
            text = (f"evaluation after step {record['step']} failed, training goes on (FitResult.eval_error and "
                    f"summary.json have the traceback): {last}")
            if self._bar is not None:
                self._bar.write(text)
            else:
                log.warning(text)
            return
        self._csv.writerow(record)
        self._file.flush()
        if "loss" not in record:  # an evaluation's record
            text = (f"epoch {record['epoch']:.2f}: eval loss {record['eval_loss']:.4f}"
                    + (f", accuracy {record['eval_accuracy']:.4f}" if "eval_accuracy" in record else "")
                    + (f"; the weights' moving average: loss {record['eval_ema_loss']:.4f}"
                       if "eval_ema_loss" in record else "")
                    + (f", accuracy {record['eval_ema_accuracy']:.4f}" if "eval_ema_accuracy" in record else ""))
            if self._bar is not None:
                self._bar.write(text)
            else:
                log.info(text)
            return
        if self._bar is not None:
            self._bar.update(record["step"] - self._step)
            self._bar.set_postfix(epoch=f"{record['epoch']:.2f}", loss=f"{record['loss']:.4f}",
                                  samples_s=f"{record['samples_per_sec']:.0f}")
        else:
            log.info("step %d (epoch %.2f): loss %.4f, lr %.4g, %.0f samples/s", record["step"], record["epoch"],
                     record["loss"], record["lr"] or 0.0, record["samples_per_sec"])
        self._step = record["step"]

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        self._file.close()
