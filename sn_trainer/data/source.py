"""Where a run's batches come from: the ``Source`` protocol, the map-style source, and the choice
of the source that reads a dataset. A worker asks for its slice of micro-batch m of step k, and
evaluation for its chunks; nothing else knows how they are produced.

Every source follows the ``Source`` protocol below, and ``SOURCES`` lists them: the first that
reads a dataset reads it (a new kind of data is one class following it, added to that list). Two:

- ``IndexSource``: a map-style dataset (``__len__``, ``__getitem__``), read by index in an order
  drawn from (seed, epoch), as a DataLoader with a seeded RandomSampler reads it (with
  ``shuffle=False``: in index order, as a DataLoader with ``shuffle=False``).
- ``StreamSource`` (``stream.py``): an ``IterableDataset``, read in order; with several workers the
  orders they read are compared (``order_digest``, ``head_digest``, ``eval_digest``), and a
  difference is refused (``different_orders``).

Datasets with ``set_epoch(epoch)`` (Hugging Face datasets, sn_trainer's folder of images) are told
each epoch before it is read, as a DistributedSampler is.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from ..errors import ConfigError
from . import random_state
from .batching import collate_items, fetch_batch, share_dataset
from .sampler import EpochTeller, GlobalBatches, part_bounds, slice_bounds, steps_per_epoch
from .seeded import sample_seed
from .stream import StreamSource

if TYPE_CHECKING:
    from ..config import TrainerConfig


class Source(Protocol):
    """How a run reads a dataset: the training slices of each worker, evaluation's chunks, what the
    rehearsal tries, and where a resumed run goes on. ``settings`` are the run's: its batch size,
    accumulation, seed and drop_last cut the global batches."""

    kind: str  # what summary.json calls this kind of data
    size: int | None  # samples per epoch (None: a stream without a length)

    @classmethod
    def reads(cls, dataset: Any) -> bool:
        """Whether this kind of source reads ``dataset``."""

    def micro_slice(self, step: int, micro: int, rank: int, world: int) -> tuple[Any, int]:
        """Worker ``rank`` of ``world``'s slice of micro-batch ``micro`` of step ``step``, collated,
        and its samples (None and 0 where the short last batch of an epoch leaves it nothing)."""

    def micro_batch(self, step: int, micro: int) -> tuple[Any, int]:
        """Micro-batch ``micro`` of step ``step`` whole, collated as a plain DataLoader collates a batch
        (what one process reads), and its samples; after ``micro_slice`` read it, at the latest."""

    def eval_chunks(self, rank: int, world: int, chunk: int, max_chunks: int | None) -> Iterator[tuple[Any, int]]:
        """Worker ``rank``'s share of an evaluation, in batches of at most ``chunk`` samples, with
        their sizes; at most ``max_chunks`` x ``chunk`` samples in all, the first ones."""

    def first(self, samples: int) -> Any:
        """The first ``samples`` items, collated (what the rehearsal trains on)."""

    def probe(self, count: int, unit: int = 1) -> tuple[Any, list[Any]]:
        """At most ``count`` samples collated together, and in parts of ``unit`` (each alone with
        1): what the loss probe compares. Only whole parts are read: the batch is as many samples
        as the parts hold. A source with a ``collate_fn`` of the user's is asked for parts of
        a worker's micro-batch; any other, for single samples."""

    def first_item(self) -> Any:
        """The first item (None: there is none)."""

    def order_digest(self, step: int) -> int | None:
        """A digest of every item of step ``step``'s global batch as this process read them, all its
        micro-batches', before it kept its slice; asked once, after the step was read (None: the
        order follows from (seed, epoch) alone, the same in every worker by construction)."""

    def head_digest(self, count: int) -> int | None:
        """A digest of the first ``count`` items, read afresh from a copy (None: as for ``order_digest``)."""

    def eval_digest(self) -> int | None:
        """A digest of every item the last ``eval_chunks`` read, all workers' chunks, once it ran to
        its end (None: as for ``order_digest``)."""

    def share_memory(self) -> None:
        """Move what workers read to shared memory, where it can be (before they start)."""

    def position(self, step: int) -> dict[str, int] | None:
        """Where step ``step`` begins, for a checkpoint (None: the step says it)."""

    def resume_at(self, position: dict[str, int] | None, step: int) -> None:
        """Go on at step ``step`` from ``position`` (a checkpoint's)."""


class IndexSource:
    """A map-style dataset: step k's samples are positions [kB, (k+1)B) of the epoch's order (the
    indices themselves, with shuffle=False)."""

    kind = "map-style"

    def __init__(self, dataset: Dataset, settings: TrainerConfig, collate_fn: Callable[[list], Any] | None = None):
        self.dataset, self.settings, self.collate_fn = dataset, settings, collate_fn
        self.size = len(dataset)
        self.steps_per_epoch = steps_per_epoch(self.size, settings.batch_size, settings.accumulate,
                                               settings.drop_last)
        self._batches = None
        self._tell = EpochTeller(dataset)

    @classmethod
    def reads(cls, dataset: Any) -> bool:
        if isinstance(dataset, IterableDataset):
            return False
        try:
            len(dataset)
        except TypeError:
            return False
        return True

    def micro_slice(self, step: int, micro: int, rank: int, world: int) -> tuple[Any, int]:
        if self._batches is None:
            s = self.settings
            self._batches = GlobalBatches(self.size, s.batch_size, s.accumulate, s.seed, s.drop_last, s.shuffle)
        epoch, in_epoch = divmod(step, self.steps_per_epoch)
        indices = self._batches.indices(epoch, in_epoch, micro)
        start, stop = slice_bounds(len(indices), world, rank)
        if start == stop:
            return None, 0
        self._tell(epoch)
        return fetch_batch(self.dataset, indices[start:stop], self.collate_fn), stop - start

    def micro_batch(self, step: int, micro: int) -> tuple[Any, int]:
        return self.micro_slice(step, micro, 0, 1)

    def eval_chunks(self, rank: int, world: int, chunk: int, max_chunks: int | None) -> Iterator[tuple[Any, int]]:
        """Contiguous slices, one per worker, of the set (or of its first max_chunks x chunk samples)."""
        total = self.size if max_chunks is None else min(self.size, max_chunks * chunk)
        start, stop = slice_bounds(total, world, rank)
        for lo in range(start, stop, chunk):
            indices = torch.arange(lo, min(lo + chunk, stop))
            yield fetch_batch(self.dataset, indices, self.collate_fn), len(indices)

    def first(self, samples: int) -> Any:
        return fetch_batch(self.dataset, torch.arange(min(samples, self.size)), self.collate_fn)

    def probe(self, count: int, unit: int = 1) -> tuple[Any, list[Any]]:
        """Samples spread over the dataset, each read once, with the global generators seeded by
        its index: a dataset that augments from them gives the batch and its parts the same
        samples (read twice, they would differ, and the loss would look coupled)."""
        picked = torch.linspace(0, self.size - 1, min(count, self.size)).round().long().unique()
        parts = part_bounds(len(picked), unit)
        picked = picked[: parts[-1][1]] if parts else picked
        items = []
        for index in picked.tolist():
            with random_state.kept():
                random_state.seed(sample_seed(0, 0, index))
                items.append(self.dataset[index])
        return collate_items(items, self.collate_fn), [collate_items(items[lo:hi], self.collate_fn) for lo, hi in parts]

    def first_item(self) -> Any:
        return self.dataset[0] if self.size else None

    def order_digest(self, step: int) -> int | None:
        return None  # positions of a permutation drawn from (seed, epoch): one order in every worker

    def head_digest(self, count: int) -> int | None:
        return None

    def eval_digest(self) -> int | None:
        return None  # contiguous slices by position

    def share_memory(self) -> None:
        share_dataset(self.dataset)

    def position(self, step: int) -> dict[str, int] | None:
        return None  # the order follows from (seed, epoch, shuffle): the step says where a resume goes on

    def resume_at(self, position: dict[str, int] | None, step: int) -> None:
        pass


def different_orders(why: str) -> str:
    """The refusal of a stream that gives workers different orders; ``why`` says how it showed."""
    return (f"the stream gives workers different orders ({why}): it shuffles itself "
            "(an unseeded shuffle buffer such as webdataset's .shuffle(n), or random / torch.randperm in __iter__), "
            "so samples would be trained twice or never; seed its shuffle, e.g. webdataset's .shuffle(n, seed=S), "
            "or draw the order from torch.Generator().manual_seed(S * 1_000_003 + epoch) with the epoch "
            "sn_trainer passes to its set_epoch(epoch) before each pass; or pass a map-style dataset, "
            "which sn_trainer shuffles itself")


# Every kind of source, in the order they are asked whether they read a dataset.
SOURCES: tuple[type, ...] = (StreamSource, IndexSource)


def source_for(dataset: Any, settings: TrainerConfig, collate_fn: Callable[[list], Any] | None = None) -> Source:
    """The source that reads ``dataset`` (the first of ``SOURCES`` that does).

    Raises:
        ConfigError: none reads it.
    """
    for kind in SOURCES:
        if kind.reads(dataset):
            return kind(dataset, settings, collate_fn)
    raise ConfigError(f"cannot read a {type(dataset).__name__}: a dataset must be map-style (__len__ and "
                      "__getitem__) or an IterableDataset")


def make_source(dataset: Any, name: str, settings: TrainerConfig, collate_fn: Callable[[list], Any] | None,
                accepts: Callable[[Any], str | None]) -> Source:
    """The source ``dataset`` is read through, once its first item is one the run can take.

    Args:
        accepts: ``accepts(item)`` says why ``item`` cannot be a sample (None: it can).

    Raises:
        ConfigError: a DataLoader, an empty dataset or one no source reads, or an item the loss
            cannot take.
    """
    if isinstance(dataset, DataLoader):
        raise ConfigError(f"{name} is a DataLoader; pass its dataset and collate function, fit({name}=loader.dataset, "
                          "collate_fn=loader.collate_fn), and the batch size as Trainer(batch_size=...): sn_trainer "
                          "draws and splits every global batch itself")
    if not any(kind.reads(dataset) for kind in SOURCES):
        raise ConfigError(f"{name} must be a map-style dataset (__len__ and __getitem__) or an IterableDataset, "
                          f"got {type(dataset).__name__}")
    source = source_for(dataset, settings, collate_fn)
    first = source.first_item() if source.size != 0 else None
    if first is None:
        raise ConfigError(f"{name} is a stream that yields no items" if source.kind == "stream" else f"{name} is empty")
    why = accepts(first)
    if why is not None:
        raise ConfigError(f"{name}[0] {why}")
    return source
