"""Callbacks: code that runs in the launching process as a run's events arrive from the workers.

A callback overrides the methods it cares about. Each runs in the process that called ``fit``,
never in a worker, so it may keep state, write files and read the trainer. Two requests go back
to the workers: ``trainer.should_stop = True`` ends the run after the current step (with a
checkpoint, when the run keeps them), and fit returns normally; ``trainer.should_checkpoint =
True``, set in ``on_eval_end``, checkpoints the step just evaluated. Both apply to the step the
callback was told of: the workers wait for the launcher after each evaluation, and after each
progress record where a callback may act on one. A callback that raises once training has
started is reported and training goes on: callbacks are side effects.
"""
from __future__ import annotations

import logging
import math
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
    """The hooks of a run; every one does nothing unless overridden.

    A callback may stop the run (``trainer.should_stop``) or ask for a checkpoint in any hook, and
    what it asks applies to the step it was told of: after a progress record the workers wait for
    the callbacks that override ``on_step_end`` (after an evaluation, for all). A callback that
    only watches (writes logs, draws) says so with ``observes_only = True``: the workers need not
    wait for it.
    """

    observes_only = False
    # Whether the run ends when this callback raises (the run's own checkpoint writer): a side
    # effect's failure (a logger, a tracker, the user's) is reported and training goes on.
    essential = False

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

    def on_restart(self, trainer, step: int) -> None:
        """The workers start again from step ``step`` (a restart after one failed, from the last
        checkpoint or from the beginning): what came after it is to be forgotten."""

    def state_dict(self) -> dict[str, Any] | None:
        """What of this callback every checkpoint keeps, as plain data (numbers, strings, lists,
        dicts), so that a resume or a restart goes on from where the checkpoint's step left it
        (the best so far, the patience left); None (the default): it keeps nothing."""
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from what ``state_dict`` gave at a checkpoint."""


class Callbacks:
    """The run's callbacks, called in order, each hook by name (Lightning Fabric's ``call``)."""

    def __init__(self, callbacks: Iterable[Callback]):
        self.callbacks = list(callbacks)
        self._failed: set[tuple[int, str]] = set()
        for callback in self.callbacks:
            if not isinstance(callback, Callback):
                raise ConfigError(f"callbacks must be sn_trainer.Callback objects, got {type(callback).__name__}; "
                                  "subclass sn_trainer.Callback and override its on_* methods")

    def call(self, hook: str, *args: Any) -> None:
        """Every callback's method ``hook``, in order; a callback without one is passed over (an event
        a newer engine sends reaches only the callbacks that know it). Once training has started (any
        hook but ``on_fit_start``, which checks a run's set-up), a callback that is not ``essential``
        and raises is reported, with its traceback the first time, and the others and training go on."""
        for callback in self.callbacks:
            method = getattr(callback, hook, None)
            if method is None:
                continue
            if callback.essential or hook == "on_fit_start":
                method(*args)
                continue
            try:
                method(*args)
            except Exception:  # noqa: BLE001 - a side effect never takes training down
                self._report_failure(callback, hook)

    def _report_failure(self, callback: Callback, hook: str) -> None:
        key = (id(callback), hook)
        if key not in self._failed:
            self._failed.add(key)
            log.error("callback %s failed in %s; training goes on (its later failures there are not shown)",
                      type(callback).__qualname__, hook, exc_info=True)

    def event(self, trainer, event: Any) -> None:
        """Hand a worker's event to the hook it names (``event.hook``)."""
        self.call(type(event).hook, trainer, event)

    def states(self) -> dict[str, dict[str, Any]]:
        """Every stateful callback's ``state_dict``, keyed by its class and place among that class's."""
        return {key: state for key, callback in self._keyed() if (state := callback.state_dict()) is not None}

    def load_states(self, states: dict[str, dict[str, Any]]) -> None:
        """Each callback's state from ``states`` (a checkpoint's), where it holds one of that key."""
        for key, callback in self._keyed():
            if key in states:
                callback.load_state_dict(states[key])

    def steer_steps(self) -> bool:
        """Whether a callback may act on a progress record (it overrides ``on_step_end`` and does
        not only observe): then the workers wait for the callbacks after each one."""
        return any(type(c).on_step_end is not Callback.on_step_end and not c.observes_only for c in self.callbacks)

    def _keyed(self) -> list[tuple[str, Callback]]:
        seen: dict[str, int] = {}
        keyed = []
        for callback in self.callbacks:
            name = type(callback).__qualname__
            keyed.append((f"{name}#{seen.get(name, 0)}", callback))
            seen[name] = seen.get(name, 0) + 1
        return keyed


class Records(Callback):
    """A callback that takes every progress and evaluation record as a plain dict, in ``write``
    (what metrics.csv, TensorBoard, MLflow, history and on_log all want)."""

    observes_only = True  # a record is written, never acted on

    def on_step_end(self, trainer, record: Progress) -> None:
        self.write(record.record())

    def on_eval_end(self, trainer, evaluation: Evaluation) -> None:
        self.write(evaluation.record())

    def write(self, record: dict[str, Any]) -> None:
        raise NotImplementedError


class History(Records):
    """Every record, as plain dicts, for ``FitResult.history``; after a restart, those of the steps
    run again are not kept twice."""

    def __init__(self):
        self.records: list[dict[str, Any]] = []

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(record)

    def on_restart(self, trainer, step: int) -> None:
        self.records = [record for record in self.records if record["step"] <= step]


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
    """In a notebook, fit's progress: tqdm's notebook bar over the steps, with the training loss,
    samples/s and the last evaluation (as eval_loss, eval_accuracy: never in the training loss's
    place); fit adds it when it runs in a Jupyter kernel."""

    observes_only = True

    def __init__(self):
        self._bar, self._display, self._step, self._shown = None, None, 0, {}

    def on_fit_start(self, trainer, plan) -> None:
        from tqdm.auto import tqdm  # the notebook bar in a kernel with ipywidgets, else text on stderr
        from tqdm.notebook import tqdm as widget_bar

        if issubclass(tqdm, widget_bar):
            from IPython.display import display

            # A widget's text form is what it was when shown: a front-end that shows text (a saved
            # notebook, nbconvert, no widget support) would keep 0/N. Shown under a display id that
            # every update renews, its text advances with the widget.
            self._bar = tqdm(total=plan.total_steps, unit="step", desc="sn_trainer", display=False)
            self._display = display(self._bundle(), raw=True, display_id=True)
        else:
            self._bar = tqdm(total=plan.total_steps, unit="step", desc="sn_trainer")

    def on_step_end(self, trainer, record: Progress) -> None:
        self._bar.update(record.step - self._step)
        self._step = record.step
        self._shown.update(loss=f"{record.loss:.4f}", samples_s=f"{record.samples_per_sec:.0f}")
        self._show()

    def on_eval_end(self, trainer, evaluation: Evaluation) -> None:
        self._shown.update({k: f"{v:.4f}" for k, v in evaluation.metrics.items()
                            if k in ("eval_loss", "eval_accuracy")})
        self._show()

    def on_fit_end(self, trainer, result) -> None:
        self._bar.close()
        self._show(postfix=False)

    def _show(self, postfix: bool = True) -> None:
        if postfix:
            self._bar.set_postfix(self._shown)
        if self._display is not None:
            self._display.update(self._bundle(), raw=True)

    def _bundle(self) -> dict[str, Any]:
        """The widget, and its text whole (ipywidgets cuts a widget's text at 110 characters)."""
        container = self._bar.container
        return {**container._repr_mimebundle_(), "text/plain": repr(container)}


class Monitor(Callback):
    """What EarlyStopping and BestCheckpoint share: one evaluation metric watched for improvement.

    ``monitor`` is checked against what the run's evaluation reports before any worker starts;
    a failed evaluation is passed over (said once), and a NaN value is never an improvement.
    """

    def __init__(self, monitor: str, mode: str, min_delta: float):
        if mode not in ("min", "max"):
            raise ConfigError(f"mode must be 'min' or 'max', got {mode!r}")
        self.monitor, self.mode, self.min_delta = monitor, mode, min_delta
        self.best: float | None = None
        self._said_failed = False

    def on_fit_start(self, trainer, plan) -> None:
        who = type(self).__name__
        if not plan.evaluates:
            raise ConfigError(f"{who} monitors {self.monitor} after each evaluation, and this run evaluates nothing: "
                              "pass eval_set=...")
        if self.monitor not in plan.metrics:
            raise ConfigError(f"{who} monitors {self.monitor}, which evaluation does not report (it reports "
                              f"{', '.join(plan.metrics)}); set monitor to one of those")

    def value(self, evaluation: Evaluation) -> float | None:
        """The monitored value of ``evaluation``; None where it failed."""
        if "eval_error" in evaluation.metrics:
            if not self._said_failed:
                log.warning("%s passes over the evaluation after step %d: it failed (and any other that fails)",
                            type(self).__name__, evaluation.step)
                self._said_failed = True
            return None
        return float(evaluation.metrics[self.monitor])

    def improved(self, value: float) -> bool:
        """Better than the best so far by more than ``min_delta`` (NaN never is)."""
        if math.isnan(value):
            return False
        if self.best is None:
            return True
        return value < self.best - self.min_delta if self.mode == "min" else value > self.best + self.min_delta


class EarlyStopping(Monitor):
    """Stop when ``monitor`` has not improved for ``patience`` evaluations in a row.

    Improved means below the best so far by more than ``min_delta`` (``mode="min"``), or above
    it (``mode="max"``). The run stops right after the evaluation that ran out of patience.
    """

    def __init__(self, monitor: str = "eval_loss", mode: str = "min", patience: int = 3, min_delta: float = 0.0):
        if not (isinstance(patience, int) and patience >= 1):
            raise ConfigError(f"EarlyStopping's patience must be an integer >= 1, got {patience!r}")
        super().__init__(monitor, mode, min_delta)
        self.patience = patience
        self.waited = 0
        self.stopped_after: int | None = None  # the step after which it stopped the run

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "waited": self.waited, "stopped_after": self.stopped_after}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.waited, self.stopped_after = state["best"], state["waited"], state["stopped_after"]

    def on_eval_end(self, trainer, evaluation: Evaluation) -> None:
        value = self.value(evaluation)
        if value is None:
            return
        if self.improved(value):
            self.best, self.waited = value, 0
            return
        self.waited += 1
        if self.waited >= self.patience:
            trainer.should_stop = True
            self.stopped_after = evaluation.step
            log.info("early stopping after step %d: %s has not improved on %.6g for %d evaluations",
                     evaluation.step, self.monitor, self.best, self.waited)


class BestCheckpoint(Monitor):
    """Keep the checkpoint of the best ``monitor`` so far as ``<checkpoint dir>/best.pt``, beside
    the latest ones (which ``checkpoint_keep`` prunes; this one it does not touch). Resumable like
    any checkpoint: ``resume=<dir>/best.pt``."""

    def __init__(self, monitor: str = "eval_loss", mode: str = "min", min_delta: float = 0.0,
                 filename: str = "best.pt"):
        super().__init__(monitor, mode, min_delta)
        self.filename = filename
        self.best_step: int | None = None
        self.path: Path | None = None  # where the best checkpoint is, once there is one
        self._wanted: int | None = None

    def state_dict(self) -> dict[str, Any]:
        # Asked while the checkpoint it waits for is being written: that one becomes the best.
        return {"best": self.best, "best_step": self._wanted if self._wanted is not None else self.best_step,
                "path": str(self.path) if self.path else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.best_step = state["best"], state["best_step"]
        self.path = Path(state["path"]) if state["path"] else None

    def on_fit_start(self, trainer, plan) -> None:
        if not trainer.config.checkpoint.dir:
            raise ConfigError("BestCheckpoint needs checkpoints: set checkpoint_dir")
        super().on_fit_start(trainer, plan)

    def on_eval_end(self, trainer, evaluation: Evaluation) -> None:
        value = self.value(evaluation)
        if value is not None and self.improved(value):
            self.best, self._wanted = value, evaluation.step
            trainer.should_checkpoint = True

    def on_checkpoint(self, trainer, path: Path) -> None:
        if self._wanted is None or not Path(path).name.endswith(f"{self._wanted:09d}.pt"):
            return
        target = Path(path).with_name(self.filename)
        temporary = target.with_name(f".{self.filename}.tmp-{os.getpid()}")
        temporary.unlink(missing_ok=True)
        try:
            try:  # a step file is never written again: best.pt may share it, costing no disk
                os.link(path, temporary)  # and pruning the step file leaves best.pt whole
            except OSError:  # a file system without hard links
                shutil.copyfile(path, temporary)
                os.chmod(temporary, 0o600)
            os.replace(temporary, target)
        except BaseException:
            temporary.unlink(missing_ok=True)  # a full disk keeps no half-copied best
            raise
        self.path, self.best_step, self._wanted = target, self._wanted, None
        log.info("best checkpoint (%s %.6g at step %d): %s", self.monitor, self.best, self.best_step, target)
