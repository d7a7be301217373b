"""The public API: ``Trainer(...).fit(model, dataset)`` trains with W pinned worker processes.

The Trainer resolves every setting once into a frozen ``Plan`` (workers, pinning, reducer,
precision, layout, shards, steps), checks the user's code on one micro-batch, starts the
workers, writes their checkpoints, restarts them after a failure, and reports what ran.
"""
from __future__ import annotations

import functools
import io
import logging
import math
import os
import pickle
import shutil
import tempfile
import time
from collections.abc import Callable
import dataclasses
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch
from torch import nn
from torch.utils.data import Dataset

from . import checkpoint, preflight, tune
from .callbacks import Callback, Callbacks, History, NotebookBar, OnLog, in_notebook
from .checkpoint import CheckpointDir
from .config import TrainerConfig
from .data.batching import share_dataset
from .data.sampler import slice_bounds, steps_per_epoch
from .data.source import Batching, IndexSource, StreamSource, make_source
from .engine import random_state, state
from .engine.batchnorm import max_channels
from .engine.board import Board
from .engine.cluster import Cluster
from .engine.events import CheckpointPart, Evaluation, WorkerResult
from .engine.comm import SHM_SAFE, ShmBuffers
from .engine.launch import Heartbeats, JobPickler, Watchdog, launch, starts_warm, unpack, warm_up
from .engine.layout import FlatLayout, tied_aliases, trainable_parameters
from .engine.objective import MEAN, Objective
from .engine.phases import JobPhase
from .engine.plan import Placement, Plan
from .engine.runtime import Runtime, available_allocators, available_openmps
from .engine.shared import SharedParams, buffer_count
from .engine.signals import StopFlags, graceful_stop
from .engine.topology import auto_workers, plan_pinning, read_topology
from .engine.worker import PHASES, Job, WorkerSpec, run_worker
from .errors import CheckpointError, ConfigError, TrainingDiverged, TrainingInterrupted, UserCodeError, WorkerFailed
from .optim import resolve_groups, shard_kind
from .phase import Phase
from .report.machine import bf16_supported
from .report.memory import PeakMemory

log = logging.getLogger(__name__)

RUN_FACTS = ("batch_size", "accumulate", "seed", "drop_last", "dataset_size")  # a resume must agree with them


@dataclass
class FitResult:
    """What a training run measured and what it ran with. Seconds per phase are averaged over the workers."""

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
    eval_metrics: dict[str, float] = field(default_factory=dict)  # every eval_* the last evaluation gave
    eval_error: str | None = None  # evaluation failed (the training is kept); its traceback
    history: list[dict[str, Any]] = field(default_factory=list)
    cpu_percent_per_core: list[float] = field(default_factory=list)  # system-wide, over the measured steps
    skipped_steps: int = 0  # updates left out for a non-finite loss or gradient (on_nan="skip")
    restarts: int = 0
    last_checkpoint: str | None = None
    channels_last: bool = False  # the layout the run used (channels_last=auto decides per model)
    other_cpu_percent: float | None = None  # other processes' share of the machine's CPU over the measured steps
    comm: str = "local"  # the reducer that ran (comm=auto decides at start-up)
    precision: str = "fp32"  # what ran (bf16 falls back to fp32 where the CPU has no native bf16)
    plan: dict[str, Any] = field(default_factory=dict)  # everything the run was resolved to
    stopped_early: int | None = None  # a callback stopped the run after this step (trainer.should_stop)
    ema_state_dict: dict[str, Any] | None = None  # with ema_decay: the model's state_dict, averaged weights
    compile_seconds: float | None = None  # with compile: the first step's time beyond a measured step's (compiling)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def save(self, folder: str | os.PathLike) -> list[Path]:
        """Write the trained weights as ``folder/model.safetensors`` (and, with ema_decay, the moving
        average's as ``folder/model_ema.safetensors``), each tied weight once; load them with
        ``safetensors.torch.load_model(model, path)``.

        Raises:
            ImportError: safetensors is not installed (``pip install sn_trainer[safetensors]``).
        """
        from .export import EMA_WEIGHTS, WEIGHTS, save_weights

        model = self._model
        tied = tied_aliases(model)
        written = [save_weights(model.state_dict(), tied, Path(folder) / WEIGHTS)]
        if self.ema_state_dict is not None:
            written.append(save_weights(self.ema_state_dict, tied, Path(folder) / EMA_WEIGHTS))
        return written


class _TensorFreePickler(JobPickler):
    """Pickles everything but tensors, as a job is pickled: enough to tell whether an object can
    reach a worker (lambdas, local functions and what a notebook defines can)."""

    def persistent_id(self, obj):
        return id(obj) if isinstance(obj, (torch.Tensor, torch.UntypedStorage, torch.TypedStorage)) else None


def _check_sendable(obj: Any, what: str) -> None:
    try:
        _TensorFreePickler(io.BytesIO(), protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    except Exception as exc:  # noqa: BLE001 - pickling fails in many ways; all mean the same here
        raise ConfigError(
            f"{what} cannot be sent to a worker process ({exc}); it holds something no process can receive "
            "(an open file, a lock, a generator, a socket): create it in the worker, e.g. lazily on first use"
        ) from None


def channels_last_helps(model: nn.Module) -> bool:
    """``channels_last=auto``: on for models with convolution (4-d) weights and no batch norm.

    oneDNN runs channels-last convolutions and pooling fastest on CPUs (results/.../layout.md);
    with batch norm the measured gain does not pay for its less accurate reductions there
    (results/.../batchnorm_layout.md).
    """
    has_conv = any(p.dim() == 4 for p in model.parameters() if p.requires_grad)
    has_bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    return has_conv and not has_bn


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
        (``Cluster.from_env(os.environ)``), None trains on this node alone.

        Raises:
            ConfigError: a bad setting, before anything starts.
        """
        self.config = TrainerConfig(**settings)
        self.cluster = cluster
        self.topology = read_topology()
        self.placement = self._place()
        if "auto" not in (self.config.allocator, self.config.openmp):  # auto is known at fit: the server starts then
            warm_up(self.config.start_method, self.placement.runtime)  # it imports torch while this process goes on
        # Shared with the workers for all of this Trainer's runs: a stop request outlives restarts.
        self._stop = StopFlags.allocate()

    @classmethod
    def from_config(cls, config: TrainerConfig, cluster: Cluster | None = None) -> "Trainer":
        return cls(cluster=cluster, **asdict(config))

    @property
    def workers(self) -> int:
        return self.placement.workers

    def _place(self, tuned: dict[str, Any] | None = None) -> Placement:
        """Workers, pinning, the reducer, precision and runtime this machine gives for the settings
        (``tuned``: the cached choice for this model, where workers, allocator or openmp are auto)."""
        cfg, nodes = self.config, self.cluster.nodes if self.cluster else 1
        threads = tuned["threads"] if tuned and cfg.workers == "auto" else cfg.threads
        workers = (tuned["workers"] if tuned else auto_workers(self.topology, threads)) if cfg.workers == "auto" \
            else cfg.workers
        if cfg.batch_size < workers * nodes:
            raise ConfigError(f"batch_size={cfg.batch_size} is smaller than workers={workers}"
                              f"{f' x {nodes} nodes' if nodes > 1 else ''}: every worker needs at least one "
                              "sample; raise batch_size or lower workers")
        notes = []
        precision = cfg.precision
        if precision == "bf16" and not bf16_supported():
            notes.append("precision=bf16 asked for, fp32 ran: this CPU has no native bfloat16 (avx512_bf16 or AMX), "
                         "and emulated bf16 is slower here than fp32")
            precision = "fp32"
        comm = cfg.comm
        if workers == 1:
            comm = "local"
        elif comm in ("shm", "auto") and not SHM_SAFE:
            if comm == "shm":
                notes.append("comm=shm asked for, gloo ran: the shared-memory barrier relies on x86-64's store order")
            comm = "gloo"
        runtime = Runtime(cfg.allocator if cfg.allocator != "auto" else (tuned or {}).get("allocator", "system"),
                          cfg.openmp if cfg.openmp != "auto" else (tuned or {}).get("openmp", "gnu"))
        runtime.libraries()  # installed, or say how to install them
        start_method = cfg.start_method
        if start_method == "forkserver" and not starts_warm(start_method, runtime):
            notes.append(f"{runtime}: this process's warm workers run another allocator or OpenMP, so these "
                         "workers were spawned (cold) with it")
            start_method = "spawn"
        for note in notes:
            log.warning(note)
        return Placement(workers=workers, threads=threads, pinning=tuple(plan_pinning(self.topology, workers, threads)),
                         nodes=nodes, node_rank=self.cluster.node_rank if self.cluster else 0, comm=comm,
                         reduce=cfg.reduce, bucket_kb=cfg.bucket_kb, precision=precision, allocator=runtime.allocator,
                         openmp=runtime.openmp,
                         start_method=start_method, notes=tuple(notes))

    def _tune_key(self, model: nn.Module) -> str:
        """Where tuning caches its choice for this model at this batch, accumulation and precision."""
        cfg = self.config
        return tune.cache_key(model, cfg.batch_size, cfg.accumulate, cfg.precision)

    def _place_for(self, model: nn.Module) -> Placement:
        """With workers or the runtime auto, what tuning cached for this model and batch, if anything."""
        cfg = self.config
        autos = [name for name in ("workers", "allocator", "openmp") if getattr(cfg, name) == "auto"]
        if not autos or self.cluster is not None:
            return self.placement
        entry = tune.load(self._tune_key(model))
        if entry is None:
            return self._place() if autos != ["workers"] else self.placement
        log.info("%s: the tuned setting measured %s (%.0f samples/s): %d workers x %d threads, %s (%s)",
                 ", ".join(f"{name}=auto" for name in autos), entry["measured_at"], entry["samples_per_sec"],
                 entry["workers"], entry["threads"], Runtime(entry["allocator"], entry["openmp"]), tune.cache_path())
        return self._place(entry)

    def tune(self, model: nn.Module, train_set: Dataset, optimizer=None, loss_fn=None, step_fn=None,
             param_groups=None, steps: int = 12, warmup: int = 3, window_s: float = 3.0, top: int = 3,
             allocators: list[str] | None = None, openmps: list[str] | None = None,
             cache: bool = True) -> "tune.TuneResult":
        """Measure which workers x threads (and runtime) trains ``model`` fastest at this batch here.

        A cost model is calibrated with a few short fits (one worker at two batch sizes, one per
        thread count, two workers), predicts every candidate, and the best ``top`` are measured
        with short real fits; then the runtimes at the winner: each of ``allocators``, then each
        of ``openmps`` with the fastest allocator (default: those installed), then the fastest
        runtime at the runner-up, when it is not the default. The global batch
        stays as set. Each measurement times at least ``steps`` steps and about ``window_s``
        seconds of them, after ``warmup``. The choice is cached for ``workers=auto`` (and
        ``allocator=auto``, ``openmp=auto``).
        """
        import copy

        cfg, started = self.config, time.monotonic()
        allocators = allocators if allocators is not None else available_allocators()
        openmps = openmps if openmps is not None else available_openmps()

        step_seconds: list[float] = []  # of the measurements so far: the next one's steps fill window_s

        def measure(workers: int, threads: int, batch: int, runtime: Runtime,
                    compiled: bool = False) -> tuple[float, float]:
            # A runtime other than the warm workers' is measured with spawned workers, as it would run.
            start_method = cfg.start_method if starts_warm(cfg.start_method, runtime) else "spawn"
            timed = max(steps, math.ceil(window_s / min(step_seconds))) if step_seconds else steps
            trainer = Trainer(**{**asdict(cfg), "workers": workers, "threads": threads, "batch_size": batch,
                                 "allocator": runtime.allocator, "openmp": runtime.openmp,
                                 "start_method": start_method, "max_steps": warmup + timed, "measure_after": warmup,
                                 "checkpoint_dir": None, "resume": None, "log_every": 10**9, "compile": compiled})
            result = trainer.fit(copy.deepcopy(model), train_set, optimizer=optimizer, loss_fn=loss_fn,
                                 step_fn=step_fn, param_groups=param_groups)
            log.info("tune: %d workers x %d threads, batch %d, %s%s: %.0f samples/s", workers, threads, batch,
                     runtime, ", compiled" if compiled else "", result.samples_per_sec)
            step_seconds.append(result.train_seconds / result.measured_steps)
            return result.samples_per_sec, step_seconds[-1]

        calibration, rows, by_runtime = tune.search(measure, self.topology.usable_cores, cfg.batch_size,
                                                    allocators, openmps, top)
        workers, threads, runtime, rate = tune.winner(rows, by_runtime)
        compiled = {}
        if cfg.compile == "auto":  # the winner compiled, against eager (its compile falls in the warm-up)
            compiled = {"eager": rate, "compiled": measure(workers, threads, cfg.batch_size, runtime, True)[0]}
        result = tune.TuneResult(workers, threads, runtime.allocator, rate, rows, calibration,
                                 time.monotonic() - started, openmp=runtime.openmp,
                                 runtimes={str(r): speed for r, speed in by_runtime.items()},
                                 compile_rates=compiled)
        if cache:
            path = tune.store(self._tune_key(model), result)
            log.info("tune: cached in %s for workers=auto", path)
        return result

    def steps(self, num_samples: int) -> tuple[int, int]:
        """Optimizer steps per epoch and in all, for a training set of ``num_samples``.

        Raises:
            ConfigError: the set is smaller than one step's batch (with drop_last).
        """
        cfg = self.config
        per_epoch = steps_per_epoch(num_samples, cfg.batch_size, cfg.accumulate, cfg.drop_last)
        if per_epoch == 0:
            raise ConfigError(f"train_set has {num_samples} samples, fewer than one step's batch of "
                              f"batch_size x accumulate = {cfg.batch_size * cfg.accumulate}; lower batch_size "
                              "or set drop_last=false")
        return per_epoch, cfg.max_steps if cfg.max_steps is not None else cfg.epochs * per_epoch

    def _steps_of(self, source: IndexSource | StreamSource) -> tuple[int, int]:
        """``steps`` for a source; a stream without a length is one epoch of max_steps steps.

        Raises:
            ConfigError: a stream without a length and no max_steps.
        """
        if source.size is not None:
            return self.steps(source.size)
        if self.config.max_steps is None:
            raise ConfigError("train_set is a stream without a length (no __len__): set max_steps=..., the number of "
                              "optimizer steps to train; epochs need a length")
        return self.config.max_steps, self.config.max_steps

    # --- fit -----------------------------------------------------------------------------------

    def fit(
        self,
        model: nn.Module,
        train_set: Dataset,
        eval_set: Dataset | None = None,
        optimizer: Callable[..., torch.optim.Optimizer] | None = None,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
        on_log: Callable[[dict[str, Any]], None] | None = None,
        run_config: dict[str, Any] | None = None,
        step_fn: Callable[[nn.Module, Any], Any] | None = None,
        metric_fn: Callable[[nn.Module, Any], dict[str, Any]] | None = None,
        param_groups: Callable[[nn.Module], Any] | None = None,
        callbacks: list[Callback] | None = None,
        phases: list[Phase] | None = None,
        collate_fn: Callable[[list], Any] | None = None,
        eval_collate_fn: Callable[[list], Any] | None = None,
    ) -> FitResult:
        """Train ``model`` on ``train_set``; evaluate on ``eval_set`` after every epoch.

        Args:
            optimizer: called as ``optimizer(params)`` with a list of tensors, or with groups
                (``param_groups``); default SGD(lr=0.01), or the class of the optimizer
                ``param_groups`` returned.
            loss_fn: ``loss_fn(model(inputs), targets)`` for (inputs, targets) batches; default
                cross-entropy. Without loss_fn and step_fn, dict batches are the model's
                keyword arguments and its output's ``loss`` is trained on (Hugging Face models).
            scheduler: called as ``scheduler(optimizer)``; stepped once per optimizer step.
            on_log: called here, in this process, with each progress record.
            run_config: plain data stored in every checkpoint (the CLI's resolved config); a
                resume refuses a checkpoint whose model or dataset name differs from it.
            step_fn: ``step_fn(model, batch)`` returning the loss (a per-sample mean or a sum,
                measured before workers start) or ``(loss_sum, count)``; ``batch`` is what the
                dataset yields, collated.
            metric_fn: ``metric_fn(model, batch)`` returning ``{name: value or (sum, count)}``,
                reported as ``eval_<name>``.
            param_groups: ``param_groups(model)`` returning torch.optim groups (or an
                optimizer built from them); called here, once.
            callbacks: ``sn_trainer.Callback`` objects, called here as the run's events arrive;
                one may end the run early (``trainer.should_stop = True``).
            phases: ``sn_trainer.Phase`` objects, each with its step function, parameters,
                optimizer and scheduler, updated in turn every step (a GAN's D, then G); instead
                of loss_fn/step_fn, param_groups, optimizer and scheduler. Evaluation computes the
                first phase's loss and metric_fn's metrics.
            collate_fn: ``collate_fn(items)`` makes a batch of a worker's slice of the dataset's
                items, as a DataLoader with it would (padding variable-length samples, say).
            eval_collate_fn: the same for the evaluation set; default collate_fn.
        Raises:
            ConfigError: bad arguments, or a scalar loss that cannot be split exactly where the
                run splits it, before any process starts.
            CheckpointError: a checkpoint to resume from cannot be used.
            UserCodeError: the model, step, loss, metric or optimizer failed on a first micro-batch.
            WorkerFailed: a worker raised, died or hung (after max_restarts restarts).
            TrainingInterrupted: SIGINT or SIGTERM; a checkpoint was written if configured.
            TrainingDiverged: a non-finite loss or gradient, with on_nan="stop".
        """
        history = History()
        hooks = Callbacks([history, *([OnLog(on_log)] if on_log is not None else []),
                           *([NotebookBar()] if in_notebook() else []), *(callbacks or [])])
        run = self._resolve(model, train_set, eval_set, optimizer, loss_fn, scheduler, step_fn, metric_fn,
                            param_groups, run_config, phases, collate_fn,
                            eval_collate_fn if eval_collate_fn is not None else collate_fn)
        writer = _CheckpointWriter(run, hooks)
        hooks = Callbacks([writer, *hooks.callbacks])
        self.should_stop = self.should_checkpoint = False
        hooks.call("on_fit_start", self, run.plan(0))
        outcome = self._train(run, hooks, writer)
        result = self._result(run, outcome, history.records, writer)
        result._model = model  # the trained model, for save(); not a field: as_dict() leaves it out
        hooks.call("on_fit_end", self, result)
        return result

    def _resolve(self, model, train_set, eval_set, optimizer, loss_fn, scheduler, step_fn, metric_fn, param_groups,
                 run_config, phases, collate_fn, eval_collate_fn) -> "_Run":
        """Check everything, rehearse the user's code on one micro-batch, and decide every setting
        of the run once."""
        cfg = self.config
        placement = self.placement = self._place_for(model)
        if phases:
            given = [name for name, value in (("loss_fn", loss_fn), ("step_fn", step_fn), ("optimizer", optimizer),
                                              ("scheduler", scheduler), ("param_groups", param_groups)) if value]
            if given:
                raise ConfigError(f"give phases or {', '.join(given)}, not both: each Phase brings its step_fn, "
                                  "params, optimizer and scheduler")
            objective = Objective(step_fn=phases[0].step_fn, metric_fn=metric_fn)
        else:
            objective = _objective(loss_fn, step_fn, metric_fn)
        with random_state.kept():  # reading first items leaves the caller's random streams as they were
            train = make_source(train_set, "train_set", Batching(cfg.batch_size, cfg.accumulate, cfg.seed,
                                                                 cfg.drop_last), collate_fn,
                                _accepts(objective, model, collate_fn))
            if eval_set is not None:
                make_source(eval_set, "eval_set", Batching(cfg.eval_batch_size), eval_collate_fn,
                            _accepts(objective, model, eval_collate_fn))
        per_epoch, total_steps = self._steps_of(train)
        if cfg.measure_after >= total_steps:
            raise ConfigError(f"measure_after={cfg.measure_after} leaves none of the {total_steps} steps to measure; "
                              "lower it or train longer")
        trainable = [p for _, p in trainable_parameters(model)]
        if not trainable:
            raise ConfigError("the model has no trainable parameters (none with requires_grad=True)")
        if not any(module.training for module in model.modules()):
            log.warning("the model is in eval mode (every module): it trains so, as a plain loop without "
                        "model.train() would (no dropout, batch norm by its running statistics); call model.train() "
                        "before fit to train with them")
        job_phases = _job_phases(model, trainable, phases, objective, optimizer, param_groups, scheduler)
        for obj, what in ((model, "the model"), (objective, "the loss, step or metric function"),
                          (train_set, "train_set"), (eval_set, "eval_set"), (collate_fn, "collate_fn"),
                          (eval_collate_fn, "eval_collate_fn")):
            _check_sendable(obj, what)
        for phase in job_phases:
            where = f"phase {phase.name!r}: " if phases else ""
            for obj, what in ((phase.objective, "the step function"), (phase.optimizer, "the optimizer factory"),
                              (phase.scheduler, "the scheduler factory"),
                              (phase.group_options, "the parameter groups' options")):
                _check_sendable(obj, where + what)
        channels_last = self._channels_last(model)
        read = preflight.script(model, train, slice_bounds(cfg.batch_size, placement.global_workers, 0)[1], eval_set,
                                eval_collate_fn, cfg.eval_batch_size, objective, job_phases, placement.precision,
                                channels_last)
        prefetch = self._prefetch(read.data_draws_random)
        rehearsal = self._rehearse(read)
        objective.eval_keys = rehearsal.eval_keys
        splits = placement.global_workers * cfg.accumulate > 1
        for phase, found in zip(job_phases, rehearsal.phases):
            phase.objective.form = _loss_form(found.loss, phase.objective, splits)
            _check_monitor(found.schedule_monitor, objective.eval_keys, eval_set)
        kind = max((shard_kind(found.optimizer_class, cfg.shards) for found in rehearsal.phases), key=SHARD_KINDS.index)
        self._check_combinations(kind, train.size)
        layout = FlatLayout(model, placement.workers, channels_last, kind)

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
                resume_from = Path(cfg.checkpoint_dir) if CheckpointDir(cfg.checkpoint_dir).latest() else None
        compiled = self._compile_for(model)
        facts = {"batch_size": cfg.batch_size, "accumulate": cfg.accumulate, "seed": cfg.seed,
                 "drop_last": cfg.drop_last, "dataset_size": train.size}
        plan = Plan(placement=placement, batch_size=cfg.batch_size, accumulate=cfg.accumulate, seed=cfg.seed,
                    drop_last=cfg.drop_last, dataset_size=train.size, steps_per_epoch=per_epoch,
                    total_steps=total_steps, clip_grad_norm=cfg.clip_grad_norm, on_nan=cfg.on_nan,
                    channels_last=channels_last, shards=kind, sync_batchnorm=cfg.sync_batchnorm,
                    ema_decay=cfg.ema_decay, loss_form=objective.form, log_every=cfg.log_every,
                    phases=tuple((phase.name, phase.objective.form) for phase in job_phases) if phases else (),
                    eval_batch_size=cfg.eval_batch_size, evaluates=eval_set is not None, eval_every=cfg.eval_every,
                    max_eval_batches=cfg.max_eval_batches,
                    measure_after=cfg.measure_after, checkpointing=directory is not None,
                    checkpoint_every_steps=cfg.checkpoint_every_steps,
                    checkpoint_every_epochs=cfg.checkpoint_every_epochs, profile_dir=cfg.profile_dir,
                    profile_steps=cfg.profile_steps, worker_timeout=cfg.worker_timeout, prefetch=prefetch,
                    compile=compiled,
                    data=train.kind)
        return _Run(model=model, train=train, eval_set=eval_set, eval_collate_fn=eval_collate_fn, objective=objective, phases=job_phases,
                    layout=layout, rehearsal=rehearsal, first_plan=plan,
                    directory=directory, resume_from=resume_from, facts=facts, run_config=run_config,
                    initial_state={k: v.detach().clone() for k, v in model.state_dict().items()})

    def _train(self, run: "_Run", hooks: Callbacks, writer: "_CheckpointWriter") -> "_Outcome":
        """Launch the workers; when one fails, restart all from the last checkpoint, up to
        ``max_restarts`` times."""
        cfg, restarts, resume_from = self.config, 0, run.resume_from
        self._stop.reset()

        def relay(rank: int, event: Any) -> None:
            hooks.event(self, rank, event)
            if isinstance(event, Evaluation) and self.should_checkpoint:
                self._stop.save_at(event.step)
                self.should_checkpoint = False
            if self.should_stop:
                self._stop.ask()
            if isinstance(event, Evaluation):
                self._stop.acknowledge(event.step)  # worker 0 waits for this, then the workers go on

        with graceful_stop(self._stop):
            while True:
                resume = self._resume(resume_from, run) if resume_from else None
                plan = run.plan(resume["step"] if resume else 0)
                try:
                    launcher_cpu = -_own_cpu_seconds()
                    results, peak, ema = self._run(run.model, run.layout, run.train, run.eval_set,
                                                   run.objective, run.phases, plan, relay, resume,
                                                   eval_collate_fn=run.eval_collate_fn)
                    return _Outcome(plan, results, peak, launcher_cpu + _own_cpu_seconds(), restarts, ema)
                except WorkerFailed as failure:
                    if self._stop.signal:  # asked to stop: a restart would resurrect the run
                        raise TrainingInterrupted(self._stop.signal, None, writer.last_saved) from failure
                    if restarts >= cfg.max_restarts:
                        raise
                    restarts += 1
                    latest = run.directory.latest() if run.directory else None
                    log.warning("%s\nrestart %d of %d, from %s", failure, restarts, cfg.max_restarts,
                                latest or resume_from or "the initial parameters")
                    if latest is not None:
                        resume_from = run.directory.path
                    elif resume_from is None:
                        run.model.load_state_dict(run.initial_state)
                    self._stop.clear_for_restart()

    def _result(self, run: "_Run", outcome: "_Outcome", history: list[dict[str, Any]],
                writer: "_CheckpointWriter") -> FitResult:
        """What the run measured, or the error that ended it."""
        cfg, plan, results = self.config, outcome.plan, outcome.results
        lead = results[0]
        if lead.diverged_at is not None:
            raise TrainingDiverged(lead.diverged_at)
        if lead.stopped_at is not None and self._stop.signal:
            raise TrainingInterrupted(self._stop.signal, lead.stopped_at, writer.last_saved)
        eval_metrics = {k: v for k, v in lead.eval_metrics.items() if k != "eval_error"}
        if lead.eval_metrics.get("eval_error"):
            log.warning("evaluation failed; the trained model is kept:\n%s", lead.eval_metrics["eval_error"])
        other = _other_cpu_percent(results, outcome.launcher_cpu)
        if other is not None and other > OTHERS_WARNING_PERCENT:
            log.warning("other processes used %.0f%% of this machine's CPU during the measured steps: the speeds "
                        "measured mean little (measure on an idle machine)", other)
        measured_from = plan.measure_from
        samples = plan.samples(measured_from, measured_from + lead.measured_steps)
        placement = plan.placement
        return FitResult(
            samples_per_sec=samples / lead.train_seconds if lead.train_seconds > 0 else 0.0,
            per_worker_batch=plan.per_worker_batch,
            steps=lead.stopped_at or plan.total_steps,
            measured_steps=lead.measured_steps,
            final_loss=lead.final_loss,
            workers=placement.workers,
            threads=placement.threads,
            batch_size=cfg.batch_size,
            train_seconds=lead.train_seconds,
            phase_seconds={p: sum(r.phase_seconds[p] for r in results) / len(results) for p in PHASES},
            peak_memory_bytes=max(outcome.peak, sum(r.pss_bytes for r in results)),
            eval_loss=eval_metrics.get("eval_loss"),
            eval_accuracy=eval_metrics.get("eval_accuracy"),
            eval_metrics=eval_metrics,
            eval_error=lead.eval_metrics.get("eval_error"),
            history=history,
            cpu_percent_per_core=lead.cpu_percent_per_core,
            skipped_steps=lead.skipped_steps,
            restarts=outcome.restarts,
            last_checkpoint=str(writer.last_saved) if writer.last_saved else None,
            channels_last=plan.channels_last,
            other_cpu_percent=other,
            comm=lead.comm,
            precision=placement.precision,
            plan=plan.summary(lead.comm),
            stopped_early=lead.stopped_at,
            ema_state_dict=outcome.ema_state_dict,
            compile_seconds=max(0.0, lead.first_step_seconds - lead.train_seconds / lead.measured_steps)
            if plan.compile and lead.measured_steps else None,
        )

    def _check_combinations(self, kind: str, dataset_size: int) -> None:
        cfg, workers = self.config, self.placement.global_workers
        if kind != "elements" and self.placement.comm != "local" and cfg.reduce == "reduce_scatter":
            raise ConfigError(f"reduce=reduce_scatter needs elementwise shards (equal slices), and this run's are "
                              f"shards={kind}; use reduce=all_reduce")
        if cfg.sync_batchnorm and not cfg.drop_last:
            rest = dataset_size % (cfg.batch_size * cfg.accumulate) % cfg.batch_size
            if 0 < rest < workers:
                raise ConfigError(f"sync_batchnorm with drop_last=false: the last micro-batch of an epoch has "
                                  f"{rest} samples, fewer than the {workers} workers, and every worker must take "
                                  "part in each batch norm; set drop_last=true or change batch_size")

    def _agree_with_other_nodes(self) -> None:
        """Every node must run the same number of workers: the shards and the batch split depend on it."""
        store = self.cluster.store("nodes")
        store.set(f"workers/{self.cluster.node_rank}", str(self.workers))
        for node in range(self.cluster.nodes):
            theirs = int(store.get(f"workers/{node}"))
            if theirs != self.workers:
                raise ConfigError(f"node {node} runs {theirs} workers, this node {self.workers}: every node needs "
                                  "the same workers=... (set it explicitly rather than auto)")

    def _resume(self, target: Path, run: "_Run") -> dict[str, Any]:
        """Load a checkpoint once, check it fits this run, and cut it into each worker's share."""
        path, saved, passed = checkpoint.load_resumable(target)
        for reason in passed:
            log.warning("passing over a damaged checkpoint: %s", reason)
        _check_same_run(saved, path, run.facts, run.run_config, self.config.resume_strict)
        checkpoint.check_model(saved, run.model, path)
        optimizers, schedules = checkpoint.phase_states(saved, [(s.name, s.shape) for s in run.layout.slots],
                                                        len(run.phases), path)
        for held, found in zip(optimizers, run.rehearsal.phases):
            if found.optimizer_class is not None:
                checkpoint.check_optimizer(held, found.optimizer_state_keys, found.optimizer_class.__name__, path)
        total_steps = run.first_plan.total_steps
        if saved["step"] >= total_steps:
            raise ConfigError(f"{path} is at step {saved['step']}, and this run has {total_steps} steps: nothing "
                              "left to train; raise epochs or max_steps to go on")
        same_streams = len(saved["rng"]) == self.workers and self.cluster is None
        if not same_streams:
            log.warning("%s was written by %d workers, this run has %d: parameters and optimizer state resume "
                        "exactly, random streams (dropout, augmentation) do not", path, len(saved["rng"]),
                        self.workers)
        run.model.load_state_dict(saved["model"])
        log.info("resuming from %s (step %d)", path, saved["step"])
        if self.config.ema_decay is not None and saved.get("ema") is None:
            log.warning("%s holds no moving average of the weights (ema_decay): it starts from the weights resumed",
                        path)
        stream = (saved.get("run") or {}).get("stream")
        return {"step": saved["step"], "ema": saved.get("ema"),
                "ranks": [{"phases": [{"optimizer": state.scatter(held, run.layout, rank, phase.slot_groups)
                                       if held else {}, "schedule": schedule}
                                      for phase, held, schedule in zip(run.phases, optimizers, schedules)],
                           "rng": saved["rng"][rank] if same_streams else None, "stream": stream}
                          for rank in range(self.workers)]}

    # --- evaluate ------------------------------------------------------------------------------

    def evaluate(self, model: nn.Module, dataset: Dataset, loss_fn: Callable[..., torch.Tensor] | None = None,
                 step_fn: Callable[[nn.Module, Any], Any] | None = None,
                 metric_fn: Callable[[nn.Module, Any], dict[str, Any]] | None = None,
                 collate_fn: Callable[[list], Any] | None = None) -> dict[str, Any]:
        """Exact mean loss (and accuracy for class scores, and metric_fn's metrics) over ``dataset``."""
        cfg, placement = self.config, self.placement
        objective = _objective(loss_fn, step_fn, metric_fn)
        source = make_source(dataset, "dataset", Batching(cfg.eval_batch_size), collate_fn,
                             _accepts(objective, model, collate_fn))
        for obj, what in ((model, "the model"), (objective, "the loss, step or metric function"),
                          (dataset, "dataset"), (collate_fn, "collate_fn")):
            _check_sendable(obj, what)
        channels_last = self._channels_last(model)
        rehearsal = self._rehearse(preflight.script(model, None, 0, dataset, collate_fn, cfg.eval_batch_size,
                                                    objective, [], placement.precision, channels_last))
        objective.eval_keys = rehearsal.eval_keys
        objective.form = rehearsal.loss.form or MEAN  # evaluation weighs chunks by samples, as a plain loop does
        layout = FlatLayout(model, placement.workers, channels_last)
        plan = Plan(placement=placement, batch_size=cfg.batch_size, accumulate=1, seed=cfg.seed, drop_last=True,
                    dataset_size=source.size, steps_per_epoch=1, total_steps=0, channels_last=channels_last,
                    eval_batch_size=cfg.eval_batch_size, max_eval_batches=cfg.max_eval_batches, evaluate_only=True,
                    worker_timeout=cfg.worker_timeout)
        results, _, _ = self._run(model, layout, None, dataset, objective, [], plan, None, None,
                                  eval_collate_fn=collate_fn)
        return dict(results[0].eval_metrics)

    def _compile_for(self, model: nn.Module) -> bool:
        """``compile``: as set, or with ``auto`` what tuning measured for this model and batch
        (eager where it measured nothing)."""
        cfg = self.config
        if cfg.compile != "auto":
            return cfg.compile
        entry = tune.load(self._tune_key(model))
        rates = (entry or {}).get("compile_rates") or {}
        if not rates:
            log.info("compile=auto: eager, as tuning measured no compiled run of this model and batch "
                     "(Trainer.tune with compile=auto, or tune=true, measures one)")
            return False
        log.info("compile=auto: %s (tuning measured %.0f samples/s compiled, %.0f eager)",
                 "compiled" if rates["compiled"] > rates["eager"] else "eager", rates["compiled"], rates["eager"])
        return rates["compiled"] > rates["eager"]

    def _prefetch(self, draws_random: bool) -> bool:
        """Whether workers read the next step's slice in a thread while this step computes:
        ``prefetch=auto`` does where reading draws no global random numbers (a thread drawing
        them beside the model's dropout would change which numbers each gets).

        Raises:
            ConfigError: prefetch=true for data that draws from the global generators.
        """
        setting = self.config.prefetch
        if draws_random and setting is True:
            raise ConfigError("prefetch=true, and reading train_set draws from torch's, numpy's or random's global "
                              "random generator (augmentation): read ahead in a thread, its draws would interleave "
                              "with the model's; draw from a generator of the dataset's own, e.g. torch.Generator()"
                              ".manual_seed(hash((seed, epoch, index))) with set_epoch(epoch), or set prefetch=auto")
        if draws_random and setting == "auto":
            log.info("prefetch=auto: off, as reading train_set draws global random numbers (augmentation); a "
                     "dataset that draws from generators of its own is read ahead")
        return bool(setting) and not draws_random

    def _channels_last(self, model: nn.Module) -> bool:
        """The layout this model runs in: as set, or what ``channels_last=auto`` decides for it."""
        setting = self.config.channels_last
        return setting if isinstance(setting, bool) else channels_last_helps(model)

    def _rehearse(self, script: "preflight.Script") -> "preflight.Rehearsal":
        """The user's code on one micro-batch, before any worker starts: in a warm worker (so
        that this process never imports what torch.optim needs), else here."""
        placement = self.placement
        if placement.start_method != "forkserver":
            return preflight.rehearse(script)
        (outcome,) = launch(preflight.rehearse_in_worker, [script], start_method=placement.start_method,
                            runtime=placement.runtime)
        if "error" in outcome:
            raise UserCodeError(outcome["error"])
        return outcome["rehearsal"]

    # --- one launch of the workers -------------------------------------------------------------

    def _run(self, model, layout: FlatLayout, train: IndexSource | StreamSource | None, eval_set, objective: Objective,
             phases: list[JobPhase], plan: Plan, relay, resume, target=run_worker, eval_collate_fn=None):
        placement = plan.placement
        rendezvous_dir = _rendezvous_dir()
        shared = SharedParams(model, layout, ema=plan.ema_decay is not None,
                              ema_values=resume.get("ema") if resume else None)
        try:
            for dataset in (train.dataset if isinstance(train, IndexSource) else None, eval_set):
                if dataset is not None:
                    share_dataset(dataset)
            heartbeats = Heartbeats.allocate(placement.workers)
            shm = None
            if placement.comm in ("shm", "auto"):
                # Wide enough for the widest small sum: batch norm's statistics, evaluation's sums
                # (a sum and a count per metric, the samples, the failures); wider ones go in pieces.
                width = max(2 * max_channels(model) + 1 if plan.sync_batchnorm else 0,
                            2 * len(objective.eval_keys) + 2)
                shm = ShmBuffers.allocate(placement.workers, layout.padded_numel, shared.flat.dtype, width)
            job = Job(plan=plan, model=model, layout=layout, flat=shared.flat, train=train, eval_set=eval_set,
                      objective=objective, phases=phases,
                      board=Board.allocate(placement.workers, len(layout.slots), buffer_count(model)), stop=self._stop,
                      heartbeats=heartbeats, shm=shm, ema=shared.ema,
                      eval_collate_fn=eval_collate_fn)
            specs = [WorkerSpec(rank=r, store_path=f"{rendezvous_dir}/store", job=job,
                                resume=resume["ranks"][r] if resume else None, cluster=self.cluster)
                     for r in range(placement.workers)]
            peak = PeakMemory()
            where = f"node {self.cluster.node_rank} " if self.cluster else ""
            results = launch(target, specs, on_message=relay, stop=self._stop, where=where,
                             watchdog=Watchdog(heartbeats, plan.worker_timeout, on_tick=peak),
                             start_method=placement.start_method, runtime=placement.runtime)
            ema = shared.ema_state_dict(model, layout) if shared.ema is not None else None
            return results, peak.peak_bytes, ema
        finally:
            SharedParams.release(model)
            shutil.rmtree(rendezvous_dir, ignore_errors=True)


@dataclass(frozen=True)
class _Run:
    """One fit, resolved: what every launch of its workers (the first, and each restart) runs."""

    model: nn.Module
    train: IndexSource | StreamSource
    eval_set: Dataset | None
    eval_collate_fn: Callable[[list], Any] | None
    objective: Objective  # evaluation's
    phases: list[JobPhase]  # training's: one optimizer each
    layout: FlatLayout
    rehearsal: "preflight.Rehearsal"
    first_plan: Plan  # from step 0
    directory: CheckpointDir | None
    resume_from: Path | None
    facts: dict[str, Any]  # what a resume must agree with
    run_config: dict[str, Any] | None
    initial_state: dict[str, torch.Tensor]  # a restart without a checkpoint starts over from it

    def plan(self, start_step: int) -> Plan:
        return dataclasses.replace(self.first_plan, start_step=start_step)


@dataclass(frozen=True)
class _Outcome:
    """The launch that finished: its plan, every worker's result, and what it cost."""

    plan: Plan
    results: list[WorkerResult]
    peak: int
    launcher_cpu: float
    restarts: int
    ema_state_dict: dict[str, torch.Tensor] | None = None


OTHERS_WARNING_PERCENT = 5.0


def _own_cpu_seconds() -> float:
    times = psutil.Process().cpu_times()
    return times.user + times.system


def _other_cpu_percent(results: list[WorkerResult], launcher_cpu: float) -> float | None:
    """CPU the machine spent on anything but this run, as a share of all its logical CPUs' time,
    over the measured steps (the launcher counts as the run's, whole, to err on the low side)."""
    clocks = [r.cpu_seconds or {} for r in results]
    if not all(clocks) or clocks[0]["machine_total"] <= 0:
        return None
    ours = sum(c["own"] for c in clocks) + launcher_cpu
    return max(0.0, 100 * (clocks[0]["machine_busy"] - ours) / clocks[0]["machine_total"])


SHARD_KINDS = ("elements", "tensors", "full")  # each exact for the optimizers the ones before it are


def _job_phases(model: nn.Module, trainable: list[nn.Parameter], phases: list[Phase] | None, objective: Objective,
                optimizer, param_groups, scheduler) -> list[JobPhase]:
    """The run's phases, resolved against the model: one from fit's own arguments, or each Phase's.

    Raises:
        ConfigError: a phase's parameters are not the model's, or a parameter is in two phases.
    """
    if not phases:
        groups = resolve_groups(model, trainable, param_groups)
        return [_job_phase("train", objective, groups, optimizer, scheduler)]
    resolved, owner = [], {}
    for index, phase in enumerate(phases):
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
        resolved.append(_job_phase(name, phase_objective, groups, phase.optimizer, phase.scheduler))
    return resolved


def _job_phase(name: str, objective: Objective, groups, optimizer, scheduler) -> JobPhase:
    """One phase with its optimizer factory: as given, else the class of the optimizer the groups
    came as, else SGD(lr=0.01)."""
    factory = optimizer or groups.factory or functools.partial(torch.optim.SGD, lr=0.01)
    return JobPhase(name, objective, factory, groups.options, groups.slot_groups, scheduler)


def _accepts(objective: Objective, model: nn.Module, collate_fn) -> Callable[[Any], str | None]:
    """What make_source asks of a dataset's items: the objective's check, or, with a collate
    function, nothing (its batches are what the objective gets; the preflight runs them)."""
    return (lambda item: None) if collate_fn is not None else (lambda item: objective.accepts(item, model))


def _objective(loss_fn, step_fn, metric_fn) -> Objective:
    if loss_fn is not None and step_fn is not None:
        raise ConfigError("give loss_fn or step_fn, not both: step_fn computes the loss itself")
    return Objective(loss_fn, step_fn, metric_fn)


def _check_monitor(monitor: str | None, eval_keys: tuple[str, ...], eval_set) -> None:
    """A scheduler that steps on an evaluation metric needs an evaluation that reports it.

    Raises:
        ConfigError: no evaluation set, or one whose evaluation does not report ``monitor``.
    """
    if monitor is None:
        return
    if eval_set is None:
        raise ConfigError(f"the scheduler steps on {monitor} after each evaluation, and this run evaluates nothing: "
                          "pass eval_set=..., or a scheduler that steps per step or epoch")
    reported = [f"eval_{key}" for key in eval_keys]
    if monitor not in reported:
        raise ConfigError(f"the scheduler steps on {monitor}, which evaluation does not report (it reports "
                          f"{', '.join(reported)}); set its monitor to one of those")


def _loss_form(finding, objective: Objective, splits: bool) -> str:
    """The form a scalar loss is split by; a loss with no exact split is refused where it splits.

    Raises:
        ConfigError: the loss cannot be split exactly, and the run splits it (workers or accumulate).
    """
    if finding.form is not None:
        return finding.form
    if not splits:
        return MEAN  # one slice a step: its loss is the batch's, whatever it divides by
    raise ConfigError(
        f"{objective.what} gives a scalar loss that cannot be split over workers exactly: {finding.detail}. Return "
        "(loss_sum, count) from a step_fn instead: the loss summed over the slice and what the whole batch's loss "
        "divides by, e.g. (F.cross_entropy(logits, targets, ignore_index=-100, reduction=\"sum\"), "
        "(targets != -100).sum()), or (loss * n, n) for a per-sample mean of n samples (a Hugging Face model needs "
        "no step_fn: sn_trainer calls it and counts its labels)")


def _check_same_run(saved: dict[str, Any], path, facts: dict[str, Any], run_config: dict[str, Any] | None,
                    strict: bool) -> None:
    """Refuse (or, not strict, warn about) a checkpoint of another model, dataset or sample order."""
    if run_config:
        for section in ("model", "dataset"):
            theirs = ((saved.get("config") or {}).get(section) or {}).get("name")
            mine = (run_config.get(section) or {}).get("name")
            if theirs is not None and mine is not None and theirs != mine:
                raise CheckpointError(f"{path} was written for {section}={theirs}, this run has {section}={mine}; "
                                      f"resume with {section}={theirs} or start afresh without resume")
    for key in RUN_FACTS:
        theirs = (saved.get("run") or {}).get(key)
        if theirs is not None and theirs != facts[key]:
            what = "training-set size" if key == "dataset_size" else key
            message = (f"{path} was written with {what} {theirs}, this run has {facts[key]}: the samples of each "
                       "step would differ from the run it continues")
            if strict:
                raise CheckpointError(f"{message}; resume with {key}={theirs}, or set resume_strict=false to go on "
                                      "anyway")
            log.warning("%s (resume_strict=false: going on)", message)


class _CheckpointWriter(Callback):
    """In the launcher: gathers every worker's part of a checkpoint and writes it when complete."""

    def __init__(self, run: _Run, hooks: Callbacks):
        self.directory, self.layout, self.phases = run.directory, run.layout, run.phases
        self.facts, self.config, self.hooks = run.facts, run.run_config, hooks
        self._parts: dict[int, dict[int, dict[str, Any]]] = {}
        self.last_saved: Path | None = None

    def on_checkpoint_part(self, trainer, rank: int, part: CheckpointPart) -> None:
        parts = self._parts.setdefault(part.step, {})
        parts[rank] = unpack(part.data)
        if self.directory is None or len(parts) < self.layout.world_size:
            return
        step = part.step
        del self._parts[step]
        ordered = [parts[r] for r in range(self.layout.world_size)]
        optimizers, schedules = [], []
        for index, phase in enumerate(self.phases):
            held = [p["phases"][index]["optimizer"] for p in ordered]
            optimizers.append(state.gather(held, self.layout, phase.slot_groups)
                              if any(h is not None for h in held) else None)
            # A plateau scheduler's state: the same in every worker that holds one of this phase's pieces.
            schedules.append(next((p["phases"][index]["schedule"] for p in ordered
                                   if p["phases"][index]["schedule"] is not None), None))
        optimizer, schedule = checkpoint.phase_entries(optimizers, schedules)
        saved = checkpoint.build(step, ordered[0]["model"], optimizer, [p["rng"] for p in ordered],
                                 {**self.facts, "workers": self.layout.world_size, "stream": ordered[0].get("stream")},
                                 self.config, schedule=schedule,
                                 ema=ordered[0].get("ema"), aliases=ordered[0].get("aliases"))
        try:
            self.last_saved = self.directory.save(saved)
        except OSError as exc:  # a full disk: stop, rather than train on with nothing to resume from
            raise OSError(exc.errno, f"cannot write the checkpoint of step {step} to {self.directory.path} "
                                     f"({exc.strerror}); the checkpoints before it are intact") from None
        log.info("checkpoint: %s", self.last_saved)
        self.hooks.call("on_checkpoint", trainer, self.last_saved)


def _rendezvous_dir() -> str:
    """A private temporary directory for the workers' rendezvous, named after this process.

    One left by a launcher that was SIGKILLed (no chance to remove it) is removed here, by the
    next run: its name says whose it was, and that process is gone.
    """
    base = Path(tempfile.gettempdir())
    for stale in base.glob("sn_trainer-*-*"):
        try:
            pid = int(stale.name.split("-")[1])
        except (IndexError, ValueError):
            continue
        if pid != os.getpid() and not psutil.pid_exists(pid) and stale.stat().st_uid == os.getuid():
            shutil.rmtree(stale, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"sn_trainer-{os.getpid()}-")
