"""A fit resolved before any worker starts: the user's code checked and rehearsed on one micro-batch,
every ``auto`` decided, and one frozen ``Run`` that every launch of the workers repeats."""
from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..checkpoint.directory import CheckpointDir
from ..checkpoint.resume import locate, sample_order
from ..config import TrainerConfig
from ..data import random_state
from ..data.sampler import slice_bounds, steps_per_epoch
from ..data.source import Source, make_source
from ..engine import PhaseSpec, compression, run_workers
from ..engine.plan import Decision, Placement, Plan
from ..errors import ConfigError, UserCodeError
from ..node.cluster import Cluster
from ..node.runtime import Runtime
from ..recipe.flat_layout import FlatLayout, trainable_parameters
from ..recipe.objective import Objective
from ..optim import resolve_groups
from ..phase import Phase
from . import checks, decide, preflight, settle
from .agreement import AGREED_SETTINGS, agree_with_other_nodes, node_facts

log = logging.getLogger(__name__)


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

    In stages, in this order: the user's objective and data read (``_objective``, ``_sources``,
    ``steps_of``), the inputs refused where bad and the phases resolved (``_checked``), the user's
    code rehearsed on one micro-batch (``_rehearsed``), the objectives settled on what it found
    (``settle.objectives``), the shards decided and the settings checked together (``_decided``),
    the checkpoints located and agreed between the nodes (``_located``), and the plan every worker
    reads, with why the run is like DDP (``settle.like_ddp``), and the flat layout.

    Raises:
        ConfigError, DataError, CheckpointError, UserCodeError: before any worker starts.
    """
    splits = placement.global_workers * settings.accumulate > 1  # no decision below changes accumulate
    objective = _objective(given)
    train, evaluation = _sources(given, settings, objective)
    per_epoch, total_steps = steps_of(settings, train)
    phases = _checked(given, objective, train, evaluation, settings, placement, total_steps)
    settings, findings, draws_random, decided = _rehearsed(given.model, train, evaluation, objective, phases,
                                                           settings, placement, splits)
    objective, phases = settle.objectives(objective, phases, findings, splits, evaluation, placement.global_workers,
                                          settings.split)
    settings, unproven, sharding = _decided(settings, placement, phases, findings, train.size)
    placement = dataclasses.replace(placement, decisions=(*placement.decisions, *decided, *sharding))
    checkpoints, resume_from = _located(given.model, settings, placement, cluster, train.size, total_steps)
    like_ddp = settle.like_ddp(given.model, phases, findings, draws_random, settings) if splits else ()
    plan = Plan(settings=settings, placement=placement, dataset_size=train.size, steps_per_epoch=per_epoch,
                total_steps=total_steps, start_step=0, loss_form=objective.form,
                phase_forms=tuple((p.name, p.objective.form) for p in phases) if given.phases else (),
                evaluates=evaluation is not None, metrics=reported(findings.eval_keys, settings) if evaluation else (),
                evaluate_only=False, checkpointing=checkpoints is not None, progress_awaited=progress_awaited,
                like_ddp=like_ddp, unproven=unproven if splits else ())
    layout = FlatLayout(given.model, placement.workers, settings.channels_last, settings.shards)
    _say_compression(settings, phases, layout)
    return Run(model=given.model, train=train, evaluation=evaluation, objective=objective, phases=phases,
               layout=layout, findings=findings, first_plan=plan, checkpoints=checkpoints, resume_from=resume_from,
               sample_order=sample_order(settings, train.size), run_config=given.run_config,
               initial_state={k: v.detach().clone() for k, v in given.model.state_dict().items()})


def _checked(given: FitInputs, objective: Objective, train: Source, evaluation: Source | None,
             settings: TrainerConfig, placement: Placement, total_steps: int) -> list[PhaseSpec]:
    """The run's phases, with what can be refused before the user's code runs refused: steps
    left to measure, one order of the data in every worker, the model, and what the workers
    receive.

    Raises:
        ConfigError, DataError: what is wrong, and how to fix it.
    """
    checks.check_measured(settings.measure_after, total_steps)
    if placement.global_workers > 1:
        checks.check_one_order(train, settings.batch_size * settings.accumulate, settings.seed)
        if evaluation is not None:
            checks.check_one_order(evaluation, settings.eval_batch_size * placement.global_workers, settings.seed)
    checks.check_model(given.model)
    phases = resolve_phases(given.model, given, objective)
    checks.check_sendable(_sent(given, objective, phases))
    return phases


def _rehearsed(model: nn.Module, train: Source, evaluation: Source | None, objective: Objective,
               phases: list[PhaseSpec], settings: TrainerConfig, placement: Placement, splits: bool
               ) -> tuple[TrainerConfig, preflight.Findings, bool, list[Decision]]:
    """The user's code rehearsed on one micro-batch, with the settings it needs decided first (the
    model's layout and compile, then how the training set is read), and ignored labels looked for
    where the run splits its batches: the settings so far, the findings, whether reading the
    training set draws from the global random generators, and the decisions made.

    Raises:
        ConfigError, UserCodeError: before any worker starts.
    """
    settings, decided = decide.for_model(settings, model)
    rehearsal = preflight.prepare(model, train, slice_bounds(settings.batch_size, placement.global_workers, 0)[1],
                                  evaluation, settings.eval_batch_size, objective, phases, settings, splits)
    settings, reading = decide.for_reading(settings, rehearsal.data_draws_random, rehearsal.data_sets_generators,
                                           global_workers=placement.global_workers)
    findings = rehearse(rehearsal, settings)
    if splits:
        findings = settle.labels_seen(findings, train, rehearsal.probe_group, settings, rehearsal.train_samples)
    return settings, findings, rehearsal.data_draws_random, decided + reading


def _decided(settings: TrainerConfig, placement: Placement, phases: list[PhaseSpec], findings: preflight.Findings,
             dataset_size: int | None) -> tuple[TrainerConfig, tuple[str, ...], list[Decision]]:
    """The settings with the shards decided for the optimizers the rehearsal built, and checked
    together; why a shard kind set by hand is unproven for an optimizer; the decision for auto.

    Raises:
        ConfigError: an optimizer sn_trainer cannot run, or settings that cannot work together.
    """
    settings, unproven, decided = decide.for_optimizers(settings, [f.optimizer_class for f in findings.phases])
    checks.check_combinations(settings, placement, dataset_size)
    checks.check_gathered(phases, findings, settings, placement, dataset_size)
    return settings, unproven, decided


def _located(model: nn.Module, settings: TrainerConfig, placement: Placement, cluster: Cluster | None,
             dataset_size: int | None, total_steps: int) -> tuple[CheckpointDir | None, Path | None]:
    """Where this process writes checkpoints and which one the run resumes from, agreed with every
    other node's, with what else every node must share (``agreement``).

    Raises:
        CheckpointError, ConfigError: no such checkpoint, or nodes that disagree.
    """
    checkpoints, resume_from = locate(settings, cluster)
    if cluster is not None and cluster.spans_nodes:
        shared = {name: getattr(settings, name) for name in AGREED_SETTINGS}
        agree_with_other_nodes(cluster, node_facts(model, placement.workers, total_steps,
                                                   sample_order(settings, dataset_size), shared, resume_from))
    return checkpoints, resume_from


def resolve_evaluation(given: FitInputs, settings: TrainerConfig, placement: Placement) -> Run:
    """An evaluation of ``given.model`` on ``given.eval_set``, resolved as a fit is, with no training.

    Raises:
        ConfigError, DataError, UserCodeError: before any worker starts.
    """
    objective = _objective(given)
    evaluation = make_source(given.eval_set, "dataset", settings, given.eval_collate_fn,
                             _accepts(objective, given.model, given.eval_collate_fn))
    if placement.global_workers > 1:
        checks.check_one_order(evaluation, settings.eval_batch_size * placement.global_workers, settings.seed)
    checks.check_sendable(_sent(given, objective, []))
    settings, decided = decide.for_model(settings, given.model)
    placement = dataclasses.replace(placement, decisions=(*placement.decisions, *decided))
    findings = rehearse(preflight.prepare(given.model, None, 0, evaluation, settings.eval_batch_size, objective, [],
                                          settings), settings)
    objective = settle.evaluation_objective(objective, findings, placement.global_workers)
    checks.check_gathered([], findings, settings, placement, None)
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


def _sent(given: FitInputs, objective: Objective, phases: list[PhaseSpec]) -> list[tuple[Any, str]]:
    """Everything the workers receive of the user's, each as ``checks.check_sendable`` names it."""
    training = given.train_set is not None  # else evaluate(dataset, collate_fn=...) was called
    named = [(given.model, "the model"), (objective, "the loss, step or metric function"),
             (given.train_set, "train_set"), (given.eval_set, "eval_set" if training else "dataset"),
             (given.collate_fn, "collate_fn"), (given.eval_collate_fn, "eval_collate_fn" if training else "collate_fn")]
    for phase in phases:
        where = f"phase {phase.name!r}: " if given.phases else ""
        named += [(phase.objective, where + "the step function"), (phase.optimizer, where + "the optimizer factory"),
                  (phase.scheduler, where + "the scheduler factory"), (phase.after_update, where + "after_update"),
                  (phase.group_options, where + "the parameter groups' options")]
    return named


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
