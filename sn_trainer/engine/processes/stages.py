"""What a worker is doing, by name: the stages of a training step, whose seconds are measured, and
the stages a heartbeat reports besides them."""
from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

# A step's time, split; "verify": worker 0 comparing a verified step with one process's (engine/step/verification.py).
STEP_STAGES = ("data", "forward", "backward", "reduce", "update", "verify", "wait")
STAGES = ("setup", *STEP_STAGES, "eval", "sync", "checkpoint")  # what a heartbeat says a worker is in
# Stages in which a worker waits for its peers: one stuck there is a victim, not the cause.
WAITING = frozenset({"reduce", "wait", "sync", "setup"})


@dataclass
class StageTimer:
    """Seconds per stage of the steps, and a heartbeat at every change of stage."""

    beat: Callable[[str], None]
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STEP_STAGES, 0.0))

    @contextmanager
    def __call__(self, stage: str):
        self.beat(stage)
        start = time.perf_counter()
        yield
        self.seconds[stage] += time.perf_counter() - start
