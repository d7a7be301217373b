"""Stopping a run on request: SIGINT or SIGTERM to any of its processes ends it at a step boundary.

The request lives in shared memory (``StopFlags``): the launcher and every worker set it when a
signal reaches them, so ``kill -TERM <launcher>``, ``kill -TERM <worker>`` and ``kill -TERM
-<group>`` (what schedulers do) all end the same way. Worker 0 reads it after each step and
names the step every worker stops after; a second signal to the launcher stops at once.
"""
from __future__ import annotations

import signal
import threading
from contextlib import contextmanager

import torch

_SIGNAL, _STOP_AT = 0, 1
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopFlags:
    """A shared int64 pair: the first stop signal received anywhere (0: none), and the step to stop after."""

    def __init__(self, block: torch.Tensor):
        self.block = block

    @classmethod
    def allocate(cls) -> "StopFlags":
        return cls(torch.zeros(2, dtype=torch.int64).share_memory_())

    def request(self, signum: int) -> None:
        if int(self.block[_SIGNAL]) == 0:
            self.block[_SIGNAL] = signum

    @property
    def signal(self) -> int:
        """The signal that asked the run to stop, or 0."""
        return int(self.block[_SIGNAL])

    def decide(self, step_done: int) -> None:
        """Worker 0, after a step, before the closing barrier: all workers stop after this step."""
        if self.signal and not int(self.block[_STOP_AT]):
            self.block[_STOP_AT] = step_done

    def stops_after(self, step_done: int) -> bool:
        return int(self.block[_STOP_AT]) == step_done

    def reset(self) -> None:
        """A new run: no request, no decision."""
        self.block.zero_()

    def clear_for_restart(self) -> None:
        """A restart starts a new stop decision; a stop request itself is never cleared."""
        self.block[_STOP_AT] = 0


def stop_on_signals(flags: StopFlags) -> None:
    """In a worker: SIGINT and SIGTERM ask the whole run to stop at the next step boundary."""
    for s in STOP_SIGNALS:
        signal.signal(s, lambda signum, frame: flags.request(signum))


@contextmanager
def graceful_stop(flags: StopFlags):
    """In the launcher: the first SIGINT/SIGTERM requests a stop; a second raises KeyboardInterrupt.

    Outside the main thread (where Python cannot install handlers) it only yields.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def handler(signum, frame):
        if received:
            raise KeyboardInterrupt  # second signal: stop now (the launcher kills the workers)
        received.append(signum)
        flags.request(signum)

    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old)
