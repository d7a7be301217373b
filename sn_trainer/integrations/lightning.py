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
``validation_step``) or dropped (elsewhere: the run reports each step's loss itself)
(``lightning_stand_in``). The module's steps, optimizer and scheduler become fit's arguments in
``lightning_module``, its phases under manual optimization in ``lightning_manual``; this module
refuses what does not map, calls the hooks and puts the rest in fit's places. Lightning is
imported only for a model whose class comes from it.
"""
from __future__ import annotations

import dataclasses
import importlib
import logging
from typing import Any

from torch import nn

from ..callbacks import Callback
from ..recipe import position
from ..errors import ConfigError
from ..fit.resolve import FitInputs
from ..phase import Phase
from .lightning_manual import manual_phases
from .lightning_module import (ModuleOptimizer, ModuleScheduler, OptimizerConfig, TrainingStep, ValidationMetrics,
                               lightning_optimizers, lightning_root, overrides)
from .lightning_stand_in import standing_in

log = logging.getLogger(__name__)

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
