"""A LightningModule's steps, optimizer and scheduler as fit's arguments, read as Lightning's Trainer reads them.

Which Lightning a model comes from and what its class overrides; what ``configure_optimizers``
returned (one optimizer, its scheduler with Lightning's interval, frequency and monitor), built
again in each worker as fit's ``param_groups`` and ``scheduler``; ``training_step`` as fit's
``step_fn`` and what ``validation_step`` logs as its ``metric_fn``. Lightning is imported only for
a model whose class comes from it.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import torch
from torch import nn

from ..recipe import position
from ..errors import ConfigError
from .lightning_stand_in import Logged, standing_in, step_arguments

_ROOTS = ("lightning.pytorch", "pytorch_lightning")


def lightning_root(model: Any) -> str | None:
    """The Lightning package ``model``'s class comes from (``lightning.pytorch`` or
    ``pytorch_lightning``), or None for any other model; nothing is imported to tell."""
    for cls in type(model).__mro__:
        root = cls.__module__.rsplit(".core", 1)[0]
        if cls.__name__ == "LightningModule" and root in _ROOTS:
            return root
    return None


def overrides(model: nn.Module, root: str, name: str) -> bool:
    """Whether the module's class defines ``name`` itself, not as LightningModule does."""
    base = importlib.import_module(root).LightningModule
    return getattr(type(model), name, None) is not getattr(base, name, None)


@dataclasses.dataclass
class OptimizerConfig:
    """What configure_optimizers returned, as Lightning reads it: one optimizer, and its scheduler
    as fit's scheduler dict (None: no scheduler)."""

    optimizer: torch.optim.Optimizer
    schedule: dict[str, Any] | None


def lightning_optimizers(module: nn.Module, root: str | None = None) -> OptimizerConfig:
    """Call the module's configure_optimizers and read what it returned as Lightning does.

    Raises:
        ConfigError: no optimizer, several optimizers or schedulers, or a step scheduler with a
            frequency above 1.
    """
    root = root or lightning_root(module)
    parse = importlib.import_module(f"{root}.core.optimizer")
    name = type(module).__name__
    with standing_in(module):
        returned = module.configure_optimizers()
    if returned is None:
        raise ConfigError(f"{name}.configure_optimizers returned None (Lightning then trains nothing): return the "
                          "optimizer to train with")
    optimizers, schedulers, monitor = parse._configure_optimizers(returned)
    if len(optimizers) != 1:
        raise ConfigError(f"{name}.configure_optimizers returned {len(optimizers)} optimizers; with automatic "
                          "optimization Lightning takes one, and so does sn_trainer (several in turn: "
                          "sn_trainer.Phase)")
    configs = parse._configure_schedulers_automatic_opt(schedulers, monitor)
    if len(configs) > 1:
        raise ConfigError(f"{name}.configure_optimizers returned {len(configs)} schedulers; sn_trainer steps one: "
                          "chain them into one (torch.optim.lr_scheduler.SequentialLR or ChainedScheduler)")
    if not configs:
        return OptimizerConfig(optimizers[0], None)
    config = configs[0]
    if config.interval == "step" and config.frequency != 1:
        raise ConfigError(f"{name}'s scheduler steps every {config.frequency} steps, which Lightning counts in batches "
                          "of each epoch and sn_trainer in optimizer steps of the run; use frequency 1 (or interval "
                          "'epoch')")
    # Metrics are reported as eval_<the name self.log was given>.
    monitor = f"eval_{config.monitor}" if config.monitor else None
    return OptimizerConfig(optimizers[0], {"scheduler": config.scheduler, "interval": config.interval,
                                           "frequency": config.frequency, "monitor": monitor})


class ModuleOptimizer:
    """fit's ``param_groups`` (or a phase's ``params``): the optimizer the module's
    configure_optimizers builds, its ``index``-th under manual optimization (its class then
    becomes every worker's optimizer, with its groups' options)."""

    def __init__(self, index: int | None = None):
        self.index = index

    def __call__(self, model: nn.Module) -> torch.optim.Optimizer:
        if self.index is None:
            return lightning_optimizers(model).optimizer
        parse = importlib.import_module(f"{lightning_root(model)}.core.optimizer")
        with standing_in(model):
            return parse._configure_optimizers(model.configure_optimizers())[0][self.index]


class ModuleScheduler:
    """fit's ``scheduler``: the module's own, built by its configure_optimizers in the worker, moved
    onto the worker's optimizer, with Lightning's interval, frequency and monitor."""

    def __init__(self, module: nn.Module):
        self.module = module

    def __call__(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        config = lightning_optimizers(self.module)
        built = config.optimizer
        if len(built.param_groups) != len(optimizer.param_groups):
            raise ConfigError(f"{type(self.module).__name__}.configure_optimizers built {len(built.param_groups)} "
                              f"parameter groups, then {len(optimizer.param_groups)}: build the same every call")
        # torch's schedulers count optimizer steps through a wrapper they put on optimizer.step
        # when built; the user's was built on another optimizer, so one that changes nothing puts
        # it on this one.
        torch.optim.lr_scheduler.ConstantLR(optimizer, factor=1.0, total_iters=0)
        for mine, theirs in zip(optimizer.param_groups, built.param_groups):
            mine.update({key: value for key, value in theirs.items() if key != "params"})  # lr as the scheduler set it
        _rebind(config.schedule["scheduler"], optimizer)
        return config.schedule


def _rebind(scheduler: Any, optimizer: torch.optim.Optimizer) -> None:
    """Point ``scheduler`` (and the schedulers it chains) at ``optimizer``."""
    scheduler.optimizer = optimizer
    for inner in getattr(scheduler, "_schedulers", ()):
        _rebind(inner, optimizer)


class TrainingStep:
    """fit's ``step_fn``: the module's training_step at the batch's index in its epoch; its loss,
    or the ``loss`` of the dict it returns."""

    def __call__(self, model: nn.Module, batch: Any) -> torch.Tensor:
        module = getattr(model, "_orig_mod", model)  # a compiled model's module
        where = position.current()
        with standing_in(module, where):
            out = module.training_step(*step_arguments(module.training_step, batch, where.batch))
        if isinstance(out, dict) and "loss" in out:
            out = out["loss"]
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"{type(module).__name__}.training_step returned {type(out).__name__}; sn_trainer trains "
                            "every batch on its loss: return the loss tensor, or a dict with 'loss' (Lightning skips a "
                            "batch whose step returns None; sn_trainer does not)")
        return out


class ValidationMetrics:
    """fit's ``metric_fn``: what the module's validation_step logs with ``self.log``, each as
    Lightning's epoch value (the mean over batches, weighted by each batch's size), or the
    torchmetrics Metric it logged."""

    def __call__(self, model: nn.Module, batch: Any) -> dict[str, Any]:
        module = getattr(model, "_orig_mod", model)
        where = position.current()
        logged = Logged(batch, lightning_root(module))
        with standing_in(module, where, logged):
            module.validation_step(*step_arguments(module.validation_step, batch, where.batch))
        return logged.terms
