"""Where a run's batches come from. A worker asks for its slice of micro-batch m of step k, and
evaluation for its chunks; nothing else knows how they are produced.

Every source follows the ``Source`` protocol below, and ``SOURCES`` lists them: the first that
reads a dataset reads it (a new kind of data is one class here, added to that list). Two:

- ``IndexSource``: a map-style dataset (``__len__``, ``__getitem__``), read by index in an order
  drawn from (seed, epoch), as a DataLoader with a seeded RandomSampler reads it (with
  ``shuffle=False``: in index order, as a DataLoader with ``shuffle=False``).
- ``StreamSource``: an ``IterableDataset``, read in order. Micro-batch j is items [jB, (j+1)B) of
  the stream, as a DataLoader with ``batch_size=B`` batches it. A stream with a length is read
  afresh each epoch; one without is one sequence (when a pass ends, the next begins, and a batch
  may run across the seam). Every worker reads the whole stream and keeps its slice: items not
  its own are drawn and dropped before ``collate_fn``, so a stream of cheap references (file
  names, offsets) with a collate_fn that loads them loads each sample once. That is exact only
  if every worker reads the same order, so with several workers each digests every item of each
  global batch it reads (``order_digest``), the workers compare the digests on the board with
  the step's sums, and a difference ends the run at that step (an evaluation's, ``eval_digest``,
  is an evaluation error); a stream whose order follows the process's random state is refused
  before any worker starts (``head_digest``, read twice).

Datasets with ``set_epoch(epoch)`` (Hugging Face datasets, sn_trainer's folder of images) are told
each epoch before it is read, as a DistributedSampler is.
"""
from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset
from torch.utils.data._utils.collate import default_collate

from ..errors import ConfigError, DataError
from . import random_state
from .batching import collate, fetch_batch, share_dataset
from .digest import ItemDigest
from .sampler import GlobalBatches, slice_bounds, steps_per_epoch
from .seeded import sample_seed

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


def _collate(items: list, collate_fn) -> Any:
    return collate(collate_fn, items) if collate_fn is not None else default_collate(items)


def _parts(count: int, unit: int) -> list[tuple[int, int]]:
    """Bounds of the whole parts of ``unit`` in ``count`` positions (a short rest left out)."""
    return [(lo, lo + unit) for lo in range(0, count - unit + 1, unit)]


class _EpochTeller:
    """Calls the dataset's ``set_epoch`` when the epoch read changes (only where it has one)."""

    def __init__(self, dataset):
        self._set = getattr(dataset, "set_epoch", None)
        self._epoch = None

    def __call__(self, epoch: int) -> None:
        if self._set is not None and epoch != self._epoch:
            self._set(epoch)
        self._epoch = epoch


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
        self._tell = _EpochTeller(dataset)

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
        parts = _parts(len(picked), unit)
        picked = picked[: parts[-1][1]] if parts else picked
        items = []
        for index in picked.tolist():
            with random_state.kept():
                random_state.seed(sample_seed(0, 0, index))
                items.append(self.dataset[index])
        return _collate(items, self.collate_fn), [_collate(items[lo:hi], self.collate_fn) for lo, hi in parts]

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


class _Reader:
    """One pass after another over a stream, counting items; set_epoch(pass) before each pass."""

    def __init__(self, stream: IterableDataset):
        self.stream = stream
        self._tell = _EpochTeller(stream)
        self.pass_, self.offset, self._items = -1, 0, iter(())

    def open(self, pass_: int) -> None:
        self._tell(pass_)
        self.pass_, self.offset, self._items = pass_, 0, iter(self.stream)

    def take(self, count: int) -> list:
        """Up to ``count`` items of this pass (fewer where it ends)."""
        items = list(itertools.islice(self._items, count))
        self.offset += len(items)
        return items

    def skip_to(self, offset: int) -> None:
        """Read on (and drop) up to item ``offset`` of this pass (at or after where it is)."""
        self.take(offset - self.offset)
        if self.offset < offset:
            raise DataError(f"the stream's pass {self.pass_} ended after {self.offset} items, before item {offset} "
                            "where this run goes on: is it the same stream, in the same order?")


class StreamSource:
    """An IterableDataset read in order: micro-batch j of an epoch is its items [jB, (j+1)B)."""

    kind = "stream"

    def __init__(self, stream: IterableDataset, settings: TrainerConfig,
                 collate_fn: Callable[[list], Any] | None = None):
        self.stream, self.settings, self.collate_fn = stream, settings, collate_fn
        try:
            self.size = len(stream)
        except TypeError:
            self.size = None
        self.steps_per_epoch = steps_per_epoch(self.size, settings.batch_size, settings.accumulate,
                                               settings.drop_last) if self.size is not None else None
        self._reader: _Reader | None = None
        self._own: IterableDataset | None = None  # this process's copy of the stream (see _stream)
        self._start = 0  # the reader's pass's first item's place in the whole sequence
        self._starts = {0: 0}  # the same for every pass seen (a stream without a length)
        self._digests: dict[int, ItemDigest] = {}  # each step read and not yet asked for (several workers)
        self._eval_digest: int | None = None  # of the last evaluation read (several workers)
        self._wholes: dict[tuple[int, int], list] = {}  # the last steps' micro-batches, every item (micro_batch)

    @classmethod
    def reads(cls, dataset: Any) -> bool:
        return isinstance(dataset, IterableDataset)

    def __getstate__(self):
        # Iterators, copies and digests stay in their process.
        return {**self.__dict__, "_reader": None, "_own": None, "_digests": {}, "_wholes": {}}

    def _stream(self) -> IterableDataset:
        """A copy of the stream of this worker's own: its state (the epoch set_epoch sets, which a
        Hugging Face stream keeps in a tensor shared between processes) is then no other worker's."""
        if self._own is None:
            self._own = copy.deepcopy(self.stream)
        return self._own

    # --- reading ------------------------------------------------------------------------------

    def micro_slice(self, step: int, micro: int, rank: int, world: int) -> tuple[Any, int]:
        b = self.settings
        if self.size is not None:
            items = self._read_in_pass(*divmod(step, self.steps_per_epoch), micro)
        else:
            items = self._read_across_passes((step * b.accumulate + micro) * b.batch_size)
        if world > 1:  # the reading thread adds to step's digest; the step asks for it once read
            digest = self._digests[step] = ItemDigest() if micro == 0 else self._digests[step]
            digest.add(items)
        self._wholes[(step, micro)] = items  # kept for this step and the next: a verified step reads it whole
        for kept in [key for key in self._wholes if key[0] < step - 1]:
            del self._wholes[kept]
        start, stop = slice_bounds(len(items), world, rank)
        if start == stop:
            return None, 0
        return _collate(items[start:stop], self.collate_fn), stop - start

    def micro_batch(self, step: int, micro: int) -> tuple[Any, int]:
        """From the items ``micro_slice`` read for it (every worker reads every item of the stream)."""
        items = self._wholes.get((step, micro))
        if items is None:
            return self.micro_slice(step, micro, 0, 1)
        return (_collate(items, self.collate_fn), len(items)) if items else (None, 0)

    def _read_in_pass(self, epoch: int, in_epoch: int, micro: int) -> list:
        """A stream with a length: epoch e is pass e, and micro-batches never cross passes."""
        b = self.settings
        first = (in_epoch * b.accumulate + micro) * b.batch_size
        expected = max(0, min(b.batch_size, self.size - first))
        if expected == 0:
            return []  # past the end of an epoch's short last step: nothing to read
        reader = self._reader_at(epoch, first)
        items = reader.take(expected)
        if len(items) < expected:
            raise DataError(f"the stream has len() {self.size} but its pass {epoch} ended after {reader.offset} "
                            "items; its __len__ must count the items it yields")
        return items

    def _read_across_passes(self, first: int) -> list:
        """A stream without a length: one sequence of passes; a batch may run across two."""
        size = self.settings.batch_size
        reader = self._reader
        if reader is None or self._start + reader.offset > first:
            pass_ = max((p for p, start in self._starts.items() if start <= first), key=self._starts.get)
            reader = self._reader = _Reader(self._stream())
            reader.open(pass_)
            self._start = self._starts[pass_]
        items: list = []
        while len(items) < size:
            at = self._start + reader.offset
            wanted = first - at if at < first else size - len(items)
            got = reader.take(wanted)
            if at >= first:
                items += got
            if len(got) < wanted:  # this pass ended: the next one goes on
                if reader.offset == 0:
                    raise DataError(f"the stream yielded no items in pass {reader.pass_}: a stream without a length "
                                    "is read again when it ends, and an empty pass would never fill a batch")
                self._start += reader.offset
                self._starts[reader.pass_ + 1] = self._start
                reader.open(reader.pass_ + 1)
        return items

    def _reader_at(self, pass_: int, offset: int) -> _Reader:
        reader = self._reader
        if reader is None or reader.pass_ != pass_ or reader.offset > offset:
            reader = self._reader = _Reader(self._stream())
            reader.open(pass_)
        reader.skip_to(offset)
        return reader

    def order_digest(self, step: int) -> int | None:
        digest = self._digests.pop(step, None)
        return digest.value() if digest is not None else None

    # --- before the run, and its checkpoints --------------------------------------------------

    def _head(self, count: int) -> list:
        return list(itertools.islice(iter(self.stream), count))

    def first(self, samples: int) -> Any:
        return _collate(self._head(samples), self.collate_fn)

    def probe(self, count: int, unit: int = 1) -> tuple[Any, list[Any]]:
        items = self._head(count)  # a stream is read in order: its first items
        parts = _parts(len(items), unit)
        items = items[: parts[-1][1]] if parts else items
        return _collate(items, self.collate_fn), [_collate(items[lo:hi], self.collate_fn) for lo, hi in parts]

    def first_item(self) -> Any:
        head = self._head(1)
        return head[0] if head else None

    def head_digest(self, count: int) -> int:
        # A copy, as each worker reads one: reading the stream itself could move a state of its own
        # (a generator object it holds) that every worker receives alike.
        digest = ItemDigest()
        digest.add(itertools.islice(iter(copy.deepcopy(self.stream)), count))
        return digest.value()

    def share_memory(self) -> None:
        pass  # each worker reads a copy of its own (see _stream)

    def eval_chunks(self, rank: int, world: int, chunk: int, max_chunks: int | None) -> Iterator[tuple[Any, int]]:
        """Chunks of ``chunk`` items in order, chunk c going to worker c mod ``world``."""
        items, digest = iter(self.stream), ItemDigest() if world > 1 else None
        self._eval_digest = None
        for c in itertools.count() if max_chunks is None else range(max_chunks):
            batch = list(itertools.islice(items, chunk))
            if not batch:
                break
            if digest is not None:
                digest.add(batch)
            if c % world == rank:
                yield _collate(batch, self.collate_fn), len(batch)
        self._eval_digest = digest.value() if digest is not None else None

    def eval_digest(self) -> int | None:
        return self._eval_digest

    def position(self, step: int) -> dict[str, int]:
        """The pass and the items of it before."""
        step_batch = self.settings.batch_size * self.settings.accumulate
        if self.size is not None:
            epoch, in_epoch = divmod(step, self.steps_per_epoch)
            return {"pass": epoch, "offset": in_epoch * step_batch}
        first = step * step_batch
        starts = dict(self._starts)  # a copy: the reading thread may add a pass meanwhile
        pass_ = max((p for p, start in starts.items() if start <= first), key=starts.get)
        return {"pass": pass_, "offset": first - starts[pass_]}

    def resume_at(self, position: dict[str, int] | None, step: int) -> None:
        """Go on at step ``step`` from ``position`` (a checkpoint's): the passes before it are not
        read again."""
        if self.size is None and position is not None:
            step_batch = self.settings.batch_size * self.settings.accumulate
            self._starts = {position["pass"]: step * step_batch - position["offset"]}
            self._reader = None


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
