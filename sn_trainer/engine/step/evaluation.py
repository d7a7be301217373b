"""A worker's part of an evaluation: its slice of the evaluation set, the loss and metrics summed
(or, for torchmetrics Metrics, gathered) over every worker, of the weights and of their moving average."""
from __future__ import annotations

import functools
import math
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ...data.batching import in_layout
from ...data.source import different_orders
from ...recipe import metric_states
from ..memory.shared import ReplicaBuffers
from ...recipe import position
from .board import digest_terms, one_digest
from ...recipe.gather import Gathering, Refusing, gathering
from ...recipe.objective import Precision
from .worker_spec import WorkerSpec


def _hold_metric(updated: dict[str, Any], key: str, value: Any) -> None:
    """Keep the Metric metric_fn returned for ``key``; it must be the same object every chunk.

    Raises:
        TypeError: another object than the first chunk's.
    """
    if value is None:
        return
    if not metric_states.is_metric(value):
        raise TypeError(f"metric_fn's {key!r} was a torchmetrics Metric on the first batch and is now "
                        f"{type(value).__name__}; return the same kind of value for a name on every batch")
    if updated.setdefault(key, value) is not value:
        raise TypeError(f"metric_fn's {key!r} returned another Metric object than on the first batch; create the "
                        "Metric once, outside metric_fn, and update that one in metric_fn")


class Evaluator:
    """This worker's evaluation of the shared weights, exact over the whole evaluation set."""

    def __init__(self, spec: WorkerSpec, runner: nn.Module, precision: Precision, buffers: ReplicaBuffers,
                 global_sum: Callable[[torch.Tensor], torch.Tensor]):
        """``runner``: what forward passes call; ``global_sum``: a small tensor summed over every worker
        of every node, in place."""
        shared = spec.shared
        self.shared, self.plan, self.rank = shared, shared.plan, spec.rank
        self.global_rank, self.global_workers = spec.global_rank, shared.plan.placement.global_workers
        self.model, self.layout, self.objective = shared.model, shared.layout, shared.objective
        self.runner, self.precision, self.dtype = runner, precision, shared.flat.dtype
        self.buffers, self.global_sum = buffers, global_sum

    def evaluate(self, beat: Callable[[str], None]) -> dict[str, Any]:
        """``eval_*`` of the weights, and, with ema_decay, ``eval_ema_*`` of their moving average
        (the model's parameters pointed at it for the while)."""
        metrics = self.evaluate_weights(beat)
        if self.shared.ema is None or "eval_error" in metrics:
            return metrics
        self.layout.bind(self.model, self.shared.ema)
        try:
            averaged = self.evaluate_weights(beat)
        finally:
            self.layout.bind(self.model, self.shared.flat)
        if "eval_error" in averaged:
            return {**metrics, "eval_error": averaged["eval_error"]}
        return {**metrics, **{f"eval_ema_{k[5:]}": v for k, v in averaged.items() if k != "eval_samples"}}

    @torch.no_grad()
    def evaluate_weights(self, beat: Callable[[str], None]) -> dict[str, Any]:
        """Exact loss and metrics over the whole evaluation set, each worker taking a slice.

        ``(sum, count)`` terms are summed over chunks and workers; a torchmetrics Metric is
        updated by metric_fn over this worker's chunks, its states gathered from every worker,
        computed once, and reset. A failure in any worker's evaluation is reported, not raised:
        the training is kept. Every module is put back in the mode it was in (a frozen backbone
        stays in eval mode).
        """
        modes = [(module, module.training) for module in self.model.modules()]
        self.model.eval()
        if self.rank != 0:
            self.buffers.adopt()
        templates = self.objective.metric_templates
        keys = [key for key in self.objective.eval_keys if key not in templates]  # the summed ones
        sums, updated, error = self._evaluate_chunks(keys, beat)
        computed: dict[str, float] = {}
        beat("sync")
        # Each worker digests all it read of the set, its peers' chunks too: equal where all read one order.
        digest = self.shared.evaluation.eval_digest() if error is None else None
        summed = self.global_sum(torch.cat([sums, digest_terms(digest)]))
        sums, read = summed[: len(sums)], summed[len(sums) :]
        same_items = one_digest(read)
        try:
            if sums[-1] == 0 and same_items:  # every worker evaluated, so every worker gathers the same states below
                computed = self._computed_metrics(updated)
        except Exception:  # noqa: BLE001 - computed from the same states in every worker: all fail alike
            error, sums[-1] = traceback.format_exc(), 1
        finally:
            for metric in updated.values():
                metric.reset()  # the next evaluation starts from the metric as built
            for module, training in modes:
                module.training = training
        if sums[-1] > 0:
            return {"eval_error": error or "evaluation failed in another worker"}
        if not same_items:
            return {"eval_error": different_orders("the workers read different items for the evaluation")}
        summed = {key: (sums[2 * k] / sums[2 * k + 1]).item() if sums[2 * k + 1] > 0 else math.nan
                  for k, key in enumerate(keys)}  # a metric that counted nothing is NaN, as a mean of nothing is
        return {"eval_samples": int(sums[-2].item()),
                **{f"eval_{key}": summed[key] if key in summed else computed[key] for key in self.objective.eval_keys}}

    def _evaluate_chunks(self, keys: list[str], beat: Callable[[str], None]
                         ) -> tuple[torch.Tensor, dict[str, Any], str | None]:
        """This worker's chunks of the evaluation set: the ``(sum, count)`` of each of ``keys``, then
        its samples and failures; each Metric metric_fn updated (as it returned it); the traceback
        of a failure (the peers must still meet after it)."""
        templates = self.objective.metric_templates
        sums = torch.zeros(2 * len(keys) + 2, dtype=torch.float64)
        updated: dict[str, Any] = {}
        # Workers evaluate different numbers of chunks: nothing may wait for the others (a gather
        # in evaluation is refused before the run where there are several).
        alone = Gathering() if self.global_workers == 1 else Refusing(
            "sn_trainer.gather was called in evaluation, where each worker evaluates its own chunks: with several "
            "workers a loss over the global batch has no exact evaluation; evaluate with workers=1")
        try:
            settings = self.plan.settings
            chunks = self.shared.evaluation.eval_chunks(self.global_rank, self.global_workers,
                                                        settings.eval_batch_size, settings.max_eval_batches)
            for index, (batch, samples) in enumerate(chunks):
                beat("eval")
                batch = in_layout(batch, settings.channels_last)
                with gathering(alone), position.at(position.in_evaluation(index)):
                    found = self.objective.eval_terms(self.runner, batch, samples, self.precision, self.dtype)
                for k, key in enumerate(keys):
                    value_sum, value_count = found.get(key, (0.0, 0.0))
                    sums[2 * k] += value_sum
                    sums[2 * k + 1] += value_count
                for key in templates:
                    _hold_metric(updated, key, found.get(key))
                sums[-2] += samples
        except Exception:  # noqa: BLE001 - reported with its traceback; the peers must still meet
            sums[-1] += 1
            return sums, updated, traceback.format_exc()
        return sums, updated, None

    def _computed_metrics(self, updated: dict[str, Any]) -> dict[str, float]:
        """Each torchmetrics Metric's value, by name, from every worker's states (a worker that
        evaluated nothing takes part with the metric as built)."""
        gather = None if self.global_workers == 1 else functools.partial(
            metric_states.gather_by_sums, rank=self.global_rank, world=self.global_workers,
            global_sum=self.global_sum)
        result = {}
        for key, template in self.objective.metric_templates.items():
            metric = updated[key] if key in updated else metric_states.fresh(template)
            result[key] = metric_states.computed(metric, gather, f"metric_fn's {key!r}")
        return result
