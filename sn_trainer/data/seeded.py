"""Random augmentation that is the same however a batch is split: each sample's draws seeded from
(seed, epoch, index).

A dataset that augments with torch's, numpy's or ``random``'s global generators (torchvision's
transforms, timm's, a script's ``random.random()``) draws, in each worker, from that worker's own
streams: the run is like DDP, not equal to one process. Wrapped in ``SeededPerSample``, reading
sample ``i`` of epoch ``e`` seeds all three generators from ``(seed, e, i)`` and puts them back
after, so the sample comes out the same in any worker, in any order, and in a plain DataLoader
over the same wrapper: the run is exact again.
"""
from __future__ import annotations

from typing import Any

from torch.utils.data import Dataset

from . import random_state

_MIX = 1_000_003  # a prime: (seed, epoch, index) -> one seed, distinct for any index below it


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of sample ``index``'s draws in ``epoch`` (the folder dataset's crops use it too)."""
    return ((seed * _MIX + epoch) * _MIX + index) % 2**63


class SeededPerSample(Dataset):
    """``dataset``, each item read with torch's, numpy's and ``random``'s generators seeded from
    ``(seed, epoch, index)`` and restored afterwards. The Trainer calls ``set_epoch`` before each
    epoch; a plain loop does the same to get the same samples.

        train_set = sn_trainer.data.SeededPerSample(ImageFolder(root, transform=augment), seed=0)
    """

    def __init__(self, dataset: Dataset, seed: int = 0):
        self.dataset, self.seed, self.epoch = dataset, seed, 0

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        inner = getattr(self.dataset, "set_epoch", None)
        if inner is not None:
            inner(epoch)

    def __getitem__(self, index: int) -> Any:
        with random_state.kept():
            random_state.seed(sample_seed(self.seed, self.epoch, int(index)))
            return self.dataset[index]
