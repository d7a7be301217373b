"""How a scalar loss splits over the samples of a batch, measured before any worker starts.

Splitting a global batch over workers is exact when each worker's share of the loss is weighed
by what the whole batch's loss is divided by. A step function or loss that returns a scalar
does not say what that is, so it is measured on a copy of the model in the modes training runs
it in (a detector computes its losses only in training mode), with dropout and batch norm put
in eval for the measurement (their randomness and statistics are each worker's own, or synced,
whatever the loss's form: see docs/exactness.md), from the loss and its gradient on a few samples:

- the batch's loss and gradient equal the mean of each sample's alone: a per-sample mean;
- they equal the sum of them: a sum over the samples;
- a Hugging Face model (a dict batch with ``labels``, called as ``model(**batch)``) whose loss
  is a mean over the labels it keeps (all, or those after the first position for a causal LM):
  the workers have the model sum them (``num_items_in_batch=1``, where it takes that), or sum
  its logits' cross-entropy over them (where that is what its loss is), and divide by the
  global count;
- a step function that calls ``sn_trainer.gather``: a loss over the global batch, which every
  worker computes alike from the gathered slices (``recipe.gather``);
- anything else has no exact split: ``form`` is None, and the Trainer refuses it where it
  splits, with the advice that fits what was found: a weighed sum of per-sample parts (a mean
  over kept tokens, masks, class weights) needs ``(loss_sum, count)``; a loss in which samples
  interact (a contrastive loss over the batch, counts sampled over the batch) needs the global
  batch gathered, or ``split="like_ddp"``; a loss that changes between two calls on the same
  samples (random draws, state kept between calls) cannot be measured at all.

A per-sample mean measured on a few samples is not trusted where the data holds ignored labels
(-100, cross-entropy's ``ignore_index``) that those few samples happened not to show
(``labels_seen``): a mean over the labels kept divides by a count that differs between slices.
"""
from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.dropout import _DropoutNd

from ..data import random_state
from ..recipe.flat_layout import trainable_parameters
from ..recipe.gather import Gathering, gathering
from ..recipe.objective import (COUNTED, GATHERED, IGNORED_LABEL, MEAN, SHIFTED, SHIFTED_TOKENS,
                                SHIFTED_TOKENS_FROM_LOGITS, SUM, TOKENS, TOKENS_FROM_LOGITS, Objective, Precision,
                                kept_labels, model_outputs, output_loss, token_cross_entropy)

FP32 = Precision("fp32")  # the form is arithmetic: measured without autocast
# What to do about a loss whose samples interact.
COUPLED_ADVICE = ("Its samples interact, so no (loss_sum, count) of a slice makes it exact: for a contrastive loss, "
                  "gather the global batch inside step_fn (sn_trainer.gather(embeddings)) and compute the loss over "
                  "it; for a loss normalised inside the model (a detector's sampled proposals), pass "
                  "split=\"like_ddp\" to weigh each worker's loss as DDP does (each worker's mean, averaged over the "
                  "workers: like DDP, not exact); or train with workers=1 and accumulate=1")


# What a refusal advises, by what the probe found (settle.py words the refusal around it).
COUNTED_ADVICE = ("Return (loss_sum, count) from a step_fn instead: the loss summed over the slice and what the whole "
                  "batch's loss divides by, e.g. (F.cross_entropy(logits, targets, ignore_index=-100, "
                  "reduction=\"sum\"), (targets != -100).sum()), or (loss * n, n) for a per-sample mean of n samples "
                  "(a Hugging Face model needs no step_fn: sn_trainer calls it and counts its labels); where the "
                  "count is not yours to know (a loss normalised inside the model), pass split=\"like_ddp\" to weigh "
                  "each worker's loss as DDP does (like DDP, not exact)")
RANDOM_ADVICE = ("Where each sample's loss is its own (noise drawn per sample), return (loss_sum, count) from a "
                 "step_fn instead (nothing is measured then), e.g. (loss * n, n) for a per-sample mean of n samples; where "
                 "the draws span the batch (Mixup, a detector's sampled proposals), pass split=\"like_ddp\" to weigh "
                 "each worker's loss as DDP does (like DDP, not exact); or train with workers=1 and accumulate=1")
STATE_ADVICE = ("Return (loss_sum, count) from a step_fn instead (nothing is measured then), e.g. (loss * n, n) for a "
                "per-sample mean of n samples; or keep the state out of the model (pass it in with the batch); or "
                "train with workers=1 and accumulate=1")


def rounding(dtype: torch.dtype) -> float:
    """How far apart, relative, a batch's loss and its parts' may be: rounding, not a form."""
    return min(1e-2, max(1e-6, 1000 * torch.finfo(dtype).eps))


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


@dataclass(frozen=True)
class Finding:
    """What the probe found: the loss's form (None: no exact split), what it measured, and what
    to do about a loss with no exact split."""

    form: str | None
    detail: str = ""
    advice: str = COUNTED_ADVICE
    draws: str = ""  # the random draws the step makes ("": none seen): each worker's own, so like DDP where it splits


def measure(objective: Objective, model: nn.Module, group: Any, singles: list[Any]) -> Finding:
    """The form of ``objective``'s loss on ``group``, a batch of the samples that ``singles``
    holds one by one; ``model`` is a copy, measured in its own modes with dropout and batch norm
    in eval (and left in its modes).

    Raises:
        whatever the user's code raises on these batches.
    """
    with measuring(model, whole_eval=False):
        found = _measure(objective, model, group, singles)
    if found.form is None and found.advice is RANDOM_ADVICE:
        # Random draws that training mode alone makes (dropout called as a function) are each
        # worker's own, as dropout's are: measured again in eval mode, where a loss that is not
        # random there splits as measured. A model that computes no loss in eval mode (a
        # detector) keeps the finding of training mode.
        try:
            with measuring(model, whole_eval=True):
                in_eval = _measure(objective, model, group, singles)
        except Exception:  # noqa: BLE001 - its eval mode is not how it trains: training mode's finding stands
            return found
        if in_eval.form is not None:
            return Finding(in_eval.form, f"{in_eval.detail}, measured in eval mode (in training mode it draws "
                                         "random numbers, each worker from its own streams)",
                           draws=f"{objective.what} draws random numbers in training mode (dropout called as a "
                                 "function)")
    return found


def _measure(objective: Objective, model: nn.Module, group: Any, singles: list[Any]) -> Finding:
    params = [p for _, p in trainable_parameters(model)]
    dtype = params[0].dtype if params else torch.float32
    with torch.no_grad(), random_state.kept(), gathering(Gathering()) as seen:  # only its kind matters here
        first = objective.loss_value(model, fresh(group), FP32, dtype)
    if seen.calls:
        return _gathered(first, objective, _draws(objective, model, group, dtype, gathers=True))
    if isinstance(first, (tuple, list)):  # its form is given; whether it draws random numbers is not
        return Finding(COUNTED, "(loss_sum, count) given", draws=_draws(objective, model, group, dtype))
    if objective.model_loss and isinstance(group, Mapping) and "labels" in group:
        form = _token_form(model, group, dtype)
        if form is not None:
            return Finding(form, "the model's mean over the labels it keeps")
    if len(singles) < 2:
        return Finding(MEAN, "too few samples to split")
    tolerance = rounding(dtype)  # some models compute parts in fp32 anyway

    def vector(batch: Any, seed: int = 0) -> torch.Tensor:
        with random_state.kept():  # torch's, numpy's and random's streams seeded alike for every call
            random_state.seed(seed)
            value = objective.loss_value(model, fresh(batch), FP32, dtype)
        loss = value.reshape(()) if isinstance(value, torch.Tensor) else torch.tensor(float(value))
        grads = torch.autograd.grad(loss, params, allow_unused=True) if loss.requires_grad else [None] * len(params)
        return torch.cat([loss.detach().double().reshape(1)] +
                         [(g if g is not None else torch.zeros_like(p)).detach().double().reshape(-1)
                          for g, p in zip(grads, params)])

    whole = vector(group)
    if _off(vector(group), whole) > tolerance:
        return Finding(None, "its value changes between two calls on the same samples with the same random seeds: "
                             "the model or the loss keeps state from one call to the next (a recurrent hidden state "
                             "kept on the model, a counter) or draws from a generator of its own, so how it splits "
                             "cannot be measured", STATE_ADVICE)
    if _off(vector(group, seed=1), whole) > tolerance:
        return Finding(None, "its value changes between two calls on the same samples with other random seeds: the "
                             "model or the loss draws random numbers (dropout called as a function, a sampler, Mixup "
                             "or noise in the step), so how it splits cannot be measured", RANDOM_ADVICE,
                       draws=f"{objective.what} draws random numbers")
    each = torch.stack([vector(single) for single in singles])
    total, mean = each.sum(dim=0), each.mean(dim=0)
    if _off(whole, mean) <= tolerance:
        return Finding(MEAN, "a per-sample mean")
    if _off(whole, total) <= tolerance:
        return Finding(SUM, "a sum over the samples")
    measured = (f"on {len(singles)} samples, its loss and gradient are neither the mean of each sample's alone (off "
                f"by {_off(whole, mean):.2g}, relative) nor their sum (off by {_off(whole, total):.2g})")
    weighed = _weighed(each, whole)
    if _off(whole, weighed) <= tolerance:
        return Finding(None, f"{measured}, but a sum of each sample's with weights that depend on the data: what it "
                             "divides by depends on the data (kept tokens, masks, class weights)")
    return Finding(None, f"{measured}, nor any weighed sum of them (off by {_off(whole, weighed):.2g}): one sample's "
                         "loss depends on the others in the batch (a contrastive loss over the batch's negatives, a "
                         "loss normalised by counts sampled over the batch)", COUPLED_ADVICE)


def fresh(batch: Any) -> Any:
    """A copy of ``batch``'s tensors for one call: a step that changes its batch in place (timm's
    Mixup mixes it) gives the next call what it was given, not what it left. Its containers keep
    their types (a namedtuple, a BatchEncoding); one that cannot be copied is given as it is."""
    try:
        return copy.deepcopy(batch)
    except Exception:  # noqa: BLE001 - what a batch holds besides tensors is the user's: used as given
        return batch


def _draws(objective: Objective, model: nn.Module, group: Any, dtype: torch.dtype, gathers: bool = False) -> str:
    """What random draws a step makes whose form is given ((loss_sum, count)) or gathered ("": its
    loss and gradient are the same under other seeds): Mixup, noise or augmentation in the step,
    each worker from its own streams."""
    params = [p for _, p in trainable_parameters(model)]

    def vector(seed: int) -> torch.Tensor:
        with random_state.kept(), gathering(Gathering()):
            random_state.seed(seed)
            value = objective.loss_value(model, fresh(group), FP32, dtype)
        loss = torch.as_tensor(value[0] if isinstance(value, (tuple, list)) else value).reshape(())
        grads = torch.autograd.grad(loss, params, allow_unused=True) if loss.requires_grad else [None] * len(params)
        return torch.cat([loss.detach().double().reshape(1)] +
                         [(g if g is not None else torch.zeros_like(p)).detach().double().reshape(-1)
                          for g, p in zip(grads, params)])

    tolerance, first = rounding(dtype), vector(0)
    if _off(vector(0), first) <= tolerance < _off(vector(1), first):
        what = "its loss over the gathered batch" if gathers else "its (loss_sum, count)"
        return f"{objective.what} draws random numbers ({what} differs under other seeds: Mixup, noise, augmentation)"
    return ""


def _weighed(each: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """The weighed sum of the samples' (loss, gradient) vectors nearest the batch's (least squares).

    A loss made of per-sample parts, however the data weighs them (a mean over kept tokens is
    each sample's token sum over the batch's count), is such a sum; where samples interact
    (each sample's loss against the others' embeddings), no weights give the batch's gradient.
    """
    basis, _ = torch.linalg.qr(each.T.contiguous())  # the span of the samples' vectors: a projection onto it
    return basis @ (basis.T @ whole)


def labels_seen(finding: Finding, batches: Iterable[Any]) -> Finding:
    """``finding``, unless it is a per-sample mean and ``batches`` (the first batches of the data,
    collated as the workers collate them) hold ignored labels (-100 in an integer tensor): then
    whether it splits as a mean depended on which samples were measured, and it has no exact split.
    """
    if finding.form != MEAN:
        return finding
    for batch in batches:
        if _holds_ignored(batch):
            return Finding(None, f"its batches hold ignored labels ({IGNORED_LABEL}, cross-entropy's ignore_index), "
                                 "and a mean over the labels kept divides by their count, which differs between the "
                                 "workers' slices (the samples it was measured on happened to look like a per-sample "
                                 "mean)")
    return finding


def _holds_ignored(batch: Any) -> bool:
    if isinstance(batch, torch.Tensor):
        return not batch.is_floating_point() and not batch.is_complex() and batch.dtype != torch.bool \
            and bool((batch == IGNORED_LABEL).any())
    if isinstance(batch, Mapping):
        return any(_holds_ignored(v) for v in batch.values())
    if isinstance(batch, (tuple, list)):
        return any(_holds_ignored(v) for v in batch)
    return False


def _gathered(value: Any, objective: Objective, draws: str) -> Finding:
    """A step that calls sn_trainer.gather: its scalar, or its (loss_sum, count) (``loss_sum /
    count``), is the loss over the global batch; ``draws``: the random draws it makes."""
    return Finding(GATHERED, f"{objective.what} calls sn_trainer.gather: a loss over the global batch", draws=draws)


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
