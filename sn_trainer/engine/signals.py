"""Ctrl-C and SIGTERM during a run: the first asks the workers to stop after the current step,
the second stops at once."""
from __future__ import annotations

import signal
import threading
from contextlib import contextmanager

import torch


@contextmanager
def graceful_stop(control: torch.Tensor, slot: int):
    """While inside, SIGINT/SIGTERM set ``control[slot]``; a second signal raises KeyboardInterrupt.

    Yields a one-element list that holds the first signal's number once one arrives. Outside
    the main thread (where Python cannot install handlers) it only yields.
    """
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def handler(signum, frame):
        if received:
            raise KeyboardInterrupt  # second signal: stop now (the launcher kills the workers)
        received.append(signum)
        control[slot] = 1

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield received
    finally:
        for s, old in previous.items():
            signal.signal(s, old)
