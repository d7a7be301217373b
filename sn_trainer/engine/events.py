"""What workers tell the launcher: typed events while they train, and what each measured at its end.

Worker 0 sends ``Progress`` every ``log_every`` steps (and at each epoch's end and the last
step) and ``Evaluation`` after each evaluation; every worker sends its ``CheckpointPart`` when a
checkpoint is due. Each event names the callback hook it is for (``hook``): the launcher hands it
to every callback's method of that name, so a new event is one class here and one method of
``sn_trainer.Callback``. Each worker returns a ``WorkerResult`` when its run ends.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True)
class Progress:
    """A logged step: where the run is, its loss, the learning rate it used, its speed. With several
    phases, ``loss`` and ``lr`` are the first phase's, and ``phase_losses`` has each by name."""

    hook: ClassVar[str] = "on_step_end"

    step: int
    epoch: float
    loss: float
    lr: float | None
    samples_per_sec: float
    stage_ms: dict[str, float] = field(default_factory=dict)  # milliseconds per step in each stage of a step
    phase_losses: dict[str, float] = field(default_factory=dict)
    awaited: bool = False  # worker 0 waits for the launcher's callbacks to have seen it (they may stop the run)

    def record(self) -> dict[str, Any]:
        """As a plain record (FitResult.history, on_log, metrics.csv): ``loss_<name>`` per phase."""
        return {"step": self.step, "epoch": self.epoch, "loss": self.loss, "lr": self.lr,
                "samples_per_sec": self.samples_per_sec, "stage_ms": dict(self.stage_ms),
                **{f"loss_{name}": value for name, value in self.phase_losses.items()}}


@dataclass(frozen=True)
class Evaluation:
    """An evaluation after ``step``: ``metrics`` as ``eval_<name>`` (``eval_error`` when it failed)."""

    hook: ClassVar[str] = "on_eval_end"

    step: int
    epoch: float
    metrics: dict[str, Any]

    def record(self) -> dict[str, Any]:
        return {"step": self.step, "epoch": self.epoch, **self.metrics}


@dataclass(frozen=True)
class CheckpointPart:
    """Worker ``rank``'s share of the checkpoint of ``step`` (packed tensors and plain data)."""

    hook: ClassVar[str] = "on_checkpoint_part"

    rank: int
    step: int
    data: bytes


@dataclass(frozen=True)
class WorkerResult:
    """What one worker measured over its run (or, evaluating only, its evaluation)."""

    reducer: str  # the reducer that ran (what comm=auto chose)
    eval_metrics: dict[str, Any] = field(default_factory=dict)  # the last evaluation's eval_* (eval_error)
    pss_bytes: int = 0
    stage_seconds: dict[str, float] = field(default_factory=dict)  # in each stage of the measured steps
    measured_steps: int = 0  # after the warm-up (or since a resume)
    cpu_seconds: dict[str, float] | None = None  # this process's and the machine's, over the measured steps
    train_seconds: float = 0.0
    eval_seconds: float = 0.0
    final_loss: float = math.nan
    cpu_percent_per_core: list[float] = field(default_factory=list)
    skipped_steps: int = 0
    stopped_at: int | None = None  # a signal or a callback stopped the run after this step
    diverged_at: int | None = None
    first_step_seconds: float = 0.0  # the first step's wall time (with compile: compiling included)
    verified: tuple[int, ...] = ()  # steps (from 1) compared with one process's and found equal
    relabelled: str | None = None  # what a consented difference made the run ("like DDP from step 12: ...")
