"""Before any worker starts: one micro-batch through the user's step, optimizer and evaluation.

Shape and type errors in a model, a step function, a loss, a metric or an optimizer then
surface within seconds, as one error carrying the user's traceback, instead of inside a worker
after its peers have started (or after an hour of training, for evaluation). It runs in this
process, on a copy of the model, so nothing of the model, its statistics or its optimizer moves.
"""
from __future__ import annotations

import copy
import sys
import traceback
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from .data.batching import fetch_batch, map_tensors
from .engine.layout import trainable_parameters
from .engine.objective import Objective, Precision
from .engine.state import group_params
from .errors import UserCodeError
from .optim import Groups


@dataclass(frozen=True)
class Rehearsal:
    optimizer_class: type | None  # what the factory builds; None without an optimizer
    eval_keys: tuple[str, ...]  # the sums evaluation reports, in the order every worker sums them


def rehearse(model: nn.Module, train_set: Dataset | None, train_samples: int, eval_set: Dataset | None,
             eval_samples: int, objective: Objective, optimizer, groups: Groups, precision: str,
             channels_last: bool) -> Rehearsal:
    """Run one training slice of ``train_samples`` (forward, loss, backward, optimizer step) and one
    evaluation slice of ``eval_samples`` on a copy of ``model``.

    Raises:
        UserCodeError: any of them raised; the message carries the user's traceback.
    """
    replica = copy.deepcopy(model)
    params = [p for _, p in trainable_parameters(replica)]
    dtype = params[0].dtype if params else torch.float32
    how = Precision(precision)

    def prepare(batch: Any) -> Any:
        if not channels_last:
            return batch
        return map_tensors(batch, lambda t: t.contiguous(memory_format=torch.channels_last)
                           if t.dim() == 4 and t.is_floating_point() else t)

    optimizer_class = None
    if train_set is not None:
        batch = _attempt("reading a training batch", lambda: prepare(fetch_batch(train_set, torch.arange(train_samples))))
        replica.train()
        loss_sum, _ = _attempt(f"the training step (on a first slice of {train_samples} samples)",
                               lambda: objective.train_terms(replica, batch, train_samples, how, dtype))
        _attempt("the backward pass", loss_sum.backward)
        if optimizer is not None:
            built = _attempt("building the optimizer", lambda: optimizer(group_params(
                params, range(len(params)), groups.options, groups.slot_groups)))
            optimizer_class = type(built)
            if not _needs_closure(optimizer_class):
                _attempt("the optimizer's step", built.step)
    eval_keys: tuple[str, ...] = ()
    if eval_set is not None:
        batch = _attempt("reading an evaluation batch", lambda: prepare(fetch_batch(eval_set, torch.arange(eval_samples))))
        replica.eval()
        found = _attempt(f"evaluation (on a first slice of {eval_samples} samples)",
                         lambda: objective.eval_terms(replica, batch, eval_samples, how, dtype))
        eval_keys = tuple(found)
    return Rehearsal(optimizer_class, eval_keys)


def _needs_closure(optimizer_class: type) -> bool:
    return issubclass(optimizer_class, torch.optim.LBFGS)  # refused by the caller, with the reason


def _attempt(what: str, fn):
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - whatever the user's code raises is reported the same way
        frames = traceback.format_exception(type(exc), exc, exc.__traceback__)
        # Drop this module's own frames: the user's code starts below them.
        kept = [f for f in frames if __file__ not in f]
        raise UserCodeError(f"{what} failed before any worker started: {type(exc).__name__}: {exc}\n"
                            + "".join(kept).rstrip()) from None
