"""How a scalar loss splits, decided the same whatever samples the probe reads; advice that fits the loss.

Padded token batches with ignored labels, a contrastive loss, torchvision's detection recipe, a
model that squeezes, a recurrent model that keeps its state: each exact against an independent
plain-PyTorch loop in float64 where it trains, like DDP (against a two-process DDP run) where the
user chose split="like_ddp", or refused before any worker starts with advice that is right.
"""
import copy
import functools
import logging
import os
import random

import pytest
import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from helpers import (SwitchLayer, assert_exact, cross_entropy, plain_fit as plain_loop, plain_indices, switch_step,
                     worker_slices)
from sn_trainer import ConfigError, Trainer
from sn_trainer.recipe.objective import Objective
from sn_trainer.fit import loss_probe

pytestmark = pytest.mark.timeout(240)
F64 = torch.float64
SGD = functools.partial(torch.optim.SGD, lr=0.1)


def sgd_of(model):
    return SGD(model.parameters())


def plain_fit(model, dataset, batch_size, steps, seed, loss, collate):
    """Plain PyTorch over the global batches sn_trainer documents (its own sampler, its own collate)."""
    opt = sgd_of(model)
    for step in range(steps):
        batch = collate([dataset[int(i)] for i in plain_indices(len(dataset), batch_size, seed, step)])
        opt.zero_grad()
        loss(model, batch).backward()
        opt.step()
    return model


# --- ignored labels: the decision does not depend on which samples were read ------------------------

class Tokens(Dataset):
    """Token rows of 6, labels -100 on padding; the rows the probe reads first (and spread over the
    set) are full, the others short: a probe of those 8 alone sees a per-sample mean."""

    def __init__(self, n: int = 40, order_seed: int | None = None):
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, 7, (n, 6), generator=g)
        full = {0, 1, 2, 3, 4, 5, 6, 7} | {int(i) for i in torch.linspace(0, n - 1, 8).round().long()}
        lengths = torch.tensor([6 if i in full else 2 + i % 3 for i in range(n)])
        self.labels = self.ids.masked_fill(torch.arange(6)[None, :] >= lengths[:, None], -100)
        self.order = list(range(n))
        if order_seed is not None:  # the same rows in another order, full rows kept where the probe reads
            short = [i for i in range(n) if i not in full]
            shuffled = [short[int(j)] for j in torch.randperm(len(short), generator=torch.Generator().manual_seed(
                order_seed))]
            self.order = [i if i in full else shuffled.pop() for i in range(n)]

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        j = self.order[i]
        return self.ids[j], self.labels[j]


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 5)
        self.out = nn.Linear(5, 7)

    def forward(self, ids):
        return self.out(torch.tanh(self.emb(ids)))


def token_mean(model, batch):
    ids, labels = batch
    return F.cross_entropy(model(ids).flatten(0, 1), labels.flatten(), ignore_index=-100)


def token_sum_and_count(model, batch):
    ids, labels = batch
    return (F.cross_entropy(model(ids).flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"),
            (labels != -100).sum())


def stack(items):
    return tuple(torch.stack(parts) for parts in zip(*items))


@pytest.mark.unit
def test_the_probes_own_samples_show_no_padding():
    data = Tokens()  # what a probe of its first 8, or of 8 spread over the set, measures
    for picked in (range(8), torch.linspace(0, len(data) - 1, 8).round().long().tolist()):
        objective = Objective(step_fn=token_mean)
        singles = [stack([data[i]]) for i in picked]
        found = loss_probe.measure(objective, TinyLM().double(), stack([data[i] for i in picked]), singles)
        assert found.form == "mean"


@pytest.mark.parametrize("workers, seed, order_seed", [pytest.param(2, 0, None, marks=pytest.mark.quick), (2, 5, 3),
                                                   (3, 0, None)])
def test_a_token_mean_over_padded_batches_is_refused_whatever_samples_the_probe_read(workers, seed, order_seed):
    with pytest.raises(ConfigError, match=r"^step_fn gives a scalar loss that cannot be split over workers exactly: "
                                          r"its batches hold ignored labels \(-100.*Return \(loss_sum, count\)"):
        Trainer(workers=workers, batch_size=8, max_steps=2, seed=seed).fit(
            TinyLM().double(), Tokens(order_seed=order_seed), optimizer=SGD, step_fn=token_mean)


@pytest.mark.parametrize("workers, step", [(1, token_mean), (2, token_sum_and_count), (3, token_sum_and_count)])
def test_padded_token_batches_train_exactly_where_they_train(workers, step):
    torch.manual_seed(0)
    model = TinyLM().double()
    reference = plain_fit(copy.deepcopy(model), Tokens(), 8, steps=3, seed=3, loss=token_mean, collate=stack)
    Trainer(workers=workers, batch_size=8, max_steps=3, seed=3).fit(model, Tokens(), optimizer=SGD, step_fn=step)
    assert_exact(model, reference)


# --- advice: a loss of per-sample parts, and one whose samples interact ----------------------------

class Views(Dataset):
    """Two noisy views of each of n points: what SimCLR's loss pulls together."""

    def __init__(self, n: int = 16):
        g = torch.Generator().manual_seed(2)
        points = torch.randn(n, 4, generator=g, dtype=F64)
        self.a = points + 0.1 * torch.randn(n, 4, generator=g, dtype=F64)
        self.b = points + 0.1 * torch.randn(n, 4, generator=g, dtype=F64)

    def __len__(self):
        return len(self.a)

    def __getitem__(self, i):
        return self.a[i], self.b[i]


def nt_xent(model, batch, temperature=0.5):
    """SimCLR's loss over the batch: each view against its pair, every other view a negative."""
    a, b = batch
    z = F.normalize(model(torch.cat([a, b])), dim=1)
    n = len(a)
    similarity = (z @ z.T / temperature).fill_diagonal_(float("-inf"))
    targets = torch.cat([torch.arange(n, 2 * n), torch.arange(n)])
    return F.cross_entropy(similarity, targets)


def test_a_contrastive_loss_is_refused_with_the_gather_or_like_ddp_advice():
    with pytest.raises(ConfigError) as refused:
        Trainer(workers=2, batch_size=8, max_steps=2).fit(nn.Linear(4, 3).double(), Views(), optimizer=SGD,
                                                          step_fn=nt_xent)
    message = str(refused.value)
    assert "one sample's loss depends on the others in the batch" in message
    assert "sn_trainer.gather(" in message and 'split="like_ddp"' in message
    assert "(loss * n, n)" not in message and "\n" not in message


# --- verified while training: a loss that looked like a mean on the probe's samples -------------------

class Routed(Dataset):
    """Inputs for a router of 3 experts; the samples the probe reads (the first 8, and 8 spread over
    the set) are one input, so they all go to one expert, where a load-balancing loss looks like a
    per-sample mean; the rest are spread."""

    def __init__(self, n: int = 40):
        g = torch.Generator().manual_seed(2)
        self.x = torch.randn(n, 4, generator=g, dtype=F64)
        for i in set(range(8)) | {int(i) for i in torch.linspace(0, n - 1, 8).round().long()}:
            self.x[i] = self.x[0]
        self.y = torch.randint(0, 2, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def test_a_load_balancing_loss_that_looked_like_a_mean_is_stopped_at_its_first_step():
    """The probe's samples all go to one expert, so it finds a per-sample mean; step 1, compared with
    one process's step on the same global batch, differs, and the run stops there, before its
    update, with the gather/like_ddp advice (before the verification, this trained on 1e-3 off a
    plain loop)."""
    from sn_trainer.errors import NotExact

    model = SwitchLayer().double()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(NotExact) as stopped:
        Trainer(workers=2, batch_size=8, max_steps=3, seed=1).fit(model, Routed(), optimizer=SGD,
                                                                  step_fn=switch_step)
    message = str(stopped.value)
    assert message.startswith("step 1 differs from one process's step on the same global batch: the gradient of "
                              "router.")
    assert "no update was applied for step 1" in message and "no step was verified before it" in message
    assert "sn_trainer.gather" in message and 'split="like_ddp"' in message and "\n" not in message
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# --- random draws, said: like DDP wherever each worker's streams make it so ---------------------------

def mixup_in_place(model, batch):
    """timm's Mixup as a step: the batch mixed in place with its flip, lam from numpy's generator; a
    per-sample mean returned as (loss * n, n)."""
    x, y = batch
    lam = float(np.random.beta(1.0, 1.0))
    x.mul_(lam).add_(x.flip(0) * (1 - lam))
    n = len(y)
    return F.cross_entropy(model(x), y) * n, n


def pairs(n: int = 16):
    g = torch.Generator().manual_seed(4)
    return torch.utils.data.TensorDataset(torch.randn(n, 4, generator=g, dtype=F64), torch.randint(0, 3, (n,), generator=g))


@pytest.mark.parametrize("workers", [1, 2])
def test_mixup_in_place_returned_as_a_pair_is_said_like_ddp_where_the_batch_splits(workers, caplog):
    """The probe gives each call a fresh copy (an in-place mix is no state kept between calls), sees the
    pair differ under other seeds, and the run says like DDP in its log and plan; at one slice a step
    nothing is split and the run is exact."""
    with caplog.at_level(logging.WARNING, logger="sn_trainer"):
        result = Trainer(workers=workers, batch_size=8, max_steps=2, seed=1).fit(
            nn.Linear(4, 3).double(), pairs(), optimizer=SGD, step_fn=mixup_in_place)
    said = [r.getMessage() for r in caplog.records if "like DDP, not equal to one process" in r.getMessage()]
    if workers == 1:
        assert result.plan["exactness"].startswith("exact: one worker, one slice a step") and not said
    else:
        assert result.plan["exactness"].startswith("like DDP: step_fn draws random numbers (its (loss_sum, count) "
                                                   "differs under other seeds")
        assert len(said) == 1 and "step_fn draws random numbers" in said[0]


class Noisy(Dataset):
    """Samples augmented from the global generators: torch's noise and random's flip of sign."""

    def __init__(self, n: int = 16):
        g = torch.Generator().manual_seed(5)
        self.x, self.y = torch.randn(n, 4, generator=g, dtype=F64), torch.randint(0, 3, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        sign = -1.0 if random.random() < 0.5 else 1.0
        return sign * self.x[i] + 0.1 * torch.randn(4, dtype=F64), self.y[i]


def test_augmentation_from_the_global_generators_is_like_ddp_and_seeded_per_sample_is_exact(caplog):
    from sn_trainer.data import SeededPerSample

    with caplog.at_level(logging.WARNING, logger="sn_trainer"):
        result = Trainer(workers=2, batch_size=8, max_steps=2, seed=1).fit(
            nn.Linear(4, 3).double(), Noisy(), optimizer=SGD, loss_fn=F.cross_entropy)
    assert result.plan["exactness"].startswith("like DDP: reading train_set draws from torch's, numpy's or random's")
    assert any("SeededPerSample" in r.getMessage() for r in caplog.records)

    torch.manual_seed(0)
    model = nn.Linear(4, 3).double()
    reference = plain_loop(copy.deepcopy(model), SeededPerSample(Noisy(), seed=3), 8, 2, 1, sgd_of, cross_entropy)
    result = Trainer(workers=2, batch_size=8, max_steps=2, seed=1).fit(model, SeededPerSample(Noisy(), seed=3),
                                                                       optimizer=SGD, loss_fn=F.cross_entropy)
    assert result.plan["exactness"] == "exact, verified at 2 steps (1, 2)"  # the first and the last
    assert_exact(model, reference)


@pytest.mark.unit
def test_a_loss_of_per_sample_parts_is_advised_its_sum_and_count():
    data = Tokens()
    picked = [0, 8, 9, 10, 11, 12]  # full rows and short ones: a token mean, visibly not a sample mean
    found = loss_probe.measure(Objective(step_fn=token_mean), TinyLM().double(), stack([data[i] for i in picked]),
                               [stack([data[i]]) for i in picked])
    assert found.form is None and "weights that depend on the data" in found.detail
    assert found.advice.startswith("Return (loss_sum, count) from a step_fn") and "gather" not in found.advice


# --- state kept between calls, random draws: the message names the cause -----------------------------

class CarriedRNN(nn.Module):
    """A recurrent model that keeps its hidden state on itself from one call to the next."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.RNN(3, 4, batch_first=True)
        self.head = nn.Linear(4, 2)
        self.hidden = None

    def forward(self, x):
        if self.hidden is None or self.hidden.shape[1] != len(x):
            self.hidden = torch.zeros(1, len(x), 4, dtype=x.dtype)
        out, hidden = self.rnn(x, self.hidden)
        self.hidden = hidden.detach()
        return self.head(out[:, -1])


def sequences(n=12):
    g = torch.Generator().manual_seed(4)
    return torch.utils.data.TensorDataset(torch.randn(n, 5, 3, generator=g, dtype=F64),
                                          torch.randint(0, 2, (n,), generator=g))


def test_a_model_that_keeps_state_between_calls_is_told_so_without_guessing_augmentation():
    with pytest.raises(ConfigError) as refused:
        Trainer(workers=2, batch_size=6, max_steps=2).fit(CarriedRNN().double(), sequences(), optimizer=SGD,
                                                          loss_fn=F.cross_entropy)
    message = str(refused.value)
    assert "keeps state from one call to the next (a recurrent hidden state kept on the model" in message
    assert "Mixup" not in message and "augmentation" not in message
    assert "Return (loss_sum, count) from a step_fn" in message


class NoisyHead(nn.Module):
    """Dropout called as a function: random in training mode only."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        return self.fc(F.dropout(x, 0.5, training=self.training))


@pytest.mark.unit
def test_random_draws_of_training_mode_alone_are_measured_in_eval_mode_and_other_draws_are_refused():
    x, y = torch.randn(6, 3, dtype=F64), torch.randint(0, 2, (6,))
    group, singles = (x, y), [(x[i : i + 1], y[i : i + 1]) for i in range(6)]
    found = loss_probe.measure(Objective(loss_fn=F.cross_entropy), NoisyHead().double(), group, singles)
    assert found.form == "mean" and "measured in eval mode" in found.detail

    def mixup(model, batch):  # mixes samples whatever the mode
        inputs, targets = batch
        lam, perm = torch.rand(()), torch.randperm(len(inputs))
        logits = model(lam * inputs + (1 - lam) * inputs[perm])
        return lam * F.cross_entropy(logits, targets) + (1 - lam) * F.cross_entropy(logits, targets[perm])

    found = loss_probe.measure(Objective(step_fn=mixup), nn.Linear(3, 2).double(), group, singles)
    assert found.form is None and "draws random numbers" in found.detail and 'split="like_ddp"' in found.advice


# --- nothing split at W=1: a model that squeezes -------------------------------------------------------

class Squeezing(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(x).squeeze()  # a batch of one loses its batch dimension


def test_a_model_that_squeezes_trains_at_one_worker():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(5)
    data = torch.utils.data.TensorDataset(torch.randn(20, 4, generator=g, dtype=F64),
                                          torch.randint(0, 3, (20,), generator=g))
    model = Squeezing().double()

    def loss(m, batch):
        return F.cross_entropy(m(batch[0]), batch[1])

    reference = plain_fit(copy.deepcopy(model), data, 4, steps=3, seed=3, loss=loss, collate=stack)
    Trainer(workers=1, batch_size=4, max_steps=3, seed=3).fit(model, data, optimizer=SGD, loss_fn=F.cross_entropy)
    assert_exact(model, reference)


# --- torchvision's detection recipe -------------------------------------------------------------------

def detector():
    """torchvision's Faster R-CNN at a tiny size; every anchor and proposal sampled (no random subset)."""
    from torchvision.models.detection import FasterRCNN
    from torchvision.models.detection.anchor_utils import AnchorGenerator
    from torchvision.models.detection.faster_rcnn import FastRCNNPredictor, TwoMLPHead
    from torchvision.ops import MultiScaleRoIAlign

    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.ReLU(),
                             nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.ReLU())
    backbone.out_channels = 8
    return FasterRCNN(backbone, rpn_anchor_generator=AnchorGenerator(sizes=((8, 16),), aspect_ratios=((1.0,),)),
                      box_roi_pool=MultiScaleRoIAlign(featmap_names=["0"], output_size=4, sampling_ratio=2),
                      box_head=TwoMLPHead(8 * 4 * 4, 16), box_predictor=FastRCNNPredictor(16, 3),
                      min_size=32, max_size=32, rpn_batch_size_per_image=100_000, box_batch_size_per_image=100_000,
                      rpn_pre_nms_top_n_train=50, rpn_post_nms_top_n_train=20).double()


class Boxes(Dataset):
    """Images with one or two boxes each, targets as torchvision's detection references give them."""

    def __init__(self, n: int = 8):
        g = torch.Generator().manual_seed(6)
        self.images = torch.rand(n, 3, 32, 32, generator=g, dtype=F64)
        corners = torch.randint(0, 14, (n, 2, 2), generator=g).to(F64)
        self.boxes = torch.cat([corners, corners + torch.randint(6, 18, (n, 2, 2), generator=g)], dim=2)
        self.labels = torch.randint(1, 3, (n, 2), generator=g)

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        keep = 1 + i % 2
        return self.images[i], {"boxes": self.boxes[i, :keep], "labels": self.labels[i, :keep]}


def collate(batch):
    return tuple(zip(*batch))


def detection_step(model, batch):
    images, targets = batch
    loss_dict = model(list(images), list(targets))
    return sum(loss for loss in loss_dict.values())


def test_torchvisions_detection_recipe_trains_exactly_at_one_worker():
    model = detector()
    reference = plain_fit(copy.deepcopy(model), Boxes(), 4, steps=2, seed=3, loss=detection_step, collate=collate)
    Trainer(workers=1, batch_size=4, max_steps=2, seed=3).fit(model, Boxes(), optimizer=SGD, step_fn=detection_step,
                                                              collate_fn=collate)
    assert_exact(model, reference)


def test_a_detector_at_two_workers_is_refused_naming_like_ddp():
    with pytest.raises(ConfigError, match=r'^step_fn gives a scalar loss that cannot be split over workers exactly: '
                                          r'.*split="like_ddp"'):
        Trainer(workers=2, batch_size=4, max_steps=2).fit(detector(), Boxes(), optimizer=SGD,
                                                          step_fn=detection_step, collate_fn=collate)


def ddp_rank(rank, world, store_path, out_path, state, batch_size, steps, seed):
    """One rank of torch's own DDP on its slice of each global batch (the reference)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        model = detector()
        model.load_state_dict(state)
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = sgd_of(ddp)
        data = Boxes()
        lo, hi = worker_slices(batch_size, world)[rank]
        for step in range(steps):
            indices = plain_indices(len(data), batch_size, seed, step)[lo:hi]
            opt.zero_grad()
            detection_step(ddp, collate([data[int(i)] for i in indices])).backward()
            opt.step()
        if rank == 0:
            torch.save(model.state_dict(), out_path)
    finally:
        dist.destroy_process_group()
    # Done and saved: leave without Python's teardown, which gloo's threads abort (SIGABRT) at times,
    # as sn_trainer.launch's child leaves.
    os._exit(0)


def test_a_detector_with_split_like_ddp_trains_as_torchs_ddp(tmp_path):
    model = detector()
    out = tmp_path / "ddp.pt"
    mp.spawn(ddp_rank, args=(2, str(tmp_path / "store"), str(out), copy.deepcopy(model.state_dict()), 4, 2, 3),
             nprocs=2, join=True)
    result = Trainer(workers=2, batch_size=4, max_steps=2, seed=3, split="like_ddp").fit(
        model, Boxes(), optimizer=SGD, step_fn=detection_step, collate_fn=collate)
    assert result.plan["loss_form"] == "like_ddp"
    reference = detector()
    reference.load_state_dict(torch.load(out))
    assert_exact(model, reference)


@pytest.mark.unit
def test_a_settled_objective_is_frozen_and_the_one_given_stays_as_built():
    """What the rehearsal finds (the loss's form, evaluation's keys) is set once, on a copy the
    workers receive; after that no stage can change it, in this process or a worker's."""
    import pickle

    from sn_trainer.recipe.objective import MEAN, SUM

    given = Objective(nn.MSELoss())
    settled = given.settled(form=SUM, eval_keys=("loss",))
    assert (settled.form, settled.eval_keys) == (SUM, ("loss",)) and (given.form, given.eval_keys) == (MEAN, ())
    for frozen in (settled, pickle.loads(pickle.dumps(settled)), copy.copy(settled)):
        with pytest.raises(AttributeError, match="frozen"):
            frozen.form = MEAN
        assert frozen.form == SUM
    given.form = SUM  # the one given, as the rehearsal's copy, is still the user's to change
    with pytest.raises(TypeError, match="settles form, eval_keys, metric_templates, not loss_fn"):
        given.settled(loss_fn=None)
