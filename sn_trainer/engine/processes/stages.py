"""What a worker is doing, by name: the stages of a training step, whose seconds are measured, and
the stages a heartbeat reports besides them."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

# A step's time, split; "verify": worker 0 comparing a verified step with one process's (engine/step/verification.py).
STEP_STAGES = ("data", "forward", "backward", "reduce", "update", "verify", "wait")
STAGES = ("setup", *STEP_STAGES, "eval", "sync", "checkpoint")  # what a heartbeat says a worker is in
# Stages in which a worker waits for its peers: one stuck there is a victim, not the cause.
WAITING = frozenset({"reduce", "wait", "sync", "setup"})


@dataclass
class StageTimer:
    """Seconds per stage of the steps, and a heartbeat at every change of stage.

    ``with timer("forward"):`` times its block; a plain object rather than a generator-based
    context manager, as a step enters several stages and the timer should cost it nothing."""

    beat: Callable[[str], None]
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STEP_STAGES, 0.0))

    def __call__(self, stage: str) -> "_Timed":
        return _Timed(self, stage)


class _Timed:
    __slots__ = ("timer", "stage", "start")

    def __init__(self, timer: StageTimer, stage: str):
        self.timer, self.stage = timer, stage

    def __enter__(self) -> None:
        self.timer.beat(self.stage)
        self.start = time.perf_counter()

    def __exit__(self, *exc) -> None:
        self.timer.seconds[self.stage] += time.perf_counter() - self.start
