"""A stream that shuffles itself gives each worker its own order: refused before any worker starts
where two reads of it differ, and otherwise proven step by step (the workers compare digests of
the global batch they read) and stopped at the first step where they differ. A webdataset
pipeline, as its users write one: unseeded shuffle refused, seeded shuffle exact."""
import copy
import functools
import itertools
import os

import numpy as np
import pytest
import torch
from torch.utils.data import IterableDataset
from torch.utils.data._utils.collate import default_collate

from helpers import SmallConvNet, assert_exact, tiny_dataset
from sn_trainer import DataError, Trainer
from sn_trainer.data.digest import ItemDigest
from sn_trainer.engine.step.board import Board

pytestmark = pytest.mark.timeout(240)

SGD = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)
REFUSED = r"the stream gives workers different orders \("


class OwnOrder(IterableDataset):
    """20 samples in an order drawn from torch's global generator: each process draws its own.
    ``from_epoch``: the order is fixed (the samples as stored) before that epoch."""

    def __init__(self, from_epoch: int = 0):
        self.data, self.from_epoch, self.epoch = tiny_dataset(n=20, dtype=torch.float64), from_epoch, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return 20

    def __iter__(self):
        order = torch.randperm(20) if self.epoch >= self.from_epoch else torch.arange(20)
        return (self.data[int(i)] for i in order)


def test_a_stream_in_the_order_of_the_process_random_state_is_refused_before_any_worker_starts():
    with pytest.raises(DataError, match=REFUSED + r"its first 6 items differed between two reads before any worker "
                                        r"started\).*\.shuffle\(n, seed=S\).*or pass a map-style dataset"):
        Trainer(workers=2, batch_size=6, max_steps=2).fit(SmallConvNet().double(), OwnOrder(), optimizer=SGD)


def test_one_worker_reads_one_order_whatever_the_stream_draws():
    result = Trainer(workers=1, batch_size=6, max_steps=2).fit(SmallConvNet().double(), OwnOrder(), optimizer=SGD)
    assert result.steps == 2


@pytest.mark.quick
def test_workers_that_read_different_items_stop_at_the_first_step_they_differ():
    """The first epoch (3 steps of 6) is in stored order in every worker, so nothing is refused
    before the start; from the second epoch each worker draws its own order, and step 4 ends the run
    with the DataError itself (one line, no restart), as any input error a worker finds."""
    with pytest.raises(DataError, match=REFUSED + "the workers read different items for step 4's global batch"):
        Trainer(workers=2, batch_size=6, epochs=3).fit(SmallConvNet().double(), OwnOrder(from_epoch=1),
                                                       optimizer=SGD)


class OwnOrderAway(OwnOrder):
    """In the process that made it, the stored order; in any other (a worker), an order of its own."""

    def __init__(self):
        super().__init__()
        self.home = os.getpid()

    def __iter__(self):
        order = torch.arange(20) if os.getpid() == self.home else torch.randperm(20)
        return (self.data[int(i)] for i in order)


def test_an_evaluation_on_a_stream_the_workers_read_in_different_orders_is_an_error_not_a_number():
    """Each worker takes chunks c mod W of the order it reads: in different orders, some samples
    would count twice and some never, so the evaluation reports an error instead of metrics."""
    metrics = Trainer(workers=2, eval_batch_size=4).evaluate(SmallConvNet().double(), OwnOrderAway())
    assert set(metrics) == {"eval_error"}
    assert metrics["eval_error"].startswith("the stream gives workers different orders (the workers read different "
                                            "items for the evaluation)")


@pytest.mark.unit
def test_the_board_tells_one_digest_from_two_in_a_node_and_across_nodes():
    def totals(digests):
        board = Board.allocate(len(digests), parameters=1)
        for rank, digest in enumerate(digests):
            board.publish(0, rank, 1.0, 1.0, 0.0, torch.ones(1), digest=digest)
        return board.totals(0)

    d, e = 0x0123456789ABCDEF, 0x0123456789ABCDEF ^ (1 << 40)  # one bit apart
    read = Board.allocate(1, parameters=1).read
    assert read(totals([d, d, d])).one_batch and read(totals([None, None])).one_batch
    assert not read(totals([d, d, e])).one_batch
    # Two nodes, each agreeing within itself: only the sum over both can show they differ.
    assert read(totals([d, d]) + totals([d, d])).one_batch
    assert not read(totals([d, d]) + totals([e, e])).one_batch


@pytest.mark.unit
def test_an_item_digest_follows_order_and_content_not_storage():
    def digest(*items):
        h = ItemDigest()
        h.add(items)
        return h.value()

    x = torch.arange(12, dtype=torch.float64).reshape(3, 4)
    assert digest(x, 1) == digest(x.t().contiguous().t(), 1)  # another layout, the same values
    assert digest(x, 1) != digest(1, x) and digest(x) != digest(x.to(torch.int64)) and digest(x) != digest(x.t())
    assert digest({"jpg": b"\xff\xd8", "cls": 3}) != digest({"jpg": b"\xff\xd9", "cls": 3})
    assert digest({"a", "b", "c"}) == digest({"c", "a", "b"}) and digest(np.float32(1.5)) != digest(1.5)


# --- webdataset, as its users write a pipeline ---------------------------------------------------

@pytest.fixture
def wds():
    return pytest.importorskip("webdataset")  # the test extra installs it; the tests above need none


def write_shards(wds, directory, samples=20, per_shard=8):
    """Tiny .tar shards of (image, label) samples: float64 .npy images, .cls labels."""
    data = tiny_dataset(n=samples, seed=4, dtype=torch.float64)
    urls = []
    for first in range(0, samples, per_shard):
        url = str(directory / f"shard-{first // per_shard:02d}.tar")
        with wds.TarWriter(url) as sink:
            for i in range(first, min(first + per_shard, samples)):
                image, label = data[i]
                sink.write({"__key__": f"{i:04d}", "input.npy": image.numpy(), "cls": int(label)})
        urls.append(url)
    return urls


def pipeline(wds, urls, **shuffle):
    """Shards in order, a shuffle buffer of 10 (given ``shuffle``'s arguments), decoded to tensors."""
    dataset = wds.WebDataset(urls, shardshuffle=False, empty_check=False)
    if shuffle:
        dataset = dataset.shuffle(10, **shuffle)
    return dataset.decode().to_tuple("input.npy", "cls").map_tuple(torch.from_numpy, int)


def test_webdataset_with_its_unseeded_shuffle_is_refused_with_the_advice(tmp_path, wds):
    urls = write_shards(wds, tmp_path)
    with pytest.raises(DataError, match=REFUSED + r".*webdataset's \.shuffle\(n, seed=S\)"):
        Trainer(workers=2, batch_size=6, max_steps=4).fit(SmallConvNet().double(), pipeline(wds, urls, initial=10),
                                                          optimizer=SGD)


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_webdataset_with_its_shuffle_seeded_trains_as_a_plain_loop_over_it(tmp_path, wds, workers):
    """20 samples in batches of 6 for 5 steps: the stream, without a length, is read again when a
    pass ends (the seeded buffer gives every pass, in every worker, the same order)."""
    urls = write_shards(wds, tmp_path)
    torch.manual_seed(0)
    model = SmallConvNet().double()
    reference = copy.deepcopy(model)
    optimizer = SGD(reference.parameters())
    items = itertools.chain.from_iterable(pipeline(wds, urls, seed=7, initial=10) for _ in itertools.count())
    for _ in range(5):
        inputs, targets = default_collate(list(itertools.islice(items, 6)))
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(reference(inputs), targets).backward()
        optimizer.step()
    result = Trainer(workers=workers, batch_size=6, max_steps=5).fit(model, pipeline(wds, urls, seed=7, initial=10),
                                                                     optimizer=SGD)
    assert result.steps == 5 and result.plan["data"] == "stream"
    assert_exact(model, reference)
