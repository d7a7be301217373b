"""Turning a list of sample indices into one batch, without per-worker copies of the dataset."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset
from torch.utils.data._utils.collate import default_collate

from ..errors import ConfigError


def fetch_batch(dataset: Dataset, indices: torch.Tensor, collate_fn: Callable[[list], Any] | None = None) -> Any:
    """Gather ``indices`` from ``dataset`` as one batch, collated as a DataLoader would.

    With ``collate_fn``, the items are read one by one and handed to it, as a DataLoader with
    that ``collate_fn`` does. Else datasets that can gather a whole batch at once (a
    ``get_batch(indices)`` method, as the built-in ones have, or a TensorDataset) do so in one
    vectorised index, and any other map-style dataset is read item by item and collated.
    """
    if collate_fn is not None:
        return collate_fn([dataset[int(i)] for i in indices])
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


def check_sample(dataset: Dataset, name: str, accepts: Callable[[Any], str | None]) -> None:
    """Refuse, up front, a dataset that is empty, unsized, not map-style, or whose items the loss
    cannot take.

    Args:
        accepts: ``accepts(item)`` says why ``item`` cannot be a sample (None: it can).
    """
    if isinstance(dataset, DataLoader):
        raise ConfigError(f"{name} is a DataLoader; pass its dataset and collate function, fit({name}=loader.dataset, "
                          "collate_fn=loader.collate_fn), and the batch size as Trainer(batch_size=...): sn_trainer "
                          "draws and splits every global batch itself")
    if isinstance(dataset, IterableDataset):
        raise ConfigError(f"{name} is an IterableDataset ({type(dataset).__name__}); sn_trainer reads samples by "
                          "index: pass a map-style dataset (__len__ and __getitem__), e.g. "
                          "TensorDataset or a list of samples read from the stream")
    try:
        size = len(dataset)
    except TypeError:
        raise ConfigError(f"{name} must be a map-style dataset with __len__ and __getitem__") from None
    if size == 0:
        raise ConfigError(f"{name} is empty")
    why = accepts(dataset[0])
    if why is not None:
        raise ConfigError(f"{name}[0] {why}")


def share_dataset(dataset: Dataset) -> None:
    """Move a dataset's tensors to shared memory so that workers map them instead of copying."""
    if isinstance(dataset, TensorDataset):
        for t in dataset.tensors:
            t.share_memory_()
    elif hasattr(dataset, "share_memory_"):
        dataset.share_memory_()
