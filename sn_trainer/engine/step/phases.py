"""One optimizer's part of a training step, in one worker: its pieces of the shard, optimizer and scheduler.

A run has one phase, or several updated in turn (``sn_trainer.Phase``: a GAN's discriminator,
then its generator). Every worker builds each phase over its own shard: the pieces of the phase's
parameters that fall in it, an optimizer over them with the phase's groups, and its scheduler.
"""
from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...recipe.flat_layout import FlatLayout
from ..memory.state import group_params, optimizer_pieces
from ..plan import Plan
from ...recipe.objective import Objective
from ...recipe.schedule import Schedule


@dataclass
class PhaseSpec:
    """A phase as every worker receives it."""

    name: str
    objective: Objective
    optimizer: Callable[..., torch.optim.Optimizer] | None
    group_options: list[dict[str, Any]] | None  # None: the factory gets a plain list of tensors
    slot_groups: tuple[int | None, ...]  # each parameter's group in this phase (None: not this phase's)
    scheduler: Callable[[torch.optim.Optimizer], Any] | None = None
    after_update: Callable[[nn.Module], Any] | None = None  # the user's code after each of its updates


class WorkerPhase:
    """One phase in one worker: its optimizer over the pieces of the worker's shard, and its schedule."""

    def __init__(self, phase: PhaseSpec, layout: FlatLayout, rank: int, flat: torch.Tensor, shard_grad: torch.Tensor,
                 plan: Plan, resume: dict[str, Any] | None):
        """``resume``: this phase's share of a checkpoint (``optimizer`` state, ``schedule`` state)."""
        self.spec, self.objective, self.plan = phase, phase.objective, plan
        shard = layout.shards[rank]
        self.pieces = optimizer_pieces(layout, rank, phase.slot_groups)
        self.grads: list[torch.Tensor] = []
        params = []
        for piece in self.pieces:
            if piece.whole:
                tensor, grad = layout.view(flat, piece.slot), layout.view(shard_grad, piece.slot, base=shard.start)
            else:
                tensor = flat[piece.start : piece.stop]
                grad = shard_grad[piece.start - shard.start : piece.stop - shard.start]
            params.append(nn.Parameter(tensor))
            self.grads.append(grad)
            params[-1].grad = grad
        self.params = params
        self._left_out = False  # whether some parameter's .grad is None since the last update
        self.optimizer, self.schedule = None, None
        if phase.optimizer is None or not self.pieces:
            return  # nothing of this phase is this worker's to update
        self.optimizer = phase.optimizer(group_params(params, [p.slot for p in self.pieces], phase.group_options,
                                                      phase.slot_groups))
        if resume is not None and resume.get("optimizer") is not None:
            current = self.optimizer.state_dict()
            self.optimizer.load_state_dict({"state": resume["optimizer"], "param_groups": current["param_groups"]})
        if phase.scheduler is not None:
            self.schedule = Schedule(phase.scheduler(self.optimizer), plan.steps_per_epoch)
        if self.schedule is not None and plan.start_step:
            if self.schedule.plateau and resume and resume.get("schedule"):
                self.schedule.load_state_dict(resume["schedule"])  # metric-driven: as the checkpoint left it
            else:
                # The run's own schedule, fast-forwarded to where it resumes: only the step count
                # comes from the checkpoint, so a resume with more epochs follows the longer schedule.
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    self.schedule.fast_forward(plan.start_step)

    def update(self, shard_grad: torch.Tensor, count: float, unused: tuple[int, ...], step_done: int,
               norm_sum: Callable[[torch.Tensor], torch.Tensor], whole_model: bool) -> None:
        """Divide by the global count, clip by the global norm (summed by ``norm_sum`` over the
        workers: of the whole gradient in a one-phase run, of this phase's parameters otherwise),
        then step this shard's optimizer (and its scheduler, where it steps per optimizer step)."""
        if self.objective.divides:
            shard_grad.div_(count)
        clip = self.plan.settings.clip_grad_norm
        if clip is not None:
            mine = [shard_grad] if whole_model else self.grads
            sq = torch.zeros(1, dtype=torch.float64)
            sq += sum(g.double().pow(2).sum() for g in mine if g.numel()) if mine else 0.0
            total_norm = math.sqrt(norm_sum(sq).item())
            coef = clip / (total_norm + 1e-6)
            if coef < 1.0:
                shard_grad.mul_(coef)
        if self.optimizer is None:
            return
        if unused or self._left_out:  # most steps reach every parameter, as the last one did
            left_out = set(unused)
            for piece, param, grad in zip(self.pieces, self.params, self.grads):
                # A parameter no worker's backward reached: .grad None, as plain PyTorch leaves it,
                # so the optimizer leaves it alone (no decay, no momentum, no step count).
                param.grad = None if piece.slot in left_out else grad
            self._left_out = bool(unused)
        factor = self.plan.lr_factor(step_done)
        if factor == 1.0:
            self.optimizer.step()
        else:
            with scaled_lr(self.optimizer, factor):
                self.optimizer.step()
        if self.schedule is not None:
            self.schedule.after_step(step_done)

    def lr(self) -> float | None:
        if self.optimizer is None or not self.optimizer.param_groups:
            return None
        return float(self.optimizer.param_groups[0]["lr"])

    def state(self) -> dict[str, Any]:
        """This worker's share of the phase for a checkpoint."""
        return {"optimizer": self.optimizer.state_dict() if self.optimizer else None,
                "schedule": self.schedule.state_dict() if self.schedule else None}


@contextlib.contextmanager
def scaled_lr(optimizer: torch.optim.Optimizer, factor: float):
    """Each group's learning rate times ``factor`` for one step, then the schedule's own again (a
    scheduler that multiplies the current rate must not compound the ramp)."""
    if factor == 1.0:
        yield
        return
    held = [group["lr"] for group in optimizer.param_groups]
    for group, lr in zip(optimizer.param_groups, held):
        group["lr"] = lr * factor
    try:
        yield
    finally:
        for group, lr in zip(optimizer.param_groups, held):
            group["lr"] = lr
