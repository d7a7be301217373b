"""The public API: ``Trainer(...).fit(model, dataset)`` trains with W pinned worker processes.

A Trainer holds the settings and what this machine makes of them. ``fit`` is three steps:
resolve one frozen run (``fit.resolve``: the checks, the rehearsal of the user's code on one
micro-batch, every ``auto`` decided), run its launches with their restarts (``fit.session``),
and report what ran (``fit.result``).
"""
from __future__ import annotations

import copy
import dataclasses
import inspect
import logging
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from . import tuner
from .callbacks import Callback, Callbacks, History, NotebookBar, OnLog, in_notebook
from .config import TrainerConfig, setting_rows, settings_text
from .node.cluster import Cluster
from .node.runtime import Runtime, available_allocators, available_openmps
from .node.topology import read_topology
from .engine import StopFlags, starts_warm, warm_up
from .errors import ConfigError
from .fit import decide, proof
from .fit.resolve import FitInputs, resolve_evaluation, resolve_fit, steps
from .fit.result import FitResult, fit_result
from .fit.session import Session, launch_workers
from .integrations import lightning
from .integrations.lightning_module import lightning_root
from .phase import Phase

log = logging.getLogger(__name__)

__all__ = ["FitResult", "Trainer"]


class Trainer:
    """Data-parallel training on one CPU node: W workers, one shared model, exact averaging.

    Example::

        trainer = Trainer(workers=2, threads=1, batch_size=64, epochs=1, seed=0)
        result = trainer.fit(model, train_set, eval_set=test_set,
                             optimizer=functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9))

    After ``fit`` returns, ``model`` holds the trained weights. The settings come as keywords, as
    one ``TrainerConfig`` (``Trainer(config)``), or both (the keywords change the config's);
    ``cluster`` joins nodes under torchrun (``Cluster.from_env(os.environ)``). ``trainer.config``
    holds them as given, ``trainer.settings`` with this machine's choices made (workers, threads,
    runtime, precision). Every setting, with its default:

"""

    def __init__(self, config: TrainerConfig | None = None, /, *, cluster: Cluster | None = None, **settings: Any):
        """Check the settings and decide what this machine makes of them.

        Raises:
            ConfigError: a bad or unknown setting, before anything starts.
        """
        if config is not None and not isinstance(config, TrainerConfig):
            raise ConfigError(f"Trainer takes a TrainerConfig or the settings as keywords (Trainer(batch_size=64, "
                              f"...)), got a {type(config).__name__}")
        self.config = TrainerConfig.from_keywords(settings, base=config)
        self.cluster = cluster
        self.topology = read_topology()
        self.settings, self.placement = decide.place(self.config, self.topology, cluster)
        if "auto" not in (self.config.allocator, self.config.openmp):  # auto is known at fit: the server starts then
            # The warm workers' server imports torch now, while this process goes on.
            warm_up(self.config.start_method, Runtime(self.settings.allocator, self.settings.openmp))
        # Shared with the workers for all of this Trainer's runs: a stop request outlives restarts.
        self._stop = StopFlags.allocate()
        self.should_stop = self.should_checkpoint = False  # what callbacks ask of a running fit

    @property
    def workers(self) -> int:
        return self.settings.workers

    def steps(self, num_samples: int) -> tuple[int, int]:
        """Optimizer steps per epoch and in all, for a training set of ``num_samples``.

        Raises:
            ConfigError: the set is smaller than one step's batch (with drop_last).
        """
        return steps(self.settings, num_samples)

    def fit(self, model: nn.Module, train_set: Dataset, eval_set: Dataset | None = None,
            optimizer: Callable[..., torch.optim.Optimizer] | None = None,
            loss_fn: Callable[..., torch.Tensor] | None = None,
            scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
            on_log: Callable[[dict[str, Any]], None] | None = None, run_config: dict[str, Any] | None = None,
            step_fn: Callable[[nn.Module, Any], Any] | None = None,
            metric_fn: Callable[[nn.Module, Any], dict[str, Any]] | None = None,
            param_groups: Callable[[nn.Module], Any] | None = None, callbacks: list[Callback] | None = None,
            phases: list[Phase] | None = None, collate_fn: Callable[[list], Any] | None = None,
            eval_collate_fn: Callable[[list], Any] | None = None,
            after_update: Callable[[nn.Module], Any] | None = None) -> FitResult:
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
            metric_fn: ``metric_fn(model, batch)`` returning ``{name: (sum, count)}`` or
                ``{name: metric}``, a torchmetrics Metric it updated (every worker's states
                merged, computed once per evaluation, then reset), reported as ``eval_<name>``.
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
            after_update: ``after_update(model)``, called under ``torch.no_grad()`` after each
                optimizer update, before the next forward, as a loop calls it after
                ``optimizer.step()`` (open_clip's clamp of ``logit_scale``, a max-norm
                constraint): once per update, on the weights every worker shares, in place. With
                phases, each Phase has its own.
        Raises:
            ConfigError: bad arguments, or a scalar loss that cannot be split exactly where the
                run splits it, before any process starts.
            CheckpointError: a checkpoint to resume from cannot be used.
            UserCodeError: the model, step, loss, metric, optimizer or after_update failed on a first
                micro-batch.
            WorkerFailed: a worker raised, died or hung (after max_restarts restarts).
            TrainingInterrupted: SIGINT or SIGTERM; a checkpoint was written if configured.
            TrainingDiverged: a non-finite loss or gradient, with on_nan="stop".
        """
        given = FitInputs(model, train_set, eval_set, optimizer, loss_fn, scheduler, step_fn, metric_fn, param_groups,
                          phases, collate_fn, eval_collate_fn, run_config, after_update=after_update)
        module_hooks = []
        if lightning_root(model) is not None:  # its own steps, optimizer and hooks; never fit's defaults
            given, module_hooks = lightning.adapt(given)
        history = History()
        hooks = Callbacks([history, *([OnLog(on_log)] if on_log is not None else []),
                           *([NotebookBar()] if in_notebook() else []), *(callbacks or []), *module_hooks])
        cluster = self._met()
        run = resolve_fit(given, *self._settled_for(model), cluster, progress_awaited=hooks.steer_steps())
        session = Session(run, self, hooks, self._stop, cluster)
        result = fit_result(session.train(), history.records, session.writer.last_saved, self._stop, run.train.kind)
        result._model = model  # the trained model, for save(); not a field: as_dict() leaves it out
        session.callbacks.call("on_fit_end", self, result)
        return result

    def verify(self, model: nn.Module, train_set: Dataset, steps: int = 10,
               optimizer: Callable[..., torch.optim.Optimizer] | None = None,
               loss_fn: Callable[..., torch.Tensor] | None = None,
               step_fn: Callable[[nn.Module, Any], Any] | None = None,
               param_groups: Callable[[nn.Module], Any] | None = None,
               scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
               collate_fn: Callable[[list], Any] | None = None,
               after_update: Callable[[nn.Module], Any] | None = None) -> proof.VerifyReport:
        """Prove it on your model: train copies of ``model`` for ``steps`` steps with this Trainer's
        workers (every step compared with one process's) and as one plain process over the same
        global batches; ``model`` itself is left as it is.

        Returns:
            A ``VerifyReport``: the verdict (``"exact"`` to rounding, ``"like DDP"``, ``"not exact"`` or
            ``"refused"``) and why, the rows of the exactness contract that apply, and per parameter
            the largest difference between the two; ``print(report)`` shows them.
        """
        fit_args = {"optimizer": optimizer, "loss_fn": loss_fn, "step_fn": step_fn, "param_groups": param_groups,
                    "scheduler": scheduler, "collate_fn": collate_fn, "after_update": after_update}
        return proof.prove(self.config, model, train_set, steps,
                           lambda config, copied: Trainer(config, cluster=self.cluster).fit(copied, train_set,
                                                                                            **fit_args), fit_args)

    def _settled_for(self, model: nn.Module):
        """The settings and placement a fit of ``model`` runs with: with workers or the runtime
        auto, what tuning cached for this model and batch, if anything."""
        tuned = decide.tuned_for(self.config, self.cluster, model)
        if tuned is not None:
            self.settings, self.placement = decide.place(self.config, self.topology, self.cluster, tuned)
        return self.settings, self.placement

    def evaluate(self, model: nn.Module, dataset: Dataset, loss_fn: Callable[..., torch.Tensor] | None = None,
                 step_fn: Callable[[nn.Module, Any], Any] | None = None,
                 metric_fn: Callable[[nn.Module, Any], dict[str, Any]] | None = None,
                 collate_fn: Callable[[list], Any] | None = None) -> dict[str, Any]:
        """Exact mean loss (and accuracy for class scores, and metric_fn's metrics) over ``dataset``."""
        given = FitInputs(model, eval_set=dataset, loss_fn=loss_fn, step_fn=step_fn, metric_fn=metric_fn,
                          eval_collate_fn=collate_fn)
        if lightning_root(model) is not None:
            given = lightning.adapt_evaluation(given)
        run = resolve_evaluation(given, self.settings, self.placement)
        results, _, _ = launch_workers(run, run.first_plan, self._stop, self._met())
        return dict(results[0].eval_metrics)

    def _met(self) -> Cluster | None:
        """The cluster, its nodes met for this fit (their store's keys this round's alone)."""
        return self.cluster.met() if self.cluster is not None else None  # waits for the slowest node's start-up

    def tune(self, model: nn.Module, train_set: Dataset, optimizer=None, loss_fn=None, step_fn=None,
             param_groups=None, steps: int = 12, warmup: int = 3, window_s: float = 3.0, top: int = 3,
             allocators: list[str] | None = None, openmps: list[str] | None = None,
             cache: bool = True) -> tuner.TuneResult:
        """Measure which workers x threads (and runtime) trains ``model`` fastest at this batch here.

        A cost model is calibrated with a few short fits (one worker at two batch sizes, one per
        thread count, two workers), predicts every candidate, and the best ``top`` are measured
        with short real fits; then the runtimes at the winner: each of ``allocators``, then each
        of ``openmps`` with the fastest allocator (default: those installed), then the fastest
        runtime at the runner-up, when it is not the default; with compile=auto, the winner
        compiled against eager. The global batch stays as set. Each measurement times at least
        ``steps`` steps and about ``window_s`` seconds of them, after ``warmup``. The choice is
        cached for ``workers=auto`` (and ``allocator=auto``, ``openmp=auto``, ``compile=auto``).
        """
        measure = _Measurement(self.config, model, train_set, steps, warmup, window_s,
                               dict(optimizer=optimizer, loss_fn=loss_fn, step_fn=step_fn, param_groups=param_groups))
        return tuner.tune(measure, self.topology.usable_cores, self.config.batch_size,
                          allocators if allocators is not None else available_allocators(),
                          openmps if openmps is not None else available_openmps(), top, self.config.compile == "auto",
                          decide.tune_key(self.config, model) if cache else None)


class _Measurement:
    """The tuner's measurement: a short real fit of a copy of the model per call, with the given
    workers, threads, batch, runtime and compile, the rest of the settings as they are."""

    def __init__(self, config: TrainerConfig, model: nn.Module, train_set: Dataset, steps: int, warmup: int,
                 window_s: float, fit_arguments: dict[str, Any]):
        self.config, self.model, self.train_set, self.fit_arguments = config, model, train_set, fit_arguments
        self.steps, self.warmup, self.window_s = steps, warmup, window_s
        self.step_seconds: list[float] = []  # of the measurements so far: the next one's steps fill window_s

    def __call__(self, workers: int, threads: int, batch: int, runtime: Runtime,
                 compiled: bool = False) -> tuple[float, float]:
        config = self.config
        # A runtime other than the warm workers' is measured with spawned workers, as it would run.
        start_method = config.start_method if starts_warm(config.start_method, runtime) else "spawn"
        timed = max(self.steps, math.ceil(self.window_s / min(self.step_seconds))) if self.step_seconds \
            else self.steps
        measuring = dataclasses.replace(
            config, workers=workers, threads=threads, batch_size=batch, allocator=runtime.allocator,
            openmp=runtime.openmp, start_method=start_method, max_steps=self.warmup + timed,
            measure_after=self.warmup, checkpoint=dataclasses.replace(config.checkpoint, dir=None), resume=None,
            log_every=10**9, compile=compiled, verify_every=0)  # speed alone: a check would weigh on W > 1 only
        result = Trainer(measuring).fit(copy.deepcopy(self.model), self.train_set, **self.fit_arguments)
        log.info("tune: %d workers x %d threads, batch %d, %s%s: %.0f samples/s", workers, threads, batch, runtime,
                 ", compiled" if compiled else "", result.samples_per_sec)
        self.step_seconds.append(result.train_seconds / result.measured_steps)
        return result.samples_per_sec, self.step_seconds[-1]


def _signature() -> inspect.Signature:
    """``__init__(self, config=None, /, *, cluster=None, <every setting>=<its default>, ...)``."""
    positional, keyword = inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.KEYWORD_ONLY
    return inspect.Signature(
        [inspect.Parameter("self", positional), inspect.Parameter("config", positional, default=None,
                                                                 annotation="TrainerConfig | None"),
         inspect.Parameter("cluster", keyword, default=None, annotation="Cluster | None"),
         *(inspect.Parameter(row.keyword, keyword, default=row.default, annotation=row.annotation)
           for row in setting_rows())])


# What inspect.signature(Trainer), help() and notebooks show: every setting, its default.
Trainer.__init__.__signature__ = _signature()
Trainer.__doc__ = inspect.cleandoc(Trainer.__doc__) + "\n\n" + settings_text()
