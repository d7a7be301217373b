"""The objectives settled on what the rehearsal found: each phase's loss form, what evaluation
reports and merges, and why a run that splits its batches trains like DDP."""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.dropout import _DropoutNd

from ..config import TrainerConfig
from ..data import random_state
from ..data.source import Source
from ..recipe import metric_states
from ..recipe.objective import LIKE_DDP, MEAN, Objective
from ..engine import PhaseSpec
from ..errors import ConfigError
from . import loss_probe, preflight
from .checks import check_monitor

log = logging.getLogger(__name__)

# Ignored labels are looked for in the first this many training samples, collated this many at a time.
LABELS_SCANNED, LABELS_CHUNK = 1024, 64


def labels_seen(findings: preflight.Findings, train: Source, probe_group: Any, settings: TrainerConfig,
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


def objectives(objective: Objective, phases: list[PhaseSpec], findings: preflight.Findings, splits: bool,
               evaluation: Source | None, global_workers: int, split: str = "exact"
               ) -> tuple[Objective, list[PhaseSpec]]:
    """Evaluation's objective and the phases, settled: each phase's loss form (refused where it has
    no exact split and the run splits it, unless split=like_ddp), what evaluation reports, and that
    a scheduler's monitored metric is among it; evaluation's metrics as ``_metric_templates``
    refuses them. Evaluation's objective is the first phase's (``resolve_phases``), and stays one
    object with it; the objectives given, which the rehearsal ran, are left as they were.

    Raises:
        ConfigError: a loss with no exact split, a monitor evaluation does not report, a metric
            that cannot be merged.
    """
    forms = []
    for phase, found in zip(phases, findings.phases):
        forms.append(_loss_form(found.loss, phase.objective, splits, split))
        check_monitor(found.schedule_monitor, findings.eval_keys, evaluation)
    first = objective.settled(eval_keys=findings.eval_keys, form=forms[0],
                              metric_templates=_metric_templates(findings, global_workers))
    settled = [first] + [phase.objective.settled(form=form) for phase, form in zip(phases[1:], forms[1:])]
    return first, [dataclasses.replace(phase, objective=own) for phase, own in zip(phases, settled)]


def evaluation_objective(objective: Objective, findings: preflight.Findings, global_workers: int) -> Objective:
    """Evaluation's objective in a run that trains nothing, settled: what it reports, its metrics
    as ``_metric_templates`` refuses them, and its loss form.

    Raises:
        ConfigError: a metric that cannot be merged.
    """
    return objective.settled(eval_keys=findings.eval_keys,
                             metric_templates=_metric_templates(findings, global_workers),
                             form=findings.loss.form or MEAN)  # evaluation weighs chunks by samples, as a plain loop does




def like_ddp(model: nn.Module, phases: list[PhaseSpec], findings: preflight.Findings,
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


def _metric_templates(findings: preflight.Findings, global_workers: int) -> dict[str, Any]:
    """The torchmetrics Metrics evaluation merges across workers, each refused where its states
    cannot be merged exactly and the run has more than one worker to merge.

    Raises:
        ConfigError: names the metric, the state and what to do instead.
    """
    templates = dict(findings.metric_templates)
    if global_workers == 1:
        return templates  # one worker: its states are the whole set's, nothing is merged
    for name, template in templates.items():
        why = metric_states.unmergeable(template)
        if why is not None:
            raise ConfigError(f"metric_fn's {name!r} cannot be evaluated over {global_workers} workers exactly: "
                              f"{why}; return it as (sum, count) terms, use a torchmetrics metric whose states are "
                              "summed, concatenated, or a min or max, or evaluate with workers=1")
    return templates


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
