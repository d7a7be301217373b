"""The resolved plan of a run: its settings with every choice decided, and what follows from them.

The launcher decides it once (``sn_trainer.fit.resolve``); every worker reads it as is.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config import TrainerConfig
from ..node.runtime import Runtime


@dataclass(frozen=True)
class Decision:
    """One setting decided for this run (an ``auto``, or one asked for that could not be had
    here): the value it runs with, and why."""

    setting: str
    value: Any
    why: str
    fallback: bool = False  # asked for, but not to be had here: what ran instead


@dataclass(frozen=True)
class Placement:
    """Where this node's workers run: what the machine (and torchrun) gave for the settings, and
    every decision made for the run (``sn_trainer.fit.decide`` makes them all), with its reason."""

    pinning: tuple[tuple[int, ...], ...]  # each worker's logical CPUs: one entry per worker of this node
    nodes: int
    node_rank: int
    decisions: tuple[Decision, ...] = ()

    @property
    def notes(self) -> tuple[str, ...]:
        """What was asked for but could not be had here, and what ran instead."""
        return tuple(d.why for d in self.decisions if d.fallback)

    @property
    def workers(self) -> int:
        return len(self.pinning)

    @property
    def global_workers(self) -> int:
        return self.workers * self.nodes


@dataclass(frozen=True)
class Plan:
    """Everything every worker needs to walk through the run in lockstep.

    ``settings`` are the user's, every ``auto`` replaced by what was decided (workers, threads,
    precision, runtime, start method, layout, shards, compile, prefetch); ``comm`` stays ``auto``
    where the workers time the reducers at start-up, and is ``local`` for one worker.
    """

    settings: TrainerConfig
    placement: Placement
    dataset_size: int | None  # samples per epoch (None: a stream without a length, one epoch of total_steps)
    steps_per_epoch: int
    total_steps: int
    start_step: int  # > 0 when resuming
    loss_form: str  # how the first phase's scalar loss splits over samples (engine.step.objective's forms)
    phase_forms: tuple[tuple[str, str], ...]  # with several phases: each one's name and loss form
    evaluates: bool  # after each epoch (or every eval_every steps) and after the last step
    metrics: tuple[str, ...]  # what an evaluation reports, by name (eval_samples, eval_loss, ...), sorted
    evaluate_only: bool
    checkpointing: bool  # send state to the launcher (on schedule, at the end, on stop)
    progress_awaited: bool = False  # after a progress record, the workers wait for the callbacks (they may stop)
    # (step, nodes, workers in all): the run's first, then each change of them (a checkpoint carries it on)
    membership: tuple[tuple[int, int, int], ...] = ()
    # Why the run trains like DDP rather than as one process (none: exact): random draws each worker
    # makes from its own streams, a loss weighed as DDP weighs it (fit.resolve decides)
    like_ddp: tuple[str, ...] = ()
    # Settings of the user's that tests have not proven exact for this run (shards=elements for an
    # optimizer not proven elementwise): verified on the run, and a difference is said, not stopped
    unproven: tuple[str, ...] = ()

    @property
    def runtime(self) -> Runtime:
        return Runtime(self.settings.allocator, self.settings.openmp)

    @property
    def workers(self) -> int:
        return self.placement.workers

    @property
    def global_workers(self) -> int:
        return self.placement.global_workers

    @property
    def step_batch(self) -> int:
        """Samples one optimizer step trains on (the last step of an epoch may have fewer)."""
        return self.settings.batch_size * self.settings.accumulate

    def samples(self, first: int, last: int) -> int:
        """Samples trained by steps [first, last): an epoch's last step may be short (drop_last=false)."""
        total = (last - first) * self.step_batch
        if not self.settings.drop_last and self.dataset_size is not None:
            short = self.steps_per_epoch * self.step_batch - self.dataset_size
            total -= short * (last // self.steps_per_epoch - first // self.steps_per_epoch)
        return total

    @property
    def measure_from(self) -> int:
        """The first step samples/s and stage seconds cover: after the warm-up, and after the
        first step of a launch (resumed or not) where that step compiles the model."""
        compiling = self.settings.compile and self.start_step + 1 < self.total_steps
        return max(self.settings.measure_after, self.start_step + (1 if compiling else 0))

    @property
    def per_worker_batch(self) -> float:
        return self.settings.batch_size / self.global_workers

    def logs_after(self, done: int) -> bool:
        """Whether worker 0 reports progress after step ``done``."""
        return done % self.settings.log_every == 0 or done % self.steps_per_epoch == 0 or done == self.total_steps

    def evaluates_after(self, done: int) -> bool:
        """Whether the workers evaluate after step ``done``: every ``eval_every`` steps, or at each
        epoch's end, and after the last step."""
        if not self.evaluates:
            return False
        every = self.settings.eval_every
        due = done % every == 0 if every else done % self.steps_per_epoch == 0
        return due or done == self.total_steps

    def checkpoint_due(self, done: int) -> bool:
        every = self.settings.checkpoint
        if every.every_steps and done % every.every_steps == 0:
            return True
        if every.every_epochs and done % self.steps_per_epoch == 0 and \
                (done // self.steps_per_epoch) % every.every_epochs == 0:
            return True
        return done == self.total_steps

    def lr_factor(self, step_done: int) -> float:
        """What the schedule's learning rate is multiplied by in step ``step_done`` (counted from 1):
        after the last membership change, at step c, a linear ramp over rewarmup_steps steps,
        (step_done - c) / rewarmup_steps, up to 1."""
        ramp = self.settings.rewarmup_steps
        if ramp == 0 or len(self.membership) < 2:
            return 1.0
        return min(1.0, (step_done - self.membership[-1][0]) / ramp)

    def summary(self, comm_used: str | None = None, data: str | None = None,
                exactness: str | None = None) -> dict[str, Any]:
        """What the run used, for FitResult.plan and summary.json: every setting as decided, and
        what follows from them (``exactness``: what the run was found to be, else what it starts as)."""
        p, s = self.placement, self.settings
        return {**s.keywords(), "workers": p.workers, "nodes": p.nodes,
                "pinning": [list(c) for c in p.pinning], "comm": comm_used or s.comm, "loss_form": self.loss_form,
                "phases": [{"name": name, "loss_form": form} for name, form in self.phase_forms],
                "per_worker_batch": self.per_worker_batch, "data": data, "steps_per_epoch": self.steps_per_epoch,
                "total_steps": self.total_steps, "start_step": self.start_step, "notes": list(p.notes),
                "compression": self.compression, "exactness": exactness or self.exactness,
                "decisions": self.decisions(comm_used)}

    def decisions(self, comm_used: str | None = None) -> dict[str, dict[str, Any]]:
        """Every setting decided for the run, ``{setting: {"value": ..., "why": ...}}``; comm=auto as
        the workers decided it at start-up, where ``comm_used`` says what they chose."""
        decided = {d.setting: {"value": d.value, "why": d.why} for d in self.placement.decisions}
        if self.settings.comm == "auto" and comm_used and comm_used != "auto":
            decided["comm"] = {"value": comm_used, "why": "comm=auto: the workers timed each reducer's sum and barrier "
                                                          "at start-up and took the fastest"}
        return decided

    @property
    def splits(self) -> bool:
        """Whether a step's global batch is split (workers, nodes or accumulation)."""
        return self.global_workers * self.settings.accumulate > 1

    @property
    def approximate(self) -> bool:
        return self.settings.compress != "none" and self.placement.nodes > 1

    @property
    def verifies(self) -> bool:
        """Whether the workers compare steps with one process's (``engine.step.verification``): where the
        batch is split, and the run is not like DDP or approximate by construction."""
        return (self.splits and self.settings.verify_every > 0 and not self.like_ddp and not self.approximate
                and not self.evaluate_only)

    @property
    def exactness(self) -> str:
        """Against one process training plain PyTorch on the same global batches, as the run starts:
        what it is by construction, and what it will verify."""
        if self.approximate:
            return "approximate: " + self.compression
        if self.like_ddp:
            return f"like DDP: {'; '.join(self.like_ddp)}"
        if not self.splits:
            return "exact: one worker, one slice a step (nothing is split)"
        unproven = f" ({'; '.join(self.unproven)})" if self.unproven else ""
        if not self.verifies:
            return f"unverified: verify_every=0, so no step was compared with one process's{unproven}"
        return f"exact if verified: steps compared with one process's every {self.settings.verify_every} steps and " \
               f"at the last{unproven}"

    def exactness_after(self, verified: list[int], relabelled: str | None) -> str:
        """What the run was, once it ran: ``verified``, the steps (from 1) found equal to one
        process's; ``relabelled``, what a consented difference made it (None: none)."""
        if not self.verifies:
            return self.exactness
        if relabelled is not None:
            return relabelled
        listed = ", ".join(map(str, verified)) if len(verified) <= 8 else \
            f"{', '.join(map(str, verified[:4]))}, ..., {verified[-1]}"
        unproven = f" ({'; '.join(self.unproven)})" if self.unproven else ""
        since = f" since the launch resumed after step {self.start_step}" if self.start_step else ""
        return f"exact, verified at {len(verified)} step{'s' if len(verified) != 1 else ''}{since} ({listed}){unproven}"

    @property
    def compression(self) -> str:
        """What crosses between nodes, and whether that is exact (the plan, the log, summary.json say it)."""
        s = self.settings
        if s.compress == "none":
            return "none: every shard's sum sent whole between nodes (exact)" if self.placement.nodes > 1 else "none"
        return f"{s.compress} rank {s.compress_rank} after {s.compress_after} steps: approximate"
