"""A loss over the whole global batch (SimCLR's NT-Xent, CLIP's) through ``sn_trainer.gather``, against plain PyTorch.

Each test trains a tiny model with sn_trainer's workers, the step function gathering its
slice's embeddings, and once in an independent plain loop that computes the same loss over the
whole global batch at once; parameters are compared in float64 (``assert_exact``: 1e-10).
"""
import copy
import functools
import hashlib
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import sn_trainer
from helpers import assert_exact, in_a_worker, plain_batches, plain_indices
from sn_trainer import ConfigError, InputError, Trainer

pytestmark = pytest.mark.timeout(180)
F64 = torch.float64
SGD = functools.partial(torch.optim.SGD, lr=0.2, momentum=0.9)


class SimCLR(nn.Module):
    """An encoder and a learnable temperature; the temperature is used after the gather, on the
    global batch: every worker's backward reaches all of its gradient."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))
        self.log_temperature = nn.Parameter(torch.tensor(-0.7))


def nt_xent(z1, z2, log_temperature):
    """SimCLR's loss: each view's positive is the other view of its sample; every other sample of
    the batch, in both views, is a negative."""
    z = F.normalize(torch.cat([z1, z2]), dim=1)
    n = z1.shape[0]
    similarity = (z @ z.T / log_temperature.exp()).masked_fill(torch.eye(2 * n, dtype=torch.bool), float("-inf"))
    positives = torch.cat([torch.arange(n, 2 * n), torch.arange(n)])
    return F.cross_entropy(similarity, positives)


def simclr_step(model, batch):
    view1, view2 = batch
    z1, z2 = sn_trainer.gather(model.encoder(view1)), sn_trainer.gather(model.encoder(view2))
    return nt_xent(z1, z2, model.log_temperature)


def simclr_slice_only(model, batch):
    """The same loss over the worker's slice alone: each worker would train on its own negatives."""
    view1, view2 = batch
    return nt_xent(model.encoder(view1), model.encoder(view2), model.log_temperature)


def simclr_plain(model, batch):
    view1, view2 = batch
    return nt_xent(model.encoder(view1), model.encoder(view2), model.log_temperature)


def two_views(n, seed=1):
    """Two fixed augmentations of each sample: the views are given in the batch."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g, dtype=F64)
    return TensorDataset(x + 0.1 * torch.randn(n, 6, generator=g, dtype=F64), x.flip(-1) * 0.9)


def plain_steps(model, data, batch_size, steps, seed, loss, drop_last=True, micro=None):
    """Plain PyTorch: the loss over each whole global batch (or, with ``micro``, the mean of the
    losses over its consecutive micro-batches of that size, as gradient accumulation computes it)."""
    optimizer = SGD(model.parameters())
    for _, batch in zip(range(steps), plain_batches(data, batch_size, seed, drop_last)):
        optimizer.zero_grad()
        parts = [batch] if micro is None else [[t[i : i + micro] for t in batch]
                                               for i in range(0, len(batch[0]), micro)]
        for part in parts:
            (loss(model, part) / len(parts)).backward()
        optimizer.step()
    return model


@pytest.mark.parametrize("workers", [1, pytest.param(2, marks=pytest.mark.quick), 3])
def test_nt_xent_over_the_gathered_global_batch_equals_plain_pytorch(workers):
    torch.manual_seed(0)
    model, data = SimCLR().double(), two_views(36)
    reference = plain_steps(copy.deepcopy(model), data, 12, steps=4, seed=3, loss=simclr_plain)
    result = Trainer(workers=workers, batch_size=12, max_steps=4, seed=3).fit(model, data, optimizer=SGD,
                                                                              step_fn=simclr_step)
    assert result.plan["loss_form"] == "gathered"
    assert_exact(model, reference)
    assert model.log_temperature.item() != pytest.approx(-0.7)  # the temperature trained, once per step


def test_uneven_slices_and_a_short_last_batch_are_exact():
    torch.manual_seed(0)
    model, data = SimCLR().double(), two_views(25)  # batches of 10 (slices 4, 3, 3), then 5 (2, 2, 1)
    reference = plain_steps(copy.deepcopy(model), data, 10, steps=5, seed=4, loss=simclr_plain, drop_last=False)
    Trainer(workers=3, batch_size=10, max_steps=5, seed=4, drop_last=False).fit(model, data, optimizer=SGD,
                                                                               step_fn=simclr_step)
    assert_exact(model, reference)


def test_accumulated_micro_batches_each_gather_their_global_micro_batch():
    torch.manual_seed(0)
    model, data = SimCLR().double(), two_views(36)
    reference = plain_steps(copy.deepcopy(model), data, 12, steps=3, seed=5, loss=simclr_plain, micro=6)
    Trainer(workers=2, batch_size=6, accumulate=2, max_steps=3, seed=5).fit(model, data, optimizer=SGD,
                                                                            step_fn=simclr_step)
    assert_exact(model, reference)


class CLIP(nn.Module):
    """Two towers and CLIP's learnable logit scale."""

    def __init__(self):
        super().__init__()
        self.image = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5))
        self.text = nn.Linear(3, 5)
        self.logit_scale = nn.Parameter(torch.tensor(1.5))


def clip_loss(image, text, logit_scale):
    logits = logit_scale.exp() * F.normalize(image, dim=1) @ F.normalize(text, dim=1).T
    labels = torch.arange(len(logits))
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def clip_step(model, batch):
    images, texts = batch
    return clip_loss(sn_trainer.gather(model.image(images)), sn_trainer.gather(model.text(texts)), model.logit_scale)


def clip_plain(model, batch):
    images, texts = batch
    return clip_loss(model.image(images), model.text(texts), model.logit_scale)


@pytest.mark.parametrize("comm", ["shm", "gloo"])
def test_clip_loss_gradients_reach_each_slice_once_and_the_scale_whole(comm):
    """Wrong if gather's backward gave a worker more than its own rows, or if the gradient of a
    parameter used after the gather (the logit scale) were summed over the workers; through
    either reducer's exchange."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(2)
    model = CLIP().double()
    data = TensorDataset(torch.randn(30, 6, generator=g, dtype=F64), torch.randn(30, 3, generator=g, dtype=F64))
    reference = plain_steps(copy.deepcopy(model), data, 10, steps=4, seed=6, loss=clip_plain)
    Trainer(workers=2, batch_size=10, max_steps=4, seed=6, comm=comm).fit(model, data, optimizer=SGD,
                                                                          step_fn=clip_step)
    assert_exact(model, reference)


def ordered_step(model, batch, record_dir):
    """NT-Xent weighted by each sample's position in the gathered batch (an order error changes the
    gradient); the gathered sample indices written down, once per worker."""
    view1, view2, index = batch
    gathered = sn_trainer.gather(index)
    z1, z2 = sn_trainer.gather(model.encoder(view1)), sn_trainer.gather(model.encoder(view2))
    if len(gathered) == 10 and in_a_worker():  # a global batch in a worker's own step (not the verification's)
        with open(Path(record_dir) / f"{os.getpid()}.txt", "a") as out:
            digest = hashlib.sha256(z1.detach().numpy().tobytes()).hexdigest()
            out.write(" ".join(map(str, gathered.tolist())) + f" {digest}\n")
    weights = torch.arange(1, len(z1) + 1, dtype=z1.dtype).unsqueeze(1)
    return nt_xent(z1 * weights, z2, model.log_temperature)


def test_gather_returns_the_global_batch_in_sample_order(tmp_path):
    torch.manual_seed(0)
    views = two_views(30)
    data = TensorDataset(*views.tensors, torch.arange(30))
    model = SimCLR().double()
    reference = copy.deepcopy(model)
    Trainer(workers=3, batch_size=10, max_steps=3, seed=7).fit(
        model, data, optimizer=SGD, step_fn=functools.partial(ordered_step, record_dir=str(tmp_path)))
    expected = [plain_indices(30, 10, 7, step).tolist() for step in range(3)]
    written = [line.split() for f in tmp_path.iterdir() for line in f.read_text().splitlines()]
    assert sorted(line[:-1] for line in written) == sorted([list(map(str, order)) for order in expected] * 3)
    digests = {}  # the gathered embeddings of each step, bit for bit, in every worker
    for line in written:
        digests.setdefault(tuple(line[:-1]), set()).add(line[-1])
    assert all(len(seen) == 1 for seen in digests.values())

    optimizer = SGD(reference.parameters())
    for order in expected:
        optimizer.zero_grad()
        view1, view2 = views.tensors[0][order], views.tensors[1][order]
        z1 = reference.encoder(view1) * torch.arange(1, 11, dtype=F64).unsqueeze(1)
        nt_xent(z1, reference.encoder(view2), reference.log_temperature).backward()
        optimizer.step()
    assert_exact(model, reference)


@pytest.mark.unit
def test_gather_is_the_identity_outside_a_run():
    tensor = torch.randn(3, 2, requires_grad=True)
    assert sn_trainer.gather(tensor) is tensor


def test_the_same_loss_without_gather_is_still_refused_with_workers():
    with pytest.raises(ConfigError):
        Trainer(workers=2, batch_size=12, max_steps=2).fit(SimCLR().double(), two_views(24), optimizer=SGD,
                                                          step_fn=simclr_slice_only)


def test_gather_in_evaluation_with_workers_is_refused():
    with pytest.raises(ConfigError, match="evaluation calls sn_trainer.gather"):
        Trainer(workers=2, batch_size=12, max_steps=2).fit(SimCLR().double(), two_views(24), eval_set=two_views(8),
                                                          optimizer=SGD, step_fn=simclr_step)


def test_a_last_micro_batch_smaller_than_the_workers_is_refused():
    with pytest.raises(ConfigError, match="fewer than the 3 workers"):
        Trainer(workers=3, batch_size=10, max_steps=2, drop_last=False).fit(SimCLR().double(), two_views(21),
                                                                            optimizer=SGD, step_fn=simclr_step)


def gathered_pair(model, batch):
    """simclr_step's loss as (loss_sum, count) over the gathered batch: its rows, both views."""
    view1, view2 = batch
    z1, z2 = sn_trainer.gather(model.encoder(view1)), sn_trainer.gather(model.encoder(view2))
    z = F.normalize(torch.cat([z1, z2]), dim=1)
    n = z1.shape[0]
    similarity = (z @ z.T / model.log_temperature.exp()).masked_fill(torch.eye(2 * n, dtype=torch.bool), float("-inf"))
    positives = torch.cat([torch.arange(n, 2 * n), torch.arange(n)])
    return F.cross_entropy(similarity, positives, reduction="sum"), torch.tensor(2 * n)


@pytest.mark.parametrize("workers", [2, 3])  # at one worker gather is the tensor itself
def test_a_gathered_step_returning_loss_sum_and_count_trains_as_its_scalar_mean(workers):
    """(loss_sum, count) over the gathered batch is the scalar loss_sum / count: the same run."""
    torch.manual_seed(0)
    model, data = SimCLR().double(), two_views(24)
    scalar = copy.deepcopy(model)
    Trainer(workers=workers, batch_size=12, max_steps=3, seed=3).fit(scalar, data, optimizer=SGD, step_fn=simclr_step)
    result = Trainer(workers=workers, batch_size=12, max_steps=3, seed=3).fit(model, data, optimizer=SGD,
                                                                              step_fn=gathered_pair)
    assert result.plan["loss_form"] == "gathered"
    # Bitwise where it was written; 1e-12 leaves room for a kernel whose mean rounds unlike sum / count.
    assert_exact(model, scalar, rtol=1e-12, atol=1e-12)
    assert model.log_temperature.item() != pytest.approx(-0.7)  # it trained


def with_a_term_of_its_own_slice(model, batch):
    view1, _ = batch
    return simclr_step(model, batch) + model.encoder(view1).pow(2).mean()


def test_a_loss_that_differs_between_workers_stops_the_run():
    with pytest.raises(InputError, match="differs between workers"):
        Trainer(workers=2, batch_size=12, max_steps=2).fit(SimCLR().double(), two_views(24), optimizer=SGD,
                                                          step_fn=with_a_term_of_its_own_slice)
