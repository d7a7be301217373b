"""The user's learning-rate scheduler, stepped as it asks: per optimizer step, per epoch, or on a metric.

What ``scheduler(optimizer)`` returns may be:

- a torch scheduler, stepped after every optimizer step (as sn_trainer always did);
- Lightning's dict, ``{"scheduler": s, "interval": "step" | "epoch", "frequency": k, "monitor":
  "eval_loss"}``: stepped every k optimizer steps or every k epochs;
- ``ReduceLROnPlateau`` (bare or in the dict): stepped with the monitored metric (default
  ``eval_loss``) after each evaluation;
- a timm scheduler (``step_update`` and ``step(epoch, metric)``): ``step_update(num_updates)``
  after every optimizer step and ``step(epoch, metric)`` at each epoch's end, as timm's own
  training script calls them.

Every worker steps its own copy at the same points with the same metric (evaluation results are
global sums, the same in every worker), so every shard's learning rate is the same.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

LIGHTNING_KEYS = {"scheduler", "interval", "frequency", "monitor", "strict", "name"}


class Schedule:
    """One worker's scheduler and when to step it.

    Raises:
        ValueError: a dict with unknown keys, an interval other than step or epoch, a frequency
            below 1, or a monitored metric without an evaluation to report it (checked before
            the workers start, by the preflight).
    """

    def __init__(self, built: Any, steps_per_epoch: int):
        config = dict(built) if isinstance(built, Mapping) else {"scheduler": built}
        unknown = set(config) - LIGHTNING_KEYS
        if unknown or "scheduler" not in config:
            raise ValueError(f"a scheduler dict holds 'scheduler' and any of interval, frequency, monitor; got keys "
                             f"{sorted(config)}")
        self.scheduler = config["scheduler"]
        self.steps_per_epoch = steps_per_epoch
        self.plateau = isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
        self.timm = hasattr(self.scheduler, "step_update") and not isinstance(
            self.scheduler, torch.optim.lr_scheduler.LRScheduler)
        self.interval = config.get("interval", "step")
        self.frequency = config.get("frequency", 1)
        self.monitor = config.get("monitor") or ("eval_loss" if self.plateau else None)
        if self.interval not in ("step", "epoch"):
            raise ValueError(f"a scheduler's interval is 'step' or 'epoch', got {self.interval!r}")
        if not (isinstance(self.frequency, int) and self.frequency >= 1):
            raise ValueError(f"a scheduler's frequency is an integer >= 1, got {self.frequency!r}")
        if not (self.plateau or self.timm or hasattr(self.scheduler, "step")):
            raise ValueError(f"scheduler(optimizer) gave {type(self.scheduler).__name__}, which has no step(); return "
                             "a torch or timm scheduler, or Lightning's dict {'scheduler': ..., 'interval': ...}")

    @property
    def needs_metric(self) -> bool:
        """Whether it steps on an evaluation's metric (ReduceLROnPlateau, or a timm plateau)."""
        return self.plateau or (self.timm and self.monitor is not None)

    def after_step(self, step_done: int) -> None:
        """After optimizer step ``step_done`` (counted from 1)."""
        if self.timm:
            self.scheduler.step_update(num_updates=step_done)
        elif not self.plateau and self.interval == "step" and step_done % self.frequency == 0:
            self.scheduler.step()

    def after_epoch(self, epoch_done: int, metrics: Mapping[str, Any] | None) -> None:
        """At the end of epoch ``epoch_done`` (from 1), after its evaluation's ``metrics`` if any."""
        if self.timm:
            self.scheduler.step(epoch_done, metrics.get(self.monitor) if metrics and self.monitor else None)
        elif not self.plateau and self.interval == "epoch" and epoch_done % self.frequency == 0:
            self.scheduler.step()

    def after_evaluation(self, metrics: Mapping[str, Any]) -> None:
        """After an evaluation: a plateau scheduler steps on its metric (a failed evaluation has none)."""
        if self.plateau and self.monitor in metrics:
            self.scheduler.step(metrics[self.monitor])

    def fast_forward(self, steps_done: int) -> None:
        """Where a resumed run starts: the steps and epochs before it, replayed (no metric)."""
        for done in range(1, steps_done + 1):
            self.after_step(done)
            if done % self.steps_per_epoch == 0:
                self.after_epoch(done // self.steps_per_epoch, None)

    def state_dict(self) -> dict[str, Any] | None:
        """What a checkpoint keeps of a plateau scheduler: metric-driven, it cannot be replayed."""
        return self.scheduler.state_dict() if self.plateau else None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A plateau scheduler as a checkpoint left it, with the learning rates it had set (they
        live in the optimizer's groups, whose options a resume otherwise takes from this run)."""
        self.scheduler.load_state_dict(state)
        for group, lr in zip(self.scheduler.optimizer.param_groups, state.get("_last_lr") or []):
            group["lr"] = lr
