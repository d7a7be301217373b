"""A worker's micro-batches, step after step: read when asked, or one step ahead in a thread."""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from .batching import in_layout
from .source import Source


class Feed:
    """Worker ``rank`` of ``world``'s slices of every micro-batch of a step, laid out for the model.

    With ``ahead``, step k+1's slices are read in a thread while step k computes (the thread runs
    on the worker's own cores; reading files or decoding images mostly runs outside the GIL).
    Steps are asked for in order; the thread reads the source in that order too.
    """

    def __init__(self, source: Source, rank: int, world: int, accumulate: int,
                 channels_last: bool, last_step: int, ahead: bool):
        self.source, self.rank, self.world = source, rank, world
        self.accumulate, self.channels_last, self.last_step = accumulate, channels_last, last_step
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="sn_trainer-read") if ahead else None
        self._next: tuple[int, Future] | None = None

    def step(self, step: int) -> list[tuple[Any, int]]:
        """The (batch, samples) of each micro-batch of ``step``."""
        if self._pool is None:
            return self._read(step)
        ahead, self._next = self._next, None
        if ahead is not None and ahead[0] == step:
            batches = ahead[1].result()
        else:
            if ahead is not None:
                ahead[1].exception()  # the source is read by one thread at a time
            batches = self._read(step)
        self._next = (step + 1, self._pool.submit(self._read, step + 1)) if step + 1 < self.last_step else None
        return batches

    def whole(self, step: int) -> list[tuple[Any, int]]:
        """Every micro-batch of ``step`` whole, the global batch as one process reads it, collated as
        a plain DataLoader collates it (what a verified step compares with). A read ahead in flight
        ends first: the source is read by one thread at a time."""
        if self._next is not None:
            self._next[1].exception()  # waits; what it raised is raised when its step asks for it
        return [(in_layout(batch, self.channels_last), samples)
                for batch, samples in (self.source.micro_batch(step, micro) for micro in range(self.accumulate))]

    def _read(self, step: int) -> list[tuple[Any, int]]:
        slices = [self.source.micro_slice(step, micro, self.rank, self.world) for micro in range(self.accumulate)]
        return [(in_layout(batch, self.channels_last), samples) for batch, samples in slices]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
