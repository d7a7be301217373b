"""A scalar loss's split, verified on the run's own micro-batches while it trains.

Before any worker starts, ``fit.loss_probe`` measures on a few samples how a scalar loss splits (a
per-sample mean, or a sum). That is a finding about those samples, not about every batch: a loss
whose samples interact can look like a mean on samples that happen to agree (a load-balancing
loss whose first samples all go to one expert). So each worker checks it again on its own first
micro-batch of steps 1, 2, 4, 8, ... (log-spaced: the check costs a few forward passes, ever
fewer per step): the slice's loss against its two halves', weighed as the form says. A loss that
does not split there stops the run at that step, before its update (``LossDoesNotSplit``).

Measured as the probe measures: without autocast, dropout and batch norm in eval (their draws
and statistics are not the loss's form, and the check must not move running statistics), the
random streams left as they were.
"""
from __future__ import annotations

from collections.abc import Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.dropout import _DropoutNd

from ...data import random_state
from ...errors import LossDoesNotSplit
from .objective import MEAN, SUM, Objective, Precision

CHECKED = {MEAN: "a per-sample mean", SUM: "a sum over the samples"}  # the scalar forms the probe recognises
FP32 = Precision("fp32")
MIN_HALF = 2  # samples in each half at least: a half of one sample is where models squeeze a dimension away
# What to do about a loss whose samples interact (the probe's refusal says the same).
COUPLED_ADVICE = ("Its samples interact, so no (loss_sum, count) of a slice makes it exact: for a contrastive loss, "
                  "gather the global batch inside step_fn (sn_trainer.gather(embeddings)) and compute the loss over "
                  "it; for a loss normalised inside the model (a detector's sampled proposals), pass "
                  "split=\"like_ddp\" to weigh each worker's loss as DDP does (each worker's mean, averaged over the "
                  "workers: like DDP, not exact); or train with workers=1 and accumulate=1")


def due(step: int) -> bool:
    """Whether 0-based ``step`` is one the split is checked at: steps 1, 2, 4, 8, ... counted from 1."""
    return step & (step + 1) == 0


def tolerance(dtype: torch.dtype) -> float:
    """How far apart, relative, a slice's loss and its halves' may be: rounding, not a form (the probe's)."""
    return min(1e-2, max(1e-6, 1000 * torch.finfo(dtype).eps))


def verify(objective: Objective, model: nn.Module, batch: Any, samples: int, dtype: torch.dtype,
           step: int, rank: int) -> None:
    """Check that ``objective``'s scalar loss splits on ``batch`` (``samples`` samples) as its form says.

    Raises:
        LossDoesNotSplit: it does not; the message says where, by how much, and what to do.
    """
    if objective.form not in CHECKED or samples < 2 * MIN_HALF:
        return
    first = samples // 2
    parts = [_rows(batch, samples, 0, first), _rows(batch, samples, first, samples)]
    if any(part is None for part in parts):  # a batch that is not samples along dimension 0: nothing to cut
        return
    try:
        with measuring(model):
            whole = _loss(objective, model, batch, dtype)
            halves = [_loss(objective, model, part, dtype) for part in parts]
    except Exception:  # noqa: BLE001 - code that takes only the batches it trains on: unchecked, not stopped
        return
    if whole is None or any(h is None for h in halves):  # a (loss_sum, count) pair: counted, not a form
        return
    counts = (first, samples - first)
    combined = sum(h * n for h, n in zip(halves, counts)) / samples if objective.form == MEAN else sum(halves)
    scale = max(abs(whole), *(abs(h) for h in halves))
    off = abs(whole - combined) / scale if scale > 0 else 0.0
    if off > tolerance(dtype):
        raise LossDoesNotSplit(
            f"{objective.what}'s loss did not split as {CHECKED[objective.form]} at step {step + 1}: on worker "
            f"{rank}'s {samples} samples it is {whole:.6g}, and its two halves' {'mean' if objective.form == MEAN else 'sum'} "
            f"is {combined:.6g} (off by {off:.2g}, relative; rounding allows {tolerance(dtype):.0g}). It looked like "
            f"{CHECKED[objective.form]} on the few samples measured before the run; no update was applied for step "
            f"{step + 1}. {COUPLED_ADVICE}")


def _loss(objective: Objective, model: nn.Module, batch: Any, dtype: torch.dtype) -> float | None:
    with torch.no_grad(), random_state.kept():
        value = objective.loss_value(model, batch, FP32, dtype)
    if isinstance(value, (tuple, list)):
        return None
    return float(value.double().reshape(()).item()) if isinstance(value, torch.Tensor) else float(value)


def _rows(batch: Any, samples: int, start: int, stop: int) -> Any:
    """Samples ``start:stop`` of a batch of ``samples``: every tensor (and list) of that length cut
    along dimension 0, the rest as is where no sample is in it (None: a part holds another length)."""
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0:
            return batch
        return batch[start:stop] if batch.shape[0] == samples else None
    if isinstance(batch, Mapping):
        cut = {k: _rows(v, samples, start, stop) for k, v in batch.items()}
        return None if any(v is None for v in cut.values()) else cut
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        cut = [_rows(v, samples, start, stop) for v in batch]
        return None if any(v is None for v in cut) else type(batch)(*cut)
    if isinstance(batch, (tuple, list)):
        if all(not isinstance(v, (torch.Tensor, Mapping, tuple, list)) for v in batch):
            return batch[start:stop] if len(batch) == samples else None  # a list of strings, ids
        cut = [_rows(v, samples, start, stop) for v in batch]
        return None if any(v is None for v in cut) else type(batch)(cut)
    return batch if isinstance(batch, (int, float, str, bool, type(None))) else None


@contextmanager
def measuring(model: nn.Module, whole_eval: bool = False):
    """The model in the modes its loss is measured in: as it is with dropout and batch norm in
    eval, or wholly in eval; every module's mode as it was afterwards."""
    modes = [(m, m.training) for m in model.modules()]
    for m in model.modules():
        if whole_eval or isinstance(m, (_DropoutNd, _BatchNorm)):
            m.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training
