"""The public API: ``Trainer(...).fit(model, dataset)`` trains with W pinned worker processes."""
from __future__ import annotations

import functools
import io
import logging
import pickle
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from .config import ConfigError, TrainerConfig
from .data.batching import check_sample, share_dataset
from .engine.comm import SHM_SAFE, ShmBuffers
from .engine.launch import launch
from .engine.shared import SharedParams
from .engine.topology import auto_workers, plan_pinning, read_topology
from .engine.worker import PHASES, Job, StepPlan, WorkerSpec, run_worker
from .report.machine import bf16_supported
from .report.memory import PeakMemory

log = logging.getLogger(__name__)


@dataclass
class FitResult:
    """What a training run measured. Seconds per phase are averaged over the workers."""

    samples_per_sec: float
    per_worker_batch: float
    steps: int
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

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class _TensorFreePickler(pickle.Pickler):
    """Pickles everything but tensors: enough to tell whether an object can reach a worker."""

    def persistent_id(self, obj):
        return id(obj) if isinstance(obj, (torch.Tensor, torch.UntypedStorage, torch.TypedStorage)) else None


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

    def __init__(self, **settings: Any):
        self.config = TrainerConfig(**settings)
        self.topology = read_topology()
        threads = self.config.threads
        self.workers = (auto_workers(self.topology, threads) if self.config.workers == "auto"
                        else self.config.workers)
        if self.config.batch_size < self.workers:
            raise ConfigError(f"batch_size={self.config.batch_size} is smaller than workers={self.workers}: "
                              "every worker needs at least one sample; raise batch_size or lower workers")
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

    def fit(
        self,
        model: nn.Module,
        train_set: Dataset,
        eval_set: Dataset | None = None,
        optimizer: Callable[..., torch.optim.Optimizer] = functools.partial(torch.optim.SGD, lr=0.01),
        loss_fn: Callable[..., torch.Tensor] | None = None,
        scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
        on_log: Callable[[dict[str, Any]], None] | None = None,
    ) -> FitResult:
        """Train ``model`` on ``train_set``; evaluate on ``eval_set`` after every epoch.

        Args:
            optimizer: called as ``optimizer(params)``; its update must be elementwise
                (SGD, Adam, AdamW, RMSprop...), as each worker steps only its shard.
            loss_fn: ``loss_fn(outputs, targets)`` giving the batch's mean loss; default
                cross-entropy.
            scheduler: called as ``scheduler(optimizer)``; stepped once per optimizer step.
            on_log: called here, in this process, with each progress record.
        Raises:
            ConfigError: bad arguments, before any process starts.
            WorkerFailed: a worker raised or died; all workers are gone by then.
        """
        cfg = self.config
        loss_fn = loss_fn if loss_fn is not None else nn.CrossEntropyLoss()
        check_sample(train_set, "train_set")
        if eval_set is not None:
            check_sample(eval_set, "eval_set")
        steps_per_epoch = len(train_set) // (cfg.batch_size * cfg.accumulate)
        if steps_per_epoch == 0:
            raise ConfigError(f"train_set has {len(train_set)} samples, fewer than one step's batch of "
                              f"batch_size x accumulate = {cfg.batch_size * cfg.accumulate}")
        total_steps = cfg.max_steps if cfg.max_steps is not None else cfg.epochs * steps_per_epoch
        if cfg.measure_after >= total_steps:
            raise ConfigError(f"measure_after={cfg.measure_after} leaves none of the {total_steps} steps to measure; "
                              "lower it or train longer")
        plan = self._plan(total_steps, steps_per_epoch, evaluate_each_epoch=eval_set is not None)
        history: list[dict[str, Any]] = []

        def relay(rank: int, record: dict[str, Any]) -> None:
            history.append(record)
            if on_log is not None:
                on_log(record)

        results, peak = self._run(model, train_set, eval_set, optimizer, scheduler, loss_fn, plan, relay)
        lead = results[0]
        samples = lead["measured_steps"] * cfg.batch_size * cfg.accumulate
        return FitResult(
            samples_per_sec=samples / lead["train_seconds"],
            per_worker_batch=cfg.batch_size / self.workers,
            steps=total_steps,
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
        )

    def evaluate(self, model: nn.Module, dataset: Dataset,
                 loss_fn: Callable[..., torch.Tensor] | None = None) -> dict[str, float]:
        """Exact mean loss (and accuracy, for class-index targets) of ``model`` over ``dataset``."""
        check_sample(dataset, "dataset")
        plan = self._plan(0, 1, evaluate_only=True)
        loss_fn = loss_fn if loss_fn is not None else nn.CrossEntropyLoss()
        results, _ = self._run(model, None, dataset, None, None, loss_fn, plan, None)
        return results[0]

    def _plan(self, total_steps: int, steps_per_epoch: int, **flags: bool) -> StepPlan:
        cfg = self.config
        return StepPlan(batch_size=cfg.batch_size, accumulate=cfg.accumulate, total_steps=total_steps,
                        steps_per_epoch=steps_per_epoch, seed=cfg.seed, clip_grad_norm=cfg.clip_grad_norm,
                        comm=self.comm, reduce=cfg.reduce, precision=self.precision,
                        channels_last=cfg.channels_last, log_every=cfg.log_every, eval_batch_size=cfg.eval_batch_size,
                        measure_after=cfg.measure_after, profile_dir=cfg.profile_dir, profile_steps=cfg.profile_steps,
                        **flags)

    def _run(self, model, train_set, eval_set, optimizer, scheduler, loss_fn, plan, relay, target=run_worker):
        for obj, what in ((model, "the model"), (loss_fn, "loss_fn"), (optimizer, "the optimizer factory"),
                          (scheduler, "the scheduler factory"), (train_set, "train_set"), (eval_set, "eval_set")):
            _check_sendable(obj, what)
        pinning = plan_pinning(self.topology, self.workers, self.config.threads)
        rendezvous_dir = tempfile.mkdtemp(prefix="sn_trainer-")  # mode 0700, removed below
        shared = SharedParams(model, self.workers, channels_last=plan.channels_last)
        try:
            for dataset in (train_set, eval_set):
                if dataset is not None:
                    share_dataset(dataset)
            job = Job(model=model, flat=shared.flat, numel=shared.numel, train_set=train_set, eval_set=eval_set,
                      optimizer=optimizer, scheduler=scheduler, loss_fn=loss_fn, plan=plan,
                      losses=torch.zeros(2, self.workers, dtype=torch.float64).share_memory_(),
                      shm=(ShmBuffers.allocate(self.workers, shared.flat.numel(), shared.flat.dtype)
                           if plan.comm in ("shm", "auto") and self.workers > 1 else None))
            specs = [WorkerSpec(rank=r, world_size=self.workers, cpus=pinning[r], threads=self.config.threads,
                                store_path=f"{rendezvous_dir}/store", job=job) for r in range(self.workers)]
            peak = PeakMemory()
            results = launch(target, specs, on_message=relay, on_tick=peak)
            return results, peak.peak_bytes
        finally:
            SharedParams.release(model)
            shutil.rmtree(rendezvous_dir, ignore_errors=True)
