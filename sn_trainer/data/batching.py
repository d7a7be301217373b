"""Turning a list of sample indices into one batch, without per-worker copies of the dataset."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils.data import Dataset, TensorDataset
from torch.utils.data._utils.collate import default_collate

from ..errors import ConfigError


def fetch_batch(dataset: Dataset, indices: torch.Tensor) -> Any:
    """Gather ``indices`` from ``dataset`` as one batch, collated as a DataLoader would.

    Datasets that can gather a whole batch at once (a ``get_batch(indices)`` method, as the
    built-in ones have, or a TensorDataset) do so in one vectorised index; any other map-style
    dataset is read item by item and collated.
    """
    if hasattr(dataset, "get_batch"):
        return dataset.get_batch(indices)
    if isinstance(dataset, TensorDataset):
        return tuple(t[indices] for t in dataset.tensors)
    return default_collate([dataset[int(i)] for i in indices])


def map_tensors(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``batch`` with ``fn`` applied to every tensor in it (tuples, lists and dicts walked)."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        return {k: map_tensors(v, fn) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(map_tensors(v, fn) for v in batch)
    return batch


def in_layout(batch: Any, channels_last: bool) -> Any:
    """``batch`` with its 4-d floating-point tensors (images) in the model's memory layout."""
    if not channels_last:
        return batch
    return map_tensors(batch, lambda t: t.contiguous(memory_format=torch.channels_last)
                       if t.dim() == 4 and t.is_floating_point() else t)


def check_sample(dataset: Dataset, name: str, pairs: bool) -> None:
    """Refuse, up front, a dataset that is empty, unsized, or (for the default loss) not pairs.

    Args:
        pairs: items must be (input, target) pairs (no step_fn was given).
    """
    try:
        size = len(dataset)
    except TypeError:
        raise ConfigError(f"{name} must be a map-style dataset with __len__ and __getitem__") from None
    if size == 0:
        raise ConfigError(f"{name} is empty")
    if not pairs:
        return
    item = dataset[0]
    if not (isinstance(item, (tuple, list)) and len(item) == 2):
        raise ConfigError(
            f"{name}[0] is {type(item).__name__}{f' of {len(item)} items' if isinstance(item, (tuple, list)) else ''}, "
            "not an (input, target) pair; pass step_fn=... to train on any batch, or wrap the dataset so that "
            "__getitem__ returns (input, target)"
        )


def share_dataset(dataset: Dataset) -> None:
    """Move a dataset's tensors to shared memory so that workers map them instead of copying."""
    if isinstance(dataset, TensorDataset):
        for t in dataset.tensors:
            t.share_memory_()
    elif hasattr(dataset, "share_memory_"):
        dataset.share_memory_()
