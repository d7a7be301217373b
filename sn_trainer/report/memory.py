"""Peak memory of all workers together, counted by PSS so that shared pages count once."""
from __future__ import annotations

import time

import psutil


def summed_pss(pids: list[int]) -> int:
    """Proportional set size of these processes, summed; pages shared by k of them count 1/k each."""
    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_full_info().pss
        except (psutil.NoSuchProcess, psutil.AccessDenied, AttributeError):
            continue  # it just exited, or PSS is not available on this system
    return total


class PeakMemory:
    """Called with the workers' pids from time to time; remembers the largest sum seen."""

    def __init__(self, min_interval_s: float = 0.5):
        self.peak_bytes = 0
        self.min_interval_s = min_interval_s
        self._last = 0.0

    def __call__(self, pids: list[int]) -> None:
        now = time.monotonic()
        if now - self._last < self.min_interval_s:
            return
        self._last = now
        self.peak_bytes = max(self.peak_bytes, summed_pss(pids))
