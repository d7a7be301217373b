"""Callbacks: code that runs in the launching process as a run's events arrive from the workers.

A callback overrides the methods it cares about. Each runs in the process that called ``fit``,
never in a worker, so it may keep state, write files and read the trainer. Two requests go back
to the workers: ``trainer.should_stop = True`` ends the run after the current step (with a
checkpoint, when the run keeps them), and fit returns normally; ``trainer.should_checkpoint =
True``, set in ``on_eval_end``, checkpoints the step just evaluated. Both take effect right
after an evaluation (the workers wait for the launcher there); a stop asked in ``on_step_end``
takes effect at the next step the workers finish.
"""
from __future__ import annotations

import logging
import os
import shutil
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from .engine.events import CheckpointPart, Evaluation, Progress
from .errors import ConfigError

log = logging.getLogger(__name__)


class Callback:
    """The hooks of a run; every one does nothing unless overridden."""

    def on_fit_start(self, trainer, plan) -> None:
        """Before the workers start; ``plan`` is what the run was resolved to (``engine.plan.Plan``)."""

    def on_step_end(self, trainer, record: Progress) -> None:
        """A logged step (every ``log_every`` steps, each epoch's end, the last step)."""

    def on_eval_end(self, trainer, evaluation: Evaluation) -> None:
        """An evaluation (after each epoch, or every ``eval_every`` steps, and after the last)."""

    def on_checkpoint_part(self, trainer, part: CheckpointPart) -> None:
        """A worker's share of a checkpoint (``part.rank``; the run's checkpoint writer gathers them)."""

    def on_checkpoint(self, trainer, path: Path) -> None:
        """A checkpoint was written to ``path``."""

    def on_fit_end(self, trainer, result) -> None:
        """The run ended normally; ``result`` is the FitResult fit returns."""


class Callbacks:
    """The run's callbacks, called in order, each hook by name (Lightning Fabric's ``call``)."""

    def __init__(self, callbacks: Iterable[Callback]):
        self.callbacks = list(callbacks)
        for callback in self.callbacks:
            if not isinstance(callback, Callback):
                raise ConfigError(f"callbacks must be sn_trainer.Callback objects, got {type(callback).__name__}; "
                                  "subclass sn_trainer.Callback and override its on_* methods")

    def call(self, hook: str, *args: Any) -> None:
        """Every callback's method ``hook``, in order; a callback without one is passed over (an event
        a newer engine sends reaches only the callbacks that know it)."""
        for callback in self.callbacks:
            method = getattr(callback, hook, None)
            if method is not None:
                method(*args)

    def event(self, trainer, event: Any) -> None:
        """Hand a worker's event to the hook it names (``event.hook``)."""
        self.call(type(event).hook, trainer, event)


class Records(Callback):
    """A callback that takes every progress and evaluation record as a plain dict, in ``write``
    (what metrics.csv, TensorBoard, MLflow, history and on_log all want)."""

    def on_step_end(self, trainer, record: Progress) -> None:
        self.write(record.record())

    def on_eval_end(self, trainer, evaluation: Evaluation) -> None:
        self.write(evaluation.record())

    def write(self, record: dict[str, Any]) -> None:
        raise NotImplementedError


class History(Records):
    """Every record, as plain dicts, for ``FitResult.history``."""

    def __init__(self):
        self.records: list[dict[str, Any]] = []

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(record)


class OnLog(Records):
    """``fit(on_log=f)``: ``f(record)`` with each record as a plain dict, as it arrives."""

    def __init__(self, function: Callable[[dict[str, Any]], None]):
        self.function = function

    def write(self, record: dict[str, Any]) -> None:
        self.function(record)


def in_notebook() -> bool:
    """Whether this process is a Jupyter kernel (a notebook's cells run in it)."""
    if "IPython" not in sys.modules:
        return False
    shell = sys.modules["IPython"].get_ipython()
    return shell is not None and "IPKernelApp" in shell.config


class NotebookBar(Callback):
    """In a notebook, fit's progress: tqdm's notebook bar over the steps, with the loss, samples/s
    and the last evaluation (fit adds it when it runs in a Jupyter kernel)."""

    def __init__(self):
        self._bar, self._step, self._shown = None, 0, {}

    def on_fit_start(self, trainer, plan) -> None:
        from tqdm.auto import tqdm  # the notebook bar in a kernel with ipywidgets, else text

        self._bar = tqdm(total=plan.total_steps, unit="step", desc="sn_trainer")

    def on_step_end(self, trainer, record: Progress) -> None:
        self._bar.update(record.step - self._step)
        self._step = record.step
        self._shown.update(loss=f"{record.loss:.4f}", samples_s=f"{record.samples_per_sec:.0f}")
        self._bar.set_postfix(self._shown)

    def on_eval_end(self, trainer, evaluation: Evaluation) -> None:
        self._shown.update({k[5:]: f"{v:.4f}" for k, v in evaluation.metrics.items()
                            if k in ("eval_loss", "eval_accuracy")})
        self._bar.set_postfix(self._shown)

    def on_fit_end(self, trainer, result) -> None:
        self._bar.close()


def _better(mode: str, min_delta: float) -> Callable[[float, float | None], bool]:
    if mode not in ("min", "max"):
        raise ConfigError(f"mode must be 'min' or 'max', got {mode!r}")
    if mode == "min":
        return lambda value, best: best is None or value < best - min_delta
    return lambda value, best: best is None or value > best + min_delta


def _monitored(evaluation: Evaluation, monitor: str, who: str) -> float:
    if monitor not in evaluation.metrics:
        reported = ", ".join(sorted(k for k in evaluation.metrics if k.startswith("eval_"))) or "nothing"
        raise ConfigError(f"{who} monitors {monitor}, which evaluation does not report (it reports {reported}); "
                          "set monitor to one of those")
    return float(evaluation.metrics[monitor])


class EarlyStopping(Callback):
    """Stop when ``monitor`` has not improved for ``patience`` evaluations in a row.

    Improved means below the best so far by more than ``min_delta`` (``mode="min"``), or above
    it (``mode="max"``). The run stops right after the evaluation that ran out of patience.
    """

    def __init__(self, monitor: str = "eval_loss", mode: str = "min", patience: int = 3, min_delta: float = 0.0):
        if not (isinstance(patience, int) and patience >= 1):
            raise ConfigError(f"EarlyStopping's patience must be an integer >= 1, got {patience!r}")
        self.monitor, self.patience = monitor, patience
        self._improved = _better(mode, min_delta)
        self.best: float | None = None
        self.waited = 0
        self.stopped_after: int | None = None  # the step after which it stopped the run

    def on_eval_end(self, trainer, evaluation: Evaluation) -> None:
        value = _monitored(evaluation, self.monitor, "EarlyStopping")
        if self._improved(value, self.best):
            self.best, self.waited = value, 0
            return
        self.waited += 1
        if self.waited >= self.patience:
            trainer.should_stop = True
            self.stopped_after = evaluation.step
            log.info("early stopping after step %d: %s has not improved on %.6g for %d evaluations",
                     evaluation.step, self.monitor, self.best, self.waited)


class BestCheckpoint(Callback):
    """Keep the checkpoint of the best ``monitor`` so far as ``<checkpoint dir>/best.pt``, beside
    the latest ones (which ``checkpoint_keep`` prunes; this one it does not touch). Resumable like
    any checkpoint: ``resume=<dir>/best.pt``."""

    def __init__(self, monitor: str = "eval_loss", mode: str = "min", min_delta: float = 0.0,
                 filename: str = "best.pt"):
        self.monitor, self.filename = monitor, filename
        self._improved = _better(mode, min_delta)
        self.best: float | None = None
        self.best_step: int | None = None
        self.path: Path | None = None  # where the best checkpoint is, once there is one
        self._wanted: int | None = None

    def on_fit_start(self, trainer, plan) -> None:
        if not trainer.config.checkpoint.dir:
            raise ConfigError("BestCheckpoint needs checkpoints: set checkpoint_dir")

    def on_eval_end(self, trainer, evaluation: Evaluation) -> None:
        value = _monitored(evaluation, self.monitor, "BestCheckpoint")
        if self._improved(value, self.best):
            self.best, self._wanted = value, evaluation.step
            trainer.should_checkpoint = True

    def on_checkpoint(self, trainer, path: Path) -> None:
        if self._wanted is None or not Path(path).name.endswith(f"{self._wanted:09d}.pt"):
            return
        target = Path(path).with_name(self.filename)
        temporary = target.with_name(f".{self.filename}.tmp-{os.getpid()}")
        shutil.copyfile(path, temporary)  # the pruning of step files never removes it
        os.chmod(temporary, 0o600)
        os.replace(temporary, target)
        self.path, self.best_step, self._wanted = target, self._wanted, None
        log.info("best checkpoint (%s %.6g at step %d): %s", self.monitor, self.best, self.best_step, target)
