"""The public API: ``Trainer(...).fit(model, dataset)`` trains with W pinned worker processes."""
from __future__ import annotations

import functools
import io
import logging
import pickle
import signal
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from . import checkpoint
from .checkpoint import CheckpointDir
from .config import ConfigError, TrainerConfig
from .data.batching import check_sample, share_dataset
from .engine.cluster import Cluster
from .engine.comm import SHM_SAFE, ShmBuffers
from .engine.launch import WorkerFailed, launch
from .engine.signals import graceful_stop
from .engine.shared import FlatOrder, SharedParams
from .engine.topology import auto_workers, plan_pinning, read_topology
from .engine.worker import PHASES, STOP_REQUESTED, Job, StepPlan, WorkerSpec, run_worker
from .report.machine import bf16_supported
from .report.memory import PeakMemory

log = logging.getLogger(__name__)


@dataclass
class FitResult:
    """What a training run measured. Seconds per phase are averaged over the workers."""

    samples_per_sec: float
    per_worker_batch: float
    steps: int
    measured_steps: int  # the steps samples/s and phase seconds cover (after warm-up, or since a resume)
    final_loss: float
    workers: int
    threads: int
    batch_size: int
    train_seconds: float
    phase_seconds: dict[str, float]
    peak_memory_bytes: int
    eval_loss: float | None = None
    eval_accuracy: float | None = None
    history: list[dict[str, Any]] = field(default_factory=list)
    cpu_percent_per_core: list[float] = field(default_factory=list)  # system-wide, over the measured steps
    skipped_steps: int = 0  # updates left out for a non-finite loss or gradient (on_nan="skip")
    restarts: int = 0
    last_checkpoint: str | None = None
    channels_last: bool = False  # the layout the run used (channels_last=auto decides per model)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class TrainingInterrupted(RuntimeError):
    """SIGINT or SIGTERM stopped the run after a whole step; ``checkpoint`` resumes it."""

    def __init__(self, signum: int, step: int, checkpoint_path):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint_path
        where = f"checkpoint {checkpoint_path}" if checkpoint_path else "no checkpoint (set checkpoint_dir to keep one)"
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}; {where}")


class TrainingDiverged(RuntimeError):
    """The loss or the gradient became non-finite; no update was applied for that step."""

    def __init__(self, step: int):
        self.step = step
        super().__init__(f"loss or gradient became non-finite at step {step} (no update applied, no checkpoint "
                         "written); lower the learning rate, set clip_grad_norm, or use on_nan=skip")


class _TensorFreePickler(pickle.Pickler):
    """Pickles everything but tensors: enough to tell whether an object can reach a worker."""

    def persistent_id(self, obj):
        return id(obj) if isinstance(obj, (torch.Tensor, torch.UntypedStorage, torch.TypedStorage)) else None


def has_conv2d_weights(model: nn.Module) -> bool:
    """Whether channels_last=auto turns the layout on: the model has a trainable 4-d weight.

    For convolutions, oneDNN runs channels-last fastest on CPUs, and pooling over NCHW takes a
    slow path: LeNet and cifar10_quick step 1.6-1.7x faster on one core in fp32 on the
    development machine (scripts/layout.py).
    """
    return any(p.dim() == 4 for p in model.parameters() if p.requires_grad)


def _check_sendable(obj: Any, what: str) -> None:
    try:
        _TensorFreePickler(io.BytesIO(), protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    except Exception as exc:  # noqa: BLE001 - pickling fails in many ways; all mean the same here
        raise ConfigError(
            f"{what} cannot be sent to a worker process ({exc}); define its classes and functions "
            "at module level (no lambdas, local classes or open files)"
        ) from None


class Trainer:
    """Data-parallel training on one CPU node: W workers, one shared model, exact averaging.

    Example::

        trainer = Trainer(workers=2, threads=1, batch_size=64, epochs=1, seed=0)
        result = trainer.fit(model, train_set, eval_set=test_set,
                             optimizer=functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9))

    After ``fit`` returns, ``model`` holds the trained weights.
    """

    def __init__(self, cluster: Cluster | None = None, **settings: Any):
        """``settings`` are TrainerConfig's fields; ``cluster`` joins nodes under torchrun
        (``Cluster.from_env(os.environ)``), None trains on this node alone."""
        self.config = TrainerConfig(**settings)
        self.cluster = cluster
        self.topology = read_topology()
        threads = self.config.threads
        self.workers = (auto_workers(self.topology, threads) if self.config.workers == "auto"
                        else self.config.workers)
        nodes = cluster.nodes if cluster else 1
        if self.config.batch_size < self.workers * nodes:
            raise ConfigError(f"batch_size={self.config.batch_size} is smaller than workers={self.workers}"
                              f"{f' x {nodes} nodes' if nodes > 1 else ''}: every worker needs at least one "
                              "sample; raise batch_size or lower workers")
        self.precision = self.config.precision
        if self.precision == "bf16" and not bf16_supported():
            log.warning("precision=bf16 asked for, but this CPU has no native bfloat16 (avx512_bf16 or AMX); "
                        "training in fp32 instead, which is faster here than emulated bf16")
            self.precision = "fp32"
        self.comm = self.config.comm
        if self.comm == "shm" and not SHM_SAFE:
            log.warning("comm=shm relies on x86-64's store ordering; using gloo on this CPU instead")
            self.comm = "gloo"
        elif self.comm == "auto" and not SHM_SAFE:
            self.comm = "gloo"
        # Shared with the workers: the launcher sets STOP_REQUESTED on SIGINT/SIGTERM.
        self._control = torch.zeros(2, dtype=torch.int64).share_memory_()

    def fit(
        self,
        model: nn.Module,
        train_set: Dataset,
        eval_set: Dataset | None = None,
        optimizer: Callable[..., torch.optim.Optimizer] = functools.partial(torch.optim.SGD, lr=0.01),
        loss_fn: Callable[..., torch.Tensor] | None = None,
        scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
        on_log: Callable[[dict[str, Any]], None] | None = None,
        run_config: dict[str, Any] | None = None,
    ) -> FitResult:
        """Train ``model`` on ``train_set``; evaluate on ``eval_set`` after every epoch.

        Args:
            optimizer: called as ``optimizer(params)``; its update must be elementwise
                (SGD, Adam, AdamW, RMSprop...), as each worker steps only its shard.
            loss_fn: ``loss_fn(outputs, targets)`` giving the batch's mean loss; default
                cross-entropy.
            scheduler: called as ``scheduler(optimizer)``; stepped once per optimizer step.
            on_log: called here, in this process, with each progress record.
            run_config: plain data stored in every checkpoint (the CLI's resolved config).
        Raises:
            ConfigError: bad arguments or checkpoint, before any process starts.
            WorkerFailed: a worker raised or died (after max_restarts restarts); all workers
                are gone by then.
            TrainingInterrupted: SIGINT or SIGTERM; a checkpoint was written if configured.
            TrainingDiverged: a non-finite loss or gradient, with on_nan="stop".
        """
        cfg = self.config
        loss_fn = loss_fn if loss_fn is not None else nn.CrossEntropyLoss()
        check_sample(train_set, "train_set")
        if eval_set is not None:
            check_sample(eval_set, "eval_set")
        steps_per_epoch, total_steps = self.steps(len(train_set))
        if cfg.measure_after >= total_steps:
            raise ConfigError(f"measure_after={cfg.measure_after} leaves none of the {total_steps} steps to measure; "
                              "lower it or train longer")
        leader = self.cluster is None or self.cluster.is_leader  # only the global leader writes checkpoints
        directory = CheckpointDir(cfg.checkpoint_dir, cfg.checkpoint_keep) if cfg.checkpoint_dir and leader else None
        if directory is not None:
            directory.check_writable()
        resume_from = checkpoint.resolve(cfg.resume, cfg.checkpoint_dir) if cfg.resume else None
        if self.cluster is not None:
            self._agree_with_other_nodes()
            if resume_from is None and self.cluster.restart_count > 0 and cfg.checkpoint_dir:
                # torchrun restarted every node after a failure: all go on from the last checkpoint
                # in the (shared) checkpoint directory.
                resume_from = CheckpointDir(cfg.checkpoint_dir).latest()
        initial_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        history: list[dict[str, Any]] = []
        restarts = 0
        while True:
            saved = self._load_checkpoint(resume_from, model, total_steps) if resume_from else None
            plan = self._plan(model, total_steps, steps_per_epoch, evaluate_each_epoch=eval_set is not None,
                              start_step=saved["step"] if saved else 0, checkpointing=directory is not None)
            collector = (checkpoint.Collector(self.workers, sum(p.numel() for p in model.parameters() if p.requires_grad),
                                              directory, run_config, FlatOrder(model, plan.channels_last).to_contiguous)
                         if directory else None)

            def relay(rank: int, message: tuple) -> None:
                if message[0] == "progress":
                    history.append(message[1])
                    if on_log is not None:
                        on_log(message[1])
                elif message[0] == "checkpoint" and collector is not None:
                    path = collector.add(message[1], message[2])
                    if path is not None:
                        log.info("checkpoint: %s", path)

            try:
                with graceful_stop(self._control, STOP_REQUESTED) as received:
                    results, peak = self._run(model, train_set, eval_set, optimizer, scheduler, loss_fn, plan, relay,
                                              resume=saved)
                break
            except WorkerFailed as failure:
                if restarts >= cfg.max_restarts:
                    raise
                restarts += 1
                latest = directory.latest() if directory else None
                log.warning("%s\nrestart %d of %d, from %s", failure, restarts, cfg.max_restarts,
                            latest or resume_from or "the initial parameters")
                if latest is not None:
                    resume_from = latest
                elif resume_from is None:
                    model.load_state_dict(initial_state)
        lead = results[0]
        if lead["diverged_at"] is not None:
            raise TrainingDiverged(lead["diverged_at"])
        if lead["stopped_at"] is not None:
            raise TrainingInterrupted(received[0] if received else signal.SIGTERM, lead["stopped_at"],
                                      collector.last_saved if collector else None)
        samples = lead["measured_steps"] * cfg.batch_size * cfg.accumulate
        return FitResult(
            samples_per_sec=samples / lead["train_seconds"] if lead["train_seconds"] > 0 else 0.0,
            per_worker_batch=cfg.batch_size / (self.workers * (self.cluster.nodes if self.cluster else 1)),
            steps=total_steps,
            measured_steps=lead["measured_steps"],
            final_loss=lead["final_loss"],
            workers=self.workers,
            threads=cfg.threads,
            batch_size=cfg.batch_size,
            train_seconds=lead["train_seconds"],
            phase_seconds={p: sum(r["phase_seconds"][p] for r in results) / len(results) for p in PHASES},
            peak_memory_bytes=max(peak, sum(r["pss_bytes"] for r in results)),
            eval_loss=lead.get("eval_loss"),
            eval_accuracy=lead.get("eval_accuracy"),
            history=history,
            cpu_percent_per_core=lead["cpu_percent_per_core"],
            skipped_steps=lead["skipped_steps"],
            restarts=restarts,
            last_checkpoint=str(collector.last_saved) if collector and collector.last_saved else None,
            channels_last=plan.channels_last,
        )

    def steps(self, num_samples: int) -> tuple[int, int]:
        """Optimizer steps per epoch and in all, for a training set of ``num_samples``.

        Raises:
            ConfigError: the set is smaller than one step's batch.
        """
        cfg = self.config
        steps_per_epoch = num_samples // (cfg.batch_size * cfg.accumulate)
        if steps_per_epoch == 0:
            raise ConfigError(f"train_set has {num_samples} samples, fewer than one step's batch of "
                              f"batch_size x accumulate = {cfg.batch_size * cfg.accumulate}")
        return steps_per_epoch, cfg.max_steps if cfg.max_steps is not None else cfg.epochs * steps_per_epoch

    def _agree_with_other_nodes(self) -> None:
        """Every node must run the same number of workers: the shards and the batch split depend on it."""
        store = self.cluster.store("nodes")
        store.set(f"workers/{self.cluster.node_rank}", str(self.workers))
        for node in range(self.cluster.nodes):
            theirs = int(store.get(f"workers/{node}"))
            if theirs != self.workers:
                raise ConfigError(f"node {node} runs {theirs} workers, this node {self.workers}: every node needs "
                                  "the same workers=... (set it explicitly rather than auto)")

    def _load_checkpoint(self, path, model: nn.Module, total_steps: int) -> dict[str, Any]:
        saved = checkpoint.load(path)
        checkpoint.check_model(saved, model, path)
        if saved["step"] >= total_steps:
            raise ConfigError(f"{path} is at step {saved['step']}, and this run has {total_steps} steps: nothing "
                              "left to train; raise epochs or max_steps to go on")
        if len(saved["rng"]) != self.workers:
            log.warning("%s was written by %d workers, this run has %d: parameters and optimizer state resume "
                        "exactly, random streams (dropout, augmentation) do not", path, len(saved["rng"]),
                        self.workers)
        model.load_state_dict(saved["model"])
        log.info("resuming from %s (step %d)", path, saved["step"])
        return saved

    def evaluate(self, model: nn.Module, dataset: Dataset,
                 loss_fn: Callable[..., torch.Tensor] | None = None) -> dict[str, float]:
        """Exact mean loss (and accuracy, for class-index targets) of ``model`` over ``dataset``."""
        check_sample(dataset, "dataset")
        plan = self._plan(model, 0, 1, evaluate_only=True)
        loss_fn = loss_fn if loss_fn is not None else nn.CrossEntropyLoss()
        results, _ = self._run(model, None, dataset, None, None, loss_fn, plan, None)
        return results[0]

    def _plan(self, model: nn.Module, total_steps: int, steps_per_epoch: int, **flags: bool) -> StepPlan:
        cfg = self.config
        channels_last = cfg.channels_last if isinstance(cfg.channels_last, bool) else has_conv2d_weights(model)
        return StepPlan(batch_size=cfg.batch_size, accumulate=cfg.accumulate, total_steps=total_steps,
                        steps_per_epoch=steps_per_epoch, seed=cfg.seed, clip_grad_norm=cfg.clip_grad_norm,
                        comm=self.comm, reduce=cfg.reduce, bucket_kb=cfg.bucket_kb, precision=self.precision,
                        channels_last=channels_last, log_every=cfg.log_every, eval_batch_size=cfg.eval_batch_size,
                        measure_after=cfg.measure_after, profile_dir=cfg.profile_dir, profile_steps=cfg.profile_steps,
                        checkpoint_every_steps=cfg.checkpoint_every_steps,
                        checkpoint_every_epochs=cfg.checkpoint_every_epochs, on_nan=cfg.on_nan, **flags)

    def _run(self, model, train_set, eval_set, optimizer, scheduler, loss_fn, plan, relay, target=run_worker,
             resume=None):
        for obj, what in ((model, "the model"), (loss_fn, "loss_fn"), (optimizer, "the optimizer factory"),
                          (scheduler, "the scheduler factory"), (train_set, "train_set"), (eval_set, "eval_set")):
            _check_sendable(obj, what)
        pinning = plan_pinning(self.topology, self.workers, self.config.threads)
        self._control.zero_()
        rendezvous_dir = tempfile.mkdtemp(prefix="sn_trainer-")  # mode 0700, removed below
        shared = SharedParams(model, self.workers, channels_last=plan.channels_last)
        try:
            for dataset in (train_set, eval_set):
                if dataset is not None:
                    share_dataset(dataset)
            job = Job(model=model, flat=shared.flat, numel=shared.numel, train_set=train_set, eval_set=eval_set,
                      optimizer=optimizer, scheduler=scheduler, loss_fn=loss_fn, plan=plan,
                      losses=torch.zeros(2, self.workers, 2, dtype=torch.float64).share_memory_(),
                      shm=(ShmBuffers.allocate(self.workers, shared.flat.numel(), shared.flat.dtype)
                           if plan.comm in ("shm", "auto") and self.workers > 1 else None),
                      control=self._control, resume=resume)
            specs = [WorkerSpec(rank=r, world_size=self.workers, cpus=pinning[r], threads=self.config.threads,
                                store_path=f"{rendezvous_dir}/store", job=job, cluster=self.cluster)
                     for r in range(self.workers)]
            peak = PeakMemory()
            results = launch(target, specs, on_message=relay, on_tick=peak)
            return results, peak.peak_bytes
        finally:
            SharedParams.release(model)
            shutil.rmtree(rendezvous_dir, ignore_errors=True)
