"""An ``IterableDataset`` as a source, read in order. Micro-batch j is items [jB, (j+1)B) of the
stream, as a DataLoader with ``batch_size=B`` batches it. A stream with a length is read afresh
each epoch; one without is one sequence (when a pass ends, the next begins, and a batch may run
across the seam).

Every worker reads the whole stream and keeps its slice: items not its own are drawn and dropped
before ``collate_fn``, so a stream of cheap references (file names, offsets) with a collate_fn
that loads them loads each sample once. That is exact only if every worker reads the same order,
so with several workers each digests every item of each global batch it reads (``order_digest``),
the workers compare the digests on the board with the step's sums, and a difference ends the run
at that step (an evaluation's, ``eval_digest``, is an evaluation error); a stream whose order
follows the process's random state is refused before any worker starts (``head_digest``, read
twice).
"""
from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from torch.utils.data import IterableDataset

from ..errors import DataError
from .batching import collate_items
from .digest import ItemDigest
from .sampler import EpochTeller, part_bounds, slice_bounds, steps_per_epoch

if TYPE_CHECKING:
    from ..config import TrainerConfig


class _Reader:
    """One pass after another over a stream, counting items; set_epoch(pass) before each pass."""

    def __init__(self, stream: IterableDataset):
        self.stream = stream
        self._tell = EpochTeller(stream)
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
        return collate_items(items[start:stop], self.collate_fn), stop - start

    def micro_batch(self, step: int, micro: int) -> tuple[Any, int]:
        """From the items ``micro_slice`` read for it (every worker reads every item of the stream)."""
        items = self._wholes.get((step, micro))
        if items is None:
            return self.micro_slice(step, micro, 0, 1)
        return (collate_items(items, self.collate_fn), len(items)) if items else (None, 0)

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
        return collate_items(self._head(samples), self.collate_fn)

    def probe(self, count: int, unit: int = 1) -> tuple[Any, list[Any]]:
        items = self._head(count)  # a stream is read in order: its first items
        parts = part_bounds(len(items), unit)
        items = items[: parts[-1][1]] if parts else items
        return collate_items(items, self.collate_fn), [collate_items(items[lo:hi], self.collate_fn) for lo, hi in parts]

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
                yield collate_items(batch, self.collate_fn), len(batch)
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
