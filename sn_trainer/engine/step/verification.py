""""exact" earned on the run's own batches: the workers' part in comparing a split step with one
process's step.

Where a run splits its global batches (workers, nodes or accumulation), its steps are compared,
at the steps ``Schedule`` names (the first of a launch, every ``verify_every``-th, the last), with
what one process computes on the same global batch. Worker 0 of every node holds the one process
(``engine.step.reference``); at a verified step every worker hands it its shard of the summed
gradient (into memory the node's workers share) and its optimizer state, and sleeps while worker
0 computes on every core of the node (``borrowed``); then every worker of every node learns the
verdict at once (a global sum), so that all stop, or go on, at the same step:

1. what the step computed (loss, gradients, buffers), before its update: a difference stops the
   run there (``NotExact``);
2. the update, once every shard is written: a difference stops the run before the next one.

With the user's consent (``split="like_ddp"``; a ``shards`` setting tests have not proven) the
run trains on instead, relabelled from that step.
"""
from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...errors import NotExact
from ...shm import futex
from ...shm.group import SHM_SAFE
from ..plan import Plan
from .reference import Difference, Reference

# What a difference's message advises: of what the step computed, and of the update.
SPLIT_ADVICE = ("a sample's loss or output depends on the other samples of its batch (padding to the batch's longest "
                "sample, a statistic over the batch, a load-balancing term, a loss over the batch's samples), so the "
                "workers' slices do not add up to the global batch's: make it independent of the batch (pad to a "
                "fixed length), compute a loss over the global batch from sn_trainer.gather, or return (loss_sum, "
                "count); or pass split=\"like_ddp\" to train on, labelled like DDP from that step (each worker "
                "computes its slice alone, as DDP does)")
UPDATE_ADVICE = ("the optimizer's update of its shards differs from one process's update of the whole parameters: "
                 "shards=full (one worker steps the whole optimizer) is exact for any optimizer; please report it")


@dataclass(frozen=True)
class Schedule:
    """Which steps are verified: the first of a launch, every ``every``-th step and the last; a step
    that trains off is found at most ``every`` - 1 steps later. ``every`` 0: none."""

    every: int
    first: int  # the launch's first step (from 0)
    last: int  # the run's last step (from 0)

    def due(self, step: int) -> bool:
        if self.every <= 0:
            return False
        return step in (self.first, self.last) or (step + 1) % self.every == 0

    def steps(self) -> list[int]:
        """Every verified step, counted from 1."""
        return [step + 1 for step in range(self.first, self.last + 1) if self.due(step)]


@contextmanager
def borrowed(cpus: tuple[int, ...], threads: int):
    """This thread on ``cpus`` with ``threads`` intra-op threads while the block runs (the peers
    asleep lend theirs), then pinned and sized as before: the run's own steps compute as they did."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        yield
        return
    mine, held = os.sched_getaffinity(0), torch.get_num_threads()
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(held)
        os.sched_setaffinity(0, mine)


class Bell:
    """A word of shared memory (int32) the node's other workers sleep on while worker 0 verifies:
    asleep, they lend it their cores. A peer that dies meanwhile is the launcher's to see."""

    def __init__(self, word: torch.Tensor):
        self.word = word

    def ring(self, generation: int) -> None:
        self.word[0] = generation
        if SHM_SAFE:
            futex.wake(self.word.data_ptr())

    def wait(self, generation: int) -> None:
        while (seen := int(self.word[0])) != generation:
            if SHM_SAFE:
                futex.wait(self.word.data_ptr(), seen, 0.05)
            else:
                time.sleep(0.001)


@dataclass
class Peers:
    """What a worker's verification needs of the run around it."""

    rank: int  # within the node
    workers: int  # of the node
    barrier: Callable[[], None]
    global_sum: Callable[[torch.Tensor], torch.Tensor]
    state_file: Callable[[int], str]  # where worker r leaves its optimizer state for worker 0 to read
    bell: Bell
    cores: tuple[int, ...]  # every worker's of the node: worker 0 computes on them while the others sleep
    threads: int  # the node's workers' intra-op threads, together


class Verification:
    """One worker's part in verifying its run: at a verified step it hands over its shard of the
    summed gradient (into ``grads``, shared by the node's workers) and its optimizer state; worker 0
    also compares (``reference``) while the others sleep. Every worker learns the verdict at once.

    A difference stops the run (``NotExact``, in every worker) unless the user consented to what
    it means: ``split="like_ddp"`` for what the step computes, a ``shards`` setting sn_trainer has
    not proven for the optimizer (``plan.unproven``) for the update. Then the run trains on,
    relabelled from that step, and nothing more is verified. Where one process's step itself
    fails (the user's code on the global batch), the run trains on, said unverified from there.
    """

    def __init__(self, plan: Plan, peers: Peers, grads: torch.Tensor, shard: tuple[int, int],
                 reference: Reference | None):
        self.plan, self.peers, self.grads, self.shard, self.reference = plan, peers, grads, shard, reference
        self.schedule = Schedule(plan.settings.verify_every, plan.start_step, plan.total_steps - 1)
        self.verified: list[int] = []  # steps (from 1) every phase of which was found equal
        self.relabelled: str | None = None  # what the run became after a consented difference
        self._last_equal = plan.start_step  # the last step (from 1) known equal, or where the launch began
        self._rings = 0
        self._failure = ""

    def due(self, step: int) -> bool:
        return self.relabelled is None and self.schedule.due(step)

    def phase_start(self, model: nn.Module, index: int, objective: Any) -> None:
        """As verified phase ``index`` starts: worker 0 keeps what the model and the phase's code
        hold besides the weights, and nobody's forward writes a frozen parameter before it has (a
        barrier)."""
        if self.relabelled is not None:  # all workers know it: the agreement was global
            return
        if self.reference is not None:
            self.reference.phase_start(model, index, objective)
        self.peers.barrier()

    def after_reduce(self, step: int, index: int, shard_grad: torch.Tensor, optimizer: torch.optim.Optimizer | None,
                     whole: Callable[[], list[tuple[Any, int]]], flat: torch.Tensor, totals, model: nn.Module,
                     timer) -> None:
        """After phase ``index``'s reduce, before its update: one process's forward and backward
        compared with the workers'.

        Raises:
            NotExact: they differ, and the user did not consent to train on so.
        """
        if self.relabelled is not None:
            return
        start, stop = self.shard
        with timer("verify"):
            self.grads[start:stop].copy_(shard_grad)
            own = optimizer.state_dict() if optimizer is not None else None
            if self.reference is None:  # worker 0 reads the others' from files; its own it holds
                torch.save(own, self.peers.state_file(self.peers.rank))
        with timer("wait"):
            self.peers.barrier()  # every shard of the gradient and of the optimizer's state is there
        self._rings += 1
        difference = None
        if self.reference is None:
            with timer("wait"):
                self.peers.bell.wait(self._rings)
        else:
            with timer("verify"):
                try:
                    difference = self._compare_computed(step, index, whole, flat, totals, model, own)
                except Exception as exc:  # noqa: BLE001 - the user's code on the global batch: the run goes on
                    self._failure = f"{type(exc).__name__}: {exc}".splitlines()[0]
                finally:
                    self.peers.bell.ring(self._rings)
        self._agree(step, difference, timer)

    def _compare_computed(self, step, index, whole, flat, totals, model, own) -> Difference | None:
        reference = self.reference
        divides = reference.objectives[index].divides
        theirs = self.grads / totals.count if divides and totals.count > 0 else self.grads.clone()
        loss = totals.loss_sum / totals.count if divides and totals.count > 0 else totals.loss_sum
        batches = whole()
        with borrowed(self.peers.cores, self.peers.threads):
            found = reference.gradient(index, batches, flat, step)
            difference = reference.compare_computed(found, loss, theirs, totals.unused, model)
            if difference is not None and math.isfinite(difference.off) and reference.dtype != torch.float64:
                # Beyond the first bound: how far does rounding alone move one process's own step?
                # The same step in float64 tells (a step that is off stays off in any precision).
                found = found.kept()
                rounding = reference.in_float64(index, batches, step)
                if rounding is not None:
                    difference = reference.compare_computed(found, loss, theirs, totals.unused, model, rounding)
            if difference is None:
                parts = [own if rank == self.peers.rank else torch.load(self.peers.state_file(rank), weights_only=False)
                         for rank in range(self.peers.workers)]
                reference.update(index, theirs, totals.unused, parts, step)
        return difference

    def after_update(self, step: int, flat: torch.Tensor, timer, last_phase: bool) -> None:
        """After a phase's update (every shard written): one process's update compared with the
        workers'; the step counts as verified once its last phase was.

        Raises:
            NotExact: they differ, and the user did not consent to train on so.
        """
        if self.relabelled is not None:  # found so in this step's computation already: its update has no reference
            return
        with timer("wait"):
            self.peers.barrier()
        difference = None
        if self.reference is not None:
            with timer("verify"):
                difference = self.reference.compare_update(flat)
        self._agree(step, difference, timer)
        if last_phase and self.relabelled is None:
            self.verified.append(step + 1)
            self._last_equal = step + 1

    def _agree(self, step: int, difference: Difference | None, timer) -> None:
        """Every worker of every node learns whether any worker 0 found a difference, or could not
        compare: stop, relabel or go on."""
        verdict = torch.zeros(3, dtype=torch.float64)
        if difference is not None:
            verdict[1 if difference.update else 0] = 1.0
        verdict[2] = float(bool(self._failure))
        with timer("wait"):
            verdict = self.peers.global_sum(verdict)
        if not verdict.any():
            return
        if verdict[2] > 0 and not verdict[:2].any():
            self.relabelled = (f"unverified from step {step + 1}: one process's step on the global batch raised "
                               f"{self._failure or '(on another node)'}; {self._seen()}")
            return
        update = bool(verdict[1] > 0)
        consent = bool(self.plan.unproven) if update else self.plan.settings.split == "like_ddp"
        said = self._message(step, difference, update)
        if consent:
            self.relabelled = f"{'not exact' if update else 'like DDP'} from step {step + 1}: {said}"
            return
        raise NotExact(said if difference is not None else
                       f"step {step + 1} differs from one process's step on the same global batch (worker 0 found "
                       "it; its message says how)")

    def _seen(self) -> str:
        verified = self.verified
        return f"steps {_listed(verified)} were verified equal" if verified else "no step was verified before it"

    def _message(self, step: int, difference: Difference | None, update: bool) -> str:
        done = step + 1
        unverified = (f"; steps {self._last_equal + 1}-{done - 1} were not verified and may have trained off"
                      if done - 1 > self._last_equal else "")
        found = difference.said() if difference is not None else "another node's worker 0 found it"
        if update:
            return (f"step {done}'s update differs from one process's on the same gradient and optimizer state: "
                    f"{found}; {self._seen()}{unverified}; the update was applied. "
                    + ("; ".join(self.plan.unproven) if self.plan.unproven else UPDATE_ADVICE))
        return (f"step {done} differs from one process's step on the same global batch: {found}; {self._seen()}"
                f"{unverified}; no update was applied for step {done}. Likely cause: {SPLIT_ADVICE}")


def _listed(steps: list[int]) -> str:
    return ", ".join(map(str, steps)) if len(steps) <= 6 else f"{', '.join(map(str, steps[:3]))}, ..., {steps[-1]}"
