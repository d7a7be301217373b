"""What a checkpoint file holds, by format version: its contents built, and its phases' optimizer
and scheduler states read back from either version.

A checkpoint holds the model's state_dict, the optimizer's state per parameter name (as one
process's optimizer would hold it, so a run may resume with another worker count), the step
reached, every worker's random state, the sample order a resume must agree with (batch size,
accumulate, seed, shuffle, drop_last, training-set size), the resolved config and a format version.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from ..errors import CheckpointError

FORMAT = "sn_trainer-checkpoint"
# 3: each worker's random state is torch's, numpy's and Python's streams; 2: torch's alone,
# optimizer state per parameter name, with groups; 1: one flat optimizer state, one group
VERSION = 3


def build(step: int, model: dict[str, torch.Tensor], optimizer: dict[str, Any] | None, rng: list[Any],
          run: dict[str, Any], config: dict[str, Any] | None, schedule: dict[str, Any] | None = None,
          ema: dict[str, torch.Tensor] | None = None, aliases: dict[str, str] | None = None,
          callbacks: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The checkpoint's contents (``optimizer`` as ``engine.optimizer_state.gather`` gives it; ``schedule``: a
    metric-driven scheduler's state, which a resume cannot replay; ``ema``: the parameters'
    moving average by name; ``aliases``: the model's tied names, alias -> first name;
    ``callbacks``: the stateful callbacks' states at this step, by ``Callbacks.states``' keys)."""
    return {"format": FORMAT, "version": VERSION, "step": step, "model": model, "optimizer": optimizer, "rng": rng,
            "run": run, "config": config or {}, "schedule": schedule, "ema": ema, "aliases": aliases or {},
            "callbacks": callbacks or {}}


def is_finite(checkpoint: dict[str, Any]) -> bool:
    return all(torch.isfinite(t).all() for t in checkpoint["model"].values() if t.is_floating_point())



def phase_entries(optimizers: list[dict[str, Any] | None],
                  schedules: list[dict[str, Any] | None]) -> tuple[Any, Any]:
    """How a checkpoint holds each phase's optimizer and scheduler state: as they are for one phase
    (the format of version 2), as lists for several."""
    if len(optimizers) == 1:
        return optimizers[0], schedules[0]
    return optimizers, schedules


def phase_states(checkpoint: dict[str, Any], shapes: list[tuple[str, tuple[int, ...]]], phases: int,
                 path: str | os.PathLike) -> tuple[list[dict[str, Any] | None], list[dict[str, Any] | None]]:
    """Each phase's optimizer state (per parameter name) and scheduler state.

    Raises:
        CheckpointError: it was written with another number of phases.
    """
    held, schedule = optimizer_state(checkpoint, shapes), checkpoint.get("schedule")
    optimizers = held if isinstance(held, list) else [held]
    schedules = schedule if isinstance(schedule, list) else [schedule] * len(optimizers)
    if len(optimizers) != phases:
        raise CheckpointError(f"{path} was written by a run of {len(optimizers)} optimizers (phases), this run has "
                              f"{phases}; resume with the same phases, or start afresh without resume")
    return optimizers, schedules


def optimizer_state(checkpoint: dict[str, Any], shapes: list[tuple[str, tuple[int, ...]]]) -> dict[str, Any] | None:
    """The optimizer state per parameter name (``engine.memory.state`` form), from either format version.

    ``shapes`` are the trainable parameters' names and shapes in model order: a version-1
    checkpoint kept one flat, full-length state in that order.
    """
    saved = checkpoint.get("optimizer")
    if checkpoint.get("version", 1) >= 2 or saved is None:
        return saved
    state, per_element, offset = {}, {}, 0
    for name, shape in shapes:
        n = 1
        for d in shape:
            n *= d
        held = {key: value[offset : offset + n].reshape(shape).clone() for key, value in saved["per_element"].items()}
        held.update({key: (v.clone() if isinstance(v, torch.Tensor) else v) for key, v in saved["scalars"].items()})
        state[name], per_element[name] = held, list(saved["per_element"])
        offset += n
    return {"param_groups": [{**saved["param_group"], "params": [name for name, _ in shapes]}], "state": state,
            "per_element": per_element}
