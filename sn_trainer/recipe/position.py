"""Where a worker is in the run while the user's code runs: the step, the epoch and the batch's index.

A step function gets ``(model, batch)`` only; code written for a framework that hands it more (a
LightningModule's ``training_step(batch, batch_idx)``, its ``global_step`` and ``current_epoch``)
reads it here. Like ``gather``'s, the position is ambient: set around each micro-batch of a
training step and each chunk of an evaluation, and the start of the run everywhere else (the
rehearsal, the loss probe, a plain loop).
"""
from __future__ import annotations

import contextvars
import dataclasses
from contextlib import AbstractContextManager
from dataclasses import dataclass

from . import ambient


@dataclass(frozen=True)
class Position:
    """``step``: optimizer steps done before this one; ``epoch``: the epoch it is in (from 0);
    ``batch``: the micro-batch's index within the epoch (a step of ``accumulate`` micro-batches
    counts ``accumulate``), or in an evaluation the chunk's index among this worker's chunks (where
    step and epoch are None: an evaluation knows its weights, not the step that made them)."""

    step: int | None = 0
    epoch: int | None = 0
    batch: int = 0
    checking: bool = False  # a check's call (the verification's one process), not the run's own step


def in_training(step: int, micro: int, steps_per_epoch: int, accumulate: int) -> Position:
    """Micro-batch ``micro`` of step ``step`` (both from 0)."""
    return Position(step, step // steps_per_epoch, (step % steps_per_epoch) * accumulate + micro)


def checking(where: Position) -> Position:
    """``where``, as a check that repeats the step there sees it (``engine.step.verification``)."""
    return dataclasses.replace(where, checking=True)


_current: contextvars.ContextVar[Position | None] = contextvars.ContextVar("sn_trainer_position", default=None)


def at(position: Position) -> AbstractContextManager[Position]:
    """Make ``position`` what ``current`` returns while the block runs."""
    return ambient.within(_current, position)


def in_evaluation(chunk: int) -> Position:
    """Chunk ``chunk`` (from 0) of this worker's share of an evaluation."""
    return Position(None, None, chunk)


def current() -> Position:
    return _current.get() or Position()
