"""The refusals of bad input before any worker starts: each check names what is wrong and how to
fix it, in one line, and returns nothing where all is well."""
from __future__ import annotations

import io
import logging
import pickle
from typing import Any

import torch
from torch import nn

from ..config import TrainerConfig
from ..data import random_state
from ..data.source import Source, different_orders
from ..engine.plan import Placement
from ..engine import PhaseSpec, WorkerPickler
from ..recipe.objective import GATHERED
from ..errors import ConfigError, DataError
from . import preflight

log = logging.getLogger(__name__)

# Items of a stream read twice before the start: enough for a shuffle buffer's draws to show,
# few enough that the launcher's reading stays short whatever the batch.
_HEAD_ITEMS = 256


def check_measured(measure_after: int, total_steps: int) -> None:
    """Some step is left to measure after the first ``measure_after``.

    Raises:
        ConfigError: measure_after is not below the run's steps.
    """
    if measure_after >= total_steps:
        raise ConfigError(f"measure_after={measure_after} leaves none of the {total_steps} steps to "
                          "measure; lower it or train longer")


def check_one_order(source: Source, count: int, seed: int) -> None:
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


def check_model(model: nn.Module) -> None:
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


def check_sendable(named: list[tuple[Any, str]]) -> None:
    """Everything the workers receive (each object with what a refusal calls it) can be pickled to them.

    Raises:
        ConfigError: names what cannot, and why.
    """
    for obj, what in named:
        try:
            _TensorFreePickler(io.BytesIO(), protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
        except Exception as exc:  # noqa: BLE001 - pickling fails in many ways; all mean the same here
            raise ConfigError(
                f"{what} cannot be sent to a worker process ({exc}); it holds something no process can receive "
                "(an open file, a lock, a generator, a socket): create it in the worker, e.g. lazily on first use"
            ) from None


def check_monitor(monitor: str | None, eval_keys: tuple[str, ...], evaluation: Source | None) -> None:
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


def check_combinations(settings: TrainerConfig, placement: Placement, dataset_size: int | None) -> None:
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


def check_gathered(phases: list[PhaseSpec], findings: preflight.Findings, settings: TrainerConfig,
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
