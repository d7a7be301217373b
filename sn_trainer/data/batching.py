"""Turning a list of sample indices into one batch, without per-worker copies of the dataset."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils.data import Dataset, TensorDataset
from torch.utils.data._utils.collate import default_collate



def fetch_batch(dataset: Dataset, indices: torch.Tensor, collate_fn: Callable[[list], Any] | None = None) -> Any:
    """Gather ``indices`` from ``dataset`` as one batch, collated as a DataLoader would.

    With ``collate_fn``, the items are read one by one and handed to it, as a DataLoader with
    that ``collate_fn`` does. Else datasets that can gather a whole batch at once (a
    ``get_batch(indices)`` method, as the built-in ones have, or a TensorDataset) do so in one
    vectorised index, and any other map-style dataset is read item by item and collated.
    """
    if collate_fn is not None:
        return collate(collate_fn, [dataset[int(i)] for i in indices])
    if hasattr(dataset, "get_batch"):
        return dataset.get_batch(indices)
    if isinstance(dataset, TensorDataset):
        return tuple(t[indices] for t in dataset.tensors)
    return default_collate([dataset[int(i)] for i in indices])


def collate(collate_fn: Callable[[list], Any], items: list) -> Any:
    """``collate_fn(items)``; what it raises carries a note saying so, and with how many samples
    (a collate that takes only some batch sizes fails on the count, not on the data)."""
    try:
        return collate_fn(items)
    except Exception as exc:
        exc.add_note(f"{COLLATE_NOTE}{len(items)} samples")
        raise


COLLATE_NOTE = "collate_fn raised, called with "  # how the note begins: the rehearsal's error line quotes it


def collate_items(items: list, collate_fn: Callable[[list], Any] | None) -> Any:
    """``items`` as one batch: through ``collate_fn`` (see ``collate``), or as a DataLoader without one."""
    return collate(collate_fn, items) if collate_fn is not None else default_collate(items)


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


def share_dataset(dataset: Dataset) -> None:
    """Move a dataset's tensors to shared memory so that workers map them instead of copying."""
    if isinstance(dataset, TensorDataset):
        for t in dataset.tensors:
            t.share_memory_()
    elif hasattr(dataset, "share_memory_"):
        dataset.share_memory_()
