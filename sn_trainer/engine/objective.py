"""What a micro-batch contributes to a step: the user's loss as a sum and the count it is divided by.

Plain PyTorch divides a loss by something that depends on the data: the samples of the batch,
the targets an ``ignore_index`` keeps, the weight of their classes, the tokens a mask keeps.
Each worker sees only its slice, so each reports ``(loss_sum, count)``; the step's gradient is
the sum of every worker's ``loss_sum`` gradient divided by the sum of every ``count``, which is
exactly what one process computes for the whole global batch, however it is split.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

Batch = Any  # what the dataset yields, collated: a tensor, or a tuple, list or dict of them


class Precision:
    """How the step computes: fp32 as is, or bf16 autocast with parameters kept in their dtype."""

    def __init__(self, name: str):
        self.name = name

    def autocast(self):
        return torch.autocast("cpu", dtype=torch.bfloat16) if self.name == "bf16" else nullcontext()

    @staticmethod
    def for_loss(outputs: Any, dtype: torch.dtype) -> Any:
        """Outputs autocast left in lower precision, raised to the parameters' dtype for the loss."""
        if isinstance(outputs, torch.Tensor):
            if outputs.is_floating_point() and torch.finfo(outputs.dtype).bits < torch.finfo(dtype).bits:
                return outputs.to(dtype)
            return outputs
        return outputs


class Objective:
    """The user's loss, step function and metrics, turned into sums and counts.

    Args:
        loss_fn: ``loss_fn(model(inputs), targets)`` for batches of ``(inputs, targets)``;
            default cross-entropy. A loss with ``reduction="sum"`` trains on the global batch's
            sum; ``nn.CrossEntropyLoss`` / ``nn.NLLLoss`` count kept targets and class weights.
        step_fn: ``step_fn(model, batch)`` returning the loss as a per-sample mean, or
            ``(loss_sum, count)``; replaces loss_fn.
        metric_fn: ``metric_fn(model, batch)`` returning ``{name: value}`` (a per-sample mean)
            or ``{name: (sum, count)}``, evaluated in evaluation only.
    """

    def __init__(self, loss_fn: Callable | None = None, step_fn: Callable | None = None,
                 metric_fn: Callable | None = None):
        self.step_fn, self.metric_fn = step_fn, metric_fn
        self.loss_fn = loss_fn if loss_fn is not None or step_fn is not None else nn.CrossEntropyLoss()
        # A sum-reduced loss: the step trains on the global batch's sum, divided by nothing.
        self.divides = step_fn is not None or getattr(self.loss_fn, "reduction", "mean") != "sum"
        self.eval_keys: tuple[str, ...] = ()  # fixed before workers start (preflight), equal in all

    @property
    def pairs(self) -> bool:
        """Whether batches must be (inputs, targets) pairs."""
        return self.step_fn is None

    def train_terms(self, model: nn.Module, batch: Batch, samples: int, precision: Precision,
                    dtype: torch.dtype) -> tuple[torch.Tensor, float]:
        """``(loss_sum, count)`` of one slice of ``samples`` samples, ready for backward."""
        if self.step_fn is not None:
            return self._step_terms(model, batch, samples, precision)
        outputs, targets = self._forward(model, batch, precision, dtype)
        return self._loss_terms(outputs, targets, samples)

    @torch.no_grad()
    def eval_terms(self, model: nn.Module, batch: Batch, samples: int, precision: Precision,
                   dtype: torch.dtype) -> dict[str, tuple[float, float]]:
        """``{name: (sum, count)}`` of one slice: the loss, accuracy where it applies, user metrics."""
        out: dict[str, tuple[float, float]] = {}
        if self.step_fn is not None:
            loss_sum, count = self._step_terms(model, batch, samples, precision)
        else:
            outputs, targets = self._forward(model, batch, precision, dtype)
            loss_sum, count = self._loss_terms(outputs, targets, samples)
            accuracy = self._accuracy(outputs, targets)
            if accuracy is not None:
                out["accuracy"] = accuracy
        # A sum-reduced loss is reported per sample in evaluation: a sum over a whole set means little.
        out["loss"] = (float(loss_sum), float(count) if self.divides else float(samples))
        if self.metric_fn is not None:
            with precision.autocast():
                metrics = self.metric_fn(model, batch)
            if not isinstance(metrics, Mapping):
                raise TypeError(f"metric_fn must return a dict of name -> value or (sum, count), "
                                f"got {type(metrics).__name__}")
            for name, value in metrics.items():
                value_sum, value_count = terms(value, samples, f"metric_fn's {name!r}")
                out[str(name)] = (float(value_sum), float(value_count))
        return out

    def _step_terms(self, model, batch, samples, precision):
        with precision.autocast():
            value = self.step_fn(model, batch)
        return terms(value, samples, "step_fn")

    def _forward(self, model, batch, precision, dtype):
        if not (isinstance(batch, Sequence) and len(batch) == 2):
            raise TypeError("without step_fn, every batch must be an (inputs, targets) pair; "
                            "pass step_fn=... to train on other batches")
        inputs, targets = batch
        with precision.autocast():
            outputs = model(inputs)
        if not isinstance(outputs, torch.Tensor):
            raise TypeError(f"the model returned {type(outputs).__name__}, not a tensor; loss_fn(outputs, targets) "
                            "needs a tensor: pass step_fn=... to compute the loss from any outputs")
        return Precision.for_loss(outputs, dtype), targets

    def _loss_terms(self, outputs, targets, samples):
        counted = counted_cross_entropy(self.loss_fn, outputs, targets)
        if counted is not None:
            return counted
        return terms(self.loss_fn(outputs, targets), samples, "loss_fn") if self.divides else \
            (_scalar(self.loss_fn(outputs, targets), "loss_fn"), float(samples))

    def _accuracy(self, outputs, targets) -> tuple[float, float] | None:
        """Correct and counted predictions, where outputs are class scores for integer targets."""
        if not (isinstance(targets, torch.Tensor) and not targets.is_floating_point() and outputs.dim() >= 2
                and targets.dim() == outputs.dim() - 1 and outputs.shape[0] == targets.shape[0]
                and outputs.shape[2:] == targets.shape[1:]):
            return None
        kept = targets != getattr(self.loss_fn, "ignore_index", -100)
        correct = ((outputs.argmax(dim=1) == targets) & kept).sum()
        return float(correct), float(kept.sum())


def counted_cross_entropy(loss_fn, outputs: torch.Tensor, targets) -> tuple[torch.Tensor, float] | None:
    """For mean cross-entropy / NLL over class indices: the loss summed, and what the mean divides by.

    PyTorch's mean divides by the summed class weights of the kept targets (their number
    without weights), with or without label smoothing.
    """
    if not (isinstance(loss_fn, (nn.CrossEntropyLoss, nn.NLLLoss)) and loss_fn.reduction == "mean"
            and isinstance(targets, torch.Tensor) and not targets.is_floating_point()):
        return None
    kept = targets != loss_fn.ignore_index
    count = loss_fn.weight[targets[kept]].sum() if loss_fn.weight is not None else kept.sum()
    if isinstance(loss_fn, nn.CrossEntropyLoss):
        loss_sum = F.cross_entropy(outputs, targets, weight=loss_fn.weight, ignore_index=loss_fn.ignore_index,
                                   reduction="sum", label_smoothing=loss_fn.label_smoothing)
    else:
        loss_sum = F.nll_loss(outputs, targets, weight=loss_fn.weight, ignore_index=loss_fn.ignore_index,
                              reduction="sum")
    return loss_sum, float(count)


def terms(value: Any, samples: int, what: str) -> tuple[torch.Tensor, float]:
    """A loss as ``(sum, count)``: a scalar is a per-sample mean over ``samples``; a pair is given as is."""
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise TypeError(f"{what} returned a {type(value).__name__} of {len(value)} items; return the loss, "
                            "or (loss_sum, count)")
        loss_sum, count = value
        return _scalar(loss_sum, what), float(count)
    return _scalar(value, what) * samples, float(samples)


def _scalar(value: Any, what: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.reshape(())
    if isinstance(value, (int, float)):
        return torch.tensor(float(value))
    shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
    raise TypeError(f"{what} must give a scalar loss (a one-element tensor), got {shape}")
