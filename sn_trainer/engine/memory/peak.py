"""Peak memory of all workers together, counted by PSS so that shared pages count once."""
from __future__ import annotations

import time

import psutil


def pss_bytes(pid: int | None = None) -> int:
    """Proportional set size of one process (pages shared by k processes count 1/k); 0 if unknown."""
    try:
        return psutil.Process(pid).memory_full_info().pss
    except (psutil.NoSuchProcess, psutil.AccessDenied, AttributeError):
        return 0  # it just exited, or PSS is not available on this system


class PeakMemory:
    """Called with the workers' pids from time to time; remembers the largest summed PSS seen.

    Reading a process's PSS walks its whole memory map (about 9 ms for a process with torch
    loaded) and holds that process's mmap lock meanwhile, so it steals time from training:
    samples come at 0.5, 1, 2, 4 and 8 s, then every 10 s. The workers also report their own
    PSS at the end of training, which the trainer adds up.
    """

    def __init__(self, first_after_s: float = 0.5, max_interval_s: float = 10.0):
        self.peak_bytes = 0
        self._interval, self._max_interval = first_after_s, max_interval_s
        self._next = time.monotonic() + first_after_s

    def __call__(self, pids: list[int]) -> None:
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self._interval
        self._interval = min(self._interval * 2, self._max_interval)
        self.peak_bytes = max(self.peak_bytes, sum(pss_bytes(pid) for pid in pids))
