"""Hugging Face ``datasets`` trained directly: a memory-mapped Arrow Dataset read where it lies,
and a streaming IterableDataset shuffled anew each pass; each exact against plain PyTorch."""
import copy
import functools
import itertools

import datasets
import pytest
import torch
from torch.utils.data._utils.collate import default_collate

from helpers import EXACT, plain_fit
from sn_trainer import Trainer

pytestmark = pytest.mark.timeout(240)

SGD = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)


def table(n: int = 30, seed: int = 0) -> "datasets.Dataset":
    g = torch.Generator().manual_seed(seed)
    return datasets.Dataset.from_dict({"features": torch.randn(n, 6, generator=g).tolist(),
                                       "label": torch.randint(0, 3, (n,), generator=g).tolist()})


def step(model, batch):
    """A dict batch, as Hugging Face datasets give: the mean cross-entropy of its rows."""
    return torch.nn.functional.cross_entropy(model(batch["features"].double()), batch["label"])


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()


def assert_same(mine, theirs):
    for (name, p), q in zip(mine.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(p, q, **EXACT, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("workers", [1, pytest.param(2, marks=pytest.mark.quick), 3])
def test_an_arrow_dataset_on_disk_trains_where_it_lies(tmp_path, workers):
    table().save_to_disk(str(tmp_path / "data"))
    data = datasets.load_from_disk(str(tmp_path / "data")).with_format("torch")
    assert data.cache_files  # memory-mapped from its Arrow file: workers map the file, not a copy
    net = model()
    reference = plain_fit(copy.deepcopy(net), data, batch_size=6, steps=8, seed=2, optimizer=lambda m: SGD(
        m.parameters()), loss=step)
    result = Trainer(workers=workers, batch_size=6, max_steps=8, seed=2).fit(net, data, step_fn=step, optimizer=SGD)
    assert result.plan["data"] == "map-style" and result.steps == 8
    assert_same(net, reference)


@pytest.mark.parametrize("comm", ["shm", "gloo"])
def test_a_streaming_dataset_shuffled_each_pass_trains_as_its_passes_read_in_order(comm):
    """``to_iterable_dataset().shuffle()``: no length, a new order at each set_epoch; 30 rows in
    batches of 8, so batches run across the passes' seams."""
    stream = table().with_format("torch").to_iterable_dataset(num_shards=3).shuffle(seed=4, buffer_size=10)
    net = model()
    reference = copy.deepcopy(net)
    optimizer = SGD(reference.parameters())
    rows = itertools.chain.from_iterable((stream.set_epoch(epoch), stream)[1] for epoch in itertools.count())
    for _ in range(9):
        optimizer.zero_grad()
        step(reference, default_collate(list(itertools.islice(rows, 8)))).backward()
        optimizer.step()
    stream.set_epoch(0)
    result = Trainer(workers=2, batch_size=8, max_steps=9, comm=comm).fit(net, stream, step_fn=step, optimizer=SGD)
    assert result.plan["data"] == "stream"
    assert_same(net, reference)
