"""Optimizers: which shards each kind needs, and their parameter groups resolved against a model."""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .errors import ConfigError

# Optimizers whose update of an element depends only on that element's gradient and state:
# each worker may step any slice of the parameters and compute what one process would. Each is
# proven so by a test against plain PyTorch (tests/test_byo_optimizer.py).
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop, torch.optim.Adagrad,
               torch.optim.Adadelta, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.ASGD,
               torch.optim.Rprop)
# Optimizers whose update of a tensor depends only on that whole tensor (factored moments, a
# norm per tensor): each worker may step whole tensors. Proven by a test too.
PER_TENSOR = (torch.optim.Adafactor,)
# Refused: they need what a sharded step cannot give. Each with what to use instead.
REFUSED = {torch.optim.LBFGS: "it re-evaluates the loss through a closure, several times a step; use an optimizer "
                              "whose step() needs no closure (SGD, AdamW, Adafactor...)",
           torch.optim.SparseAdam: "it needs sparse gradients, and sn_trainer trains dense ones; use Adam or AdamW, "
                                   "with every embedding built with sparse=False"}


def refuse_unrunnable(optimizer_class: type) -> None:
    """Refuse an optimizer class sn_trainer cannot run, whatever the worker count.

    Raises:
        ConfigError: LBFGS, SparseAdam (or a subclass), with what to use instead.
    """
    for refused, why in REFUSED.items():
        if issubclass(optimizer_class, refused):
            raise ConfigError(f"{optimizer_class.__name__} cannot train with sn_trainer: {why}")


def shard_kind(optimizer_class: type, asked: str) -> str:
    """How an optimizer class's work is split; ``asked`` is the shards setting.

    ``auto``: ``elements`` for the optimizers proven elementwise, ``tensors`` for those proven
    to look at one tensor at a time, and ``full`` for any other (it may look across tensors, as
    Lamb's or LARS's global norms do): one worker then steps the whole optimizer on the summed
    gradient, exact for any optimizer.

    Raises:
        ConfigError: an optimizer sn_trainer cannot run (LBFGS, SparseAdam).
    """
    refuse_unrunnable(optimizer_class)
    if asked != "auto":
        return asked
    # Exact classes only: a subclass may change what its step looks at.
    if optimizer_class in ELEMENTWISE:
        return "elements"
    return "tensors" if optimizer_class in PER_TENSOR else "full"


@dataclass(frozen=True)
class Groups:
    """Parameter groups resolved against the model: options per group, and each parameter's group."""

    options: list[dict[str, Any]] | None  # None: no groups; the factory gets a plain list of tensors
    slot_groups: tuple[int | None, ...]  # per trainable parameter (model order); None: in no group
    factory: Callable[..., torch.optim.Optimizer] | None = None  # the class of an optimizer G returned


def resolve_groups(model: nn.Module, trainable: Sequence[nn.Parameter], param_groups: Callable | None) -> Groups:
    """Call ``param_groups(model)`` and map its groups onto the trainable parameters.

    It may return groups in torch.optim's format (dicts with "params" and options), parameters
    (one group without options), or an optimizer built from them (as nanoGPT's
    ``configure_optimizers`` does); then its class becomes the factory, unless one is given.

    A frozen parameter of the model (``requires_grad=False``) in a group is left out, as
    torch.optim never steps it (it never has a gradient).

    Raises:
        ConfigError: a group holds something that is not a parameter of the model, or a
            parameter twice.
    """
    if param_groups is None:
        return Groups(None, (0,) * len(trainable))
    result = param_groups(model)
    factory = None
    if isinstance(result, torch.optim.Optimizer):
        factory, result = functools.partial(type(result)), result.param_groups
    groups = list(result)
    if groups and all(isinstance(g, torch.Tensor) for g in groups):  # parameters, not groups: one group, no options
        return Groups(None, _membership(model, trainable, [{"params": groups}]), factory)
    if not groups or not all(isinstance(g, dict) and "params" in g for g in groups):
        raise ConfigError("param_groups(model) must return groups as torch.optim takes them: a list of dicts, "
                          "each with 'params' and its options (or an optimizer built from them)")
    options = [{k: v for k, v in group.items() if k != "params"} for group in groups]
    return Groups(options, _membership(model, trainable, groups), factory)


def _membership(model: nn.Module, trainable: Sequence[nn.Parameter], groups: list[dict]) -> tuple[int | None, ...]:
    """Each trainable parameter's group (None: in none); frozen parameters of the model are left out."""
    index = {id(p): i for i, p in enumerate(trainable)}
    frozen = {id(p) for p in model.parameters() if not p.requires_grad}
    slot_groups: list[int | None] = [None] * len(trainable)
    for g, group in enumerate(groups):
        params = [group["params"]] if isinstance(group["params"], torch.Tensor) else list(group["params"])
        for p in params:
            if id(p) in frozen:
                continue
            if id(p) not in index:
                raise ConfigError(f"param_groups: group {g} holds a tensor of shape {tuple(p.shape)} that is not a "
                                  "parameter of the model")
            if slot_groups[index[id(p)]] is not None:
                raise ConfigError(f"param_groups: a parameter of shape {tuple(p.shape)} is in groups "
                                  f"{slot_groups[index[id(p)]]} and {g}; put each parameter in one group")
            slot_groups[index[id(p)]] = g
    return tuple(slot_groups)
