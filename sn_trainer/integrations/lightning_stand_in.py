"""What a LightningModule's own code meets inside sn_trainer in place of Lightning's Trainer.

``self.trainer`` is a stand-in that knows where the run is (``global_step``, ``current_epoch``)
and refuses anything else in one line; ``self.log`` is collected (in ``validation_step``) or
dropped (elsewhere: the run reports each step's loss itself); a step is called with
``(batch, batch_idx)`` or ``(batch,)``, as Lightning calls it.
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..recipe import position
from ..errors import ConfigError

_RESERVED_NAMES = ("loss", "accuracy", "samples")  # what evaluation reports itself


def step_arguments(method: Any, batch: Any, batch_idx: int) -> tuple[Any, ...]:
    """``(batch, batch_idx)``, or ``(batch,)`` for a step that takes no index (as Lightning calls it)."""
    takes = [p for p in inspect.signature(method).parameters.values()
             if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)]
    return (batch, batch_idx) if len(takes) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in takes) else (batch,)


class Logged:
    """``self.log`` inside validation_step: each value's ``(value x batch size, batch size)``, as
    Lightning's mean over an epoch weighs it, or the Metric logged."""

    def __init__(self, batch: Any, root: str):
        self.batch, self.root = batch, root
        self.terms: dict[str, Any] = {}

    def log(self, name: str, value: Any, *args: Any, on_epoch: bool | None = None, reduce_fx: Any = "mean",
            batch_size: int | None = None, **kwargs: Any) -> None:
        if name in _RESERVED_NAMES:
            raise ValueError(f"validation_step logs {name!r}, which sn_trainer's evaluation reports itself "
                             f"(eval_{name}: training_step's loss); log it under another name")
        if on_epoch is False or reduce_fx not in ("mean", torch.mean):
            raise ValueError(f"validation_step logs {name!r} with on_epoch={on_epoch}, reduce_fx={reduce_fx!r}; "
                             "sn_trainer collects epoch means (the defaults): log a per-batch mean, or a torchmetrics "
                             "Metric")
        if hasattr(value, "compute") and hasattr(value, "update"):  # a torchmetrics Metric: merged, computed once
            self.terms[name] = value
            return
        if batch_size is None:
            batch_size = importlib.import_module(f"{self.root}.utilities.data").extract_batch_size(self.batch)
        # A float64 tensor: sn_trainer sums the terms in float64, and a Python float would not stay one.
        value = torch.as_tensor(value).detach().to(torch.float64).reshape(())
        value_sum, count = self.terms.get(name, (torch.zeros((), dtype=torch.float64), 0))
        self.terms[name] = (value_sum + value * batch_size, count + batch_size)


class TrainerStandIn:
    """What the module's ``self.trainer`` is inside sn_trainer: where the run is; anything else of
    Lightning's Trainer refused in one line."""

    def __init__(self, where: position.Position, module_name: str):
        self._where, self._module_name = where, module_name

    @property
    def global_step(self) -> int:
        return self._known("global_step", self._where.step)

    @property
    def current_epoch(self) -> int:
        return self._known("current_epoch", self._where.epoch)

    def _known(self, name: str, value: int | None) -> int:
        if value is None:
            raise ConfigError(f"{self._module_name} reads self.{name} in an evaluation, where sn_trainer evaluates "
                              "weights, not a step: leave it out of validation_step")
        return value

    def __getattr__(self, name: str) -> Any:
        raise ConfigError(f"{self._module_name} reads self.trainer.{name}, and no Lightning Trainer runs here: "
                          "sn_trainer's module knows only global_step and current_epoch; pass what it needs to "
                          "the module's __init__")


@contextlib.contextmanager
def standing_in(module: nn.Module, where: position.Position | None = None, logged: Logged | None = None,
                methods: dict[str, Any] | None = None) -> Iterator[None]:
    """While the block runs, the module's ``self.trainer`` is a ``TrainerStandIn`` at ``where``,
    its ``self.log`` goes to ``logged`` (None: dropped), and each of ``methods`` is the module's
    method of that name; all put back after."""
    replaced = {"log": logged.log if logged is not None else dropped, **(methods or {})}
    trainer, own = module.__dict__.get("_trainer"), {name: module.__dict__.get(name) for name in replaced}
    module._trainer = TrainerStandIn(where or position.Position(), type(module).__name__)
    for name, method in replaced.items():
        setattr(module, name, method)
    try:
        yield
    finally:
        module._trainer = trainer
        for name, method in own.items():
            if method is None:
                delattr(module, name)
            else:
                setattr(module, name, method)


def dropped(*args: Any, **kwargs: Any) -> None:
    """``self.log`` where nothing collects it (training_step, hooks)."""
