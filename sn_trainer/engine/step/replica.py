"""What a worker receives (``Launch``, ``WorkerSpec``), and the replica it builds from it: the
model over the shared parameters, its gradient buffer, its shard of each optimizer, its peers; one
training step, an evaluation, and its share of a checkpoint."""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...data import random_state
from ...data.batching import in_layout
from ...data.feed import Feed
from ...data.source import Source, different_orders
from ...errors import DataError
from ...recipe import metric_states
from ..collectives.compression import PowerSGD, shard_compression
from ..collectives.over_gloo import CrossNodeReducer
from ..collectives.reducer import Reducer, ReducerSetup
from ..collectives.registry import make_reducer
from ...recipe.flat_layout import FlatLayout, tied_aliases
from ..memory.shared import ReplicaBuffers
from ...node.cluster import Cluster
from ..plan import Plan
from ..processes.pickling import pack
from ..processes.supervise import Heartbeats
from ..processes.signals import StopFlags
from ..processes.stages import StageTimer
from ...recipe import position
from .batchnorm import synchronise
from .board import Board, Reached, StepTotals, digest_terms, one_digest
from ...recipe.gather import Gathering, Refusing, StepGathering, gathering
from ...recipe.objective import GATHERED, Objective, Precision
from .phases import PhaseSpec, WorkerPhase
from .reference import Reference
from .verification import Bell, Peers, Verification


@dataclass
class Launch:
    """What the workers of one launch share. Tensors in it live in shared memory: pickling sends handles."""

    plan: Plan
    model: nn.Module
    layout: FlatLayout
    flat: torch.Tensor
    train: Source | None  # the training set, as the workers read it
    evaluation: Source | None  # the evaluation set
    objective: Objective  # what evaluation computes (the first phase's loss, and the metrics)
    phases: list[PhaseSpec]  # one optimizer each, updated in turn every step
    board: Board
    stop: StopFlags
    heartbeats: Heartbeats
    reducers: dict[str, tuple[type, Any]]  # the reducers the workers may build: each class, what it shares
    ema: torch.Tensor | None = None  # the parameters' moving average, laid out as ``flat`` (ema_decay)
    verify_grads: torch.Tensor | None = None  # laid out as ``flat``: every shard's summed gradient, at a verified step
    verify_bell: torch.Tensor | None = None  # an int32 the other workers sleep on while worker 0 verifies


@dataclass
class WorkerSpec:
    rank: int  # within the node
    store_path: str
    launch: Launch
    share: dict[str, Any] | None = None  # this worker's share of a checkpoint: each phase's state, random state
    cluster: Cluster | None = None  # several nodes under torchrun


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


class Replica:
    """This worker's model replica, its gradient buffer, its shard of the optimizer and its peers."""

    def __init__(self, spec: WorkerSpec):
        launch, plan = spec.launch, spec.launch.plan
        settings, placement = plan.settings, plan.placement
        self.launch, self.plan, self.rank = launch, plan, spec.rank
        self.global_rank = placement.node_rank * placement.workers + spec.rank
        self.global_workers = placement.global_workers
        self.model, self.layout, self.objective = launch.model, launch.layout, launch.objective
        self.precision, self.dtype = Precision(settings.precision), launch.flat.dtype
        # Worker 0's one process, copied from the model before it becomes the shared one.
        reference = Reference(self.model, self.layout, launch.phases, plan, self.dtype) \
            if plan.verifies and spec.rank == 0 else None
        self.layout.bind(self.model, launch.flat)
        # What forward passes call: the model, or (compile) inductor's compilation of it, over the
        # same parameters; it compiles on its first call (the first step), from the shared cache
        # where another worker or run compiled it already.
        self.runner = torch.compile(self.model) if settings.compile else self.model
        self.params = self.layout.parameters(self.model)
        self.buffers = ReplicaBuffers(self.model, spec.rank)
        self._compression_state: tuple[int, dict] | None = None  # compress=powersgd: (step, every node's state)
        self.reducer = self._reducer(spec)
        self.cluster = spec.cluster
        self.reached = Reached(self.layout.attach_gradients(self.model, self.reducer.grad_flat))
        self.reducer.watch(self.params, self.layout, settings.accumulate, settings.bucket_kb * 1024)
        if settings.sync_batchnorm:
            synchronise(self.model, self._waiting_sum)

        share = spec.share
        self.phases = [WorkerPhase(phase, self.layout, spec.rank, launch.flat, self.reducer.shard_grad, plan,
                                   share["phases"][index] if share else None)
                       for index, phase in enumerate(launch.phases)]
        self.verification = None
        if plan.verifies:
            rendezvous = os.path.dirname(spec.store_path)
            peers = Peers(spec.rank, plan.workers, self.reducer.barrier, self.global_sum,
                          lambda rank: os.path.join(rendezvous, f"verify-{rank}.pt"), Bell(launch.verify_bell),
                          tuple(sorted({cpu for cpus in placement.pinning for cpu in cpus})),
                          settings.threads * plan.workers)
            shard = self.layout.shards[spec.rank]
            self.verification = Verification(plan, peers, launch.verify_grads, (shard.start, shard.stop), reference)
        self.lr_used: float | None = None  # by the last step's update
        self._refusing: dict[int, Refusing] = {}  # by id of the objective (each phase's lives as long as the run)
        self._awaited_sent = 0  # worker 0: the events it sent in this launch that it waits on the launcher for
        if share is not None and share.get("rng") is not None:
            random_state.restore(share["rng"])  # same workers: same random streams
        self.feed = None
        if launch.train is not None:
            launch.train.resume_at(share.get("stream") if share else None, plan.start_step)
            self.feed = Feed(launch.train, self.global_rank, self.global_workers, settings.accumulate,
                             settings.channels_last, plan.total_steps, settings.prefetch)

    def _reducer(self, spec: WorkerSpec) -> Reducer:
        """The reducer the plan names (comm=auto: the fastest here), and across nodes gloo over it."""
        settings = self.plan.settings
        # gloo's own timeout is a backstop behind the launcher's watchdog, which names the worker
        # that stopped (gloo would name one of those left waiting for it).
        backstop = 2 * settings.worker_timeout + 30
        setup = ReducerSetup(spec.rank, self.plan.workers, self.layout.shards[spec.rank], self.layout.padded_numel,
                             self.dtype, spec.store_path, settings.reduce, backstop)
        reducer = make_reducer(settings.comm, setup, self.launch.reducers)
        if spec.cluster is None:
            return reducer
        return CrossNodeReducer(reducer, spec.cluster.store(f"shard{spec.rank}"), spec.cluster.node_rank,
                                spec.cluster.nodes, spec.cluster.device(), backstop, self._compressor(spec))

    def _compressor(self, spec: WorkerSpec) -> PowerSGD | None:
        """compress=powersgd: this worker's exchange of its shard between nodes (None: sent whole)."""
        settings = self.plan.settings
        if settings.compress == "none":
            return None
        rank = spec.rank
        plan = shard_compression(self.layout, rank, settings.compress_rank)
        compressor = PowerSGD(plan, settings.compress_rank, settings.compress_after,
                              seed=settings.seed * 1_000_003 + rank, steps_done=self.plan.start_step)
        saved = (spec.share or {}).get("compress")
        if saved is not None:
            compressor.load_state(saved, spec.cluster.node_rank, spec.cluster.nodes)
        return compressor

    def keep_compression(self, step_done: int) -> None:
        """At a scheduled checkpoint after ``step_done``, with compress=powersgd, every node's worker
        gathers its shard's compression state from all nodes: the leader's checkpoint keeps each node's."""
        compressor = getattr(self.reducer, "compressor", None)
        settings = self.plan.settings
        if compressor is None or settings.checkpoint.dir is None or not self.plan.checkpoint_due(step_done):
            return
        self._compression_state = (step_done, compressor.gathered_state(self.reducer.group, self.cluster.nodes))

    def global_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum a small tensor over every worker of every node, in place."""
        return self.reducer.sum_across_nodes(self.reducer.sum_in_node(tensor))

    def _waiting_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """``global_sum`` inside a forward or backward pass (batch norm): its wait for the peers is
        a wait, so that a worker stopped there is not blamed for the peers it waits for."""
        with self.launch.heartbeats.waiting(self.rank):
            return self.global_sum(tensor)

    # --- one step ------------------------------------------------------------------------------

    def train_step(self, step: int, timer: StageTimer) -> list[StepTotals]:
        """One optimizer step, in every worker at once: each phase in turn on the same micro-batches
        (forward, backward, sum, update of its shards; a barrier before the next phase reads the
        weights). A phase's update is left out if anything in it is non-finite. Its totals, per phase."""
        plan = self.plan
        with timer("data"):
            micro_batches = self.feed.step(step)
            digest = self.launch.train.order_digest(step)
        phase_totals = []
        verifying = self.verification is not None and self.verification.due(step)
        for index, phase in enumerate(self.phases):
            if index:
                with timer("wait"):
                    self.reducer.barrier()  # the previous phase's update is written everywhere
            if verifying:
                with timer("wait"):
                    self.verification.phase_start(self.model, index, phase.objective)
            totals = self.phase_step(step * len(self.phases) + index, phase, micro_batches, timer, digest)
            phase_totals.append(totals)
            if not totals.one_batch:  # every worker reads the same totals: all stop here, before an update
                raise DataError(different_orders(f"the workers read different items for step {step + 1}'s global "
                                                 "batch"))
            checked = verifying and totals.finite  # a left-out update has nothing to compare
            if checked:
                self.verification.after_reduce(step, index, self.reducer.shard_grad, phase.optimizer,
                                               lambda: self.feed.whole(step), self.launch.flat, totals, self.model,
                                               timer)
            if index == 0:
                self.lr_used = self.current_lr()  # before the scheduler moves it on
            with timer("update"):
                if totals.finite:
                    phase.update(self.reducer.shard_grad, totals.count, totals.unused, step + 1,
                                 self.reducer.sum_in_node, whole_model=len(self.phases) == 1)
            if phase.spec.after_update is not None and totals.finite:  # a left-out update has no after
                self.after_update(phase.spec.after_update, timer)
            if checked:
                self.verification.after_update(step, self.launch.flat, timer, last_phase=index == len(self.phases) - 1)
        with timer("update"):
            if self.launch.ema is not None:  # this shard's average: 1/W of the work in each worker
                shard = self.layout.shards[self.rank]
                self.launch.ema[shard.start : shard.stop].lerp_(self.launch.flat[shard.start : shard.stop],
                                                               1 - plan.settings.ema_decay)
        if self.rank == 0:
            self.launch.stop.decide(step + 1)  # before the barrier: all workers read the same decision
        with timer("wait"):
            self.reducer.barrier()  # nobody reads parameters that are still being written
        return phase_totals

    def after_update(self, fn: Callable[[nn.Module], Any], timer: StageTimer) -> None:
        """The user's ``fn(model)`` once on the weights just updated, as a loop calls it after
        ``optimizer.step()``. The parameters live once per node, and each worker updated only its
        shard of them: so every shard is written first (a barrier), worker 0 alone calls ``fn``
        on the whole shared parameters (in every worker at once it would race, and a constraint
        that is not idempotent would apply W times), and nobody reads them before it returned (a
        barrier). Across nodes each node's worker 0 calls it on its node's copy: the same
        weights in, the same out."""
        with timer("wait"):
            self.reducer.barrier()  # every worker's shard of the update is written
        if self.rank == 0:
            with timer("update"), torch.no_grad():
                fn(self.model)
        with timer("wait"):
            self.reducer.barrier()  # fn's writes are done before any worker reads the weights

    def phase_step(self, round_: int, phase: WorkerPhase, micro_batches: list[tuple[Any, int]],
                   timer: StageTimer, digest: int | None = None) -> StepTotals:
        """Forward and backward of one phase's loss on this worker's micro-batches, and the sum of
        the gradients over the workers; ``round_`` counts phases over the run (the board's turn),
        ``digest`` is the source's of the global batch read (compared with the peers' on the board)."""
        # Cleared here, not after the update: with comm=shm, peers read this buffer until the
        # barrier that closed the previous phase or step.
        self.reducer.grad_flat.zero_()
        self.reached.start()
        loss_sum = count = 0.0
        step = round_ // len(self.phases)
        for micro, (batch, samples) in enumerate(micro_batches):
            if samples == 0:
                continue  # the short last step of an epoch (drop_last=false): nothing here for this worker
            where = position.in_training(step, micro, self.plan.steps_per_epoch, self.plan.settings.accumulate)
            with timer("forward"), gathering(self._gathering(phase.objective)), position.at(where):
                micro_loss, micro_count = phase.objective.train_terms(self.runner, batch, samples, self.precision,
                                                                      self.dtype)
            with timer("backward"):
                micro_loss.backward()
            loss_sum += micro_loss.item()
            count += micro_count
        with timer("reduce"):
            changed = self.buffers.changed() if self.rank == 0 else None
            self.launch.board.publish(round_, self.rank, loss_sum, count, self.reducer.local_sum(),
                                      self.reached.flags(), changed, digest)
            self.reducer.reduce()
            totals = self.step_totals(round_, phase.objective)
        if self.rank != 0:
            with timer("update"):
                self.buffers.adopt(totals.changed_buffers)  # worker 0 writes its buffers no more this phase
        return totals

    def _gathering(self, objective: Objective) -> Gathering:
        """What sn_trainer.gather does in a micro-batch of ``objective``'s step: exchange the slices
        where the probe saw the step gather, else refuse (its loss is split as the probe measured it)."""
        if objective.form == GATHERED:
            return StepGathering(self.rank, self.plan.workers, self._waiting_in_node)
        refusing = self._refusing.get(id(objective))
        if refusing is None:  # it holds no state: one per objective for the whole run
            refusing = self._refusing[id(objective)] = Refusing(
                f"{objective.what} called sn_trainer.gather, but not when its loss was probed before the run "
                "(on a first batch): call it on every batch")
        return refusing

    def _waiting_in_node(self, tensor: torch.Tensor) -> torch.Tensor:
        """``sum_in_node`` inside a step function (a gather): its wait for the peers is a wait."""
        with self.launch.heartbeats.waiting(self.rank):
            return self.reducer.sum_in_node(tensor)

    def step_totals(self, round_: int, objective: Objective) -> StepTotals:
        totals = self.launch.board.totals(round_)
        if self.cluster is not None:  # add the other nodes' losses, counts, checks and use counts
            totals = self.reducer.sum_across_nodes(totals)
        totals = self.launch.board.read(totals)
        if objective.divides and totals.count <= 0:  # 0 / 0, as plain PyTorch's mean gives
            return dataclasses.replace(totals, loss_sum=math.nan, finite=False)
        return totals

    def scheduled_points(self, step_done: int, metrics: dict[str, Any] | None) -> None:
        """The scheduler's other points after step ``step_done``: an evaluation's ``metrics`` (None:
        none was made), the end of an epoch."""
        for schedule in (phase.schedule for phase in self.phases if phase.schedule is not None):
            if metrics is not None:
                schedule.after_evaluation(metrics)
            if step_done % self.plan.steps_per_epoch == 0:
                schedule.after_epoch(step_done // self.plan.steps_per_epoch, metrics)

    def agree_on_stop(self, step_done: int) -> bool:
        """After an event worker 0 sent for the launcher's callbacks to act on (an evaluation, an
        awaited progress record): worker 0 waits until the launcher has handed it to them and
        decides whether the run stops after this step (a callback may have asked); every worker
        reads the same decision, returned."""
        if self.rank == 0:
            self._awaited_sent += 1
            self.launch.stop.wait_for_acknowledgement(self._awaited_sent)
            self.launch.stop.decide(step_done)
        self.reducer.barrier()
        return self.launch.stop.stops_after(step_done)

    def losses(self, phase_totals: list[StepTotals]) -> list[float]:
        """Each phase's loss as plain PyTorch reports it: the mean (or, for a sum loss, the sum)."""
        return [totals.loss_sum / totals.count if phase.objective.divides and totals.count > 0 else totals.loss_sum
                for phase, totals in zip(self.phases, phase_totals)]

    def current_lr(self) -> float | None:
        """The first phase's learning rate (of its first group)."""
        return self.phases[0].lr()

    # --- evaluation and state ------------------------------------------------------------------

    def evaluate(self, beat: Callable[[str], None]) -> dict[str, Any]:
        """``eval_*`` of the weights, and, with ema_decay, ``eval_ema_*`` of their moving average
        (the model's parameters pointed at it for the while)."""
        metrics = self.evaluate_weights(beat)
        if self.launch.ema is None or "eval_error" in metrics:
            return metrics
        self.layout.bind(self.model, self.launch.ema)
        try:
            averaged = self.evaluate_weights(beat)
        finally:
            self.layout.bind(self.model, self.launch.flat)
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
        digest = self.launch.evaluation.eval_digest() if error is None else None
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
            chunks = self.launch.evaluation.eval_chunks(self.global_rank, self.global_workers,
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

    def state_part(self, step_done: int) -> bytes:
        """What this worker contributes to a checkpoint: its optimizer's state, its random state
        (and, from worker 0, the model's and where the stream goes on after step ``step_done``), as
        tensors and plain data."""
        part = {"rank": self.rank, "phases": [phase.state() for phase in self.phases], "rng": random_state.capture()}
        kept = self._compression_state
        if kept is not None and kept[0] == step_done:  # compress=powersgd: every node's, gathered at this step
            part["compress"] = kept[1]
        if self.rank == 0:
            part["model"] = {k: v.detach().clone(memory_format=torch.contiguous_format)
                             for k, v in self.model.state_dict().items()}
            part["ema"] = self.layout.by_name(self.launch.ema) if self.launch.ema is not None else None
            part["aliases"] = tied_aliases(self.model)
            part["stream"] = self.launch.train.position(step_done) if self.launch.train is not None else None
        return pack(part)

    def close(self) -> None:
        if self.feed is not None:
            self.feed.close()
        self.reducer.close()
