"""One optimizer's part of every training step: a GAN's discriminator step, then its generator's."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Phase:
    """``fit(phases=[Phase(...), Phase(...)])``: each optimizer step runs the phases in order, on
    the same micro-batches. A phase's forward and backward, the sum of its gradients over the
    workers and the update of its parameters' shards all end before the next phase starts, so
    the next phase sees the weights this one updated, as in pytorch/examples' DCGAN (D, then G).

    Args:
        step_fn: ``step_fn(model, batch)`` returning this phase's loss (a per-sample mean or a
            sum, measured up front) or ``(loss_sum, count)``.
        params: ``params(model)`` returning the parameters this phase updates, or torch.optim's
            groups of them (or an optimizer built from them). Parameters outside it are not
            touched by this phase; a parameter may be in one phase only.
        optimizer: called as ``optimizer(params)`` with this phase's parameters or groups;
            default the class of the optimizer ``params`` returned, else SGD(lr=0.01).
        scheduler: called as ``scheduler(optimizer)`` with this phase's optimizer (any kind
            ``fit``'s scheduler may be).
        name: reported with its loss (``loss_<name>``); default ``phase<i>``.
        after_update: ``after_update(model)``, called under ``torch.no_grad()`` after each of this
            phase's updates, before the next phase's forward (WGAN clips the critic's weights
            after the critic's step): once per update, on the shared weights, in place.
    """

    step_fn: Callable[..., Any]
    params: Callable[..., Any]
    optimizer: Callable[..., Any] | None = None
    scheduler: Callable[..., Any] | None = None
    name: str | None = None
    after_update: Callable[..., Any] | None = None
