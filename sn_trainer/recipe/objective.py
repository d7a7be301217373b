"""What a micro-batch contributes to a step: the user's loss as a sum and the count it is divided by.

Plain PyTorch divides a loss by something that depends on the data: the samples of the batch,
the targets an ``ignore_index`` keeps, the weight of their classes, the tokens a mask keeps.
Each worker sees only its slice, so each reports ``(loss_sum, count)``; the step's gradient is
the sum of every worker's ``loss_sum`` gradient divided by the sum of every ``count``, which is
exactly what one process computes for the whole global batch, however it is split.

A scalar loss hides its denominator. How it splits (its ``form``) is measured before any
worker starts (``loss_probe``) and is one of: a per-sample mean, a sum over the samples, or a
Hugging Face model's mean over kept tokens, which the model sums when it is called with
``num_items_in_batch=1``, or a loss over the global batch that the step computes from
``sn_trainer.gather`` (``recipe.gather``); anything else is refused where the split would matter.
"""
from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from . import metric_states
from . import gather

Batch = Any  # what the dataset yields, collated: a tensor, or a tuple, list or dict of them

# How a loss splits over the samples of a batch.
COUNTED = "counted"  # the user's code (or a counted cross-entropy) gives (loss_sum, count)
MEAN = "mean"  # a per-sample mean: weighed by the slice's samples
SUM = "sum"  # a sum over the samples: added up, divided by nothing
LIKE_DDP = "like_ddp"  # no exact split, and split=like_ddp: each slice's loss counts once, as DDP averages ranks
# A Hugging Face model's mean over the labels it keeps (!= -100), all of them or those of
# labels[..., 1:] (a causal LM predicts token t+1 at position t). The model sums them when
# told num_items_in_batch=1; one that ignores it has its logits' cross-entropy summed instead.
TOKENS, SHIFTED_TOKENS = "tokens", "shifted_tokens"
TOKENS_FROM_LOGITS, SHIFTED_TOKENS_FROM_LOGITS = "tokens_from_logits", "shifted_tokens_from_logits"
TOKEN_FORMS = (TOKENS, SHIFTED_TOKENS, TOKENS_FROM_LOGITS, SHIFTED_TOKENS_FROM_LOGITS)
SHIFTED = (SHIFTED_TOKENS, SHIFTED_TOKENS_FROM_LOGITS)
# A loss over the global batch, computed alike in every worker from what sn_trainer.gather returns.
GATHERED = "gathered"
FORMS = (COUNTED, MEAN, SUM, LIKE_DDP, *TOKEN_FORMS, GATHERED)
IGNORED_LABEL = -100  # Hugging Face's label for "no target here"


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
            default cross-entropy. ``nn.CrossEntropyLoss`` / ``nn.NLLLoss`` themselves (not
            subclasses) count kept targets and class weights; any other loss is a scalar whose
            form is measured.
        step_fn: ``step_fn(model, batch)`` returning the loss, or ``(loss_sum, count)``;
            replaces loss_fn.
        metric_fn: ``metric_fn(model, batch)`` returning ``{name: (sum, count)}`` or
            ``{name: metric}``, a torchmetrics Metric it updated (see ``metric_states``),
            evaluated in evaluation only.

    Without loss_fn and step_fn, a batch that is a dict is the model's keyword arguments and
    its output's ``loss`` is the loss (a Hugging Face model with ``labels`` in the batch).
    """

    def __init__(self, loss_fn: Callable | None = None, step_fn: Callable | None = None,
                 metric_fn: Callable | None = None):
        self.step_fn, self.metric_fn = step_fn, metric_fn
        self.model_loss = loss_fn is None and step_fn is None  # dict batches: model(**batch).loss
        self.loss_fn = loss_fn if loss_fn is not None or step_fn is not None else nn.CrossEntropyLoss()
        self.form = MEAN  # how a scalar loss splits: measured before workers start (preflight), equal in all
        self.eval_keys: tuple[str, ...] = ()  # fixed before workers start (preflight), equal in all
        # Of those, the torchmetrics Metrics, each as built (fixed by the preflight): what a worker
        # that evaluates nothing merges, and what says which states every worker gathers.
        self.metric_templates: dict[str, Any] = {}

    SETTLED = ("form", "eval_keys", "metric_templates")  # what the rehearsal finds out, before workers start

    def settled(self, **found: Any) -> Objective:
        """A copy with what the rehearsal found (``form``, ``eval_keys``, ``metric_templates``),
        frozen: every worker receives it so, and no stage after the rehearsal can change it. The
        objective it was made from stays as it is."""
        unknown = sorted(set(found) - set(self.SETTLED))
        if unknown:
            raise TypeError(f"an objective settles {', '.join(self.SETTLED)}, not {', '.join(unknown)}")
        settled = copy.copy(self)
        settled.__dict__.update(found, _frozen=True)
        return settled

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_frozen"):
            raise AttributeError(f"this objective was settled by the rehearsal and is frozen: {name} stays as found; "
                                 "settle a new copy with Objective.settled(...)")
        object.__setattr__(self, name, value)

    @property
    def what(self) -> str:
        """The user's code that gives the loss, as error messages name it."""
        return "step_fn" if self.step_fn is not None else "model(**batch).loss" if self.model_loss else "loss_fn"

    @property
    def divides(self) -> bool:
        """Whether the step's summed loss is divided by a count (all but a sum-reduced loss)."""
        return self.form != SUM

    def accepts(self, item: Any, model: nn.Module) -> str | None:
        """Why a dataset item cannot be a sample of this objective's batches for ``model`` (None: it can)."""
        if self.step_fn is not None or (isinstance(item, (tuple, list)) and len(item) == 2):
            return None
        if self.model_loss and isinstance(item, Mapping) and _takes(model, item):
            return None
        what = f"{type(item).__name__}{f' of {len(item)} items' if isinstance(item, (tuple, list)) else ''}"
        return (f"is {what}, not an (input, target) pair{' or a dict of model arguments' if self.model_loss else ''}; "
                "pass step_fn=... to train on any batch, or wrap the dataset so that __getitem__ returns "
                "(input, target)")

    def train_terms(self, model: nn.Module, batch: Batch, samples: int, precision: Precision,
                    dtype: torch.dtype) -> tuple[torch.Tensor, float]:
        """``(loss_sum, count)`` of one slice of ``samples`` samples, ready for backward."""
        return self.split(self.loss_value(model, batch, precision, dtype), batch, samples)

    def loss_value(self, model: nn.Module, batch: Batch, precision: Precision, dtype: torch.dtype) -> Any:
        """What the user's code gives for ``batch``: a scalar, ``(sum, count)``, or a counted
        cross-entropy (a pair too); a model's mean over kept tokens, as the sum its form says."""
        if self.step_fn is not None:
            with precision.autocast():
                return self.step_fn(model, batch)
        if self.model_loss and isinstance(batch, Mapping):
            if self.form in (TOKENS, SHIFTED_TOKENS):
                return output_loss(model_outputs(model, batch, precision, num_items=1), dtype)
            outputs = model_outputs(model, batch, precision)
            if self.form in (TOKENS_FROM_LOGITS, SHIFTED_TOKENS_FROM_LOGITS):
                return token_cross_entropy(outputs, batch["labels"], self.form in SHIFTED, "sum")
            return output_loss(outputs, dtype)
        return self._pair_loss(*self._forward(model, batch, precision, dtype))

    def _pair_loss(self, outputs: torch.Tensor, targets: Any) -> Any:
        """``loss_fn(outputs, targets)``, or its (sum, count) where it is a counted cross-entropy."""
        counted = counted_cross_entropy(self.loss_fn, outputs, targets)
        return counted if counted is not None else self.loss_fn(outputs, targets)

    def split(self, value: Any, batch: Batch, samples: int) -> tuple[torch.Tensor, float]:
        """A loss value as ``(loss_sum, count)``, by its form."""
        if self.form == GATHERED:
            if isinstance(value, (tuple, list)):
                # Over the gathered batch, every worker holds the global batch's sum and count: its
                # loss is their quotient, exactly the scalar the user could have returned.
                loss_sum, count = terms(value, samples, self.what)
                value = loss_sum / count if count else loss_sum  # nothing counted: a sum of nothing, no gradient
            return gather.current().terms(_scalar(value, self.what), samples)
        if isinstance(value, (tuple, list)):
            return terms(value, samples, self.what)
        loss = _scalar(value, self.what)
        if self.form == SUM:
            return loss, float(samples)
        if self.form == LIKE_DDP:
            return loss, 1.0
        if self.form in TOKEN_FORMS:
            return loss, float(kept_labels(batch["labels"], self.form in SHIFTED))
        return loss * samples, float(samples)

    @torch.no_grad()
    def eval_terms(self, model: nn.Module, batch: Batch, samples: int, precision: Precision,
                   dtype: torch.dtype) -> dict[str, Any]:
        """``{name: (sum, count)}`` of one slice: the loss, accuracy where it applies, user metrics;
        a user metric that is a torchmetrics Metric as the Metric itself (updated by metric_fn).

        Raises:
            ConfigError: a metric_fn value is neither (sum, count) nor a Metric.
        """
        out: dict[str, Any] = {}
        counted_pairs = self.step_fn is None and not (self.model_loss and isinstance(batch, Mapping))
        if counted_pairs:
            outputs, targets = self._forward(model, batch, precision, dtype)
            loss_sum, count = self.split(self._pair_loss(outputs, targets), batch, samples)
            accuracy = self._accuracy(outputs, targets)
            if accuracy is not None:
                out["accuracy"] = accuracy
        else:
            loss_sum, count = self.train_terms(model, batch, samples, precision, dtype)
        # A sum-reduced loss is reported per sample in evaluation: a sum over a whole set means little.
        out["loss"] = (float(loss_sum), float(count) if self.divides else float(samples))
        if self.metric_fn is not None:
            with precision.autocast():
                metrics = self.metric_fn(model, batch)
            if not isinstance(metrics, Mapping):
                raise TypeError(f"metric_fn must return a dict of name -> (sum, count) or torchmetrics Metric, "
                                f"got {type(metrics).__name__}")
            for name, value in metrics.items():
                out[str(name)] = metric_terms(value, f"metric_fn's {str(name)!r}")
        return out

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

    def _accuracy(self, outputs, targets) -> tuple[float, float] | None:
        """Correct and counted predictions, where outputs are class scores for integer targets."""
        if not (isinstance(targets, torch.Tensor) and not targets.is_floating_point() and outputs.dim() >= 2
                and targets.dim() == outputs.dim() - 1 and outputs.shape[0] == targets.shape[0]
                and outputs.shape[2:] == targets.shape[1:]):
            return None
        kept = targets != getattr(self.loss_fn, "ignore_index", -100)
        correct = ((outputs.argmax(dim=1) == targets) & kept).sum()
        return float(correct), float(kept.sum())


def _takes(model: nn.Module, arguments: Mapping) -> bool:
    """Whether ``model(**arguments)`` matches its forward's signature."""
    try:
        parameters = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return True  # no signature to read: the preflight will tell
    names = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return any(p.kind == p.VAR_KEYWORD for p in parameters) or set(map(str, arguments)) <= names


def model_outputs(model: nn.Module, batch: Mapping, precision: Precision, num_items: int | None = None) -> Any:
    """``model(**batch)``, as Hugging Face models are called; with ``num_items``, told
    ``num_items_in_batch=num_items`` (such a model then divides its sum over kept tokens by it)."""
    with precision.autocast():
        return model(**batch) if num_items is None else model(**batch, num_items_in_batch=num_items)


def _field(outputs: Any, name: str) -> Any:
    return outputs.get(name) if isinstance(outputs, Mapping) else getattr(outputs, name, None)


def output_loss(outputs: Any, dtype: torch.dtype) -> torch.Tensor:
    """The ``loss`` of a model's outputs (a Hugging Face ``ModelOutput``, a dict, an object)."""
    loss = _field(outputs, "loss")
    if loss is None:
        raise TypeError(f"model(**batch) returned {type(outputs).__name__} without a loss; put the targets in the "
                        "batch (labels=...), or pass step_fn=... (or loss_fn=...) to compute the loss")
    return Precision.for_loss(loss, dtype)


def token_cross_entropy(outputs: Any, labels: torch.Tensor, shifted: bool, reduction: str) -> torch.Tensor:
    """Cross-entropy of a model's ``logits`` [..., T, V] against ``labels`` [..., T] (-100 kept
    out), shifted by one for a causal LM, computed in the logits' dtype (at least float32)."""
    logits = _field(outputs, "logits")
    if logits is None:
        raise TypeError("model(**batch) returned no logits")
    if shifted:
        logits, labels = logits[..., :-1, :], labels[..., 1:]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORED_LABEL,
                           reduction=reduction)


def kept_labels(labels: torch.Tensor, shifted: bool) -> int:
    """Labels a Hugging Face loss keeps: those not -100 (of ``labels[..., 1:]`` for a causal LM)."""
    return int(((labels[..., 1:] if shifted else labels) != IGNORED_LABEL).sum())


def counted_cross_entropy(loss_fn, outputs: torch.Tensor, targets) -> tuple[torch.Tensor, float] | None:
    """For mean cross-entropy / NLL over class indices: the loss summed, and what the mean divides by.

    PyTorch's mean divides by the summed class weights of the kept targets (their number
    without weights), with or without label smoothing. Only for the classes themselves: a
    subclass may compute something else in its own forward, which must run.
    """
    if not (type(loss_fn) in (nn.CrossEntropyLoss, nn.NLLLoss) and loss_fn.reduction == "mean"
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


def metric_terms(value: Any, what: str) -> Any:
    """A metric_fn value as ``(sum, count)`` floats, or the torchmetrics Metric it is.

    A single number is refused, whatever it is: a per-batch mean and a per-batch macro F1 look
    the same, and only the first may be averaged over chunks and workers.

    Raises:
        ConfigError: it is neither.
    """
    if metric_states.is_metric(value):
        return value
    if isinstance(value, (tuple, list)) and len(value) == 2:
        value_sum, value_count = value
        return float(_scalar(value_sum, what)), float(_scalar(value_count, what))
    if isinstance(value, (int, float)) or (isinstance(value, torch.Tensor) and value.numel() == 1):
        got = "a single number"
    else:
        got = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
    raise ConfigError(f"{what} is {got}, which cannot be merged exactly over evaluation chunks and workers; return "
                      "(sum, count) for a mean, e.g. ((preds == targets).sum(), len(targets)), or a torchmetrics "
                      "Metric that metric_fn updates, e.g. f1.update(logits, targets); return {'f1': f1}")


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
        return value if value.dim() == 0 else value.reshape(())
    if isinstance(value, (int, float)):
        return torch.tensor(float(value), dtype=torch.float64)  # a Python float is a double
    shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
    raise TypeError(f"{what} must give a scalar loss (a one-element tensor), got {shape}")
