"""What a fit returns: ``FitResult``, made from the launch that finished, and what summary.json holds of it."""
from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..config import TrainerConfig
from ..engine.collectives.registry import REDUCERS
from ..engine.events import WorkerResult
from ..engine.memory.layout import tied_aliases
from ..engine.processes.signals import StopFlags
from ..engine.processes.stages import STEP_STAGES
from ..errors import TrainingDiverged, TrainingInterrupted
from .membership import as_records
from .session import Outcome

log = logging.getLogger(__name__)

OTHERS_WARNING_PERCENT = 5.0  # above it, the speeds measured mean little


@dataclass
class FitResult:
    """What a training run measured and what it ran with. Seconds per stage are averaged over the workers."""

    samples_per_sec: float
    per_worker_batch: float
    steps: int
    measured_steps: int  # the steps samples/s and stage seconds cover (after warm-up, or since a resume)
    final_loss: float
    train_seconds: float
    stage_seconds: dict[str, float]  # in each stage of a step (data, forward, backward, reduce, update, wait)
    peak_memory_bytes: int
    settings: TrainerConfig  # as the run used them: every auto decided (across nodes, comm as asked)
    comm: str  # the reducer that ran (comm=auto decides at start-up)
    compression: str = "none"  # what crossed between nodes: "none", or e.g. "powersgd rank 2 after 10 steps: approximate"
    eval_loss: float | None = None
    eval_accuracy: float | None = None
    eval_metrics: dict[str, float] = field(default_factory=dict)  # every eval_* the last evaluation gave
    eval_error: str | None = None  # evaluation failed (the training is kept); its traceback
    history: list[dict[str, Any]] = field(default_factory=list)
    cpu_percent_per_core: list[float] = field(default_factory=list)  # system-wide, over the measured steps
    skipped_steps: int = 0  # updates left out for a non-finite loss or gradient (on_nan="skip")
    restarts: int = 0
    last_checkpoint: str | None = None
    other_cpu_percent: float | None = None  # other processes' share of the machine's CPU over the measured steps
    plan: dict[str, Any] = field(default_factory=dict)  # everything the run was resolved to
    stopped_early: int | None = None  # a callback stopped the run after this step (trainer.should_stop)
    ema_state_dict: dict[str, Any] | None = None  # with ema_decay: the model's state_dict, averaged weights
    compile_seconds: float | None = None  # with compile: the first step's time beyond a measured step's (compiling)
    # Each worker's own stage seconds (this node's): how long the others waited for the slowest one.
    stage_seconds_per_worker: list[dict[str, float]] = field(default_factory=list)
    # Each worker's seconds ready to run while other processes held its CPU (a busy machine's cost).
    run_queue_seconds: list[float] = field(default_factory=list)
    # {step, nodes, workers}: the nodes and workers (in all) the run started with, then each change
    # (an elastic restart, a resume at another size), carried on by the checkpoints
    membership: list[dict[str, int]] = field(default_factory=list)
    # The steps (from 1) compared with what one process computes on the same global batch and found
    # equal (plan["exactness"] says what that makes the run)
    verified_steps: list[int] = field(default_factory=list)

    @property
    def workers(self) -> int:
        return self.settings.workers

    @property
    def threads(self) -> int:
        return self.settings.threads

    @property
    def batch_size(self) -> int:
        return self.settings.batch_size

    @property
    def precision(self) -> str:
        """What ran (bf16 falls back to fp32 where the CPU has no native bf16)."""
        return self.settings.precision

    @property
    def channels_last(self) -> bool:
        """The layout the run used (channels_last=auto decides per model)."""
        return self.settings.channels_last

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> dict[str, Any]:
        """What summary.json holds of the run: every figure, plain data only (no history, no weights)."""
        skipped = {"history", "ema_state_dict", "settings"}
        return {"workers": self.workers, "threads": self.threads, "batch_size": self.batch_size,
                "channels_last": self.channels_last, "precision": self.precision,
                **{k: v for k, v in asdict(self).items() if k not in skipped}}

    def save(self, folder: str | os.PathLike) -> list[Path]:
        """Write the trained weights as ``folder/model.safetensors`` (and, with ema_decay, the moving
        average's as ``folder/model_ema.safetensors``), each tied weight once; load them with
        ``safetensors.torch.load_model(model, path)``.

        Raises:
            ImportError: safetensors is not installed (``pip install sn_trainer[safetensors]``).
        """
        from ..export import EMA_WEIGHTS, WEIGHTS, save_weights

        model = self._model
        tied = tied_aliases(model)
        written = [save_weights(model.state_dict(), tied, Path(folder) / WEIGHTS)]
        if self.ema_state_dict is not None:
            written.append(save_weights(self.ema_state_dict, tied, Path(folder) / EMA_WEIGHTS))
        return written


def fit_result(outcome: Outcome, history: list[dict[str, Any]], last_saved: Path | None, stop: StopFlags,
               data: str | None) -> FitResult:
    """What the run measured, or the error that ended it.

    Raises:
        TrainingDiverged: a non-finite loss or gradient, with on_nan="stop".
        TrainingInterrupted: a signal stopped the run.
    """
    plan, results = outcome.plan, outcome.results
    lead = results[0]
    if lead.diverged_at is not None:
        raise TrainingDiverged(lead.diverged_at)
    if lead.stopped_at is not None and stop.signal:
        raise TrainingInterrupted(stop.signal, lead.stopped_at, last_saved)
    eval_metrics = {k: v for k, v in lead.eval_metrics.items() if k != "eval_error"}
    if lead.eval_metrics.get("eval_error"):
        log.warning("evaluation failed; the trained model is kept:\n%s", lead.eval_metrics["eval_error"])
    other = other_cpu_percent(results, outcome.launcher_cpu)
    if other is not None and other > OTHERS_WARNING_PERCENT:
        log.warning("other processes used %.0f%% of this machine's CPU during the measured steps: the speeds "
                    "measured mean little (measure on an idle machine)", other)
    samples = plan.samples(plan.measure_from, plan.measure_from + lead.measured_steps)
    # comm=auto decided: in one node the reducer that ran is one of comm's own values.
    settings = dataclasses.replace(plan.settings, comm=lead.reducer) if lead.reducer in REDUCERS else plan.settings
    return FitResult(
        samples_per_sec=samples / lead.train_seconds if lead.train_seconds > 0 else 0.0,
        per_worker_batch=plan.per_worker_batch, steps=lead.stopped_at or plan.total_steps,
        measured_steps=lead.measured_steps, final_loss=lead.final_loss, train_seconds=lead.train_seconds,
        stage_seconds={s: sum(r.stage_seconds[s] for r in results) / len(results) for s in STEP_STAGES},
        peak_memory_bytes=max(outcome.peak_bytes, sum(r.pss_bytes for r in results)), settings=settings,
        comm=lead.reducer, compression=plan.compression, eval_loss=eval_metrics.get("eval_loss"), eval_accuracy=eval_metrics.get("eval_accuracy"),
        eval_metrics=eval_metrics, eval_error=lead.eval_metrics.get("eval_error"), history=history,
        cpu_percent_per_core=lead.cpu_percent_per_core, skipped_steps=lead.skipped_steps, restarts=outcome.restarts,
        last_checkpoint=str(last_saved) if last_saved else None, other_cpu_percent=other,
        plan=plan.summary(lead.reducer, data, plan.exactness_after(list(lead.verified), lead.relabelled)),
        stopped_early=lead.stopped_at, ema_state_dict=outcome.ema_state_dict,
        compile_seconds=max(0.0, lead.first_step_seconds - lead.train_seconds / lead.measured_steps)
        if plan.settings.compile and lead.measured_steps else None,
        stage_seconds_per_worker=[dict(r.stage_seconds) for r in results],
        run_queue_seconds=[(r.cpu_seconds or {}).get("run_queue", 0.0) for r in results],
        membership=as_records(plan.membership), verified_steps=list(lead.verified))


def other_cpu_percent(results: list[WorkerResult], launcher_cpu: float) -> float | None:
    """CPU the machine spent on anything but this run, as a share of all its logical CPUs' time,
    over the measured steps (the launcher counts as the run's, whole, to err on the low side)."""
    clocks = [r.cpu_seconds or {} for r in results]
    if not all(clocks) or clocks[0]["machine_total"] <= 0:
        return None
    ours = sum(c["own"] for c in clocks) + launcher_cpu
    return max(0.0, 100 * (clocks[0]["machine_busy"] - ours) / clocks[0]["machine_total"])
