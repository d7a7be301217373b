"""A LightningModule handed to ``Trainer.fit``: its own steps, optimizer, scheduler, logged metrics and hooks.

Lightning's Trainer calls the module's ``training_step(batch, batch_idx)``, builds the optimizer
and scheduler from ``configure_optimizers()``, collects what ``validation_step`` logs with
``self.log``, and calls hooks at points of its loop. Here each maps onto what ``fit`` already
takes: the step function, ``param_groups`` (the optimizer configure_optimizers built), the
scheduler with Lightning's stepping (per epoch unless said otherwise), ``metric_fn``, and hooks
called where a plain loop around the workers would call them; under manual optimization, one
phase per optimizer. What has no counterpart here (an epoch-end hook running inside the loop,
several optimizers under automatic optimization, gradient clipping of Lightning's own) is
refused up front, naming it: a module that defines its own steps never trains with fit's
defaults.

Inside the user's code, ``self.trainer`` is a stand-in that knows where the run is (``global_step``,
``current_epoch``) and refuses anything else in one line, and ``self.log`` is collected (in
``validation_step``) or dropped (elsewhere: the run reports each step's loss itself).
Lightning is imported only for a model whose class comes from it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..callbacks import Callback
from ..recipe import position
from ..errors import ConfigError
from ..phase import Phase
from .resolve import FitInputs

log = logging.getLogger(__name__)

_ROOTS = ("lightning.pytorch", "pytorch_lightning")
# Hooks a fit calls before the workers start, in Lightning's order (configure_optimizers after the
# first three), and after training ends.
BEFORE = ("prepare_data", "setup", "configure_model", "on_fit_start", "on_train_start")
AFTER = ("on_train_end", "on_fit_end", "teardown")
_WITH_STAGE = ("setup", "teardown")
# Hooks Lightning's fit never calls when it is given its data (test, predict), or that fit's own
# arguments replace (the module's data loaders, when fit is given the datasets).
_NOT_IN_FIT = ("train_dataloader", "val_dataloader", "test_dataloader", "predict_dataloader",
               "on_test_start", "on_test_end", "on_predict_start", "on_predict_end", "on_test_batch_start",
               "on_test_batch_end", "on_predict_batch_start", "on_predict_batch_end", "on_test_model_eval",
               "on_test_model_train", "on_predict_model_eval", "on_test_epoch_start", "on_test_epoch_end",
               "on_predict_epoch_start", "on_predict_epoch_end", "configure_sharded_model")
# The LightningModule's own methods its Trainer calls, beyond the hook classes' (overridden: refused).
_LOOP_METHODS = ("backward", "optimizer_step", "optimizer_zero_grad", "lr_scheduler_step",
                 "configure_gradient_clipping", "configure_callbacks")
# What to do instead of a hook that is refused (None: a hook of the loop's points).
_ADVICE = {
    None: "do it in an sn_trainer.Callback (on_step_end, on_eval_end and on_fit_end run in this process, as the "
          "run's events arrive), or inside training_step",
    **dict.fromkeys(("configure_gradient_clipping", "on_before_optimizer_step"),
                    "clip by the global norm with Trainer(clip_grad_norm=...), which the workers apply to the summed "
                    "gradient"),
    **dict.fromkeys(("backward", "optimizer_step", "optimizer_zero_grad", "lr_scheduler_step", "on_before_backward",
                     "on_after_backward", "on_before_zero_grad"),
                    "the workers do the backward, the sum and the update themselves; leave it out (accumulate=... and "
                    "clip_grad_norm=... are Trainer settings)"),
    **dict.fromkeys(("on_save_checkpoint", "on_load_checkpoint"),
                    "sn_trainer checkpoints the model's state_dict and the optimizer itself; keep extra state in the "
                    "module's buffers"),
    "configure_callbacks": "pass sn_trainer.Callback objects as fit(callbacks=[...])",
    **dict.fromkeys(("on_before_batch_transfer", "on_after_batch_transfer", "transfer_batch_to_device"),
                    "shape the batch in fit(collate_fn=...)"),
}
_FIT_ARGUMENTS = ("loss_fn", "step_fn", "optimizer", "scheduler", "metric_fn", "param_groups", "phases")
_RESERVED_NAMES = ("loss", "accuracy", "samples")  # what evaluation reports itself


def lightning_root(model: Any) -> str | None:
    """The Lightning package ``model``'s class comes from (``lightning.pytorch`` or
    ``pytorch_lightning``), or None for any other model; nothing is imported to tell."""
    for cls in type(model).__mro__:
        root = cls.__module__.rsplit(".core", 1)[0]
        if cls.__name__ == "LightningModule" and root in _ROOTS:
            return root
    return None


def adapt(given: FitInputs) -> tuple[FitInputs, list[Callback]]:
    """``given`` with the module's step, optimizer, scheduler and validation metrics in the places
    of fit's arguments, and the callback that calls its end-of-fit hooks; its start-of-fit hooks
    are called here, on the model the workers will receive.

    Raises:
        ConfigError: fit was also given a step, loss, optimizer, scheduler, metrics or phases; or
            the module uses what does not map (named, with what to do instead); after_update with
            manual optimization.
    """
    model, root = given.model, lightning_root(given.model)
    both = [name for name in _FIT_ARGUMENTS if getattr(given, name) is not None]
    if both:
        raise ConfigError(f"the model is a LightningModule, whose training_step, configure_optimizers and "
                          f"validation_step make the step, optimizer, scheduler and metrics; leave out "
                          f"{', '.join(both)} (or pass a plain nn.Module with them)")
    _check_module(model, root, given.eval_set is not None)
    if given.after_update is not None and not model.automatic_optimization:
        # Manual optimization becomes a phase per optimizer, and each phase has its own code after it.
        raise ConfigError("the LightningModule optimizes manually (a phase per optimizer), so fit's after_update has "
                          "no one update to follow: call it in training_step after the optimizer's step")
    for hook in BEFORE[:3]:  # what builds the module comes before configure_optimizers, as in Lightning
        call_hook(model, hook)
    config = lightning_optimizers(model, root) if model.automatic_optimization else manual_phases(model, root)
    for hook in BEFORE[3:]:
        call_hook(model, hook)
    metric_fn = ValidationMetrics() if overrides(model, root, "validation_step") else None
    log.info("LightningModule %s: %s%s; what training_step logs with self.log is not collected (the run reports "
             "each step's loss)", type(model).__name__, _described(config),
             ", validation_step's self.log as eval_<name>" if metric_fn is not None else "")
    if isinstance(config, list):  # manual optimization: a phase per optimizer
        return dataclasses.replace(given, phases=config, metric_fn=metric_fn), [EndHooks()]
    adapted = dataclasses.replace(
        given, step_fn=TrainingStep(), param_groups=ModuleOptimizer(),
        scheduler=ModuleScheduler(model) if config.schedule else None, metric_fn=metric_fn)
    return adapted, [EndHooks()]


def _described(config: OptimizerConfig | list[Phase]) -> str:
    """What the log says the module trains with."""
    if isinstance(config, list):
        return f"manual optimization, training_step once per optimizer as {len(config)} phases in turn"
    schedule = config.schedule
    scheduler = f", {type(schedule['scheduler']).__name__} per {schedule['interval']}" if schedule else ""
    return f"training_step, configure_optimizers ({type(config.optimizer).__name__}{scheduler})"


def adapt_evaluation(given: FitInputs) -> FitInputs:
    """``given`` for ``Trainer.evaluate``: the module's training_step as the loss and what its
    validation_step logs as the metrics (an evaluation calls no hooks).

    Raises:
        ConfigError: evaluate was also given a loss, step or metrics.
    """
    model, root = given.model, lightning_root(given.model)
    both = [name for name in ("loss_fn", "step_fn", "metric_fn") if getattr(given, name) is not None]
    if both:
        raise ConfigError(f"the model is a LightningModule, whose training_step and validation_step make the loss "
                          f"and metrics; leave out {', '.join(both)} (or pass a plain nn.Module with them)")
    _check_module(model, root, True)
    # Under manual optimization the loss is the first optimizer's, as a fit's evaluation reports it.
    step_fn = TrainingStep() if model.automatic_optimization else manual_phases(model, root)[0].step_fn
    return dataclasses.replace(given, step_fn=step_fn,
                               metric_fn=ValidationMetrics() if overrides(model, root, "validation_step") else None)


def overrides(model: nn.Module, root: str, name: str) -> bool:
    """Whether the module's class defines ``name`` itself, not as LightningModule does."""
    base = importlib.import_module(root).LightningModule
    return getattr(type(model), name, None) is not getattr(base, name, None)


def _check_module(model: nn.Module, root: str, evaluates: bool) -> None:
    """Refuse what has no exact counterpart here, naming it.

    Raises:
        ConfigError: no training_step, an overridden hook that does not map,
            or a val_dataloader without an eval_set.
    """
    name = type(model).__name__
    if not overrides(model, root, "training_step"):
        raise ConfigError(f"{name} defines no training_step: define it, or pass a plain nn.Module with step_fn=...")
    if overrides(model, root, "val_dataloader") and not evaluates:
        raise ConfigError(f"{name}.val_dataloader is not read by sn_trainer: pass its dataset as eval_set=...")
    hooks = importlib.import_module(f"{root}.core.hooks")
    named = {hook for cls in (hooks.ModelHooks, hooks.DataHooks, hooks.CheckpointHooks)
             for hook in vars(cls) if not hook.startswith("_")} | set(_LOOP_METHODS)
    refused = sorted(hook for hook in named - set(BEFORE) - set(AFTER) - set(_NOT_IN_FIT)
                     if overrides(model, root, hook))
    if refused:
        raise ConfigError(f"{name}.{refused[0]} has no counterpart in sn_trainer's loop"
                          f"{' (nor ' + ', '.join(refused[1:]) + ')' if refused[1:] else ''}, whose workers run no "
                          f"Lightning loop: {_ADVICE.get(refused[0], _ADVICE[None])}")


@dataclasses.dataclass
class OptimizerConfig:
    """What configure_optimizers returned, as Lightning reads it: one optimizer, and its scheduler
    as fit's scheduler dict (None: no scheduler)."""

    optimizer: torch.optim.Optimizer
    schedule: dict[str, Any] | None


def lightning_optimizers(module: nn.Module, root: str | None = None) -> OptimizerConfig:
    """Call the module's configure_optimizers and read what it returned as Lightning does.

    Raises:
        ConfigError: no optimizer, several optimizers or schedulers, or a step scheduler with a
            frequency above 1.
    """
    root = root or lightning_root(module)
    parse = importlib.import_module(f"{root}.core.optimizer")
    name = type(module).__name__
    with standing_in(module):
        returned = module.configure_optimizers()
    if returned is None:
        raise ConfigError(f"{name}.configure_optimizers returned None (Lightning then trains nothing): return the "
                          "optimizer to train with")
    optimizers, schedulers, monitor = parse._configure_optimizers(returned)
    if len(optimizers) != 1:
        raise ConfigError(f"{name}.configure_optimizers returned {len(optimizers)} optimizers; with automatic "
                          "optimization Lightning takes one, and so does sn_trainer (several in turn: "
                          "sn_trainer.Phase)")
    configs = parse._configure_schedulers_automatic_opt(schedulers, monitor)
    if len(configs) > 1:
        raise ConfigError(f"{name}.configure_optimizers returned {len(configs)} schedulers; sn_trainer steps one: "
                          "chain them into one (torch.optim.lr_scheduler.SequentialLR or ChainedScheduler)")
    if not configs:
        return OptimizerConfig(optimizers[0], None)
    config = configs[0]
    if config.interval == "step" and config.frequency != 1:
        raise ConfigError(f"{name}'s scheduler steps every {config.frequency} steps, which Lightning counts in batches "
                          "of each epoch and sn_trainer in optimizer steps of the run; use frequency 1 (or interval "
                          "'epoch')")
    # Metrics are reported as eval_<the name self.log was given>.
    monitor = f"eval_{config.monitor}" if config.monitor else None
    return OptimizerConfig(optimizers[0], {"scheduler": config.scheduler, "interval": config.interval,
                                           "frequency": config.frequency, "monitor": monitor})


class ModuleOptimizer:
    """fit's ``param_groups`` (or a phase's ``params``): the optimizer the module's
    configure_optimizers builds, its ``index``-th under manual optimization (its class then
    becomes every worker's optimizer, with its groups' options)."""

    def __init__(self, index: int | None = None):
        self.index = index

    def __call__(self, model: nn.Module) -> torch.optim.Optimizer:
        if self.index is None:
            return lightning_optimizers(model).optimizer
        parse = importlib.import_module(f"{lightning_root(model)}.core.optimizer")
        with standing_in(model):
            return parse._configure_optimizers(model.configure_optimizers())[0][self.index]


class ModuleScheduler:
    """fit's ``scheduler``: the module's own, built by its configure_optimizers in the worker, moved
    onto the worker's optimizer, with Lightning's interval, frequency and monitor."""

    def __init__(self, module: nn.Module):
        self.module = module

    def __call__(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        config = lightning_optimizers(self.module)
        built = config.optimizer
        if len(built.param_groups) != len(optimizer.param_groups):
            raise ConfigError(f"{type(self.module).__name__}.configure_optimizers built {len(built.param_groups)} "
                              f"parameter groups, then {len(optimizer.param_groups)}: build the same every call")
        # torch's schedulers count optimizer steps through a wrapper they put on optimizer.step
        # when built; the user's was built on another optimizer, so one that changes nothing puts
        # it on this one.
        torch.optim.lr_scheduler.ConstantLR(optimizer, factor=1.0, total_iters=0)
        for mine, theirs in zip(optimizer.param_groups, built.param_groups):
            mine.update({key: value for key, value in theirs.items() if key != "params"})  # lr as the scheduler set it
        _rebind(config.schedule["scheduler"], optimizer)
        return config.schedule


def _rebind(scheduler: Any, optimizer: torch.optim.Optimizer) -> None:
    """Point ``scheduler`` (and the schedulers it chains) at ``optimizer``."""
    scheduler.optimizer = optimizer
    for inner in getattr(scheduler, "_schedulers", ()):
        _rebind(inner, optimizer)


class TrainingStep:
    """fit's ``step_fn``: the module's training_step at the batch's index in its epoch; its loss,
    or the ``loss`` of the dict it returns."""

    def __call__(self, model: nn.Module, batch: Any) -> torch.Tensor:
        module = getattr(model, "_orig_mod", model)  # a compiled model's module
        where = position.current()
        with standing_in(module, where):
            out = module.training_step(*_step_arguments(module.training_step, batch, where.batch))
        if isinstance(out, dict) and "loss" in out:
            out = out["loss"]
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"{type(module).__name__}.training_step returned {type(out).__name__}; sn_trainer trains "
                            "every batch on its loss: return the loss tensor, or a dict with 'loss' (Lightning skips a "
                            "batch whose step returns None; sn_trainer does not)")
        return out


class ValidationMetrics:
    """fit's ``metric_fn``: what the module's validation_step logs with ``self.log``, each as
    Lightning's epoch value (the mean over batches, weighted by each batch's size), or the
    torchmetrics Metric it logged."""

    def __call__(self, model: nn.Module, batch: Any) -> dict[str, Any]:
        module = getattr(model, "_orig_mod", model)
        where = position.current()
        logged = Logged(batch, lightning_root(module))
        with standing_in(module, where, logged):
            module.validation_step(*_step_arguments(module.validation_step, batch, where.batch))
        return logged.terms


def _step_arguments(method: Any, batch: Any, batch_idx: int) -> tuple[Any, ...]:
    """``(batch, batch_idx)``, or ``(batch,)`` for a step that takes no index (as Lightning calls it)."""
    takes = [p for p in inspect.signature(method).parameters.values()
             if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)]
    return (batch, batch_idx) if len(takes) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in takes) else (batch,)


class Logged:
    """``self.log`` inside validation_step: each value's ``(value x batch size, batch size)``, as
    Lightning's mean over an epoch weighs it, or the Metric logged."""

    def __init__(self, batch: Any, root: str):
        self.batch, self.root = batch, root
        self.terms: dict[str, Any] = {}

    def log(self, name: str, value: Any, *args: Any, on_epoch: bool | None = None, reduce_fx: Any = "mean",
            batch_size: int | None = None, **kwargs: Any) -> None:
        if name in _RESERVED_NAMES:
            raise ValueError(f"validation_step logs {name!r}, which sn_trainer's evaluation reports itself "
                             f"(eval_{name}: training_step's loss); log it under another name")
        if on_epoch is False or reduce_fx not in ("mean", torch.mean):
            raise ValueError(f"validation_step logs {name!r} with on_epoch={on_epoch}, reduce_fx={reduce_fx!r}; "
                             "sn_trainer collects epoch means (the defaults): log a per-batch mean, or a torchmetrics "
                             "Metric")
        if hasattr(value, "compute") and hasattr(value, "update"):  # a torchmetrics Metric: merged, computed once
            self.terms[name] = value
            return
        if batch_size is None:
            batch_size = importlib.import_module(f"{self.root}.utilities.data").extract_batch_size(self.batch)
        # A float64 tensor: sn_trainer sums the terms in float64, and a Python float would not stay one.
        value = torch.as_tensor(value).detach().to(torch.float64).reshape(())
        value_sum, count = self.terms.get(name, (torch.zeros((), dtype=torch.float64), 0))
        self.terms[name] = (value_sum + value * batch_size, count + batch_size)


class TrainerStandIn:
    """What the module's ``self.trainer`` is inside sn_trainer: where the run is; anything else of
    Lightning's Trainer refused in one line."""

    def __init__(self, where: position.Position, module_name: str):
        self._where, self._module_name = where, module_name

    @property
    def global_step(self) -> int:
        return self._known("global_step", self._where.step)

    @property
    def current_epoch(self) -> int:
        return self._known("current_epoch", self._where.epoch)

    def _known(self, name: str, value: int | None) -> int:
        if value is None:
            raise ConfigError(f"{self._module_name} reads self.{name} in an evaluation, where sn_trainer evaluates "
                              "weights, not a step: leave it out of validation_step")
        return value

    def __getattr__(self, name: str) -> Any:
        raise ConfigError(f"{self._module_name} reads self.trainer.{name}, and no Lightning Trainer runs here: "
                          "sn_trainer's module knows only global_step and current_epoch; pass what it needs to "
                          "the module's __init__")


@contextlib.contextmanager
def standing_in(module: nn.Module, where: position.Position | None = None, logged: Logged | None = None,
                methods: dict[str, Any] | None = None) -> Iterator[None]:
    """While the block runs, the module's ``self.trainer`` is a ``TrainerStandIn`` at ``where``,
    its ``self.log`` goes to ``logged`` (None: dropped), and each of ``methods`` is the module's
    method of that name; all put back after."""
    replaced = {"log": logged.log if logged is not None else _dropped, **(methods or {})}
    trainer, own = module.__dict__.get("_trainer"), {name: module.__dict__.get(name) for name in replaced}
    module._trainer = TrainerStandIn(where or position.Position(), type(module).__name__)
    for name, method in replaced.items():
        setattr(module, name, method)
    try:
        yield
    finally:
        module._trainer = trainer
        for name, method in own.items():
            if method is None:
                delattr(module, name)
            else:
                setattr(module, name, method)


def _dropped(*args: Any, **kwargs: Any) -> None:
    """``self.log`` where nothing collects it (training_step, hooks)."""


def call_hook(module: nn.Module, hook: str, where: position.Position | None = None) -> None:
    """One of the module's hooks, as Lightning's fit calls it (setup and teardown with ``"fit"``)."""
    with standing_in(module, where):
        getattr(module, hook)(*(("fit",) if hook in _WITH_STAGE else ()))


class EndHooks(Callback):
    """The module's end-of-fit hooks (on_train_end, on_fit_end, teardown), on the trained model."""

    observes_only = True
    essential = True  # a hook that raises fails the fit, as under Lightning's Trainer

    def on_fit_end(self, trainer: Any, result: Any) -> None:
        for hook in AFTER:
            call_hook(result._model, hook, position.Position(result.steps, None, 0))


# --- manual optimization: one phase per optimizer ------------------------------------------------


def manual_phases(module: nn.Module, root: str) -> list[Phase]:
    """Under manual optimization, a phase per optimizer configure_optimizers returns, in its order:
    phase k runs training_step up to optimizer k's ``step()``, and trains on what
    ``manual_backward`` was given since the optimizer before it stepped (the earlier ones' steps
    the workers made already, before this phase started; the code after is not run).

    Raises:
        ConfigError: a scheduler (stepped by the module itself, which sn_trainer cannot split).
    """
    parse = importlib.import_module(f"{root}.core.optimizer")
    with standing_in(module):
        optimizers, schedulers, _ = parse._configure_optimizers(module.configure_optimizers())
    if schedulers:
        raise ConfigError(f"{type(module).__name__} uses manual optimization with a scheduler, which its "
                          "training_step steps itself; sn_trainer cannot step it there: give each optimizer's "
                          "schedule to an sn_trainer.Phase(step_fn, params, optimizer, scheduler)")
    count = len(optimizers)
    return [Phase(ManualStep(k, count), ModuleOptimizer(k), name=f"optimizer{k}") for k in range(count)]


class _PhaseLoss(Exception):  # noqa: N818 - not an error: how a phase's loss leaves training_step
    """Raised at the phase's optimizer's ``step()``, carrying the phase's loss out of training_step."""

    def __init__(self, loss: torch.Tensor):
        super().__init__()
        self.loss = loss


class _PhasePass:
    """One run of training_step for phase ``phase``: the losses manual_backward was given since
    the last optimizer step, and which optimizer must step next."""

    def __init__(self, module_name: str, phase: int):
        self.module_name, self.phase, self.pending, self.next = module_name, phase, None, 0

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        self.pending = loss if self.pending is None else self.pending + loss

    def stepped(self, index: int) -> None:
        if index != self.next:
            raise ConfigError(f"{self.module_name}.training_step stepped optimizer {index} where optimizer "
                              f"{self.next} was due: sn_trainer steps each optimizer once a step, in the order "
                              "configure_optimizers returns them; step them in that order")
        self.next += 1
        loss, self.pending = self.pending, None
        if index == self.phase:
            if loss is None:
                raise ConfigError(f"{self.module_name}.training_step stepped optimizer {index} with no "
                                  "manual_backward before it: call self.manual_backward(loss) first")
            raise _PhaseLoss(loss)


class StandInOptimizer:
    """What ``self.optimizers()`` gives training_step: ``step()`` ends the phase at its own optimizer
    and passes over an earlier one's (the workers made it); ``zero_grad()`` does nothing (the
    workers clear the gradients of each phase)."""

    def __init__(self, index: int, run: _PhasePass):
        self._index, self._run = index, run

    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise ConfigError(f"{self._run.module_name}.training_step steps optimizer {self._index} with a closure, "
                              "which sn_trainer cannot split: compute the loss, manual_backward it, then step()")
        self._run.stepped(self._index)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The workers clear each phase's gradients themselves."""

    def __getattr__(self, name: str) -> Any:
        raise ConfigError(f"{self._run.module_name}.training_step reads optimizer.{name}: under sn_trainer "
                          "self.optimizers() gives step() and zero_grad() only (each worker's optimizer holds "
                          "its shard)")


class ManualStep:
    """Phase ``phase``'s step function: training_step run until optimizer ``phase`` steps."""

    def __init__(self, phase: int, count: int):
        self.phase, self.count = phase, count

    def __call__(self, model: nn.Module, batch: Any) -> torch.Tensor:
        module = getattr(model, "_orig_mod", model)
        where, name = position.current(), type(module).__name__
        run = _PhasePass(name, self.phase)
        optimizers = [StandInOptimizer(k, run) for k in range(self.count)]
        methods = {"optimizers": lambda use_pl_optimizer=True: optimizers[0] if self.count == 1 else optimizers,
                   "manual_backward": run.backward, "toggle_optimizer": _dropped, "untoggle_optimizer": _dropped,
                   "toggled_optimizer": lambda optimizer: contextlib.nullcontext(), "lr_schedulers": lambda: None}
        try:
            with standing_in(module, where, methods=methods):
                module.training_step(*_step_arguments(module.training_step, batch, where.batch))
        except _PhaseLoss as done:
            return done.loss
        raise ConfigError(f"{name}.training_step did not step optimizer {self.phase} on batch {where.batch}: "
                          "sn_trainer steps every optimizer every step (a D stepped every other batch is not "
                          "one of its shapes)")
