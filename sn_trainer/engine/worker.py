"""What one worker process does: set itself up, then train its share of every global batch."""
from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import psutil
import torch
from torch import nn
from torch.utils.data import Dataset

from ..data.batching import fetch_batch
from ..data.sampler import GlobalBatches, slice_bounds
from ..checkpoint import shard_optimizer_state, worker_part
from ..report.memory import pss_bytes
from .cluster import Cluster
from .comm import CrossNodeReducer, ShmBuffers, make_reducer
from .shared import (FlatOrder, attach_gradients, bind_parameters, private_buffers, refresh_buffers, shard_bounds,
                     shard_parameter, trainable_parameters)

PHASES = ("data", "forward", "backward", "reduce", "update", "wait")
STOP_REQUESTED, STOP_AT = 0, 1  # slots of Job.control


@dataclass
class StepPlan:
    """What every worker needs to know to walk through the run in lockstep."""

    batch_size: int
    accumulate: int
    total_steps: int
    steps_per_epoch: int
    seed: int
    clip_grad_norm: float | None
    comm: str  # auto, shm or gloo
    reduce: str  # gloo's collective: all_reduce or reduce_scatter
    bucket_kb: int  # gloo all_reduce: sent in buckets of this size during the backward pass; 0: after it
    precision: str  # fp32 or bf16 (autocast; parameters and gradients stay fp32)
    channels_last: bool
    log_every: int
    eval_batch_size: int
    evaluate_each_epoch: bool = False  # and after the last step
    evaluate_only: bool = False
    measure_after: int = 0  # warm-up steps left out of samples/s and phase seconds
    start_step: int = 0  # > 0 when resuming
    checkpoint_every_steps: int | None = None
    checkpoint_every_epochs: int | None = None
    on_nan: str = "stop"  # or "skip": leave out the update of a step with a non-finite loss or gradient
    checkpointing: bool = False  # send checkpoint parts to the launcher (on schedule, at the end, on stop)
    profile_dir: str | None = None  # write a torch.profiler trace per worker here
    profile_steps: int = 3


@dataclass
class Job:
    """Everything the workers share. Tensors in it live in shared memory: pickling sends handles."""

    model: nn.Module
    flat: torch.Tensor
    numel: int
    train_set: Dataset | None
    eval_set: Dataset | None
    optimizer: Callable[..., torch.optim.Optimizer] | None
    scheduler: Callable[[torch.optim.Optimizer], Any] | None
    loss_fn: Callable[..., torch.Tensor]
    plan: StepPlan
    # [2, world, 2] float64, double-buffered by step parity: each worker's weighted loss and the
    # sum of its own gradient (non-finite if any element is), written before the reduce.
    losses: torch.Tensor
    control: torch.Tensor | None = None  # int64 [2]: STOP_REQUESTED (set by the launcher), STOP_AT
    shm: ShmBuffers | None = None  # for comm=shm or auto
    resume: dict[str, Any] | None = None  # optimizer, scheduler and RNG states of a checkpoint


@dataclass
class WorkerSpec:
    rank: int  # within the node
    world_size: int  # workers in the node
    cpus: tuple[int, ...]
    threads: int
    store_path: str
    job: Job
    cluster: Cluster | None = None  # several nodes under torchrun

    @property
    def global_rank(self) -> int:
        return (self.cluster.node_rank if self.cluster else 0) * self.world_size + self.rank

    @property
    def global_world_size(self) -> int:
        return (self.cluster.nodes if self.cluster else 1) * self.world_size


@dataclass
class PhaseTimer:
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))

    @contextmanager
    def __call__(self, phase: str):
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
        self.rank, self.world_size = spec.rank, spec.world_size
        self.job, self.plan = job, plan
        self.model = job.model
        bind_parameters(self.model, job.flat, plan.channels_last)
        self.buffer_links = private_buffers(self.model) if self.rank != 0 else []
        self.shard = shard_bounds(job.numel, spec.world_size)[spec.rank]
        self.reducer = make_reducer(plan.comm, spec.rank, spec.world_size, self.shard, job.flat.numel(),
                                    job.flat.dtype, spec.store_path, job.shm, plan.reduce)
        self.cluster = spec.cluster
        if spec.cluster is not None:
            self.reducer = CrossNodeReducer(self.reducer, spec.cluster.store(f"shard{spec.rank}"),
                                            spec.cluster.node_rank, spec.cluster.nodes, spec.cluster.device())
        self.global_rank, self.global_world_size = spec.global_rank, spec.global_world_size
        self.grad_flat = self.reducer.grad_flat
        attach_gradients(self.model, self.grad_flat, plan.channels_last)
        self.reducer.watch(trainable_parameters(self.model), plan.accumulate, plan.bucket_kb * 1024)
        self.shard_param = shard_parameter(job.flat, self.shard)
        self.optimizer = None
        self.scheduler = None
        if job.optimizer is not None and self.shard_param is not None:
            self.optimizer = job.optimizer([self.shard_param])
            if job.scheduler is not None:
                self.scheduler = job.scheduler(self.optimizer)
        if job.resume is not None:
            self.restore(job.resume)
        self.batches = None
        if job.train_set is not None:
            self.batches = GlobalBatches(len(job.train_set), plan.batch_size, plan.accumulate, plan.seed)
        # Every worker of every node takes its own slice of the same global batch.
        self.slice = slice_bounds(plan.batch_size, spec.global_world_size, spec.global_rank)
        # The share of the step's loss this worker carries: b_r / (B * accumulate). The sum of
        # the workers' gradients is then exactly the gradient of the step's mean loss.
        self.loss_weight = (self.slice[1] - self.slice[0]) / (plan.batch_size * plan.accumulate)

    def restore(self, saved: dict[str, Any]) -> None:
        """Continue from a checkpoint: this shard's optimizer state, the schedule, the RNG."""
        if self.optimizer is not None:
            order = FlatOrder(self.model, self.plan.channels_last)
            self.optimizer.load_state_dict(shard_optimizer_state(saved, self.shard.start, self.shard.stop, order.to_flat))
            if self.scheduler is not None and saved["scheduler"] is not None:
                self.scheduler.load_state_dict(saved["scheduler"])
        if len(saved["rng"]) == self.world_size and self.cluster is None:  # same workers: same random streams
            torch.set_rng_state(saved["rng"][self.rank])

    def checkpoint_part(self) -> bytes:
        return worker_part(self.rank, (self.shard.start, self.shard.stop), self.optimizer, self.scheduler,
                           self.model if self.rank == 0 else None)

    def micro_batch(self, epoch: int, step_in_epoch: int, micro: int):
        indices = self.batches.indices(epoch, step_in_epoch, micro)[self.slice[0] : self.slice[1]]
        return self.prepare(*fetch_batch(self.job.train_set, indices))

    def prepare(self, inputs, targets):
        if self.plan.channels_last and isinstance(inputs, torch.Tensor) and inputs.dim() == 4:
            inputs = inputs.contiguous(memory_format=torch.channels_last)
        return inputs, targets

    def forward(self, inputs):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.plan.precision == "bf16"):
            return self.model(inputs)

    def update(self, shard_grad: torch.Tensor) -> None:
        """Clip by the global norm, then step this shard's optimizer (and schedule)."""
        if self.plan.clip_grad_norm is not None:
            sq = torch.zeros(1, dtype=torch.float64)
            sq += shard_grad.double().pow(2).sum() if shard_grad.numel() else 0.0
            total_norm = math.sqrt(self.reducer.sum_in_node(sq).item())  # every node holds all shards
            coef = self.plan.clip_grad_norm / (total_norm + 1e-6)
            if coef < 1.0:
                shard_grad.mul_(coef)
        if self.optimizer is not None:
            self.shard_param.grad = shard_grad
            self.optimizer.step()
            if self.scheduler is not None:
                self.scheduler.step()

    def publish(self, step: int, weighted_loss: float) -> None:
        """Put this worker's loss and gradient check where its peers read them after the reduce."""
        # One sum over the local gradient: inf or nan anywhere in it makes the sum non-finite
        # (as does a sum beyond float32's range, which is divergence too).
        self.job.losses[step % 2, self.rank] = torch.tensor([weighted_loss, self.reducer.local_sum()])

    def outcome(self, step: int) -> tuple[float, bool]:
        """The global batch's mean loss, and whether it and every worker's gradient are finite.

        Read after the reduce: every worker of the node has published by then, and a peer
        writes this parity again only after the next step's reduce, so all read the same.
        Checking the workers' own gradients here, rather than the summed shards afterwards,
        spares the step a round of synchronisation.
        """
        published = self.job.losses[step % 2]
        totals = torch.tensor([published[:, 0].sum().item(), float((~torch.isfinite(published)).sum())],
                              dtype=torch.float64)
        if self.cluster is not None:  # add the other nodes' losses and non-finite counts
            totals = self.reducer.sum_across_nodes(totals)
        loss, non_finite = totals.tolist()
        return loss, non_finite == 0 and math.isfinite(loss)

    def current_lr(self) -> float | None:
        if self.optimizer is None:
            return None
        return float(self.optimizer.param_groups[0]["lr"])

    @torch.no_grad()
    def evaluate(self, dataset: Dataset) -> dict[str, float]:
        """Exact loss and accuracy over the whole of ``dataset``, each worker taking a slice."""
        self.model.eval()
        refresh_buffers(self.buffer_links)
        start, stop = slice_bounds(len(dataset), self.global_world_size, self.global_rank)
        per_item = getattr(self.job.loss_fn, "reduction", "mean") == "mean"
        totals = torch.zeros(4, dtype=torch.float64)  # loss sum, correct, samples, classified
        for lo in range(start, stop, self.plan.eval_batch_size):
            indices = torch.arange(lo, min(lo + self.plan.eval_batch_size, stop))
            inputs, targets = self.prepare(*fetch_batch(dataset, indices))
            outputs = self.forward(inputs).float()
            loss = float(self.job.loss_fn(outputs, targets))
            totals[0] += loss * len(indices) if per_item else loss
            totals[2] += len(indices)
            if outputs.dim() == 2 and not targets.is_floating_point():
                totals[1] += (outputs.argmax(dim=1) == targets).sum().item()
                totals[3] += len(indices)
        self.reducer.sum_across_nodes(self.reducer.sum_in_node(totals))
        self.model.train()
        result = {"eval_loss": totals[0].item() / totals[2].item(), "eval_samples": int(totals[2].item())}
        if totals[3] > 0:
            result["eval_accuracy"] = totals[1].item() / totals[3].item()
        return result

    def close(self) -> None:
        self.reducer.close()


def run_worker(spec: WorkerSpec, send: Callable[[Any], None]) -> dict[str, Any]:
    """The worker's whole life: set up, train (and/or evaluate), return what it measured."""
    pin_and_set_threads(spec.cpus, spec.threads)
    torch.manual_seed(spec.job.plan.seed * 1000 + spec.global_rank)
    replica = Replica(spec)
    try:
        if spec.job.plan.evaluate_only:
            return replica.evaluate(spec.job.eval_set)
        return train(replica, send)
    finally:
        replica.close()


def train_step(replica: Replica, timer: PhaseTimer, step: int) -> tuple[float, bool]:
    """One optimizer step, in every worker at once.

    Returns:
        The global batch's mean loss, and whether loss and gradient were finite (when not,
        the update was left out).
    """
    plan, job = replica.plan, replica.job
    epoch, step_in_epoch = divmod(step, plan.steps_per_epoch)
    weighted_loss = 0.0
    # Cleared here, not after the update: with comm=shm, peers read this buffer until the
    # previous step's closing barrier.
    replica.grad_flat.zero_()
    for micro in range(plan.accumulate):
        with timer("data"):
            inputs, targets = replica.micro_batch(epoch, step_in_epoch, micro)
        with timer("forward"):
            micro_loss = job.loss_fn(replica.forward(inputs).float(), targets) * replica.loss_weight
        with timer("backward"):
            micro_loss.backward()
        weighted_loss += micro_loss.item()
    with timer("reduce"):
        replica.publish(step, weighted_loss)
        shard_grad = replica.reducer.reduce()
    loss, finite = replica.outcome(step)
    with timer("update"):
        if finite:
            replica.update(shard_grad)
    if replica.rank == 0 and job.control[STOP_REQUESTED]:
        job.control[STOP_AT] = step + 1  # published before the barrier: all workers stop together
    with timer("wait"):
        replica.reducer.barrier()  # nobody reads parameters that are still being written
    return loss, finite


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


def train(replica: Replica, send: Callable[[Any], None]) -> dict[str, Any]:
    """The training loop. Every worker runs it in lockstep; rank 0 also reports progress."""
    plan, job = replica.plan, replica.job
    reporting = replica.rank == 0
    step_samples = plan.batch_size * plan.accumulate
    measure_from = max(plan.measure_after, plan.start_step)
    timer = PhaseTimer()
    profiler = Profiler(plan.profile_dir, measure_from, plan.profile_steps, replica.rank)
    eval_seconds, eval_metrics, loss, cpu_percent = 0.0, {}, float("nan"), []
    skipped, stopped_at, diverged_at = 0, None, None
    started = last_log_time = time.perf_counter()
    last_log_step = plan.start_step
    replica.model.train()
    for step in range(plan.start_step, plan.total_steps):
        if step == measure_from:  # warm-up over (if any): measure from here
            timer, eval_seconds = PhaseTimer(), 0.0
            started = time.perf_counter()
            psutil.cpu_percent(percpu=True)  # starts the per-core utilisation interval
        profiler.before(step)
        loss, finite = train_step(replica, timer, step)
        profiler.after(step)

        done = step + 1
        if not finite:  # every worker saw the same loss and gradient check: they agree
            if plan.on_nan == "stop":
                diverged_at = done
                break
            skipped += 1
        end_of_epoch = done % plan.steps_per_epoch == 0
        stopping = int(job.control[STOP_AT]) == done
        if plan.checkpointing and (stopping or checkpoint_due(plan, done, end_of_epoch)):
            send(("checkpoint", done, replica.checkpoint_part()))
        if stopping:
            stopped_at = done
            break
        if reporting and (done % plan.log_every == 0 or end_of_epoch or done == plan.total_steps):
            now = time.perf_counter()
            send(("progress", {"step": done, "epoch": done / plan.steps_per_epoch, "loss": loss,
                               "lr": replica.current_lr(),
                               "samples_per_sec": (done - last_log_step) * step_samples / (now - last_log_time)}))
            last_log_step, last_log_time = done, now
        if plan.evaluate_each_epoch and (end_of_epoch or done == plan.total_steps):
            eval_started = time.perf_counter()
            eval_metrics = replica.evaluate(job.eval_set)
            eval_seconds += time.perf_counter() - eval_started
            last_log_time += time.perf_counter() - eval_started
            if reporting:
                send(("progress", {"step": done, "epoch": done / plan.steps_per_epoch, **eval_metrics}))
    train_seconds = time.perf_counter() - started - eval_seconds
    last = stopped_at or diverged_at or plan.total_steps
    if last > measure_from:
        cpu_percent = psutil.cpu_percent(percpu=True)  # per core, since the warm-up ended
    profiler.stop()
    return {"pss_bytes": pss_bytes(), "phase_seconds": timer.seconds, "measured_steps": last - measure_from,
            "train_seconds": train_seconds, "eval_seconds": eval_seconds, "final_loss": loss,
            "cpu_percent_per_core": cpu_percent, "skipped_steps": skipped, "stopped_at": stopped_at,
            "diverged_at": diverged_at, **eval_metrics}


def checkpoint_due(plan: StepPlan, done: int, end_of_epoch: bool) -> bool:
    if plan.checkpoint_every_steps and done % plan.checkpoint_every_steps == 0:
        return True
    if plan.checkpoint_every_epochs and end_of_epoch and (done // plan.steps_per_epoch) % plan.checkpoint_every_epochs == 0:
        return True
    return done == plan.total_steps
