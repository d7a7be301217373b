"""Manual optimization of a LightningModule: one phase per optimizer its configure_optimizers returns.

Inside training_step, ``self.optimizers()`` gives stand-ins whose ``step()`` ends the phase at its
own optimizer, and ``self.manual_backward`` collects the loss that phase trains on.
"""
from __future__ import annotations

import contextlib
import importlib
from typing import Any

import torch
from torch import nn

from ..recipe import position
from ..errors import ConfigError
from ..phase import Phase
from .lightning_module import ModuleOptimizer
from .lightning_stand_in import dropped, standing_in, step_arguments


def manual_phases(module: nn.Module, root: str) -> list[Phase]:
    """Under manual optimization, a phase per optimizer configure_optimizers returns, in its order:
    phase k runs training_step up to optimizer k's ``step()``, and trains on what
    ``manual_backward`` was given since the optimizer before it stepped (the earlier ones' steps
    the workers made already, before this phase started; the code after is not run).

    Raises:
        ConfigError: a scheduler (stepped by the module itself, which sn_trainer cannot split).
    """
    parse = importlib.import_module(f"{root}.core.optimizer")
    with standing_in(module):
        optimizers, schedulers, _ = parse._configure_optimizers(module.configure_optimizers())
    if schedulers:
        raise ConfigError(f"{type(module).__name__} uses manual optimization with a scheduler, which its "
                          "training_step steps itself; sn_trainer cannot step it there: give each optimizer's "
                          "schedule to an sn_trainer.Phase(step_fn, params, optimizer, scheduler)")
    count = len(optimizers)
    return [Phase(ManualStep(k, count), ModuleOptimizer(k), name=f"optimizer{k}") for k in range(count)]


class _PhaseLoss(Exception):  # noqa: N818 - not an error: how a phase's loss leaves training_step
    """Raised at the phase's optimizer's ``step()``, carrying the phase's loss out of training_step."""

    def __init__(self, loss: torch.Tensor):
        super().__init__()
        self.loss = loss


class _PhasePass:
    """One run of training_step for phase ``phase``: the losses manual_backward was given since
    the last optimizer step, and which optimizer must step next."""

    def __init__(self, module_name: str, phase: int):
        self.module_name, self.phase, self.pending, self.next = module_name, phase, None, 0

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        self.pending = loss if self.pending is None else self.pending + loss

    def stepped(self, index: int) -> None:
        if index != self.next:
            raise ConfigError(f"{self.module_name}.training_step stepped optimizer {index} where optimizer "
                              f"{self.next} was due: sn_trainer steps each optimizer once a step, in the order "
                              "configure_optimizers returns them; step them in that order")
        self.next += 1
        loss, self.pending = self.pending, None
        if index == self.phase:
            if loss is None:
                raise ConfigError(f"{self.module_name}.training_step stepped optimizer {index} with no "
                                  "manual_backward before it: call self.manual_backward(loss) first")
            raise _PhaseLoss(loss)


class StandInOptimizer:
    """What ``self.optimizers()`` gives training_step: ``step()`` ends the phase at its own optimizer
    and passes over an earlier one's (the workers made it); ``zero_grad()`` does nothing (the
    workers clear the gradients of each phase)."""

    def __init__(self, index: int, run: _PhasePass):
        self._index, self._run = index, run

    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise ConfigError(f"{self._run.module_name}.training_step steps optimizer {self._index} with a closure, "
                              "which sn_trainer cannot split: compute the loss, manual_backward it, then step()")
        self._run.stepped(self._index)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The workers clear each phase's gradients themselves."""

    def __getattr__(self, name: str) -> Any:
        raise ConfigError(f"{self._run.module_name}.training_step reads optimizer.{name}: under sn_trainer "
                          "self.optimizers() gives step() and zero_grad() only (each worker's optimizer holds "
                          "its shard)")


class ManualStep:
    """Phase ``phase``'s step function: training_step run until optimizer ``phase`` steps."""

    def __init__(self, phase: int, count: int):
        self.phase, self.count = phase, count

    def __call__(self, model: nn.Module, batch: Any) -> torch.Tensor:
        module = getattr(model, "_orig_mod", model)
        where, name = position.current(), type(module).__name__
        run = _PhasePass(name, self.phase)
        optimizers = [StandInOptimizer(k, run) for k in range(self.count)]
        methods = {"optimizers": lambda use_pl_optimizer=True: optimizers[0] if self.count == 1 else optimizers,
                   "manual_backward": run.backward, "toggle_optimizer": dropped, "untoggle_optimizer": dropped,
                   "toggled_optimizer": lambda optimizer: contextlib.nullcontext(), "lr_schedulers": lambda: None}
        try:
            with standing_in(module, where, methods=methods):
                module.training_step(*step_arguments(module.training_step, batch, where.batch))
        except _PhaseLoss as done:
            return done.loss
        raise ConfigError(f"{name}.training_step did not step optimizer {self.phase} on batch {where.batch}: "
                          "sn_trainer steps every optimizer every step (a D stepped every other batch is not "
                          "one of its shapes)")
