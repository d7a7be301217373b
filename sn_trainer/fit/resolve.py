"""A fit resolved before any worker starts: the user's code checked and rehearsed on one micro-batch,
every ``auto`` decided, and one frozen ``Run`` that every launch of the workers repeats."""
from __future__ import annotations

import dataclasses
import functools
import io
import logging
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.dropout import _DropoutNd

from ..checkpoint.directory import CheckpointDir
from ..checkpoint.resume import locate, sample_order
from ..config import TrainerConfig
from ..data import random_state
from ..data.sampler import slice_bounds, steps_per_epoch
from ..data.source import Source, different_orders, make_source
from ..engine import PhaseSpec, WorkerPickler, compression, run_workers
from ..recipe import metric_states
from ..recipe.flat_layout import FlatLayout, trainable_parameters
from ..node.cluster import Cluster
from ..node.runtime import Runtime
from ..engine.plan import Placement, Plan
from ..recipe.objective import GATHERED, LIKE_DDP, MEAN, Objective
from ..errors import ConfigError, DataError, UserCodeError
from ..optim import resolve_groups
from ..phase import Phase
from . import decide, loss_probe, preflight
from .agreement import AGREED_SETTINGS, agree_with_other_nodes, node_facts

log = logging.getLogger(__name__)

# Ignored labels are looked for in the first this many training samples, collated this many at a time.
LABELS_SCANNED, LABELS_CHUNK = 1024, 64


@dataclass(frozen=True)
class FitInputs:
    """What ``Trainer.fit`` (or ``evaluate``) was given: the user's model, data and code."""

    model: nn.Module
    train_set: Any = None  # None: evaluate only
    eval_set: Any = None
    optimizer: Callable[..., torch.optim.Optimizer] | None = None
    loss_fn: Callable[..., torch.Tensor] | None = None
    scheduler: Callable[[torch.optim.Optimizer], Any] | None = None
    step_fn: Callable[[nn.Module, Any], Any] | None = None
    metric_fn: Callable[[nn.Module, Any], dict[str, Any]] | None = None
    param_groups: Callable[[nn.Module], Any] | None = None
    phases: list[Phase] | None = None
    collate_fn: Callable[[list], Any] | None = None
    eval_collate_fn: Callable[[list], Any] | None = None
    run_config: dict[str, Any] | None = None
    after_update: Callable[[nn.Module], Any] | None = None


@dataclass(frozen=True)
class Run:
    """One fit, resolved: what every launch of its workers (the first, and each restart) runs."""

    model: nn.Module
    train: Source | None  # None: evaluation only
    evaluation: Source | None
    objective: Objective  # evaluation's
    phases: list[PhaseSpec]  # training's: one optimizer each
    layout: FlatLayout
    findings: preflight.Findings
    first_plan: Plan  # from step 0
    checkpoints: CheckpointDir | None  # where this process writes them (None: nowhere)
    resume_from: Path | None
    sample_order: dict[str, Any]  # what a resume must agree with
    run_config: dict[str, Any] | None
    initial_state: dict[str, torch.Tensor]  # a restart without a checkpoint starts over from it

    def plan(self, start_step: int) -> Plan:
        return dataclasses.replace(self.first_plan, start_step=start_step)

    @property
    def settings(self) -> TrainerConfig:
        return self.first_plan.settings

    @property
    def total_steps(self) -> int:
        return self.first_plan.total_steps

    @property
    def optimizers(self) -> list[tuple[type | None, tuple[str, ...]]]:
        return [(found.optimizer_class, found.optimizer_state_keys) for found in self.findings.phases]


def resolve_fit(given: FitInputs, settings: TrainerConfig, placement: Placement, cluster: Cluster | None,
                progress_awaited: bool = False) -> Run:
    """Check everything, rehearse the user's code on one micro-batch, and decide every setting of
    the run once (``settings`` have the machine's choices decided already; ``progress_awaited``:
    a callback may act on progress records, so the workers wait for the callbacks after each).

    Raises:
        ConfigError, DataError, CheckpointError, UserCodeError: before any worker starts.
    """
    model = given.model
    objective = _objective(given)
    train, evaluation = _sources(given, settings, objective)
    per_epoch, total_steps = steps_of(settings, train)
    if settings.measure_after >= total_steps:
        raise ConfigError(f"measure_after={settings.measure_after} leaves none of the {total_steps} steps to "
                          "measure; lower it or train longer")
    if placement.global_workers > 1:
        _check_one_order(train, settings.batch_size * settings.accumulate, settings.seed)
        if evaluation is not None:
            _check_one_order(evaluation, settings.eval_batch_size * placement.global_workers, settings.seed)
    _check_model(model)
    phases = resolve_phases(model, given, objective)
    _check_sendable(given, objective, phases)
    settings = decide.for_model(settings, model)
    splits = placement.global_workers * settings.accumulate > 1
    rehearsal = preflight.prepare(model, train, slice_bounds(settings.batch_size, placement.global_workers, 0)[1],
                                  evaluation, settings.eval_batch_size, objective, phases, settings, splits)
    settings = decide.for_reading(settings, rehearsal.data_draws_random, rehearsal.data_sets_generators,
                                  global_workers=placement.global_workers)
    findings = rehearse(rehearsal, settings)
    if splits:
        findings = _labels_seen(findings, train, rehearsal.probe_group, settings, rehearsal.train_samples)
    _settle_losses(objective, phases, findings, splits, evaluation, settings.split)
    _settle_metrics(objective, findings, placement.global_workers)
    settings, unproven = decide.for_optimizers(settings, [f.optimizer_class for f in findings.phases])
    _check_combinations(settings, placement, train.size)
    _check_gathered(phases, findings, settings, placement, train.size)
    checkpoints, resume_from = locate(settings, cluster)
    if cluster is not None and cluster.spans_nodes:
        agree_with_other_nodes(cluster, node_facts(model, placement.workers, total_steps,
                                                   sample_order(settings, train.size), {
                                                       name: getattr(settings, name) for name in AGREED_SETTINGS},
                                                   resume_from))
    like_ddp = _like_ddp(model, phases, findings, rehearsal.data_draws_random, settings) if splits else ()
    plan = Plan(settings=settings, placement=placement, dataset_size=train.size, steps_per_epoch=per_epoch,
                total_steps=total_steps, start_step=0, loss_form=objective.form,
                phase_forms=tuple((p.name, p.objective.form) for p in phases) if given.phases else (),
                evaluates=evaluation is not None, metrics=reported(findings.eval_keys, settings) if evaluation else (),
                evaluate_only=False, checkpointing=checkpoints is not None, progress_awaited=progress_awaited,
                like_ddp=like_ddp, unproven=unproven if splits else ())
    layout = FlatLayout(model, placement.workers, settings.channels_last, settings.shards)
    _say_compression(settings, phases, layout)
    return Run(model=model, train=train, evaluation=evaluation, objective=objective, phases=phases,
               layout=layout,
               findings=findings, first_plan=plan, checkpoints=checkpoints, resume_from=resume_from,
               sample_order=sample_order(settings, train.size), run_config=given.run_config,
               initial_state={k: v.detach().clone() for k, v in model.state_dict().items()})


def resolve_evaluation(given: FitInputs, settings: TrainerConfig, placement: Placement) -> Run:
    """An evaluation of ``given.model`` on ``given.eval_set``, resolved as a fit is, with no training.

    Raises:
        ConfigError, DataError, UserCodeError: before any worker starts.
    """
    objective = _objective(given)
    evaluation = make_source(given.eval_set, "dataset", settings, given.eval_collate_fn,
                             _accepts(objective, given.model, given.eval_collate_fn))
    if placement.global_workers > 1:
        _check_one_order(evaluation, settings.eval_batch_size * placement.global_workers, settings.seed)
    _check_sendable(given, objective, [])
    settings = decide.for_model(settings, given.model)
    findings = rehearse(preflight.prepare(given.model, None, 0, evaluation, settings.eval_batch_size, objective, [],
                                          settings), settings)
    objective.eval_keys = findings.eval_keys
    _settle_metrics(objective, findings, placement.global_workers)
    objective.form = findings.loss.form or MEAN  # evaluation weighs chunks by samples, as a plain loop does
    _check_gathered([], findings, settings, placement, None)
    # What only training uses stays out: no accumulation, no moving average, no batch-norm sums.
    settings = dataclasses.replace(settings, accumulate=1, drop_last=True, shards="elements", prefetch=False,
                                   ema_decay=None, sync_batchnorm=False)
    plan = Plan(settings=settings, placement=placement, dataset_size=evaluation.size, steps_per_epoch=1,
                total_steps=0, start_step=0, loss_form=objective.form, phase_forms=(), evaluates=True,
                metrics=reported(findings.eval_keys, settings), evaluate_only=True, checkpointing=False)
    return Run(model=given.model, train=None, evaluation=evaluation, objective=objective, phases=[],
               layout=FlatLayout(given.model, placement.workers, settings.channels_last), findings=findings,
               first_plan=plan, checkpoints=None, resume_from=None, sample_order={}, run_config=None,
               initial_state={})


def reported(eval_keys: tuple[str, ...], settings: TrainerConfig) -> tuple[str, ...]:
    """What an evaluation reports: its samples, each of its sums (``eval_<key>``), and with
    ema_decay each again for the weights' moving average (``eval_ema_<key>``)."""
    averaged = [f"eval_ema_{key}" for key in eval_keys] if settings.ema_decay is not None else []
    return tuple(sorted({"eval_samples", *(f"eval_{key}" for key in eval_keys), *averaged}))


def steps(settings: TrainerConfig, num_samples: int) -> tuple[int, int]:
    """Optimizer steps per epoch and in all, for a training set of ``num_samples``.

    Raises:
        ConfigError: the set is smaller than one step's batch (with drop_last).
    """
    per_epoch = steps_per_epoch(num_samples, settings.batch_size, settings.accumulate, settings.drop_last)
    if per_epoch == 0:
        raise ConfigError(f"train_set has {num_samples} samples, fewer than one step's batch of "
                          f"batch_size x accumulate = {settings.batch_size * settings.accumulate}; lower batch_size "
                          "or set drop_last=false")
    return per_epoch, settings.max_steps if settings.max_steps is not None else settings.epochs * per_epoch


def steps_of(settings: TrainerConfig, source: Source) -> tuple[int, int]:
    """``steps`` for a source; a stream without a length is one epoch of max_steps steps.

    Raises:
        ConfigError: a stream without a length and no max_steps.
    """
    if source.size is not None:
        return steps(settings, source.size)
    if settings.max_steps is None:
        raise ConfigError("train_set is a stream without a length (no __len__): set max_steps=..., the number of "
                          "optimizer steps to train; epochs need a length")
    return settings.max_steps, settings.max_steps


def rehearse(rehearsal: preflight.Rehearsal, settings: TrainerConfig) -> preflight.Findings:
    """The user's code on one micro-batch, before any worker starts: in a warm worker (so that this
    process never imports what torch.optim needs), else here.

    Raises:
        UserCodeError: any of it failed; the message carries the user's traceback.
    """
    if settings.start_method != "forkserver":
        return preflight.rehearse(rehearsal)
    (outcome,) = run_workers(preflight.rehearse_in_worker, [rehearsal], start_method=settings.start_method,
                        runtime=Runtime(settings.allocator, settings.openmp))
    if "error" in outcome:
        raise UserCodeError(outcome["error"])
    if "refusal" in outcome:
        raise ConfigError(outcome["refusal"])
    return outcome["findings"]


def resolve_phases(model: nn.Module, given: FitInputs, objective: Objective) -> list[PhaseSpec]:
    """The run's phases, resolved against the model: one from fit's own arguments, or each Phase's.

    Raises:
        ConfigError: a phase's parameters are not the model's, or a parameter is in two phases.
    """
    trainable = [p for _, p in trainable_parameters(model)]
    if not given.phases:
        groups = resolve_groups(model, trainable, given.param_groups)
        return [_phase_spec("train", objective, groups, given.optimizer, given.scheduler, given.after_update)]
    resolved, owner = [], {}
    for index, phase in enumerate(given.phases):
        if not isinstance(phase, Phase):
            raise ConfigError(f"phases must be sn_trainer.Phase objects, got {type(phase).__name__}")
        name = phase.name or f"phase{index}"
        groups = resolve_groups(model, trainable, phase.params)
        for slot, group in enumerate(groups.slot_groups):
            if group is not None:
                if slot in owner:
                    raise ConfigError(f"a parameter of shape {tuple(trainable[slot].shape)} is in phases "
                                      f"{owner[slot]!r} and {name!r}; each parameter may be in one phase only")
                owner[slot] = name
        phase_objective = objective if index == 0 else Objective(step_fn=phase.step_fn)
        resolved.append(_phase_spec(name, phase_objective, groups, phase.optimizer, phase.scheduler,
                                    phase.after_update, f"phase {name!r}'s after_update"))
    return resolved


def _phase_spec(name: str, objective: Objective, groups, optimizer, scheduler, after_update=None,
                what: str = "after_update") -> PhaseSpec:
    """One phase with its optimizer factory: as given, else the class of the optimizer the groups
    came as, else SGD(lr=0.01).

    Raises:
        ConfigError: ``after_update`` (``what``) given and not callable.
    """
    if after_update is not None and not callable(after_update):
        raise ConfigError(f"{what} must be a function of the model, got {type(after_update).__name__}: pass "
                          "after_update=fn, called as fn(model) after each optimizer update")
    factory = optimizer or groups.factory or functools.partial(torch.optim.SGD, lr=0.01)
    return PhaseSpec(name, objective, factory, groups.options, groups.slot_groups, scheduler, after_update)


def _objective(given: FitInputs) -> Objective:
    """Evaluation's objective (and the first phase's): fit's loss or step function, or the first Phase's.

    Raises:
        ConfigError: both loss_fn and step_fn, or phases with fit's own step, optimizer or scheduler.
    """
    if given.phases:
        both = [name for name in ("loss_fn", "step_fn", "optimizer", "scheduler", "param_groups", "after_update")
                if getattr(given, name)]
        if both:
            raise ConfigError(f"give phases or {', '.join(both)}, not both: each Phase brings its step_fn, "
                              "params, optimizer, scheduler and after_update")
        return Objective(step_fn=given.phases[0].step_fn, metric_fn=given.metric_fn)
    if given.loss_fn is not None and given.step_fn is not None:
        raise ConfigError("give loss_fn or step_fn, not both: step_fn computes the loss itself")
    return Objective(given.loss_fn, given.step_fn, given.metric_fn)


def _accepts(objective: Objective, model: nn.Module, collate_fn) -> Callable[[Any], str | None]:
    """What make_source asks of a dataset's items: the objective's check, or, with a collate
    function, nothing (its batches are what the objective gets; the preflight runs them)."""
    return (lambda item: None) if collate_fn is not None else (lambda item: objective.accepts(item, model))


def _sources(given: FitInputs, settings: TrainerConfig, objective: Objective) -> tuple[Source, Source | None]:
    """The training set's source and the evaluation set's, each checked on its first item."""
    eval_collate_fn = given.eval_collate_fn if given.eval_collate_fn is not None else given.collate_fn
    with random_state.kept():  # reading first items leaves the caller's random streams as they were
        train = make_source(given.train_set, "train_set", settings, given.collate_fn,
                            _accepts(objective, given.model, given.collate_fn))
        evaluation = make_source(given.eval_set, "eval_set", settings, eval_collate_fn,
                                 _accepts(objective, given.model, eval_collate_fn)) \
            if given.eval_set is not None else None
    if train.kind == "stream" and settings.shuffle:
        # Said, not refused: shuffle's default is true, and a stream has one order, its own.
        log.info("train_set is a stream: it is read in its own order (shuffle reorders map-style sets only; a "
                 "stream that should be reordered each pass does so itself, told the pass by set_epoch)")
    return train, evaluation


# Items of a stream read twice before the start: enough for a shuffle buffer's draws to show,
# few enough that the launcher's reading stays short whatever the batch.
_HEAD_ITEMS = 256


def _check_one_order(source: Source, count: int, seed: int) -> None:
    """Refuse a stream whose order follows the random state of the process reading it: its first
    ``count`` items (at most ``_HEAD_ITEMS``) read twice, from two copies, in the random states
    workers 0 and 1 start with. The workers prove their orders the same step by step; this
    catches most such streams (an unseeded shuffle buffer, torch.randperm in __iter__) before any
    worker starts.

    Raises:
        DataError: the two reads differ.
    """
    count, digests = min(count, _HEAD_ITEMS), set()
    for rank in (0, 1):
        with random_state.kept():
            random_state.seed(seed * 1000 + rank)  # as engine/worker.py seeds worker ``rank``
            digests.add(source.head_digest(count))
    if len(digests) > 1:
        raise DataError(different_orders(f"its first {count} items differed between two reads before any worker "
                                         "started"))


def _check_model(model: nn.Module) -> None:
    """A model sn_trainer can train: some trainable parameter, and only dense gradients.

    Raises:
        ConfigError: no trainable parameter; an embedding built with sparse=True (its gradient is a
            sparse tensor, which the flat gradient buffers and the loss probe cannot hold).
    """
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError("the model has no trainable parameters (none with requires_grad=True)")
    for name, module in model.named_modules():
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse and module.weight.requires_grad:
            raise ConfigError(f"the model's {type(module).__name__} {name or '(the model itself)'!r} is built with "
                              "sparse=True, and sn_trainer trains dense gradients only: build it with sparse=False "
                              "(dense gradients), and use a dense optimizer such as Adam or AdamW instead of "
                              "SparseAdam")
    if not any(module.training for module in model.modules()):
        log.warning("the model is in eval mode (every module): it trains so, as a plain loop without "
                    "model.train() would (no dropout, batch norm by its running statistics); call model.train() "
                    "before fit to train with them")


class _TensorFreePickler(WorkerPickler):
    """Pickles everything but tensors, as a launch is pickled: enough to tell whether an object can
    reach a worker (lambdas, local functions and what a notebook defines can)."""

    def persistent_id(self, obj):
        return id(obj) if isinstance(obj, (torch.Tensor, torch.UntypedStorage, torch.TypedStorage)) else None


def _check_sendable(given: FitInputs, objective: Objective, phases: list[PhaseSpec]) -> None:
    """Everything the workers receive can be pickled to them.

    Raises:
        ConfigError: names what cannot, and why.
    """
    training = given.train_set is not None  # else evaluate(dataset, collate_fn=...) was called
    named = [(given.model, "the model"), (objective, "the loss, step or metric function"),
             (given.train_set, "train_set"), (given.eval_set, "eval_set" if training else "dataset"),
             (given.collate_fn, "collate_fn"), (given.eval_collate_fn, "eval_collate_fn" if training else "collate_fn")]
    for phase in phases:
        where = f"phase {phase.name!r}: " if given.phases else ""
        named += [(phase.objective, where + "the step function"), (phase.optimizer, where + "the optimizer factory"),
                  (phase.scheduler, where + "the scheduler factory"), (phase.after_update, where + "after_update"),
                  (phase.group_options, where + "the parameter groups' options")]
    for obj, what in named:
        try:
            _TensorFreePickler(io.BytesIO(), protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
        except Exception as exc:  # noqa: BLE001 - pickling fails in many ways; all mean the same here
            raise ConfigError(
                f"{what} cannot be sent to a worker process ({exc}); it holds something no process can receive "
                "(an open file, a lock, a generator, a socket): create it in the worker, e.g. lazily on first use"
            ) from None


def _labels_seen(findings: preflight.Findings, train: Source, probe_group: Any, settings: TrainerConfig,
                 micro: int) -> preflight.Findings:
    """The findings, with a per-sample mean measured on a few samples not trusted where the first
    LABELS_SCANNED samples of the training set, collated in global batches, hold ignored labels:
    whether the measured samples showed them was chance, the positions read are not. A
    collate_fn of the user's collates whole micro-batches of a worker (``micro`` samples) only.

    Raises:
        UserCodeError: the dataset or collate_fn failed.
    """
    if not any(found.loss.form == MEAN for found in findings.phases):
        return findings
    chunk = min(settings.batch_size, LABELS_CHUNK)
    chunks = max(1, LABELS_SCANNED // chunk)
    if getattr(train, "collate_fn", None) is not None:  # whole micro-batches, no short rest (as the rehearsal's)
        chunk = max(1, micro)
        chunks = max(1, (LABELS_SCANNED if train.size is None else min(LABELS_SCANNED, train.size)) // chunk)

    def batches():
        yield probe_group
        for batch, _ in train.eval_chunks(0, 1, chunk, chunks):
            yield batch

    with random_state.kept():  # a stream that shuffles itself draws; the run's streams stay as they were
        seen = preflight.attempt("looking for ignored labels in the first training samples", lambda: [
            dataclasses.replace(found, loss=loss_probe.labels_seen(found.loss, batches()))
            for found in findings.phases])
    return dataclasses.replace(findings, phases=tuple(seen), loss=seen[0].loss if seen else findings.loss)


def _settle_losses(objective: Objective, phases: list[PhaseSpec], findings: preflight.Findings, splits: bool,
                   evaluation: Source | None, split: str = "exact") -> None:
    """Each phase's loss form (refused where it has no exact split and the run splits it, unless
    split=like_ddp), what evaluation reports, and that a scheduler's monitored metric is among it."""
    objective.eval_keys = findings.eval_keys
    for phase, found in zip(phases, findings.phases):
        phase.objective.form = _loss_form(found.loss, phase.objective, splits, split)
        _check_monitor(found.schedule_monitor, objective.eval_keys, evaluation)


def _like_ddp(model: nn.Module, phases: list[PhaseSpec], findings: preflight.Findings,
              data_draws_random: bool, settings: TrainerConfig) -> tuple[str, ...]:
    """Why a run that splits its batches trains like DDP rather than as one process would (none:
    exact, to be verified on the run): random draws each worker makes from its own streams, batch
    norm over each worker's slice, buffers worker 0's forward passes write, and losses weighed as DDP
    weighs them. Said at the default log level, and kept in the plan (summary.json's ``exactness``):
    where one process's step cannot be reproduced, nothing is verified against it."""
    reasons = []
    dropout = [name or type(model).__name__ for name, m in model.named_modules()
               if isinstance(m, _DropoutNd) and m.p > 0]
    if dropout:
        reasons.append(f"the model's dropout ({_names(dropout)}) draws each worker's masks")
    norms = [name or type(model).__name__ for name, m in model.named_modules() if isinstance(m, _BatchNorm) and m.training]
    if norms and not settings.sync_batchnorm:
        reasons.append(f"batch norm ({_names(norms)}) normalises each worker's slice by its own statistics "
                       "(sync_batchnorm=true: by the global batch's)")
    normed = {f"{name}.{leaf}" if name else leaf for name, m in model.named_modules() if isinstance(m, _BatchNorm)
              for leaf in m._buffers}
    changed = sorted({b for found in findings.phases for b in found.changed_buffers} - normed)
    if changed:
        reasons.append(f"the forward pass writes buffers ({_names(changed)}): every worker starts each step from "
                       "worker 0's values")
    for phase, found in zip(phases, findings.phases):
        prefix = f"phase {phase.name!r}: " if len(phases) > 1 else ""
        if found.loss.draws:
            reasons.append(prefix + found.loss.draws)
        if phase.objective.form == LIKE_DDP:
            reasons.append(f"{prefix}split=like_ddp weighs each worker's loss as DDP does")
    if data_draws_random:
        reasons.append("reading train_set draws from torch's, numpy's or random's global generators (augmentation); "
                       "for exact augmentation, seed each sample's draws from (seed, epoch, index): wrap the "
                       "dataset in sn_trainer.data.SeededPerSample")
    if reasons:
        log.warning("like DDP, not equal to one process: %s (random draws come from each worker's own streams, seeded "
                    "from seed and rank: repeatable, same distribution, other numbers); no step is compared with one "
                    "process's", "; ".join(reasons))
    return tuple(reasons)


def _names(names: list[str]) -> str:
    return f"{', '.join(names[:3])}{', ...' if len(names) > 3 else ''}"


def _settle_metrics(objective: Objective, findings: preflight.Findings, global_workers: int) -> None:
    """The torchmetrics Metrics evaluation merges across workers, each refused where its states
    cannot be merged exactly and the run has more than one worker to merge.

    Raises:
        ConfigError: names the metric, the state and what to do instead.
    """
    objective.metric_templates = dict(findings.metric_templates)
    if global_workers == 1:
        return  # one worker: its states are the whole set's, nothing is merged
    for name, template in objective.metric_templates.items():
        why = metric_states.unmergeable(template)
        if why is not None:
            raise ConfigError(f"metric_fn's {name!r} cannot be evaluated over {global_workers} workers exactly: "
                              f"{why}; return it as (sum, count) terms, use a torchmetrics metric whose states are "
                              "summed, concatenated, or a min or max, or evaluate with workers=1")


def _loss_form(finding: loss_probe.Finding, objective: Objective, splits: bool, split: str = "exact") -> str:
    """The form a scalar loss is split by; a loss with no exact split is refused where it splits,
    or weighed like DDP where the user chose split=like_ddp.

    Raises:
        ConfigError: the loss cannot be split exactly, and the run splits it (workers or accumulate).
    """
    if finding.form is not None:
        return finding.form
    if not splits:
        return MEAN  # one slice a step: its loss is the batch's, whatever it divides by
    if split == "like_ddp":
        log.warning("%s gives a scalar loss with no exact split (%s); split=like_ddp: each worker's loss is weighed "
                    "as DDP weighs it (each worker's mean, averaged over the workers): like DDP, not exact",
                    objective.what, finding.detail)
        return LIKE_DDP
    raise ConfigError(f"{objective.what} gives a scalar loss that cannot be split over workers exactly: "
                      f"{finding.detail}. {finding.advice}")


def _check_monitor(monitor: str | None, eval_keys: tuple[str, ...], evaluation: Source | None) -> None:
    """A scheduler that steps on an evaluation metric needs an evaluation that reports it.

    Raises:
        ConfigError: no evaluation set, or one whose evaluation does not report ``monitor``.
    """
    if monitor is None:
        return
    if evaluation is None:
        raise ConfigError(f"the scheduler steps on {monitor} after each evaluation, and this run evaluates nothing: "
                          "pass eval_set=..., or a scheduler that steps per step or epoch")
    reported = [f"eval_{key}" for key in eval_keys]
    if monitor not in reported:
        raise ConfigError(f"the scheduler steps on {monitor}, which evaluation does not report (it reports "
                          f"{', '.join(reported)}); set its monitor to one of those")


def _check_combinations(settings: TrainerConfig, placement: Placement, dataset_size: int | None) -> None:
    """Settings that each work, and together cannot.

    Raises:
        ConfigError: reduce_scatter with shards that are not equal slices; sync_batchnorm with a
            last micro-batch too small for every worker.
    """
    workers = placement.global_workers
    if settings.shards != "elements" and placement.workers > 1 and settings.reduce == "reduce_scatter":
        raise ConfigError(f"reduce=reduce_scatter needs elementwise shards (equal slices), and this run's are "
                          f"shards={settings.shards}; use reduce=all_reduce")
    if settings.sync_batchnorm and not settings.drop_last and dataset_size is not None:
        rest = dataset_size % (settings.batch_size * settings.accumulate) % settings.batch_size
        if 0 < rest < workers:
            raise ConfigError(f"sync_batchnorm with drop_last=false: the last micro-batch of an epoch has "
                              f"{rest} samples, fewer than the {workers} workers, and every worker must take "
                              "part in each batch norm; set drop_last=true or change batch_size")


def _say_compression(settings: TrainerConfig, phases: list[PhaseSpec], layout: FlatLayout) -> None:
    """compress=powersgd (between nodes: one node has set it to none): say once what it compresses
    and that the run is approximate.

    Raises:
        ConfigError: several phases (their gradients share one error feedback per shard).
    """
    if settings.compress == "none":
        return
    if len(phases) > 1:
        raise ConfigError(f"compress={settings.compress} keeps one error feedback per shard, and this run updates "
                          f"{len(phases)} optimizers in turn (phases); use compress=none")
    log.warning("%s", compression.describe(layout, settings.compress_rank, settings.compress_after))


def _check_gathered(phases: list[PhaseSpec], findings: preflight.Findings, settings: TrainerConfig,
                    placement: Placement, dataset_size: int | None) -> None:
    """Where sn_trainer.gather is called, what keeps it exact: one node, every worker a sample of
    every micro-batch, and no evaluation split over workers.

    Raises:
        ConfigError: a gathered loss across nodes, or with a last micro-batch too small for every
            worker; a gather in evaluation with several workers.
    """
    workers = placement.global_workers
    if findings.eval_gathers and workers > 1:
        raise ConfigError(f"evaluation calls sn_trainer.gather (in step_fn or metric_fn), and with {workers} workers "
                          "each evaluates its own chunks of the evaluation set, so a loss over the global batch has "
                          "no exact evaluation: leave eval_set out, or evaluate with workers=1")
    if not any(phase.objective.form == GATHERED for phase in phases):
        return
    if placement.nodes > 1:
        raise ConfigError(f"step_fn calls sn_trainer.gather, which gathers the workers of one node, and this run has "
                          f"{placement.nodes} nodes: train it on one node")
    if not settings.drop_last and dataset_size is not None:
        rest = dataset_size % (settings.batch_size * settings.accumulate) % settings.batch_size
        if 0 < rest < workers:
            raise ConfigError(f"step_fn calls sn_trainer.gather, and with drop_last=false the last micro-batch of an "
                              f"epoch has {rest} samples, fewer than the {workers} workers: every worker takes part "
                              "in each gather with a slice of its own; set drop_last=true or change batch_size")
