"""The order samples are read in: ``shuffle=False`` reads a map-style set in index order, every
epoch, at any worker count and across a resume; a resume with another shuffle is refused."""
import copy
import functools
import logging

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from helpers import SmallConvNet, assert_exact, cross_entropy, tiny_dataset
from sn_trainer import CheckpointError, Trainer
from sn_trainer.checkpoint.resume import check_same_run

pytestmark = pytest.mark.timeout(120)

SGD = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)
N, BATCH, STEPS = 21, 7, 8  # 3 steps an epoch: 8 steps run into a third epoch


def plain_in_order(model, steps):
    """Plain PyTorch over a DataLoader with shuffle=False, epoch after epoch."""
    opt = SGD(model.parameters())
    done = 0
    while done < steps:
        for batch in DataLoader(tiny_dataset(n=N, dtype=torch.float64), batch_size=BATCH, shuffle=False):
            if done == steps:
                break
            opt.zero_grad()
            cross_entropy(model, batch).backward()
            opt.step()
            done += 1
    return model


def fit(model, workers, steps=STEPS, **settings):
    return Trainer(workers=workers, batch_size=BATCH, max_steps=steps, seed=3, shuffle=False, log_every=1,
                   **settings).fit(model, tiny_dataset(n=N, dtype=torch.float64), optimizer=SGD)


@pytest.mark.parametrize("workers", [1, pytest.param(2, marks=pytest.mark.quick), 3])
def test_unshuffled_set_trains_in_index_order_every_epoch(workers):
    """Global batch k of each epoch is samples kB..(k+1)B-1, split over the workers (7 = 4+3, 3+2+2)."""
    torch.manual_seed(0)
    start = SmallConvNet().double()
    model = copy.deepcopy(start)
    fit(model, workers)
    assert_exact(model, plain_in_order(copy.deepcopy(start), STEPS))


def test_the_shuffled_default_differs_from_index_order():
    torch.manual_seed(0)
    start = SmallConvNet().double()
    model = copy.deepcopy(start)
    Trainer(workers=1, batch_size=BATCH, max_steps=3, seed=3).fit(model, tiny_dataset(n=N, dtype=torch.float64),
                                                                   optimizer=SGD)
    reference = plain_in_order(copy.deepcopy(start), 3)
    assert not torch.allclose(model.fc.weight, reference.fc.weight)


def test_an_unshuffled_run_resumed_mid_epoch_reads_on_in_index_order(tmp_path):
    """A checkpoint after step 4 (the second of epoch 1), resumed at W=3 from W=2: the same
    weights as the plain loop's after 8 steps; a resume with shuffle=True is refused."""
    torch.manual_seed(0)
    start = SmallConvNet().double()
    fit(copy.deepcopy(start), 2, steps=4, checkpoint_dir=str(tmp_path))
    with pytest.raises(CheckpointError, match="shuffle"):
        Trainer(workers=1, batch_size=BATCH, max_steps=STEPS, seed=3, resume="latest",
                checkpoint_dir=str(tmp_path)).fit(copy.deepcopy(start), tiny_dataset(n=N, dtype=torch.float64),
                                                  optimizer=SGD)
    resumed = copy.deepcopy(start)
    result = fit(resumed, 3, resume="latest", checkpoint_dir=str(tmp_path))
    assert [r["step"] for r in result.history if "loss" in r] == [5, 6, 7, 8]  # it went on, not afresh
    assert_exact(resumed, plain_in_order(copy.deepcopy(start), STEPS))


class InOrder(IterableDataset):
    """A stream of a map-style set's items, in index order."""

    def __iter__(self):
        yield from tiny_dataset(n=N, dtype=torch.float64)


def test_a_stream_is_read_in_its_own_order_whatever_shuffle_says(caplog):
    """shuffle=True (the default) has no meaning for a stream: one line says so, and the run
    trains as shuffle=False, in the stream's order."""
    torch.manual_seed(0)
    start = SmallConvNet().double()
    models = {}
    for shuffle in (True, False):
        models[shuffle] = copy.deepcopy(start)
        with caplog.at_level(logging.INFO, logger="sn_trainer"):
            caplog.clear()
            Trainer(workers=2, batch_size=BATCH, max_steps=3, seed=3, shuffle=shuffle).fit(models[shuffle], InOrder(),
                                                                                           optimizer=SGD)
        said = [r.getMessage() for r in caplog.records if "read in its own order" in r.getMessage()]
        assert len(said) == (1 if shuffle else 0), said
    assert_exact(models[True], plain_in_order(copy.deepcopy(start), 3))
    assert_exact(models[False], plain_in_order(copy.deepcopy(start), 3))


@pytest.mark.unit
def test_a_checkpoint_from_before_shuffle_was_recorded_counts_as_shuffled():
    older = {"run": {"batch_size": BATCH, "accumulate": 1, "seed": 3, "drop_last": True, "dataset_size": N}}
    order = dict(older["run"], shuffle=True)
    check_same_run(older, "old.pt", order, None, strict=True)
    with pytest.raises(CheckpointError, match="written with shuffle True, this run has False"):
        check_same_run(older, "old.pt", dict(order, shuffle=False), None, strict=True)
