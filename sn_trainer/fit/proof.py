"""Prove it on your model: k steps with W workers against k steps of one plain process over the same
global batches, per parameter, with the exactness row that applies and the verdict
(``Trainer.verify``, ``python -m sn_trainer.verify``).

The W-worker run is a fit with every step compared with one process's (verify_every=1), so that a
difference is found at the step it happens; where it stops (split="exact"), it runs again with
split="like_ddp" to train the k steps as it would with consent, and the parameters say how far
that ends. The plain process is a loop of its own: the global batch of each step read and
collated as a plain DataLoader reads it, the user's loss and optimizer, clipping, after_update and
the scheduler as a training loop calls them.
"""
from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..config import TrainerConfig
from ..data import random_state
from ..data.batching import in_layout
from ..data.source import make_source
from ..recipe.flat_layout import trainable_parameters
from ..engine import group_params, tolerances
from ..recipe.objective import TOKEN_FORMS, Objective, Precision
from ..recipe.schedule import Schedule
from ..errors import ConfigError, NotExact
from ..optim import resolve_groups

# The rows of docs/exactness.md a run's plan points to, by what it found (each title is a row's first words).
FORM_ROWS = {"mean": "a per-sample mean loss", "sum": "a loss with `reduction=\"sum\"`",
             "counted": "a step returning `(loss_sum, count)`", "gathered": "a loss that couples the samples of a batch",
             "like_ddp": "torchvision's detection recipe"}
REASON_ROWS = {"dropout": "random ops (dropout, a VAE's noise, augmentation with torch, numpy or `random`)",
               "draws random numbers": "random ops (dropout, a VAE's noise, augmentation with torch, numpy or `random`)",
               "batch norm": "BatchNorm without it (the default)",
               "writes buffers": "buffers a forward pass changes, not batch norm's",
               "reading train_set draws": "augmentation seeded per sample"}
VERDICTS = ("exact", "like DDP", "not exact", "refused")


@dataclass(frozen=True)
class ParameterDifference:
    """One parameter after k steps: the W-worker run's against the plain process's."""

    name: str
    max_abs: float
    relative: float  # |W-run - plain| / |plain|, over the whole tensor


@dataclass(frozen=True)
class VerifyReport:
    """What ``Trainer.verify`` found. ``verdict``: "exact" (to rounding), "like DDP", "not exact" or
    "refused"; ``why`` says what made it so, ``rows`` the exactness contract's rows that apply."""

    verdict: str
    why: str
    rows: tuple[str, ...]
    exactness: str  # the run's own label (FitResult.plan["exactness"])
    steps: int
    workers: int
    tolerance: float  # what rounding moves the parameters by at most, relative
    differences: tuple[ParameterDifference, ...] = ()

    @property
    def largest(self) -> float:
        return max((d.relative for d in self.differences), default=0.0)

    def __str__(self) -> str:
        lines = [f"verdict: {self.verdict}: {self.why}",
                 f"{self.workers} workers against one plain process, {self.steps} steps over the same global batches"]
        if self.rows:
            lines.append("exactness rows that apply (docs/exactness.md): " + "; ".join(self.rows))
        if self.differences:
            width = max(len(d.name) for d in self.differences)
            lines.append(f"{'parameter'.ljust(width)}  largest difference  relative (rounding allows "
                         f"{self.tolerance:.0e})")
            lines += [f"{d.name.ljust(width)}  {d.max_abs:18.3e}  {d.relative:.3e}" for d in self.differences]
        return "\n".join(lines)


FitFunction = Callable[[TrainerConfig, nn.Module], Any]  # fit(config, model) -> FitResult


def prove(config: TrainerConfig, model: nn.Module, train_set: Any, steps: int, fit: FitFunction,
          fit_args: dict[str, Any]) -> VerifyReport:
    """Train copies of ``model`` for ``steps`` steps with ``config``'s workers (``fit``) and as one
    plain process, and compare them.

    Raises:
        ConfigError: steps is not a positive integer.
    """
    if not (isinstance(steps, int) and steps >= 1):
        raise ConfigError(f"steps must be a positive integer, got {steps!r}")
    checked = dataclasses.replace(config, max_steps=steps, verify_every=1, resume=None, log_every=10**9,
                                  checkpoint=dataclasses.replace(config.checkpoint, dir=None))
    trained, stopped = copy.deepcopy(model), None
    try:
        result = fit(checked, trained)
    except NotExact as exc:
        stopped = str(exc)
        trained = copy.deepcopy(model)
        result = fit(dataclasses.replace(checked, split="like_ddp"), trained)
    except ConfigError as exc:
        return VerifyReport("refused", str(exc), (_refused_row(str(exc)),), "refused", steps, _workers(config), 0.0)
    plan = result.plan
    plain = plain_fit(copy.deepcopy(model), train_set, result.settings, plan["loss_form"], steps, fit_args)
    differences = tuple(_differences(trained, plain))
    dtype = next((p.dtype for _, p in trainable_parameters(model)), torch.float32)
    tolerance = tolerances(dtype, result.settings.precision)[0]
    label = plan["exactness"]
    rows = tuple(dict.fromkeys([_form_row(plan["loss_form"], fit_args), *_reason_rows(label)]))
    if stopped is not None:
        verdict, why = "not exact", (f"{stopped} (with split=\"like_ddp\" it trains like DDP from there: the "
                                     "differences below)")
    elif label.startswith("like DDP: "):  # by construction: why, as the run says it
        verdict, why = "like DDP", label[len("like DDP: "):]
    elif label.startswith("like DDP") or label.startswith("not exact") or label.startswith("approximate"):
        verdict, why = ("like DDP" if label.startswith("like DDP") else "not exact"), label
    else:
        largest = max((d.relative for d in differences), default=0.0)
        verdict, why = "exact", label
        if largest > tolerance:
            why += (f"; after {steps} steps the parameters are {largest:.1e} apart, more than rounding within a "
                    "step moves them: an optimizer that turns rounding in near-zero gradients into whole steps "
                    "(Adam in float32) makes such distances grow")
    return VerifyReport(verdict, why, rows, label, steps, result.workers, tolerance, differences)


def _workers(config: TrainerConfig) -> int:
    return config.workers if isinstance(config.workers, int) else 0


def _form_row(form: str, fit_args: dict[str, Any]) -> str:
    if form in TOKEN_FORMS:
        return "a Hugging Face model's `model(**batch).loss`"
    if form == "counted" and fit_args.get("step_fn") is None:  # fit's own count of a cross-entropy's targets
        return "`CrossEntropyLoss` / `NLLLoss` with `weight` and/or `ignore_index` (mean)"
    return FORM_ROWS.get(form, FORM_ROWS["mean"])


def _reason_rows(label: str) -> list[str]:
    return [row for key, row in REASON_ROWS.items() if key in label]


def _refused_row(message: str) -> str:
    """The row of a refusal: what it names."""
    for key, row in (("sparse", "LBFGS, SparseAdam, an `Embedding`/`EmbeddingBag` built with `sparse=True`"),
                     ("LBFGS", "LBFGS, SparseAdam, an `Embedding`/`EmbeddingBag` built with `sparse=True`"),
                     ("interact", "a loss whose samples interact"), ("random", "a model that keeps state between "
                     "calls"), ("state", "a model that keeps state between calls"),
                     ("depends on the data", "a scalar loss whose denominator depends on the data")):
        if key in message:
            return row
    return "a scalar loss whose denominator depends on the data"


def _differences(trained: nn.Module, plain: nn.Module):
    for (name, p), q in zip(trained.named_parameters(), plain.parameters()):
        delta = (p.detach().double() - q.detach().double())
        scale = q.detach().double().norm().item()
        yield ParameterDifference(name, delta.abs().max().item() if delta.numel() else 0.0,
                                  delta.norm().item() / scale if scale > 0 else (0.0 if delta.norm() == 0 else math.inf))


def plain_fit(model: nn.Module, train_set: Any, settings: TrainerConfig, loss_form: str, steps: int,
              fit_args: dict[str, Any]) -> nn.Module:
    """``steps`` steps of one plain process over the global batches the run read: each step's
    micro-batches whole, the user's loss on each (weighed as its form says, as accumulation weighs
    them), one optimizer over the whole model, clipping, after_update and the scheduler. Its random
    streams are worker 0's (seeded from seed x 1000), so that a run of one worker is it, draw for draw."""
    objective = Objective(fit_args.get("loss_fn"), fit_args.get("step_fn"))
    objective.form = loss_form
    source = make_source(train_set, "train_set", settings, fit_args.get("collate_fn"), lambda item: None)
    trainable = [p for _, p in trainable_parameters(model)]
    groups = resolve_groups(model, trainable, fit_args.get("param_groups"))
    factory = fit_args.get("optimizer") or groups.factory or (lambda params: torch.optim.SGD(params, lr=0.01))
    optimizer = factory(group_params(trainable, range(len(trainable)), groups.options, groups.slot_groups))
    schedule = Schedule(fit_args["scheduler"](optimizer), source.steps_per_epoch or steps) \
        if fit_args.get("scheduler") else None
    precision, dtype = Precision(settings.precision), trainable[0].dtype
    after = fit_args.get("after_update")
    with random_state.kept():
        random_state.seed(settings.seed * 1000)
        for step in range(steps):
            optimizer.zero_grad(set_to_none=True)
            count = 0.0
            for micro in range(settings.accumulate):
                batch, samples = source.micro_batch(step, micro)
                if samples == 0:
                    continue
                micro_loss, micro_count = objective.train_terms(model, in_layout(batch, settings.channels_last),
                                                                samples, precision, dtype)
                micro_loss.backward()
                count += micro_count
            if objective.divides and count > 0:
                for p in trainable:
                    if p.grad is not None:
                        p.grad.div_(count)
            if settings.clip_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_([p for p in trainable if p.grad is not None], settings.clip_grad_norm)
            optimizer.step()
            if after is not None:
                with torch.no_grad():
                    after(model)
            if schedule is not None:
                schedule.after_step(step + 1)
                if source.steps_per_epoch and (step + 1) % source.steps_per_epoch == 0:
                    schedule.after_epoch((step + 1) // source.steps_per_epoch, None)
    return model
