"""How a scalar loss splits over the samples of a batch, measured before any worker starts.

Splitting a global batch over workers is exact when each worker's share of the loss is weighed
by what the whole batch's loss is divided by. A step function or loss that returns a scalar
does not say what that is, so it is measured on a copy of the model in eval mode (no dropout;
batch norm by its running statistics), from the loss and its gradient on a few samples:

- the batch's loss and gradient equal the mean of each sample's alone: a per-sample mean;
- they equal the sum of them: a sum over the samples;
- a Hugging Face model (a dict batch with ``labels``, called as ``model(**batch)``) whose loss
  is a mean over the labels it keeps (all, or those after the first position for a causal LM):
  the workers have the model sum them (``num_items_in_batch=1``, where it takes that), or sum
  its logits' cross-entropy over them (where that is what its loss is), and divide by the
  global count;
- a step function that calls ``sn_trainer.gather``: a loss over the global batch, which every
  worker computes alike from the gathered slices (``engine.gather``);
- anything else (a mean over tokens, masks or class weights, a loss of the batch as a whole, a
  random one) has no exact split: ``form`` is None, and the Trainer refuses it where it splits.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..engine.gather import Gathering, gathering
from ..engine.layout import trainable_parameters
from ..engine.objective import (COUNTED, GATHERED, IGNORED_LABEL, MEAN, SHIFTED, SHIFTED_TOKENS, SHIFTED_TOKENS_FROM_LOGITS, SUM,
                               TOKENS, TOKENS_FROM_LOGITS, Objective, Precision, kept_labels, model_outputs,
                               output_loss, token_cross_entropy)

FP32 = Precision("fp32")  # the form is arithmetic: measured without autocast


@dataclass(frozen=True)
class Finding:
    """What the probe found: the loss's form (None: no exact split), and what it measured."""

    form: str | None
    detail: str = ""


def measure(objective: Objective, model: nn.Module, group: Any, singles: list[Any]) -> Finding:
    """The form of ``objective``'s loss on ``group``, a batch of the samples that ``singles``
    holds one by one; ``model`` is a copy, put in eval mode here.

    Raises:
        whatever the user's code raises on these batches.
    """
    model.eval()
    params = [p for _, p in trainable_parameters(model)]
    dtype = params[0].dtype if params else torch.float32
    with torch.no_grad(), gathering(Gathering()) as seen:  # only its kind matters here
        first = objective.loss_value(model, group, FP32, dtype)
    if seen.calls:
        return _gathered(first, objective)
    if isinstance(first, (tuple, list)):
        return Finding(COUNTED, "(loss_sum, count) given")  # nothing to measure
    if objective.model_loss and isinstance(group, Mapping) and "labels" in group:
        form = _token_form(model, group, dtype)
        if form is not None:
            return Finding(form, "the model's mean over the labels it keeps")
    if len(singles) < 2:
        return Finding(MEAN, "too few samples to split")
    tolerance = min(1e-2, max(1e-6, 1000 * torch.finfo(dtype).eps))  # some models compute parts in fp32 anyway

    def vector(batch: Any, seed: int = 0) -> torch.Tensor:
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            value = objective.loss_value(model, batch, FP32, dtype)
        loss = value.reshape(()) if isinstance(value, torch.Tensor) else torch.tensor(float(value))
        grads = torch.autograd.grad(loss, params, allow_unused=True) if loss.requires_grad else [None] * len(params)
        return torch.cat([loss.detach().double().reshape(1)] +
                         [(g if g is not None else torch.zeros_like(p)).detach().double().reshape(-1)
                          for g, p in zip(grads, params)])

    whole = vector(group)
    if _off(vector(group, seed=1), whole) > tolerance:
        return Finding(None, "its value changes between two calls on the same samples, even in eval mode (random "
                             "augmentation such as Mixup?), so how it splits cannot be measured")
    each = torch.stack([vector(single) for single in singles])
    total, mean = each.sum(dim=0), each.mean(dim=0)
    if _off(whole, mean) <= tolerance:
        return Finding(MEAN, "a per-sample mean")
    if _off(whole, total) <= tolerance:
        return Finding(SUM, "a sum over the samples")
    return Finding(None, f"on {len(singles)} samples, its loss and gradient are neither the mean of each sample's "
                         f"alone (off by {_off(whole, mean):.2g}, relative) nor their sum (off by "
                         f"{_off(whole, total):.2g}): what it divides by depends on the data (kept tokens, masks, "
                         "class weights), or it is a loss of the batch as a whole")


def _gathered(value: Any, objective: Objective) -> Finding:
    """A step that calls sn_trainer.gather: its scalar is the loss over the global batch."""
    if isinstance(value, (tuple, list)):
        return Finding(None, "it calls sn_trainer.gather and returns (loss_sum, count); return the loss over the "
                             "gathered batch as a scalar (loss_sum / count)")
    return Finding(GATHERED, f"{objective.what} calls sn_trainer.gather: a loss over the global batch")


def _off(found: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative distance of two vectors (inf where either is not finite)."""
    if not (torch.isfinite(found).all() and torch.isfinite(expected).all()):
        return math.inf
    scale = max(found.norm().item(), expected.norm().item())
    return (found - expected).norm().item() / scale if scale > 0 else 0.0


@torch.no_grad()
def _token_form(model: nn.Module, batch: Mapping, dtype: torch.dtype) -> str | None:
    """How a Hugging Face model's loss over kept labels splits, or None.

    Which labels it keeps is told by a made-up target: the first sample with labels -100 but in
    its first two positions (class 0). A causal LM predicts, from position 0, only the label at
    1: it keeps one; any other model keeps two. Then: a model that divides by
    ``num_items_in_batch`` when given it (2 gives half of what 1 gives) is told 1 and sums; one
    that ignores it, but whose loss is its logits' cross-entropy over the kept labels, has that
    summed. Whichever it is must also hold on the real batch.
    """
    labels = batch["labels"]
    if not (isinstance(labels, torch.Tensor) and not labels.is_floating_point() and labels.dim() >= 2
            and labels.shape[-1] >= 2):
        return None
    rows = labels.shape[0]
    first = {k: v[:1] if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == rows else v
             for k, v in batch.items()}
    made_up = torch.full_like(first["labels"], IGNORED_LABEL)
    made_up[..., :2] = 0
    probe = {**first, "labels": made_up}

    def loss(of: Mapping, num_items: int | None = None) -> float:
        return float(output_loss(model_outputs(model, of, FP32, num_items), dtype))

    mean = loss(probe)
    if not math.isfinite(mean) or mean <= 0:
        return None
    try:
        one, two = loss(probe, 1), loss(probe, 2)
    except TypeError:  # a forward that takes no num_items_in_batch
        one = two = mean
    if math.isfinite(one) and _close(one, 2 * two, 1e-6) and not _close(one, two, 1e-6):
        kept = one / mean
        form = SHIFTED_TOKENS if _close(kept, 1.0, 1e-3) else TOKENS if _close(kept, 2.0, 1e-3) else None
        if form is not None:
            real_mean, real_sum = loss(batch), loss(batch, 1)
            count = kept_labels(labels, form in SHIFTED)
            if (real_sum == 0) if count == 0 else _close(real_sum / count, real_mean, 1e-4):
                return form
    for form in (SHIFTED_TOKENS_FROM_LOGITS, TOKENS_FROM_LOGITS):
        shifted = form in SHIFTED
        try:
            matches = all(_close(float(token_cross_entropy(outputs, of["labels"], shifted, "mean")),
                                 float(output_loss(outputs, dtype)), 1e-4)
                          for of in (probe, batch) if kept_labels(of["labels"], shifted) > 0
                          for outputs in [model_outputs(model, of, FP32)])
        except (TypeError, RuntimeError, IndexError):  # no logits, or not shaped as tokens x classes
            return None
        if matches:
            return form
    return None


def _close(a: float, b: float, rel: float) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b))
