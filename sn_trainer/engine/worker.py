"""What one worker process does: set itself up, then train its share of every global batch."""
from __future__ import annotations

import dataclasses
import math
import os
import time
import traceback
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import psutil
import torch
from torch import nn
from torch.utils.data import Dataset

from ..data.batching import in_layout
from ..data.feed import Feed
from ..data.source import IndexSource, StreamSource, eval_chunks
from . import random_state
from .batchnorm import synchronise
from .board import Board, StepTotals
from .cluster import Cluster
from .comm import CrossNodeReducer, ShmBuffers, make_reducer
from .events import CheckpointPart, Evaluation, Progress, WorkerResult
from .launch import Heartbeats, pack
from .layout import FlatLayout, tied_aliases
from .objective import Objective, Precision
from .phases import JobPhase, WorkerPhase
from .plan import Plan
from .shared import ReplicaBuffers
from .signals import StopFlags

PHASES = ("data", "forward", "backward", "reduce", "update", "wait")


@dataclass
class Job:
    """Everything the workers share. Tensors in it live in shared memory: pickling sends handles."""

    plan: Plan
    model: nn.Module
    layout: FlatLayout
    flat: torch.Tensor
    train: IndexSource | StreamSource | None  # the training set, as the worker reads it
    eval_set: Dataset | None
    objective: Objective  # what evaluation computes (the first phase's loss, and the metrics)
    phases: list[JobPhase]  # one optimizer each, updated in turn every step
    board: Board
    stop: StopFlags
    heartbeats: Heartbeats
    shm: ShmBuffers | None = None
    ema: torch.Tensor | None = None  # the parameters' moving average, laid out as ``flat`` (ema_decay)
    eval_collate_fn: Callable[[list], Any] | None = None


@dataclass
class WorkerSpec:
    rank: int  # within the node
    store_path: str
    job: Job
    resume: dict[str, Any] | None = None  # this worker's share of a checkpoint: each phase's state, random state
    cluster: Cluster | None = None  # several nodes under torchrun


@dataclass
class PhaseTimer:
    """Seconds per phase, and a heartbeat at every phase change."""

    beat: Callable[[str], None]
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))

    @contextmanager
    def __call__(self, phase: str):
        self.beat(phase)
        start = time.perf_counter()
        yield
        self.seconds[phase] += time.perf_counter() - start


def pin_and_set_threads(cpus: tuple[int, ...], threads: int) -> None:
    """Pin this process to its cores and give torch exactly ``threads`` intra-op threads."""
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already fixed: only possible before the first parallel work
        pass


class Replica:
    """This worker's model replica, its gradient buffer, its shard of the optimizer and its peers."""

    def __init__(self, spec: WorkerSpec):
        job, plan = spec.job, spec.job.plan
        placement = plan.placement
        self.job, self.plan, self.rank = job, plan, spec.rank
        self.global_rank = placement.node_rank * placement.workers + spec.rank
        self.global_workers = placement.global_workers
        self.model, self.layout, self.objective = job.model, job.layout, job.objective
        self.precision, self.dtype = Precision(placement.precision), job.flat.dtype
        self.layout.bind(self.model, job.flat)
        # What forward passes call: the model, or (compile) inductor's compilation of it, over the
        # same parameters; it compiles on its first call (the first step), from the shared cache
        # where another worker or run compiled it already.
        self.runner = torch.compile(self.model) if plan.compile else self.model
        self.params = self.layout.parameters(self.model)
        self.buffers = ReplicaBuffers(self.model, spec.rank)

        shard = self.layout.shards[spec.rank]
        # gloo's own timeout is a backstop behind the launcher's watchdog, which names the worker
        # that stopped (gloo would name one of those left waiting for it).
        backstop = 2 * plan.worker_timeout + 30
        self.reducer = make_reducer(placement.comm, spec.rank, placement.workers, shard, self.layout.padded_numel,
                                    self.dtype, spec.store_path, job.shm, placement.reduce, backstop)
        if spec.cluster is not None:
            self.reducer = CrossNodeReducer(self.reducer, spec.cluster.store(f"shard{spec.rank}"),
                                            spec.cluster.node_rank, spec.cluster.nodes, spec.cluster.device(), backstop)
        self.cluster = spec.cluster
        self.layout.attach_gradients(self.model, self.reducer.grad_flat)
        self.reducer.watch(self.params, self.layout, plan.accumulate, placement.bucket_kb * 1024)
        self.used = torch.zeros(len(self.params), dtype=torch.float64)
        for index, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(lambda _p, i=index: self.used.__setitem__(i, 1.0))
        if plan.sync_batchnorm:
            synchronise(self.model, self._waiting_sum)

        self.phases = [WorkerPhase(phase, self.layout, spec.rank, job.flat, self.reducer.shard_grad, plan,
                                   spec.resume["phases"][index] if spec.resume else None)
                       for index, phase in enumerate(job.phases)]
        self.lr_used: float | None = None  # by the last step's update
        if spec.resume is not None and spec.resume.get("rng") is not None:
            random_state.restore(spec.resume["rng"])  # same workers: same random streams
        self.feed = None
        if job.train is not None:
            job.train.resume_at(spec.resume.get("stream") if spec.resume else None, plan.start_step)
            self.feed = Feed(job.train, self.global_rank, self.global_workers, plan.accumulate, plan.channels_last,
                             plan.total_steps, plan.prefetch)

    def global_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum a small tensor over every worker of every node, in place."""
        return self.reducer.sum_across_nodes(self.reducer.sum_in_node(tensor))

    def _waiting_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """``global_sum`` inside a forward or backward pass (batch norm): its wait for the peers is
        a wait, so that a worker stopped there is not blamed for the peers it waits for."""
        with self.job.heartbeats.waiting(self.rank):
            return self.global_sum(tensor)

    # --- one step ------------------------------------------------------------------------------

    def train_step(self, step: int, timer: PhaseTimer) -> list[StepTotals]:
        """One optimizer step, in every worker at once: each phase in turn on the same micro-batches
        (forward, backward, sum, update of its shards; a barrier before the next phase reads the
        weights). A phase's update is left out if anything in it is non-finite. Its totals, per phase."""
        plan = self.plan
        with timer("data"):
            micro_batches = self.feed.step(step)
        phase_totals = []
        for index, phase in enumerate(self.phases):
            if index:
                with timer("wait"):
                    self.reducer.barrier()  # the previous phase's update is written everywhere
            phase_totals.append(self.phase_step(step * len(self.phases) + index, phase, micro_batches, timer))
            if index == 0:
                self.lr_used = self.current_lr()  # before the scheduler moves it on
            with timer("update"):
                if phase_totals[-1].finite:
                    phase.update(self.reducer.shard_grad, phase_totals[-1].count, phase_totals[-1].unused, step + 1,
                                 self.reducer.sum_in_node, whole_model=len(self.phases) == 1)
        with timer("update"):
            if self.job.ema is not None:  # this shard's average: 1/W of the work in each worker
                shard = self.layout.shards[self.rank]
                self.job.ema[shard.start : shard.stop].lerp_(self.job.flat[shard.start : shard.stop],
                                                            1 - plan.ema_decay)
        if self.rank == 0:
            self.job.stop.decide(step + 1)  # before the barrier: all workers read the same decision
        with timer("wait"):
            self.reducer.barrier()  # nobody reads parameters that are still being written
        return phase_totals

    def phase_step(self, round_: int, phase: WorkerPhase, micro_batches: list[tuple[Any, int]],
                   timer: PhaseTimer) -> StepTotals:
        """Forward and backward of one phase's loss on this worker's micro-batches, and the sum of
        the gradients over the workers; ``round_`` counts phases over the run (the board's turn)."""
        # Cleared here, not after the update: with comm=shm, peers read this buffer until the
        # barrier that closed the previous phase or step.
        self.reducer.grad_flat.zero_()
        self.used.zero_()
        loss_sum = count = 0.0
        for batch, samples in micro_batches:
            if samples == 0:
                continue  # the short last step of an epoch (drop_last=false): nothing here for this worker
            with timer("forward"):
                micro_loss, micro_count = phase.objective.train_terms(self.runner, batch, samples, self.precision,
                                                                      self.dtype)
            with timer("backward"):
                micro_loss.backward()
            loss_sum += micro_loss.item()
            count += micro_count
        with timer("reduce"):
            changed = self.buffers.changed() if self.rank == 0 else None
            self.job.board.publish(round_, self.rank, loss_sum, count, self.reducer.local_sum(), self.used, changed)
            self.reducer.reduce()
        totals = self.step_totals(round_, phase.objective)
        if self.rank != 0:
            with timer("update"):
                self.buffers.adopt(totals.changed_buffers)  # worker 0 writes its buffers no more this phase
        return totals

    def step_totals(self, round_: int, objective: Objective) -> StepTotals:
        totals = self.job.board.totals(round_)
        if self.cluster is not None:  # add the other nodes' losses, counts, checks and use counts
            totals = self.reducer.sum_across_nodes(totals)
        totals = self.job.board.read(totals)
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

    def settle(self, step_done: int) -> None:
        """After an evaluation: worker 0 decides whether the run stops after this step (a callback
        may have asked), and every worker reads the same decision."""
        if self.rank == 0:
            self.job.stop.decide(step_done)
        self.reducer.barrier()

    def losses(self, phase_totals: list[StepTotals]) -> list[float]:
        """Each phase's loss as plain PyTorch reports it: the mean (or, for a sum loss, the sum)."""
        return [totals.loss_sum / totals.count if phase.objective.divides and totals.count > 0 else totals.loss_sum
                for phase, totals in zip(self.phases, phase_totals)]

    def current_lr(self) -> float | None:
        """The first phase's learning rate (of its first group)."""
        return self.phases[0].lr()

    # --- evaluation and state ------------------------------------------------------------------

    def evaluate(self, dataset: Dataset, beat: Callable[[str], None]) -> dict[str, Any]:
        """``eval_*`` of the weights, and, with ema_decay, ``eval_ema_*`` of their moving average
        (the model's parameters pointed at it for the while)."""
        metrics = self.evaluate_weights(dataset, beat)
        if self.job.ema is None or "eval_error" in metrics:
            return metrics
        self.layout.bind(self.model, self.job.ema)
        try:
            averaged = self.evaluate_weights(dataset, beat)
        finally:
            self.layout.bind(self.model, self.job.flat)
        if "eval_error" in averaged:
            return {**metrics, "eval_error": averaged["eval_error"]}
        return {**metrics, **{f"eval_ema_{k[5:]}": v for k, v in averaged.items() if k != "eval_samples"}}

    @torch.no_grad()
    def evaluate_weights(self, dataset: Dataset, beat: Callable[[str], None]) -> dict[str, Any]:
        """Exact loss and metrics over the whole of ``dataset``, each worker taking a slice.

        A failure in any worker's evaluation is reported, not raised: the training is kept. Every
        module is put back in the mode it was in (a frozen backbone stays in eval mode).
        """
        modes = [(module, module.training) for module in self.model.modules()]
        self.model.eval()
        if self.rank != 0:
            self.buffers.adopt()
        keys = self.objective.eval_keys
        sums = torch.zeros(2 * len(keys) + 2, dtype=torch.float64)  # (sum, count) per key, samples, failures
        error = None
        try:
            for batch, samples in eval_chunks(dataset, self.job.eval_collate_fn, self.global_rank, self.global_workers,
                                              self.plan.eval_batch_size, self.plan.max_eval_batches):
                beat("eval")
                batch = in_layout(batch, self.plan.channels_last)
                found = self.objective.eval_terms(self.runner, batch, samples, self.precision, self.dtype)
                for k, key in enumerate(keys):
                    value_sum, value_count = found.get(key, (0.0, 0.0))
                    sums[2 * k] += value_sum
                    sums[2 * k + 1] += value_count
                sums[-2] += samples
        except Exception:  # noqa: BLE001 - reported with its traceback; the peers must still meet below
            error = traceback.format_exc()
            sums[-1] += 1
        beat("sync")
        self.global_sum(sums)
        for module, training in modes:
            module.training = training
        if sums[-1] > 0:
            return {"eval_error": error or "evaluation failed in another worker"}
        result: dict[str, Any] = {"eval_samples": int(sums[-2].item())}
        for k, key in enumerate(keys):
            if sums[2 * k + 1] > 0:
                result[f"eval_{key}"] = (sums[2 * k] / sums[2 * k + 1]).item()
        return result

    def state_part(self, step_done: int) -> bytes:
        """What this worker contributes to a checkpoint: its optimizer's state, its random state
        (and, from worker 0, the model's and where the stream goes on after step ``step_done``), as
        tensors and plain data."""
        part = {"rank": self.rank, "phases": [phase.state() for phase in self.phases], "rng": random_state.capture()}
        if self.rank == 0:
            part["model"] = {k: v.detach().clone(memory_format=torch.contiguous_format)
                             for k, v in self.model.state_dict().items()}
            part["ema"] = self.layout.by_name(self.job.ema) if self.job.ema is not None else None
            part["aliases"] = tied_aliases(self.model)
            part["stream"] = self.job.train.position(step_done) if self.job.train is not None else None
        return pack(part)

    def close(self) -> None:
        if self.feed is not None:
            self.feed.close()
        self.reducer.close()


class CpuClock:
    """CPU seconds over the measured steps: this process's, and the whole machine's busy and total.

    The launcher subtracts what the run's own processes used from what the machine did, and
    so tells a shared machine from an idle one.
    """

    def start(self) -> None:
        self._own, self._machine = self._read()

    def stop(self) -> dict[str, float]:
        if not hasattr(self, "_own"):
            return {}
        own, machine = self._read()
        # Linux counts guest time inside user and nice as well: summed again, it would count twice.
        busy = {k: machine[k] - self._machine[k] for k in machine if k not in ("guest", "guest_nice")}
        return {"own": own - self._own, "machine_busy": sum(v for k, v in busy.items() if k not in ("idle", "iowait")),
                "machine_total": sum(busy.values())}

    @staticmethod
    def _read() -> tuple[float, dict[str, float]]:
        mine = psutil.Process().cpu_times()
        return mine.user + mine.system, psutil.cpu_times()._asdict()


def own_pss() -> int:
    """This process's proportional set size (shared pages count 1/k), or 0 where unknown."""
    try:
        return psutil.Process().memory_full_info().pss
    except (psutil.Error, AttributeError):
        return 0


def run_worker(spec: WorkerSpec, send: Callable[[Any], None]) -> WorkerResult:
    """The worker's whole life: set up, train (and/or evaluate), return what it measured."""
    plan = spec.job.plan
    spec.job.heartbeats.beat(spec.rank, plan.start_step, "setup")
    pin_and_set_threads(plan.placement.pinning[spec.rank], plan.placement.threads)
    random_state.seed(plan.seed * 1000 + plan.placement.node_rank * plan.placement.workers + spec.rank)
    replica = Replica(spec)
    try:
        if plan.evaluate_only:
            return WorkerResult(replica.reducer.name, replica.evaluate(spec.job.eval_set, lambda phase: None))
        return train(replica, send)
    finally:
        replica.close()


class Profiler:
    """A torch.profiler trace of ``steps`` steps from ``first``, written as a Chrome trace."""

    def __init__(self, out_dir: str | None, first: int, steps: int, rank: int):
        self.out_dir, self.first, self.last, self.rank = out_dir, first, first + steps, rank
        self._profile = None

    def before(self, step: int) -> None:
        if self.out_dir and step == self.first:
            self._profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self._profile.__enter__()

    def after(self, step: int) -> None:
        if self._profile is not None and step + 1 == self.last:
            self.stop()

    def stop(self) -> None:
        if self._profile is not None:
            self._profile.__exit__(None, None, None)
            self._profile.export_chrome_trace(os.path.join(self.out_dir, f"trace_rank{self.rank}.json"))
            self._profile = None


def train(replica: Replica, send: Callable[[Any], None]) -> WorkerResult:
    """The training loop. Every worker runs it in lockstep; rank 0 also reports progress."""
    plan, job = replica.plan, replica.job
    reporting = replica.rank == 0
    step = plan.start_step

    def beat(phase: str) -> None:
        job.heartbeats.beat(replica.rank, step, phase)

    measure_from = plan.measure_from
    timer = PhaseTimer(beat)
    profiler = Profiler(plan.profile_dir, measure_from, plan.profile_steps, replica.rank)
    eval_seconds, eval_metrics, loss, cpu_percent = 0.0, {}, float("nan"), []
    skipped, stopped_at, diverged_at, first_step_seconds = 0, None, None, 0.0
    started = last_log_time = time.perf_counter()
    last_log_step, last_log_phases = plan.start_step, dict(timer.seconds)
    cpu = CpuClock()
    for step in range(plan.start_step, plan.total_steps):
        if step == measure_from:  # warm-up over (if any): measure from here
            timer, eval_seconds = PhaseTimer(beat), 0.0
            last_log_phases = dict(timer.seconds)
            started = time.perf_counter()
            psutil.cpu_percent(percpu=True)  # starts the per-core utilisation interval
            cpu.start()
        profiler.before(step)
        step_started = time.perf_counter()
        phase_totals = replica.train_step(step, timer)
        if step == plan.start_step:
            first_step_seconds = time.perf_counter() - step_started
        profiler.after(step)
        losses = replica.losses(phase_totals)
        loss = losses[0]

        done = step + 1
        if not all(totals.finite for totals in phase_totals):  # every worker saw the same checks: they agree
            if plan.on_nan == "stop":
                diverged_at = done
                break
            skipped += 1
        stopping = job.stop.stops_after(done)  # a signal (or a callback) asked, and worker 0 decided
        if not stopping and reporting and plan.logs_after(done):
            now = time.perf_counter()
            steps = done - last_log_step
            phase_ms = {p: 1000 * (timer.seconds[p] - last_log_phases[p]) / steps for p in PHASES}
            named = {phase.phase.name: value for phase, value in zip(replica.phases, losses)} if len(losses) > 1 else {}
            send(Progress(done, done / plan.steps_per_epoch, loss, replica.lr_used,
                          plan.samples(last_log_step, done) / (now - last_log_time), phase_ms, named))
            last_log_step, last_log_time, last_log_phases = done, now, dict(timer.seconds)
        evaluated = None
        if not stopping and plan.evaluates_after(done):
            eval_started = time.perf_counter()
            eval_metrics = evaluated = replica.evaluate(job.eval_set, beat)
            if reporting:
                beat("sync")
                send(Evaluation(done, done / plan.steps_per_epoch, eval_metrics))
                job.stop.wait_for_acknowledgement(done)  # what the callbacks decide applies to this step
            replica.settle(done)
            eval_seconds += time.perf_counter() - eval_started
            last_log_time += time.perf_counter() - eval_started
            stopping = job.stop.stops_after(done)
        replica.scheduled_points(done, evaluated)
        if plan.checkpointing and (stopping or plan.checkpoint_due(done) or job.stop.saves_at(done)):
            beat("checkpoint")
            send(CheckpointPart(done, replica.state_part(done)))
        if stopping:
            stopped_at = done
            break
    train_seconds = time.perf_counter() - started - eval_seconds
    last = stopped_at or diverged_at or plan.total_steps
    if last > measure_from:
        cpu_percent = psutil.cpu_percent(percpu=True)  # per core, since the warm-up ended
    profiler.stop()
    return WorkerResult(replica.reducer.name, eval_metrics, pss_bytes=own_pss(), phase_seconds=timer.seconds,
                        measured_steps=last - measure_from, cpu_seconds=cpu.stop(), train_seconds=train_seconds,
                        eval_seconds=eval_seconds, final_loss=loss, cpu_percent_per_core=cpu_percent,
                        skipped_steps=skipped, stopped_at=stopped_at, diverged_at=diverged_at,
                        first_step_seconds=first_step_seconds)
