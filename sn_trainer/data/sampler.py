"""The global order of samples, computed identically by every worker, and each worker's slice;
a dataset that orders itself is told the epoch (``EpochTeller``)."""
from __future__ import annotations

import torch


def epoch_order(num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    """A permutation of the dataset that depends only on (seed, epoch)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_samples, generator=generator)


def slice_bounds(batch_size: int, world_size: int, rank: int) -> tuple[int, int]:
    """Worker ``rank``'s part [start, stop) of a batch: sizes differ by at most one.

    The first ``batch_size % world_size`` workers take one sample more.
    """
    base, extra = divmod(batch_size, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def part_bounds(count: int, unit: int) -> list[tuple[int, int]]:
    """Bounds of the whole parts of ``unit`` in ``count`` positions (a short rest left out)."""
    return [(lo, lo + unit) for lo in range(0, count - unit + 1, unit)]


def steps_per_epoch(num_samples: int, batch_size: int, accumulate: int, drop_last: bool) -> int:
    step_batch = batch_size * accumulate
    return num_samples // step_batch if drop_last else -(-num_samples // step_batch)


class GlobalBatches:
    """Which samples form micro-batch ``micro`` of optimizer step ``step`` of ``epoch``.

    Each epoch's order is ``epoch_order`` of (seed, epoch), or, without ``shuffle``, the indices
    in order: neither depends on the worker count, so a resume with another one reads on alike.

    An optimizer step consumes ``accumulate`` consecutive micro-batches of ``batch_size``
    samples, so ``accumulate=k`` with batch B/k covers the same samples as B with k=1. With
    ``drop_last`` the last incomplete step of an epoch is left out; without, it trains on what
    is left (its micro-batches may be short, or empty).
    """

    def __init__(self, num_samples: int, batch_size: int, accumulate: int, seed: int, drop_last: bool = True,
                 shuffle: bool = True):
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.accumulate = accumulate
        self.seed = seed
        self.shuffle = shuffle
        self.steps_per_epoch = steps_per_epoch(num_samples, batch_size, accumulate, drop_last)
        self._epoch = -1
        self._order = torch.empty(0, dtype=torch.long)

    def indices(self, epoch: int, step: int, micro: int) -> torch.Tensor:
        if epoch != self._epoch:
            self._order = (epoch_order(self.num_samples, self.seed, epoch) if self.shuffle
                           else torch.arange(self.num_samples))
            self._epoch = epoch
        start = (step * self.accumulate + micro) * self.batch_size
        return self._order[start : start + self.batch_size]


class EpochTeller:
    """Calls the dataset's ``set_epoch`` when the epoch read changes (only where it has one)."""

    def __init__(self, dataset):
        self._set = getattr(dataset, "set_epoch", None)
        self._epoch = None

    def __call__(self, epoch: int) -> None:
        if self._set is not None and epoch != self._epoch:
            self._set(epoch)
        self._epoch = epoch
