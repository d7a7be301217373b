"""The command line's optimizers and learning-rate schedules (``optim.*``)."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from .run_config import OptimConfig


@dataclass(frozen=True)
class LRSchedule:
    """Factor applied to the base lr at each optimizer step: linear warm-up, then the schedule."""

    kind: str
    total_steps: int
    warmup_steps: int = 0
    step_every: int = 1000
    gamma: float = 0.1

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.kind == "cosine":
            span = max(1, self.total_steps - self.warmup_steps)
            progress = min(1.0, (step - self.warmup_steps) / span)
            return 0.5 * (1 + math.cos(math.pi * progress))
        if self.kind == "step":
            return self.gamma ** ((step - self.warmup_steps) // self.step_every)
        return 1.0


def effective_lr(cfg: OptimConfig, step_batch: int) -> float:
    """The base lr, scaled linearly with the batch when ``scale_lr`` asks for it."""
    return cfg.lr * step_batch / cfg.reference_batch if cfg.scale_lr else cfg.lr


def build_optimizer(cfg: OptimConfig, step_batch: int):
    """A factory ``params -> optimizer`` (each worker calls it on its shard)."""
    lr = effective_lr(cfg, step_batch)
    if cfg.name == "adamw":
        return functools.partial(torch.optim.AdamW, lr=lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
    return functools.partial(torch.optim.SGD, lr=lr, momentum=cfg.momentum, nesterov=cfg.nesterov,
                             weight_decay=cfg.weight_decay)


def build_scheduler(cfg: OptimConfig, total_steps: int):
    """A factory ``optimizer -> LambdaLR``, or None when the lr stays constant."""
    if cfg.schedule == "constant" and cfg.warmup_steps == 0:
        return None
    schedule = LRSchedule(cfg.schedule, total_steps, cfg.warmup_steps, cfg.step_every, cfg.gamma)
    return functools.partial(torch.optim.lr_scheduler.LambdaLR, lr_lambda=schedule)
