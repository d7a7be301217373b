"""The replica a worker builds from what it receives: the model over the shared parameters, its
gradient buffer, its shard of each optimizer, its peers; and one training step."""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ...data import random_state
from ...data.feed import Feed
from ...data.source import different_orders
from ...errors import DataError
from ..collectives.reducer import Reducer
from ..memory.shared import ReplicaBuffers
from ..processes.signals import StopAgreement
from ..processes.stages import StageTimer
from .batchnorm import synchronise
from .board import Reached, StepTotals
from .checkpoint_share import CheckpointShare
from .evaluation import Evaluator
from .gradients import Gradients
from ...recipe.objective import Precision
from .phases import WorkerPhase
from .reduction import worker_reducer
from .reference import Reference
from .verification import Bell, Peers, Verification
from .worker_spec import WorkerSpec


class Replica:
    """This worker's model replica, its gradient buffer, its shard of the optimizer and its peers."""

    def __init__(self, spec: WorkerSpec):
        shared, plan = spec.shared, spec.shared.plan
        settings = plan.settings
        self.shared, self.plan, self.rank = shared, plan, spec.rank
        self.model, self.layout = shared.model, shared.layout
        precision = Precision(settings.precision)
        # Worker 0's one process, copied from the model before it becomes the shared one.
        reference = Reference(self.model, self.layout, shared.phases, plan, shared.flat.dtype) \
            if plan.verifies and spec.rank == 0 else None
        self.layout.bind(self.model, shared.flat)
        # What forward passes call: the model, or (compile) inductor's compilation of it, over the
        # same parameters; it compiles on its first call (the first step), from the shared cache
        # where another worker or run compiled it already.
        runner = torch.compile(self.model) if settings.compile else self.model
        params = self.layout.parameters(self.model)
        buffers = ReplicaBuffers(self.model, spec.rank)
        self.reducer: Reducer = worker_reducer(spec)
        reached = Reached(self.layout.attach_gradients(self.model, self.reducer.grad_flat))
        self.reducer.watch(params, self.layout, settings.accumulate, settings.bucket_kb * 1024)
        if settings.sync_batchnorm:
            synchronise(self.model, self._waiting_sum)
        self.gradients = Gradients(shared, spec.rank, runner, precision, self.reducer, reached, buffers,
                                   across_nodes=spec.cluster is not None)

        share = spec.share
        self.phases = [WorkerPhase(phase, self.layout, spec.rank, shared.flat, self.reducer.shard_grad, plan,
                                   share["phases"][index] if share else None)
                       for index, phase in enumerate(shared.phases)]
        self.verification = _verification(spec, self.reducer, self.global_sum, reference) if plan.verifies else None
        self.evaluator = Evaluator(spec, runner, precision, buffers, self.global_sum)
        self.checkpoint_share = CheckpointShare(spec, self.phases, self.reducer)
        self.stop_agreement = StopAgreement(shared.stop, spec.rank, self.reducer.barrier)
        self.lr_used: float | None = None  # by the last step's update
        if share is not None and share.get("rng") is not None:
            random_state.restore(share["rng"])  # same workers: same random streams
        self.feed = None
        if shared.train is not None:
            shared.train.resume_at(share.get("stream") if share else None, plan.start_step)
            self.feed = Feed(shared.train, spec.global_rank, plan.placement.global_workers, settings.accumulate,
                             settings.channels_last, plan.total_steps, settings.prefetch)

    def global_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum a small tensor over every worker of every node, in place."""
        return self.reducer.sum_across_nodes(self.reducer.sum_in_node(tensor))

    def _waiting_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """``global_sum`` inside a forward or backward pass (batch norm): its wait for the peers is
        a wait, so that a worker stopped there is not blamed for the peers it waits for."""
        with self.shared.heartbeats.waiting(self.rank):
            return self.global_sum(tensor)

    # --- one step ------------------------------------------------------------------------------

    def train_step(self, step: int, timer: StageTimer) -> list[StepTotals]:
        """One optimizer step, in every worker at once: each phase in turn on the same micro-batches
        (forward, backward, sum, update of its shards; a barrier before the next phase reads the
        weights). A phase's update is left out if anything in it is non-finite. Its totals, per phase."""
        plan = self.plan
        with timer("data"):
            micro_batches = self.feed.step(step)
            digest = self.shared.train.order_digest(step)
        phase_totals = []
        verifying = self.verification is not None and self.verification.due(step)
        for index, phase in enumerate(self.phases):
            if index:
                with timer("wait"):
                    self.reducer.barrier()  # the previous phase's update is written everywhere
            if verifying:
                with timer("wait"):
                    self.verification.phase_start(self.model, index, phase.objective)
            totals = self.gradients.compute(step * len(self.phases) + index, phase, micro_batches, timer, digest)
            phase_totals.append(totals)
            if not totals.one_batch:  # every worker reads the same totals: all stop here, before an update
                raise DataError(different_orders(f"the workers read different items for step {step + 1}'s global "
                                                 "batch"))
            checked = verifying and totals.finite  # a left-out update has nothing to compare
            if checked:
                self.verification.after_reduce(step, index, self.reducer.shard_grad, phase.optimizer,
                                               lambda: self.feed.whole(step), self.shared.flat, totals, self.model,
                                               timer)
            if index == 0:
                self.lr_used = self.current_lr()  # before the scheduler moves it on
            with timer("update"):
                if totals.finite:
                    phase.update(self.reducer.shard_grad, totals.count, totals.unused, step + 1,
                                 self.reducer.sum_in_node, whole_model=len(self.phases) == 1)
            if phase.spec.after_update is not None and totals.finite:  # a left-out update has no after
                self.after_update(phase.spec.after_update, timer)
            if checked:
                self.verification.after_update(step, self.shared.flat, timer, last_phase=index == len(self.phases) - 1)
        with timer("update"):
            if self.shared.ema is not None:  # this shard's average: 1/W of the work in each worker
                shard = self.layout.shards[self.rank]
                self.shared.ema[shard.start : shard.stop].lerp_(self.shared.flat[shard.start : shard.stop],
                                                               1 - plan.settings.ema_decay)
        if self.rank == 0:
            self.shared.stop.decide(step + 1)  # before the barrier: all workers read the same decision
        with timer("wait"):
            self.reducer.barrier()  # nobody reads parameters that are still being written
        return phase_totals

    def after_update(self, fn: Callable[[nn.Module], Any], timer: StageTimer) -> None:
        """The user's ``fn(model)`` once on the weights just updated, as a loop calls it after
        ``optimizer.step()``. The parameters live once per node, and each worker updated only its
        shard of them: so every shard is written first (a barrier), worker 0 alone calls ``fn``
        on the whole shared parameters (in every worker at once it would race, and a constraint
        that is not idempotent would apply W times), and nobody reads them before it returned (a
        barrier). Across nodes each node's worker 0 calls it on its node's copy: the same
        weights in, the same out."""
        with timer("wait"):
            self.reducer.barrier()  # every worker's shard of the update is written
        if self.rank == 0:
            with timer("update"), torch.no_grad():
                fn(self.model)
        with timer("wait"):
            self.reducer.barrier()  # fn's writes are done before any worker reads the weights

    def scheduled_points(self, step_done: int, metrics: dict[str, Any] | None) -> None:
        """The scheduler's other points after step ``step_done``: an evaluation's ``metrics`` (None:
        none was made), the end of an epoch."""
        for schedule in (phase.schedule for phase in self.phases if phase.schedule is not None):
            if metrics is not None:
                schedule.after_evaluation(metrics)
            if step_done % self.plan.steps_per_epoch == 0:
                schedule.after_epoch(step_done // self.plan.steps_per_epoch, metrics)

    def losses(self, phase_totals: list[StepTotals]) -> list[float]:
        """Each phase's loss as plain PyTorch reports it: the mean (or, for a sum loss, the sum)."""
        return [totals.loss_sum / totals.count if phase.objective.divides and totals.count > 0 else totals.loss_sum
                for phase, totals in zip(self.phases, phase_totals)]

    def current_lr(self) -> float | None:
        """The first phase's learning rate (of its first group)."""
        return self.phases[0].lr()

    def close(self) -> None:
        if self.feed is not None:
            self.feed.close()
        self.reducer.close()


def _verification(spec: WorkerSpec, reducer: Reducer, global_sum: Callable[[torch.Tensor], torch.Tensor],
                  reference: Reference | None) -> Verification:
    """verify=: this worker's part in comparing steps with one process's (``reference``, worker 0's)."""
    plan, settings = spec.shared.plan, spec.shared.plan.settings
    rendezvous = os.path.dirname(spec.store_path)
    peers = Peers(spec.rank, plan.workers, reducer.barrier, global_sum,
                  lambda rank: os.path.join(rendezvous, f"verify-{rank}.pt"), Bell(spec.shared.verify_bell),
                  tuple(sorted({cpu for cpus in plan.placement.pinning for cpu in cpus})),
                  settings.threads * plan.workers)
    shard = spec.shared.layout.shards[spec.rank]
    return Verification(plan, peers, spec.shared.verify_grads, (shard.start, shard.stop), reference)
