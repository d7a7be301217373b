"""Each seam takes a new kind as one class: a data source (one class, listed in ``SOURCES``), a
reducer (one class, registered by name), a worker-fed event (one class naming its hook)."""
import copy
import functools
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from torch.utils.data import TensorDataset

from helpers import SmallConvNet, assert_exact, cross_entropy, plain_fit, tiny_dataset
from sn_trainer import Callback, Trainer
from sn_trainer.callbacks import Callbacks
from sn_trainer.data import source as sources
from sn_trainer.data.sampler import GlobalBatches, slice_bounds, steps_per_epoch
from sn_trainer.engine.collectives import registry
from sn_trainer.engine.collectives.over_gloo import GlooReducer

pytestmark = pytest.mark.timeout(120)

SGD = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)


class Columns:
    """A dataset as named columns of equal length, as a data frame holds one: no __len__, no items."""

    def __init__(self, **columns):
        self.columns = columns


class ColumnSource:
    """Reads ``Columns``: the global batches of (seed, epoch) order, as a map-style set is read."""

    kind = "columns"

    def __init__(self, dataset: Columns, settings, collate_fn=None):
        self.columns, self.settings = dataset.columns, settings
        self.size = len(dataset.columns["inputs"])
        self.steps_per_epoch = steps_per_epoch(self.size, settings.batch_size, settings.accumulate, settings.drop_last)

    @classmethod
    def reads(cls, dataset) -> bool:
        return isinstance(dataset, Columns)

    def _rows(self, indices):
        return self.columns["inputs"][indices], self.columns["targets"][indices]

    def micro_slice(self, step, micro, rank, world):
        s = self.settings
        epoch, in_epoch = divmod(step, self.steps_per_epoch)
        indices = GlobalBatches(self.size, s.batch_size, s.accumulate, s.seed, s.drop_last).indices(epoch, in_epoch,
                                                                                                    micro)
        start, stop = slice_bounds(len(indices), world, rank)
        return (self._rows(indices[start:stop]), stop - start) if stop > start else (None, 0)

    def eval_chunks(self, rank, world, chunk, max_chunks):
        total = self.size if max_chunks is None else min(self.size, max_chunks * chunk)
        start, stop = slice_bounds(total, world, rank)
        for low in range(start, stop, chunk):
            indices = torch.arange(low, min(low + chunk, stop))
            yield self._rows(indices), len(indices)

    def first(self, samples):
        return self._rows(torch.arange(min(samples, self.size)))

    def probe(self, count):
        picked = torch.arange(min(count, self.size))
        return self._rows(picked), [self._rows(picked[i : i + 1]) for i in range(len(picked))]

    def first_item(self):
        inputs, targets = self._rows(torch.tensor([0]))
        return inputs[0], targets[0]

    def order_digest(self, step):
        return None  # read by index in (seed, epoch) order: the same in every worker

    def head_digest(self, count):
        return None

    def eval_digest(self):
        return None

    def share_memory(self):
        for column in self.columns.values():
            column.share_memory_()

    def position(self, step):
        return None

    def resume_at(self, position, step):
        pass


@pytest.mark.quick
def test_a_new_data_source_is_one_class(monkeypatch):
    monkeypatch.setattr(sources, "SOURCES", (ColumnSource, *sources.SOURCES))
    torch.manual_seed(0)
    model = SmallConvNet().double()
    data = tiny_dataset(dtype=torch.float64)
    reference = plain_fit(copy.deepcopy(model), data, 12, 6, 3, lambda m: SGD(m.parameters()), cross_entropy)
    inputs, targets = data.tensors
    result = Trainer(workers=2, batch_size=12, max_steps=6, seed=3).fit(
        model, Columns(inputs=inputs, targets=targets), eval_set=Columns(inputs=inputs[:20], targets=targets[:20]),
        optimizer=SGD)
    assert result.plan["data"] == "columns" and result.eval_metrics["eval_samples"] == 20
    assert_exact(model, reference)


class CopyOfGloo(GlooReducer):
    """A reducer of its own: gloo's, under another name."""

    name, timed = "copy_of_gloo", False


def test_a_new_reducer_is_one_class_registered_by_name(monkeypatch):
    monkeypatch.setitem(registry.REDUCERS, CopyOfGloo.name, CopyOfGloo)
    torch.manual_seed(0)
    model = SmallConvNet().double()
    reference = plain_fit(copy.deepcopy(model), tiny_dataset(dtype=torch.float64), 12, 5, 3,
                          lambda m: SGD(m.parameters()), cross_entropy)
    result = Trainer(workers=3, batch_size=12, max_steps=5, seed=3, comm="copy_of_gloo").fit(
        model, TensorDataset(*tiny_dataset(dtype=torch.float64).tensors), optimizer=SGD)
    assert result.comm == "copy_of_gloo" and result.settings.comm == "copy_of_gloo"
    assert_exact(model, reference)


@dataclass(frozen=True)
class QueueDepth:
    """A new worker-fed event: one class, naming the hook it is for."""

    hook: ClassVar[str] = "on_queue_depth"
    depth: int


@pytest.mark.unit
def test_an_event_reaches_the_callback_method_it_names():
    class Listens(Callback):
        def __init__(self):
            self.seen = []

        def on_queue_depth(self, trainer, event):
            self.seen.append((trainer, event.depth))

    listening = Listens()
    Callbacks([Callback(), listening]).event("the trainer", QueueDepth(3))  # a Callback without it is passed over
    assert listening.seen == [("the trainer", 3)]
