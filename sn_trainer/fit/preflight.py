"""Before any worker starts: one micro-batch through the user's step, optimizer and evaluation.

Shape and type errors in a model, a step function, a loss, a metric or an optimizer then
surface within seconds, as one error carrying the user's traceback, instead of inside a worker
after its peers have started (or after an hour of training, for evaluation). It runs on a copy
of the model, so nothing of the model, its statistics or its optimizer moves; the Trainer runs
it in a warm worker process (``rehearse_in_worker``), so the launcher itself never imports what
the user's code needs.
"""
from __future__ import annotations

import copy
import dataclasses
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..config import TrainerConfig
from ..data import random_state
from ..data.batching import COLLATE_NOTE, in_layout
from ..data.source import Source
from ..recipe import metric_states
from ..recipe.flat_layout import trainable_parameters
from ..engine import PhaseSpec, group_params
from ..recipe.gather import Gathering, gathering
from ..recipe.objective import MEAN, Objective, Precision
from ..recipe.schedule import Schedule
from ..errors import ConfigError, InputError, UserCodeError
from ..optim import refuse_unrunnable
from . import loss_probe

PROBE_SAMPLES = 8  # samples the loss's form is measured on, one by one and together


@dataclass(frozen=True)
class PhaseFindings:
    """What one phase's rehearsal found."""

    optimizer_class: type | None  # what the factory builds; None without an optimizer
    loss: loss_probe.Finding = loss_probe.Finding(MEAN)  # how the loss splits over samples
    optimizer_state_keys: tuple[str, ...] = ()  # what the optimizer keeps per parameter after a step
    schedule_monitor: str | None = None  # the evaluation metric the scheduler steps on, if any
    changed_buffers: tuple[str, ...] = ()  # buffers the training step's forward changed (written or replaced)


@dataclass(frozen=True)
class Findings:
    """What the rehearsal found: of each phase, and of evaluation."""

    phases: tuple[PhaseFindings, ...]  # each phase's, in order
    eval_keys: tuple[str, ...]  # the sums evaluation reports, in the order every worker sums them
    loss: loss_probe.Finding = loss_probe.Finding(MEAN)  # how evaluation's loss splits (with no phase to train)
    eval_gathers: bool = False  # evaluation's step or metric function calls sn_trainer.gather
    metric_templates: dict[str, Any] = field(default_factory=dict)  # eval_keys' torchmetrics Metrics, as built


@dataclass
class Rehearsal:
    """What a rehearsal runs: the user's code, and one slice of each dataset, already read."""

    model: nn.Module
    train_batch: Any
    train_samples: int
    eval_batch: Any
    eval_samples: int
    objective: Objective  # evaluation's
    phases: list[PhaseSpec]  # what training runs, each phase in turn
    settings: TrainerConfig  # the run's (its precision and memory layout decided)
    probe_group: Any = None  # a few samples spread over the data, together, and one by one
    probe_singles: list[Any] = field(default_factory=list)
    data_draws_random: bool = False  # reading a training slice moved torch's, numpy's or random's global generator
    splits: bool = True  # the run splits a step's batch (workers or accumulate): how the loss splits matters
    probe_unit: int = 1  # samples in each of probe_singles (a worker's micro-batch, with a collate_fn of the user's)
    data_sets_generators: bool = False  # reading a training slice seeded (or restored) a global generator


def prepare(model: nn.Module, train: Source | None, train_samples: int, evaluation: Source | None,
            eval_samples: int, objective: Objective, phases: list[PhaseSpec], settings: TrainerConfig,
            splits: bool = True) -> Rehearsal:
    """Read one training slice of ``train_samples`` from the ``train`` source, one evaluation slice
    of ``eval_samples``, and the samples the loss's form is measured on (each collated as the
    workers will). Whether reading the training slice draws from the global random generators
    (``Rehearsal.data_draws_random``) or sets their state (``data_sets_generators``: a dataset that
    seeds each sample's draws) is measured, and the generators are left as they were.

    Raises:
        UserCodeError: a dataset failed to give them.
    """
    with random_state.kept():  # the caller's random streams stay as they were
        eval_batch = attempt("reading an evaluation batch",
                              lambda: next(evaluation.eval_chunks(0, 1, eval_samples, 1))[0]) \
            if evaluation is not None else None
        draws = seeds = False
        batch = None
        if train is not None:
            with random_state.kept() as moved, random_state.setting_watched() as seeded:
                batch = attempt("reading a training batch", lambda: train.first(train_samples))
            draws, seeds = moved(), seeded()
        probed = train if train is not None else evaluation
        # A collate_fn of the user's is called only with what a worker gets (never one sample: a
        # Mixup collate asserts an even batch); the loss probe compares parts of that size.
        unit = 1
        if getattr(probed, "collate_fn", None) is not None:  # a Source of the user's may have none
            unit = max(1, train_samples if train is not None else eval_samples)
            unit = min(unit, probed.size) if probed.size is not None else unit
        group, singles = attempt("reading samples", lambda: probed.probe(max(PROBE_SAMPLES, 2 * unit), unit)
                                  if unit > 1 else probed.probe(PROBE_SAMPLES))
    return Rehearsal(model, batch, train_samples, eval_batch, eval_samples, objective, phases, settings, group,
                     singles, draws, splits, unit, seeds)


def rehearse(s: Rehearsal) -> Findings:
    """For each phase in turn: forward, loss and backward on the training slice, the loss's form
    (``loss_probe``, on the weights before the phase's step), an optimizer step and its scheduler;
    then evaluation of the other slice. On a copy of the model, in the modes the user left its
    modules in.

    Raises:
        UserCodeError: any of them raised; the message carries the user's traceback.
    """
    replica = copy.deepcopy(s.model)
    try:  # the user's code too: what its objects hold (a counter, a tensor it writes) is the run's, not this one's
        objective, phases = copy.deepcopy((s.objective, s.phases))
        s = dataclasses.replace(s, objective=objective, phases=phases)
    except Exception:  # noqa: BLE001 - code holding what cannot be copied (a lock, a file) runs as given
        pass
    params = [p for _, p in trainable_parameters(replica)]
    dtype = params[0].dtype if params else torch.float32
    how, channels_last = Precision(s.settings.precision), s.settings.channels_last
    phases = []
    for phase in s.phases:
        prefix = f"phase {phase.name!r}: " if len(s.phases) > 1 else ""
        changed: tuple[str, ...] = ()
        if s.train_batch is not None:
            batch = in_layout(s.train_batch, channels_last)
            buffers = {name: b.clone() for name, b in replica.named_buffers()}
            loss_sum, _ = attempt(f"{prefix}the training step (on a first slice of {s.train_samples} samples)",
                                   lambda: phase.objective.train_terms(replica, batch, s.train_samples, how, dtype))
            attempt(f"{prefix}the backward pass", loss_sum.backward)
            changed = _changed(buffers, dict(replica.named_buffers()))
        finding = _probe(s, phase.objective, replica, prefix)
        phase.objective.form = finding.form or MEAN  # this copy's; the Trainer decides the run's
        optimizer_class, state_keys, monitor = _optimizer_step(phase, params, prefix) \
            if s.train_batch is not None else (None, (), None)
        if phase.after_update is not None and s.train_batch is not None:
            with torch.no_grad():  # as the workers call it after each update
                attempt(f"{prefix}after_update {_named(phase.after_update)}", lambda: phase.after_update(replica))
        for p in params:
            p.grad = None
        phases.append(PhaseFindings(optimizer_class, finding, state_keys, monitor, changed))
    finding = phases[0].loss if phases else _probe(s, s.objective, replica, "")
    s.objective.form = finding.form or MEAN
    eval_keys: tuple[str, ...] = ()
    eval_gathers = False
    templates: dict[str, Any] = {}
    if s.eval_batch is not None:
        batch = in_layout(s.eval_batch, channels_last)
        replica.eval()
        with gathering(Gathering()) as seen:
            found = attempt(f"evaluation (on a first slice of {s.eval_samples} samples)",
                             lambda: s.objective.eval_terms(replica, batch, s.eval_samples, how, dtype))
        eval_keys, eval_gathers = tuple(found), seen.calls > 0
        templates = {name: _metric_template(name, value) for name, value in found.items()
                     if metric_states.is_metric(value)}
    return Findings(tuple(phases), eval_keys, finding, eval_gathers, templates)


def _changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> tuple[str, ...]:
    """The buffers whose values (or shapes) differ between two snapshots."""
    return tuple(name for name, value in after.items()
                 if name not in before or before[name].shape != value.shape or not torch.equal(before[name], value))


def _named(fn) -> str:
    """What a user's function is called in an error: its name, else its class's."""
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def _metric_template(name: str, metric) -> Any:
    """A torchmetrics Metric metric_fn updated, computed once on what it holds (one number, or
    refused), then reset: the workers' evaluations start from it as built. Its copy as built."""
    what = f"metric_fn's {name!r}"
    with warnings.catch_warnings():  # what a few samples lack (a class, a positive) says nothing of the set
        warnings.simplefilter("ignore")
        attempt(f"computing {what} (on a first slice)", lambda: metric_states.computed(metric.clone(), None, what))
    metric.reset()
    return metric_states.fresh(metric)


def _probe(s: Rehearsal, objective: Objective, replica: nn.Module, prefix: str) -> loss_probe.Finding:
    """How the loss splits; where nothing depends on it (one slice a step) or the user chose
    split=like_ddp, a probe that fails (a model that squeezes a batch of one) decides nothing."""
    if s.probe_group is None:
        return loss_probe.Finding(MEAN)
    group = in_layout(s.probe_group, s.settings.channels_last)
    singles = [in_layout(b, s.settings.channels_last) for b in s.probe_singles]
    at_a_time = "one sample" if s.probe_unit == 1 else f"{s.probe_unit} samples"
    if not s.splits or s.settings.split == "like_ddp":
        try:
            with random_state.kept():
                return loss_probe.measure(objective, replica, group, singles)
        except Exception as exc:  # noqa: BLE001 - the training step itself ran above: this only measures
            return loss_probe.Finding(None, f"not measured: on {at_a_time} at a time it raised {type(exc).__name__}")
    return attempt(f"{prefix}measuring how the loss splits over samples ({at_a_time} at a time)",
                    lambda: loss_probe.measure(objective, replica, group, singles))


def _optimizer_step(phase: PhaseSpec, params: list[torch.Tensor],
                    prefix: str) -> tuple[type | None, tuple[str, ...], str | None]:
    """The optimizer's class, the state it keeps per parameter after a step, and the metric its
    scheduler steps on (the scheduler is stepped at each of its points once)."""
    if phase.optimizer is None:
        return None, (), None
    built = attempt(f"{prefix}building the optimizer", lambda: phase.optimizer(group_params(
        params, range(len(params)), phase.group_options, phase.slot_groups)))
    # Refused here, before its step (SparseAdam's raises on dense gradients), at every worker count.
    refuse_unrunnable(type(built))
    # The scheduler is built before the step, as a training loop builds it (after, torch would
    # warn that the scheduler stepped before the optimizer).
    schedule = attempt(f"{prefix}building the scheduler", lambda: Schedule(phase.scheduler(built), steps_per_epoch=1)) \
        if phase.scheduler is not None else None
    attempt(f"{prefix}the optimizer's step", built.step)
    monitor = None
    if schedule is not None:
        monitor = schedule.monitor if schedule.needs_metric else None
        stand_in = {monitor: 1.0} if monitor else {}  # the evaluation's metric, before any evaluation ran
        def every_point():
            schedule.after_step(1)
            schedule.after_evaluation(stand_in)
            schedule.after_epoch(1, stand_in)

        attempt(f"{prefix}stepping the scheduler", every_point)
    return type(built), tuple(sorted({str(k) for held in built.state.values() for k in held})), monitor


def rehearse_in_worker(s: Rehearsal, send) -> dict[str, Any]:
    """``rehearse`` as a worker's target: the launcher then never imports what the user's code
    and torch.optim need (torch.optim's first optimizer imports torch._dynamo, which the warm
    workers' server has imported already)."""
    try:
        return {"findings": rehearse(s)}
    except UserCodeError as exc:
        return {"error": str(exc)}
    except ConfigError as exc:
        return {"refusal": str(exc)}


def attempt(what: str, fn):
    """``fn()``; what the user's code raises in it becomes a UserCodeError saying ``what`` failed
    (and, where a collate_fn raised, with how many samples), with the user's traceback.

    Raises:
        UserCodeError: ``fn`` raised anything but sn_trainer's own refusals (said as they are).
    """
    try:
        return fn()
    except (InputError, ConfigError):  # sn_trainer's own one-line refusals (a file it cannot read, a metric
        raise  # value it cannot merge): said as they are
    except Exception as exc:  # noqa: BLE001 - whatever the user's code raises is reported the same way
        frames = traceback.format_exception(type(exc), exc, exc.__traceback__)
        # Drop this module's own frames: the user's code starts below them.
        kept = [f for f in frames if __file__ not in f]
        said = [note + ": " for note in getattr(exc, "__notes__", ()) if note.startswith(COLLATE_NOTE)][:1]
        raise UserCodeError(f"{what} failed before any worker started: {''.join(said)}{type(exc).__name__}: {exc}\n"
                            + "".join(kept).rstrip()) from None
