"""One phase's gradients in a worker: forward and backward of its loss on this worker's
micro-batches, published on the board and summed over every worker (and node)."""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import nn

from ..collectives.reducer import Reducer
from ..memory.shared import ReplicaBuffers
from ..processes.stages import StageTimer
from ...recipe import position
from .board import Reached, StepTotals
from ...recipe.gather import Gathering, Refusing, StepGathering, gathering
from ...recipe.objective import GATHERED, Objective, Precision
from .phases import WorkerPhase
from .worker_spec import Shared


class Gradients:
    """This worker's part of each phase's gradient sum, and the totals every worker reads after it."""

    def __init__(self, shared: Shared, rank: int, runner: nn.Module, precision: Precision, reducer: Reducer,
                 reached: Reached, buffers: ReplicaBuffers, across_nodes: bool):
        """``runner``: what forward passes call; ``reached``: the gradients' versions, read after the
        backward passes; ``across_nodes``: the totals are summed over the nodes too."""
        self.shared, self.plan, self.rank = shared, shared.plan, rank
        self.runner, self.precision, self.dtype = runner, precision, shared.flat.dtype
        self.reducer, self.reached, self.buffers, self.across_nodes = reducer, reached, buffers, across_nodes
        self._refusing: dict[int, Refusing] = {}  # by id of the objective (each phase's lives as long as the run)

    def compute(self, round_: int, phase: WorkerPhase, micro_batches: list[tuple[Any, int]],
                timer: StageTimer, digest: int | None = None) -> StepTotals:
        """Forward and backward of one phase's loss on this worker's micro-batches, and the sum of
        the gradients over the workers; ``round_`` counts phases over the run (the board's turn),
        ``digest`` is the source's of the global batch read (compared with the peers' on the board)."""
        # Cleared here, not after the update: with comm=shm, peers read this buffer until the
        # barrier that closed the previous phase or step. Timed as the backward's, as a plain loop's
        # zero_grad is its own: clearing a row the peers have just read is no small part of a short step.
        with timer("backward"):
            self.reducer.grad_flat.zero_()
        self.reached.start()
        loss_sum = count = 0.0
        step = round_ // len(self.shared.phases)
        for micro, (batch, samples) in enumerate(micro_batches):
            if samples == 0:
                continue  # the short last step of an epoch (drop_last=false): nothing here for this worker
            where = position.in_training(step, micro, self.plan.steps_per_epoch, self.plan.settings.accumulate)
            with timer("forward"), gathering(self._gathering(phase.objective)), position.at(where):
                micro_loss, micro_count = phase.objective.train_terms(self.runner, batch, samples, self.precision,
                                                                      self.dtype)
            with timer("backward"):
                micro_loss.backward()
            loss_sum += micro_loss.item()
            count += micro_count
        with timer("reduce"):
            changed = self.buffers.changed() if self.rank == 0 else None
            self.shared.board.publish(round_, self.rank, loss_sum, count, self.reducer.local_sum(),
                                      self.reached.flags(), changed, digest)
            self.reducer.reduce()
            totals = self.step_totals(round_, phase.objective)
        if self.rank != 0:
            with timer("update"):
                self.buffers.adopt(totals.changed_buffers)  # worker 0 writes its buffers no more this phase
        return totals

    def _gathering(self, objective: Objective) -> Gathering:
        """What sn_trainer.gather does in a micro-batch of ``objective``'s step: exchange the slices
        where the probe saw the step gather, else refuse (its loss is split as the probe measured it)."""
        if objective.form == GATHERED:
            return StepGathering(self.rank, self.plan.workers, self._waiting_in_node)
        refusing = self._refusing.get(id(objective))
        if refusing is None:  # it holds no state: one per objective for the whole run
            refusing = self._refusing[id(objective)] = Refusing(
                f"{objective.what} called sn_trainer.gather, but not when its loss was probed before the run "
                "(on a first batch): call it on every batch")
        return refusing

    def _waiting_in_node(self, tensor: torch.Tensor) -> torch.Tensor:
        """``sum_in_node`` inside a step function (a gather): its wait for the peers is a wait."""
        with self.shared.heartbeats.waiting(self.rank):
            return self.reducer.sum_in_node(tensor)

    def step_totals(self, round_: int, objective: Objective) -> StepTotals:
        totals = self.shared.board.totals(round_)
        if self.across_nodes:  # add the other nodes' losses, counts, checks and use counts
            totals = self.reducer.sum_across_nodes(totals)
        totals = self.shared.board.read(totals)
        if objective.divides and totals.count <= 0:  # 0 / 0, as plain PyTorch's mean gives
            return dataclasses.replace(totals, loss_sum=math.nan, finite=False)
        return totals
