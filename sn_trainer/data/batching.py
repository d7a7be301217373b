"""Turning a list of sample indices into one (inputs, targets) batch, without per-worker copies."""
from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset, TensorDataset
from torch.utils.data._utils.collate import default_collate

from ..config import ConfigError


def fetch_batch(dataset: Dataset, indices: torch.Tensor) -> tuple[Any, Any]:
    """Gather ``indices`` from ``dataset`` as one batch.

    Datasets that can gather a whole batch at once (a ``get_batch(indices)`` method, as the
    built-in ones have, or a TensorDataset) do so in one vectorised index; any other map-style
    dataset is read item by item and collated like a DataLoader would.
    """
    if hasattr(dataset, "get_batch"):
        return dataset.get_batch(indices)
    if isinstance(dataset, TensorDataset):
        inputs, targets = (t[indices] for t in dataset.tensors[:2])
        return inputs, targets
    items = [dataset[int(i)] for i in indices]
    inputs, targets = default_collate(items)[:2]
    return inputs, targets


def check_sample(dataset: Dataset, name: str) -> None:
    """Refuse, up front, a dataset whose items are not (input, target) pairs."""
    try:
        size = len(dataset)
    except TypeError:
        raise ConfigError(f"{name} must be a map-style dataset with __len__ and __getitem__") from None
    if size == 0:
        raise ConfigError(f"{name} is empty")
    item = dataset[0]
    if not (isinstance(item, (tuple, list)) and len(item) == 2):
        raise ConfigError(
            f"{name}[0] is {type(item).__name__}, not an (input, target) pair; "
            "wrap the dataset so that __getitem__ returns (input, target)"
        )
    if not isinstance(item[0], torch.Tensor):
        raise ConfigError(f"{name}[0][0] (the input) is {type(item[0]).__name__}, not a torch.Tensor")


def share_dataset(dataset: Dataset) -> None:
    """Move a dataset's tensors to shared memory so that workers map them instead of copying."""
    if isinstance(dataset, TensorDataset):
        for t in dataset.tensors:
            t.share_memory_()
    elif hasattr(dataset, "share_memory_"):
        dataset.share_memory_()
