"""The resolved plan of a run: every setting decided once, by the Trainer, and read as is below it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .runtime import Runtime


@dataclass(frozen=True)
class Placement:
    """Where the workers run and how they talk; decided when the Trainer is built."""

    workers: int  # on this node
    threads: int
    pinning: tuple[tuple[int, ...], ...]  # logical CPUs of each worker
    nodes: int = 1
    node_rank: int = 0
    comm: str = "local"  # local (one worker), shm, gloo, or auto (measured by the workers at start-up)
    reduce: str = "all_reduce"
    bucket_kb: int = 256
    precision: str = "fp32"  # what runs, after any fallback
    allocator: str = "system"  # the workers' memory allocator
    openmp: str = "gnu"  # the workers' OpenMP runtime
    start_method: str = "forkserver"  # what starts the workers: warm (fork server) or spawn
    notes: tuple[str, ...] = ()  # what was asked for but could not be had here, and what ran instead

    @property
    def runtime(self) -> Runtime:
        return Runtime(self.allocator, self.openmp)

    @property
    def global_workers(self) -> int:
        return self.workers * self.nodes


@dataclass(frozen=True)
class Plan:
    """Everything every worker needs to walk through the run in lockstep."""

    placement: Placement
    batch_size: int
    accumulate: int
    seed: int
    drop_last: bool
    dataset_size: int | None  # samples per epoch (None: a stream without a length, one epoch of total_steps)
    steps_per_epoch: int
    total_steps: int
    start_step: int = 0  # > 0 when resuming
    clip_grad_norm: float | None = None
    on_nan: str = "stop"  # or "skip": leave out the update of a step with a non-finite loss or gradient
    channels_last: bool = False
    shards: str = "elements"  # or "tensors": whole parameters per worker
    sync_batchnorm: bool = False
    ema_decay: float | None = None  # a moving average of the parameters, each worker averaging its shard
    loss_form: str = "mean"  # how a scalar loss splits over samples (engine.objective's forms)
    phases: tuple[tuple[str, str], ...] = ()  # with several phases: each one's name and loss form
    log_every: int = 100
    eval_batch_size: int = 512
    evaluates: bool = False  # after each epoch (or every eval_every steps) and after the last step
    eval_every: int | None = None
    max_eval_batches: int | None = None  # evaluation covers the first max_eval_batches x eval_batch_size samples
    evaluate_only: bool = False
    measure_after: int = 0  # warm-up steps left out of samples/s and phase seconds
    checkpointing: bool = False  # send state to the launcher (on schedule, at the end, on stop)
    checkpoint_every_steps: int | None = None
    checkpoint_every_epochs: int | None = None
    profile_dir: str | None = None
    profile_steps: int = 3
    worker_timeout: float = 300.0
    compile: bool = False  # torch.compile the model in each worker
    prefetch: bool = False  # read the next step's slice in a thread while this step computes
    data: str = "map-style"  # or "stream": how the training set is read
    notes: tuple[str, ...] = field(default=())

    @property
    def step_batch(self) -> int:
        """Samples one optimizer step trains on (the last step of an epoch may have fewer)."""
        return self.batch_size * self.accumulate

    def samples(self, first: int, last: int) -> int:
        """Samples trained by steps [first, last): an epoch's last step may be short (drop_last=false)."""
        total = (last - first) * self.step_batch
        if not self.drop_last and self.dataset_size is not None:
            short = self.steps_per_epoch * self.step_batch - self.dataset_size
            total -= short * (last // self.steps_per_epoch - first // self.steps_per_epoch)
        return total

    @property
    def measure_from(self) -> int:
        """The first step samples/s and phase seconds cover: after the warm-up, and after the
        first step of a launch (resumed or not) where that step compiles the model."""
        compiling = self.compile and self.start_step + 1 < self.total_steps
        return max(self.measure_after, self.start_step + (1 if compiling else 0))

    @property
    def per_worker_batch(self) -> float:
        return self.batch_size / self.placement.global_workers

    def logs_after(self, done: int) -> bool:
        """Whether worker 0 reports progress after step ``done``."""
        return done % self.log_every == 0 or done % self.steps_per_epoch == 0 or done == self.total_steps

    def evaluates_after(self, done: int) -> bool:
        """Whether the workers evaluate after step ``done``: every ``eval_every`` steps, or at each
        epoch's end, and after the last step."""
        if not self.evaluates:
            return False
        due = done % self.eval_every == 0 if self.eval_every else done % self.steps_per_epoch == 0
        return due or done == self.total_steps

    def checkpoint_due(self, done: int) -> bool:
        end_of_epoch = done % self.steps_per_epoch == 0
        if self.checkpoint_every_steps and done % self.checkpoint_every_steps == 0:
            return True
        if self.checkpoint_every_epochs and end_of_epoch and \
                (done // self.steps_per_epoch) % self.checkpoint_every_epochs == 0:
            return True
        return done == self.total_steps

    def summary(self, comm_used: str | None = None) -> dict[str, Any]:
        """What the run used, for FitResult and summary.json."""
        p = self.placement
        return {"workers": p.workers, "threads": p.threads, "nodes": p.nodes, "pinning": [list(c) for c in p.pinning],
                "comm": comm_used or p.comm, "reduce": p.reduce, "precision": p.precision, "allocator": p.allocator,
                "openmp": p.openmp, "start_method": p.start_method,
                "channels_last": self.channels_last, "shards": self.shards, "sync_batchnorm": self.sync_batchnorm,
                "ema_decay": self.ema_decay, "loss_form": self.loss_form,
                "phases": [{"name": name, "loss_form": form} for name, form in self.phases],
                "batch_size": self.batch_size, "accumulate": self.accumulate, "per_worker_batch": self.per_worker_batch,
                "drop_last": self.drop_last, "data": self.data, "prefetch": self.prefetch, "compile": self.compile,
                "steps_per_epoch": self.steps_per_epoch, "total_steps": self.total_steps,
                "start_step": self.start_step, "notes": [*p.notes, *self.notes]}

