"""What real projects bring, exact or refused: each against an independent plain-PyTorch loop in float64.

Hugging Face language models, loss subclasses and functional sums, frozen backbones in eval mode,
optimizers that look across tensors, buffers written in forward, numpy and ``random`` inside the
step. Each either trains as one process would on the same global batches (W = 1, 2, 3), or is
refused before any worker starts with one line that says what to do.
"""
import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from helpers import SmallConvNet, assert_exact, plain_fit, tiny_dataset
from sn_trainer import ConfigError, Trainer

pytestmark = [pytest.mark.timeout(240), pytest.mark.contract]
F64 = torch.float64
SGD = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9, weight_decay=1e-3)


def sgd_of(model):
    return SGD(model.parameters())


# --- 1. Hugging Face models: model(**batch).loss is a mean over kept tokens ----------------------

class PaddedTokens(Dataset):
    """Token rows padded to 12, of 3 to 12 real tokens: labels -100 on padding, as HF's collators do."""

    def __init__(self, n: int = 40, length: int = 12, vocab: int = 20, seed: int = 1):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)
        real = torch.randint(3, length + 1, (n,), generator=g)
        self.mask = (torch.arange(length)[None, :] < real[:, None]).long()
        self.labels = self.ids.masked_fill(self.mask == 0, -100)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.labels[i]}


def causal_lm():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=20, n_positions=16, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config).double()


def masked_lm():
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(vocab_size=20, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=16, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    return BertForMaskedLM(config).double()


def model_loss(model, batch):
    return model(**batch).loss


def assert_close_to_fp32(model, reference):
    """Hugging Face computes its loss in float32 whatever the model's dtype (``logits.float()``),
    so the float64 comparison holds to float32's rounding of that last step, not to 1e-10."""
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-9, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("kind, form", [("causal", "shifted_tokens"), ("masked", "tokens_from_logits")])
@pytest.mark.parametrize("workers", [1, 2, 3])
def test_a_hugging_face_language_model_trains_on_the_global_token_mean(kind, form, workers):
    torch.manual_seed(0)
    model = causal_lm() if kind == "causal" else masked_lm()
    data = PaddedTokens()
    reference = plain_fit(copy.deepcopy(model), data, 8, steps=4, seed=3, optimizer=sgd_of, loss=model_loss)
    result = Trainer(workers=workers, batch_size=8, max_steps=4, seed=3).fit(model, data, optimizer=SGD)
    # measured: GPT-2 sums kept tokens when told num_items_in_batch; BERT ignores it, and its loss is its
    # logits' cross-entropy over kept labels, which the workers sum
    assert result.plan["loss_form"] == form
    assert_close_to_fp32(model, reference)


def test_a_scalar_token_mean_is_refused_where_it_splits_and_trains_where_it_does_not(no_leaks):
    torch.manual_seed(0)
    model = causal_lm()
    data = PaddedTokens()
    with pytest.raises(ConfigError, match=r"^step_fn gives a scalar loss that cannot be split over workers exactly: "
                                          r"on 8 samples, .*Return \(loss_sum, count\) from a step_fn instead"):
        Trainer(workers=2, batch_size=8, max_steps=2).fit(model, data, optimizer=SGD, step_fn=model_loss)
    reference = plain_fit(copy.deepcopy(model), data, 8, steps=2, seed=3, optimizer=sgd_of, loss=model_loss)
    Trainer(workers=1, batch_size=8, max_steps=2, seed=3).fit(model, data, optimizer=SGD, step_fn=model_loss)
    assert_close_to_fp32(model, reference)  # one slice a step: its mean is the batch's


# --- 2. a loss subclass runs its own forward; a functional sum is a sum --------------------------

class SmoothedCrossEntropy(nn.CrossEntropyLoss):
    """A subclass with its own forward: cross-entropy plus a penalty on the logits' size."""

    def forward(self, logits, targets):
        return super().forward(logits, targets) + 0.1 * logits.pow(2).mean()


class IgnoringCrossEntropy(nn.CrossEntropyLoss):
    """A subclass whose mean divides by the targets it keeps: the count depends on the data."""

    def forward(self, logits, targets):
        return F.cross_entropy(logits, targets, ignore_index=0)


@pytest.mark.parametrize("loss_fn, form", [
    (SmoothedCrossEntropy(), "mean"),
    (functools.partial(F.cross_entropy, reduction="sum"), "sum"),
], ids=["subclass", "functional-sum"])
@pytest.mark.parametrize("workers", [1, 2, 3])
def test_a_loss_subclass_and_a_functional_sum_train_as_written(loss_fn, form, workers):
    torch.manual_seed(0)
    model = SmallConvNet().double()
    lr = 0.05 if form == "mean" else 0.005
    sgd = functools.partial(torch.optim.SGD, lr=lr, momentum=0.9)
    reference = plain_fit(copy.deepcopy(model), tiny_dataset(dtype=F64), 7, steps=4, seed=3,
                          optimizer=lambda m: sgd(m.parameters()), loss=lambda m, b: loss_fn(m(b[0]), b[1]))
    result = Trainer(workers=workers, batch_size=7, max_steps=4, seed=3, log_every=1).fit(
        model, tiny_dataset(dtype=F64), optimizer=sgd, loss_fn=loss_fn)
    assert result.plan["loss_form"] == form
    assert_exact(model, reference)
    if form == "sum":  # reported as plain PyTorch reports it: the global batch's sum
        assert result.history[0]["loss"] > 3


def test_a_loss_whose_denominator_depends_on_the_data_is_refused():
    with pytest.raises(ConfigError, match=r"^loss_fn gives a scalar loss that cannot be split over workers exactly"):
        Trainer(workers=2, batch_size=8, max_steps=2).fit(SmallConvNet(), tiny_dataset(), optimizer=SGD,
                                                          loss_fn=IgnoringCrossEntropy())


# --- 3. a frozen backbone in eval mode stays in eval mode -------------------------------------------

class FineTuned(nn.Module):
    """A convolution + batch norm + dropout backbone under a linear head, as fine-tuning sets it up."""

    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Dropout(0.5))
        self.head = nn.Linear(4 * 6 * 6, 3)

    def forward(self, x):
        return self.head(self.backbone(x).flatten(1))


def frozen_backbone() -> FineTuned:
    torch.manual_seed(0)
    model = FineTuned().double()
    with torch.no_grad():  # statistics worth keeping: a few batches through it in training mode
        for _ in range(3):
            model.backbone(torch.randn(16, 1, 8, 8, dtype=F64) * 3 + 1)
    model.backbone.requires_grad_(False)
    model.backbone.eval()
    return model


@pytest.mark.parametrize("workers", [1, pytest.param(2, marks=pytest.mark.quick), 3])
def test_a_frozen_backbone_in_eval_mode_keeps_its_statistics_and_its_mode(workers):
    model = frozen_backbone()
    statistics = copy.deepcopy(model.backbone.state_dict())
    reference = plain_fit(copy.deepcopy(model), tiny_dataset(dtype=F64), 7, steps=4, seed=3, optimizer=sgd_of,
                          loss=lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    trainer = Trainer(workers=workers, batch_size=7, max_steps=4, seed=3)
    trainer.fit(model, tiny_dataset(dtype=F64), eval_set=tiny_dataset(n=20, dtype=F64), optimizer=SGD)
    assert_exact(model, reference)
    for name, value in model.backbone.state_dict().items():
        assert torch.equal(value, statistics[name]), name  # batch norm's running statistics untouched
    trainer.evaluate(model, tiny_dataset(n=20, dtype=F64))
    assert [m.training for m in model.modules()] == [True, False, False, False, False, False, True]


def test_a_model_left_in_eval_mode_is_said(caplog):
    model = SmallConvNet().eval()
    Trainer(workers=1, batch_size=8, max_steps=1).fit(model, tiny_dataset(), optimizer=SGD)
    assert "the model is in eval mode (every module): it trains so" in caplog.text


# --- 4. an optimizer that looks across tensors gets the whole model -------------------------------

def lamb(params):
    from timm.optim import Lamb  # its step clips by the global norm of every parameter's gradient

    return Lamb(params, lr=0.02, weight_decay=0.01, max_grad_norm=0.5)


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_an_optimizer_that_looks_across_tensors_steps_whole(workers):
    torch.manual_seed(0)
    model = SmallConvNet().double()
    start = copy.deepcopy(model)
    reference = plain_fit(copy.deepcopy(model), tiny_dataset(dtype=F64), 7, steps=4, seed=3,
                          optimizer=lambda m: lamb(m.parameters()), loss=lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    result = Trainer(workers=workers, batch_size=7, max_steps=4, seed=3).fit(model, tiny_dataset(dtype=F64),
                                                                             optimizer=lamb)
    assert result.plan["shards"] == "full"  # not a class tests prove elementwise or per-tensor
    assert_exact(model, reference)
    if workers > 1:  # forced into whole-tensor shards, each worker clips by its own shard's norm: wrong
        Trainer(workers=workers, batch_size=7, max_steps=4, seed=3, shards="tensors").fit(
            start, tiny_dataset(dtype=F64), optimizer=lamb)
        assert not torch.allclose(start.fc.weight, reference.fc.weight, rtol=1e-6)


# --- 5. buffers that forward changes follow worker 0, as DDP's follow rank 0 ------------------------

class RunningNormaliser(nn.Module):
    """Inputs centred by a running mean that each training forward updates: a buffer, not batch norm.

    ``replace``: the update rebinds the buffer (``self.mean = ...``) rather than writing in place.
    """

    def __init__(self, replace: bool):
        super().__init__()
        self.register_buffer("mean", torch.zeros(1, 1, 8, 8))
        self.net = SmallConvNet()
        self.replace = replace

    def forward(self, x):
        if self.training:
            update = 0.7 * self.mean + 0.3 * x.detach().mean(0, keepdim=True)
            if self.replace:
                self.mean = update
            else:
                self.mean.copy_(update)
        return self.net(x - self.mean)


def like_ddp_fit(model, dataset, batch_size, workers, steps, seed, optimizer):
    """DDP with broadcast_buffers, simulated in one process: each worker's forward starts from
    rank 0's buffers, rank 0's forward updates them; the slices' gradients are summed and divided
    by the global batch. The slices are cut as sn_trainer documents (the first batch % W take one
    more)."""
    from helpers import plain_batches, worker_slices

    opt = optimizer(model)
    for _, (inputs, targets) in zip(range(steps), plain_batches(dataset, batch_size, seed)):
        before = {name: b.clone() for name, b in model.named_buffers()}
        after = before
        opt.zero_grad()
        for rank, (lo, hi) in enumerate(worker_slices(len(inputs), workers)):
            with torch.no_grad():
                for name, b in model.named_buffers():
                    b.copy_(before[name])
            loss_sum = F.cross_entropy(model(inputs[lo:hi]), targets[lo:hi], reduction="sum")
            (loss_sum / len(inputs)).backward()
            if rank == 0:
                after = {name: b.clone() for name, b in model.named_buffers()}
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(after[name])
        opt.step()
    return model


@pytest.mark.parametrize("replace", [False, True], ids=["in-place", "replaced"])
@pytest.mark.parametrize("workers", [1, 2, 3])
def test_buffers_changed_in_forward_follow_worker_0_like_ddp(workers, replace):
    torch.manual_seed(0)
    model = RunningNormaliser(replace).double()
    reference = like_ddp_fit(copy.deepcopy(model), tiny_dataset(dtype=F64), 7, workers, steps=4, seed=3,
                             optimizer=sgd_of)
    Trainer(workers=workers, batch_size=7, max_steps=4, seed=3).fit(model, tiny_dataset(dtype=F64), optimizer=SGD)
    assert_exact(model, reference)  # parameters, and the buffer worker 0 left
    assert model.mean.abs().sum() > 0


# --- 6. torch, numpy and random: a stream per worker, from (seed, rank) ---------------------------

def augmenting_step(model, batch):
    """Augmentation drawn from all three generators: a flip (numpy), a shift (random), noise (torch)."""
    import random

    import numpy as np

    inputs, targets = batch
    flip = torch.from_numpy(np.random.rand(len(inputs)) < 0.5)
    inputs = torch.where(flip[:, None, None, None], inputs.flip(-1), inputs) + random.random()
    inputs = inputs + 0.1 * torch.randn_like(inputs)
    return F.cross_entropy(model(inputs), targets, reduction="sum"), len(inputs)


def per_worker_streams_fit(model, dataset, batch_size, workers, steps, seed, optimizer):
    """One process playing W workers: worker r's slice is augmented from streams seeded with
    seed * 1000 + r (torch, numpy and random alike, as sn_trainer documents)."""
    import random

    import numpy as np

    from helpers import plain_batches, worker_slices

    def seeded(value):
        torch.manual_seed(value)
        np.random.seed(value)
        random.seed(value)
        return torch.get_rng_state(), np.random.get_state(), random.getstate()

    streams = [seeded(seed * 1000 + rank) for rank in range(workers)]
    opt = optimizer(model)
    for _, (inputs, targets) in zip(range(steps), plain_batches(dataset, batch_size, seed)):
        opt.zero_grad()
        for rank, (lo, hi) in enumerate(worker_slices(len(inputs), workers)):
            torch.set_rng_state(streams[rank][0])
            np.random.set_state(streams[rank][1])
            random.setstate(streams[rank][2])
            loss_sum, _ = augmenting_step(model, (inputs[lo:hi], targets[lo:hi]))
            (loss_sum / len(inputs)).backward()
            streams[rank] = torch.get_rng_state(), np.random.get_state(), random.getstate()
        opt.step()
    return model


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_each_worker_augments_from_its_own_seeded_streams(workers):
    torch.manual_seed(0)
    model = SmallConvNet().double()
    reference = per_worker_streams_fit(copy.deepcopy(model), tiny_dataset(dtype=F64), 7, workers, steps=4, seed=5,
                                       optimizer=sgd_of)
    again = copy.deepcopy(model)
    Trainer(workers=workers, batch_size=7, max_steps=4, seed=5).fit(model, tiny_dataset(dtype=F64), optimizer=SGD,
                                                                    step_fn=augmenting_step)
    assert_exact(model, reference)
    Trainer(workers=workers, batch_size=7, max_steps=4, seed=6).fit(again, tiny_dataset(dtype=F64), optimizer=SGD,
                                                                    step_fn=augmenting_step)
    assert not torch.allclose(again.fc.weight, model.fc.weight)  # another seed, other augmentation
