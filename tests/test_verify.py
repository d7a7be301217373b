""""exact" earned on the run's own batches, and guards that touch nothing.

Where a run splits its batches, steps are compared with what one process computes on the same
global batch, read and collated as a plain DataLoader would (``engine.step.verification``). A model whose
output depends on its batch's padding, a loss that stops splitting mid-run, a shard kind forced on
an optimizer that looks across tensors: each ends stopped before its next update, or (with the
user's consent) labelled for what it is, never labelled exact while off. The verification runs on
copies: a run with it equals the same run without it, bit for bit. Everything in float64, W = 2
and 3 where it matters.
"""
import copy
import functools
import logging
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from helpers import SmallConvNet, SwitchLayer, assert_exact, plain_batches, switch_step, tiny_dataset, worker_slices
from sn_trainer import NotExact, Trainer

pytestmark = pytest.mark.timeout(240)
F64 = torch.float64
SGD = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)


@pytest.mark.unit
def test_the_schedule_keeps_its_gaps_bounded_and_checks_the_last_step():
    from sn_trainer.engine.step.verification import Schedule

    steps = Schedule(100, 0, 999).steps()
    assert steps == [1, *range(100, 1001, 100)]
    assert max(b - a for a, b in zip(steps, steps[1:])) <= 100
    assert Schedule(100, 0, 1036).steps()[-2:] == [1000, 1037]  # the last step, off the grid
    assert Schedule(4, 10, 19).steps() == [11, 12, 16, 20]  # a resumed launch checks its first step
    assert Schedule(0, 0, 99).steps() == []


# --- a model whose output depends on its batch's padding ------------------------------------------

class Sentences(Dataset):
    """Token rows of 2 to 9 tokens (ids 1 to 9), labelled by whether the first is odd."""

    def __init__(self, n: int = 32, seed: int = 1):
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(2, 10, (n,), generator=g)
        self.rows = [torch.randint(1, 10, (int(k),), generator=g) for k in lengths]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i], int(self.rows[i][0] % 2)


def pad_to_longest(items):
    """A DataLoader's collate for text: each batch padded with 0 to its longest row."""
    rows, labels = zip(*items)
    return nn.utils.rnn.pad_sequence(list(rows), batch_first=True), torch.tensor(labels)


class TextCNN(nn.Module):
    """Embeddings, a convolution, and a max over every position, the padding's included."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.conv, self.fc = nn.Embedding(10, 4), nn.Conv1d(4, 6, 2), nn.Linear(6, 2)

    def forward(self, ids):
        return self.fc(self.conv(self.embed(ids).transpose(1, 2)).relu().amax(-1))


def like_ddp_text_fit(model, dataset, batch_size, workers, steps, seed):
    """DDP in one process: each worker's slice collated (padded) alone, the slices' loss sums over the
    global batch's samples, one SGD step."""
    optimizer = SGD(model.parameters())
    order = plain_batches(range(len(dataset)), batch_size, seed)
    for _, indices in zip(range(steps), order):
        optimizer.zero_grad()
        for lo, hi in worker_slices(len(indices), workers):
            ids, labels = pad_to_longest([dataset[int(i)] for i in indices[lo:hi]])
            (F.cross_entropy(model(ids), labels, reduction="sum") / len(indices)).backward()
        optimizer.step()
    return model


@pytest.mark.parametrize("workers, dtype", [(2, F64), (3, F64), (2, torch.float32)])
def test_a_model_that_depends_on_its_batchs_padding_stops_or_is_like_ddp_with_consent(workers, dtype):
    model = TextCNN().to(dtype)
    before = copy.deepcopy(model.state_dict())
    trainer = Trainer(workers=workers, batch_size=8, max_steps=4, seed=2)
    with pytest.raises(NotExact) as stopped:
        trainer.fit(model, Sentences(), optimizer=SGD, collate_fn=pad_to_longest)
    message = str(stopped.value)
    assert message.startswith("step 1 differs from one process's step on the same global batch: ")
    assert "no update was applied for step 1" in message and "padding" in message and "\n" not in message
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # nothing trained off
    if dtype == torch.float32:  # found in float32 too, beyond what float64 says rounding moves it
        return

    reference = like_ddp_text_fit(copy.deepcopy(model), Sentences(), 8, workers, steps=4, seed=2)
    result = Trainer(workers=workers, batch_size=8, max_steps=4, seed=2, split="like_ddp").fit(
        model, Sentences(), optimizer=SGD, collate_fn=pad_to_longest)
    assert result.plan["exactness"].startswith("like DDP from step 1: step 1 differs from one process's step")
    assert result.verified_steps == []
    assert_exact(model, reference)  # what it trains on: DDP's step, each slice padded alone


# --- a loss that splits at first and stops splitting later --------------------------------------

def collapsed_then_spread(n: int = 160, spread_from: int = 104) -> TensorDataset:
    """Rows that all go to expert 0 (a first input of 10), then from ``spread_from`` on rows that
    spread over the experts, but at the rows the loss probe reads (8, spread over the set)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 4, generator=g, dtype=F64)
    x[:, 0] = 10.0
    probed = set(torch.linspace(0, n - 1, 8).round().long().tolist())
    for i in range(spread_from, n):
        if i not in probed:  # a worker's half of a batch of 8 to expert 1, the other's to expert 2
            x[i, 0] = 0.0 if i % 8 < 4 else -10.0
            x[i, 1 if i % 8 < 4 else 2] = 12.0
    return TensorDataset(x, torch.randint(0, 2, (n,), generator=g))


@pytest.mark.quick
def test_a_loss_that_stops_splitting_is_caught_within_the_verifications_gap():
    """Global batches 1-13 all go to expert 0, where the load-balancing term splits as a mean; from
    step 14 on they spread. Verified every 4 steps, step 16 is the first checked one that differs:
    the run stops there before its update, and says steps 13 to 15 went unverified."""
    model = SwitchLayer(collapsing=True).double()
    with pytest.raises(NotExact) as stopped:
        Trainer(workers=2, batch_size=8, max_steps=20, seed=1, shuffle=False, verify_every=4).fit(
            model, collapsed_then_spread(), optimizer=SGD, step_fn=switch_step)
    message = str(stopped.value)
    assert message.startswith("step 16 differs from one process's step on the same global batch: ")
    assert "steps 1, 4, 8, 12 were verified equal" in message
    assert "steps 13-15 were not verified and may have trained off" in message
    assert "no update was applied for step 16" in message


# --- an optimizer sharded by hand ----------------------------------------------------------------

class TimesSGD(torch.optim.SGD):
    """An elementwise optimizer sn_trainer has no test of (a subclass: its step could be anything)."""


def test_a_shard_kind_set_by_hand_is_verified_and_labelled_for_what_it_is(caplog):
    """Lamb looks across tensors (a trust ratio per tensor): its update of element shards differs
    from one process's, and with shards=elements set by hand the run trains on, labelled not exact
    from step 1. An optimizer no test proves elementwise, sharded so by hand, earns "exact"."""
    from timm.optim import Lamb

    model = SmallConvNet().double()
    with caplog.at_level(logging.WARNING, logger="sn_trainer"):
        result = Trainer(workers=2, batch_size=8, max_steps=3, seed=1, shards="elements").fit(
            model, tiny_dataset(dtype=F64), optimizer=functools.partial(Lamb, lr=0.01))
    label = result.plan["exactness"]
    assert label.startswith("not exact from step 1: step 1's update differs from one process's on the same "
                            "gradient and optimizer state: the update of ")
    assert "shards=elements was set for Lamb, which tests prove exact with shards=full" in label
    assert result.steps == 3 and result.verified_steps == []

    result = Trainer(workers=2, batch_size=8, max_steps=3, seed=1, shards="elements").fit(
        SmallConvNet().double(), tiny_dataset(dtype=F64), optimizer=functools.partial(TimesSGD, lr=0.05))
    assert result.plan["exactness"] == ("exact, verified at 2 steps (1, 3) (shards=elements was set for TimesSGD, "
                                        "which tests prove exact with shards=full)")


# --- guards that touch nothing --------------------------------------------------------------------

class CountingStep:
    """A step function that counts its calls, in shared memory (a slot per core: each worker is pinned
    to its own), as a curriculum or a logger keeps state."""

    def __init__(self):
        self.calls = torch.zeros(os.cpu_count(), dtype=torch.int64).share_memory_()

    def __call__(self, model, batch):
        self.calls[min(os.sched_getaffinity(0))] += 1
        inputs, targets = batch
        return F.cross_entropy(model(inputs), targets)


class Counted(nn.Module):
    """A conv net with a counter of forward passes and an instance norm that keeps running statistics."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = SmallConvNet()
        self.norm = nn.InstanceNorm1d(1, track_running_stats=True)
        self.register_buffer("forwards", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        self.forwards += 1
        return self.net(self.norm(x.flatten(2)).view_as(x))


def test_the_verification_touches_no_parameter_buffer_or_step_function_state(tmp_path):
    """The same runs with the verification and without: the weights, the buffers (a counter, running
    statistics), a step function's own state (its call count) and every worker's random streams come
    out the same, bit for bit."""
    from sn_trainer import checkpoint

    runs = {}
    for every in (1, 0):
        step = CountingStep()
        torch.manual_seed(0)
        model, counted = SmallConvNet().double(), Counted().double()
        first = Trainer(workers=2, batch_size=8, max_steps=4, seed=1, verify_every=every, pin=True,
                        checkpoint_dir=str(tmp_path / f"every{every}"))
        result = first.fit(model, tiny_dataset(dtype=F64), optimizer=SGD, step_fn=step)
        second = Trainer(workers=2, batch_size=8, max_steps=4, seed=1, verify_every=every)
        labelled = second.fit(counted, tiny_dataset(dtype=F64), optimizer=SGD).plan["exactness"]
        runs[every] = (model, counted, step.calls.sum().item(), checkpoint.load(result.last_checkpoint)["rng"],
                       result.verified_steps, labelled)
    (model, counted, calls, rng, verified, labelled), (model0, counted0, calls0, rng0, verified0, labelled0) = \
        runs[1], runs[0]
    assert verified == [1, 2, 3, 4] and verified0 == []
    assert calls == calls0 == 2 * 4  # one call per worker and step: none of the verification's
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model0.state_dict().values()))
    assert all(torch.equal(a, b) for a, b in zip(counted.state_dict().values(), counted0.state_dict().values()))
    assert counted.forwards.item() == 4  # worker 0's four forward passes
    assert labelled == labelled0
    assert "the forward pass writes buffers (forwards, norm.running_mean, norm.running_var)" in labelled
    for mine, theirs in zip(rng, rng0):
        assert torch.equal(mine["torch"], theirs["torch"]) and mine["random"] == theirs["random"]


def test_dropout_called_as_a_function_trains_like_ddp_where_the_batch_splits():
    """F.dropout(x, p, self.training) in forward, a per-sample mean: the probe measures the form in eval
    mode and the run says like DDP (each worker's masks); it trains, and runs again the same."""

    class FunctionalDropout(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = SmallConvNet()

        def forward(self, x):
            return self.net(F.dropout(x, 0.2, self.training))

    results = []
    for _ in range(2):
        model = FunctionalDropout().double()
        result = Trainer(workers=2, batch_size=8, max_steps=3, seed=1).fit(
            model, tiny_dataset(dtype=F64), optimizer=SGD, step_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]))
        results.append((model, result))
    (model, result), (again, _) = results
    assert result.steps == 3 and result.plan["exactness"].startswith("like DDP: step_fn draws random numbers in "
                                                                     "training mode")
    assert_exact(model, again)


# --- reading never shares a generator with training -----------------------------------------------

class Jittered(Dataset):
    """Images augmented from the global generators (torch's noise, random's shift), as torchvision's
    and timm's transforms draw."""

    def __init__(self):
        self.data = tiny_dataset(n=48, dtype=F64)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        import random

        x, y = self.data[i]
        return x + 0.1 * torch.randn_like(x) + random.random(), y


class Dropped(nn.Module):
    """A conv net with dropout: it draws from the step's torch stream on every forward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net, self.drop = SmallConvNet(), nn.Dropout(0.3)

    def forward(self, x):
        return self.net(self.drop(x))


def plain_seeded(model, dataset, batch_size, steps, seed, stream_seed):
    """A plain loop over a SeededPerSample dataset, the model's dropout drawing from torch's global
    stream seeded as worker 0's (seed x 1000): what one worker computes, draw for draw. Its DataLoader
    draws its workers' base seed from a generator of its own (from the global one, it would take a
    draw of the model's)."""
    from torch.utils.data import DataLoader, RandomSampler

    torch.manual_seed(stream_seed)
    optimizer = SGD(model.parameters())
    batches = []
    for epoch in range(-(-steps // (len(dataset) // batch_size))):
        dataset.set_epoch(epoch)
        order = RandomSampler(dataset, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        for x, y in DataLoader(dataset, batch_size, sampler=order, drop_last=True, generator=torch.Generator()):
            if len(batches) == steps:
                return model
            batches.append(None)
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
    return model


@pytest.mark.parametrize("prefetch", ["auto", True, False])
def test_seeded_per_sample_data_trains_draw_for_draw_as_a_plain_loop_at_every_prefetch(prefetch, caplog):
    """One worker, a model with dropout, augmentation seeded per sample: the worker's stream and the
    data's never meet, so the run is a plain loop's, draw for draw, whether or not it may read ahead
    (it reads inline, and says so where prefetch=true asked otherwise)."""
    from sn_trainer.data import SeededPerSample

    model = Dropped().double()
    reference = plain_seeded(copy.deepcopy(model), SeededPerSample(Jittered(), seed=4), 8, 10, seed=1,
                             stream_seed=1 * 1000)
    with caplog.at_level(logging.INFO, logger="sn_trainer"):
        result = Trainer(workers=1, threads=1, batch_size=8, max_steps=10, seed=1, prefetch=prefetch).fit(
            model, SeededPerSample(Jittered(), seed=4), optimizer=SGD, loss_fn=F.cross_entropy)
    assert result.plan["prefetch"] is False
    assert any("reading inline, as reading train_set seeds the global random generators" in r.getMessage()
               for r in caplog.records) == (prefetch is not False)
    assert_exact(model, reference)


def test_seeded_per_sample_data_trains_exactly_at_two_workers_run_after_run():
    from sn_trainer.data import SeededPerSample

    from helpers import plain_fit

    model = SmallConvNet().double()
    reference = plain_fit(copy.deepcopy(model), SeededPerSample(Jittered(), seed=4), 8, 5, 1,
                          lambda m: SGD(m.parameters()), lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    for _ in range(2):
        trained = copy.deepcopy(model)
        result = Trainer(workers=2, batch_size=8, max_steps=5, seed=1).fit(
            trained, SeededPerSample(Jittered(), seed=4), optimizer=SGD, loss_fn=F.cross_entropy)
        assert result.plan["exactness"] == "exact, verified at 2 steps (1, 5)"
        assert_exact(trained, reference)


# --- prove it on your model ---------------------------------------------------------------------

def coupled_step(model, batch):
    """Cross-entropy plus a penalty on the batch's mean output: the samples interact."""
    inputs, targets = batch
    out = model(inputs)
    return F.cross_entropy(out, targets) + out.mean(0).pow(2).sum()


def entry():
    """What ``python -m sn_trainer.verify tests/test_verify.py:entry`` trains."""
    torch.manual_seed(0)
    return {"model": SmallConvNet().double(), "train_set": tiny_dataset(dtype=F64), "optimizer": SGD}


def test_verify_tells_a_users_model_exact_like_ddp_not_exact_or_refused():
    trainer = Trainer(workers=2, batch_size=8, seed=2)
    model = SmallConvNet().double()
    before = copy.deepcopy(model.state_dict())
    exact = trainer.verify(model, tiny_dataset(dtype=F64), steps=3, optimizer=SGD)
    assert exact.verdict == "exact" and exact.why == "exact, verified at 3 steps (1, 2, 3)"
    assert exact.rows == ("`CrossEntropyLoss` / `NLLLoss` with `weight` and/or `ignore_index` (mean)",)
    assert [d.name for d in exact.differences] == ["conv.weight", "conv.bias", "fc.weight", "fc.bias"]
    assert 0 <= exact.largest < 1e-12 and all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert str(exact).startswith("verdict: exact: exact, verified at 3 steps")

    like = trainer.verify(Dropped().double(), tiny_dataset(dtype=F64), steps=3, optimizer=SGD)
    assert like.verdict == "like DDP" and like.why.startswith("the model's dropout (drop) draws each worker's masks")
    assert "random ops (dropout, a VAE's noise, augmentation with torch, numpy or `random`)" in like.rows
    assert like.largest > 1e-3  # each worker's masks are not one process's

    padded = trainer.verify(TextCNN().double(), Sentences(), steps=3, optimizer=SGD, collate_fn=pad_to_longest)
    assert padded.verdict == "not exact" and padded.why.startswith("step 1 differs from one process's step")
    assert padded.largest > 1e-3

    refused = trainer.verify(SmallConvNet().double(), tiny_dataset(dtype=F64), steps=3, optimizer=SGD,
                             step_fn=coupled_step)
    assert refused.verdict == "refused" and refused.rows == ("a loss whose samples interact",)
    assert "sn_trainer.gather" in refused.why and refused.differences == ()

    page = (Path(__file__).parents[1] / "docs" / "exactness.md").read_text()
    for row in {*exact.rows, *like.rows, *padded.rows, *refused.rows}:  # each names a row of the contract
        assert f"| {row}" in page, row


def test_verify_from_the_command_line(tmp_path):
    import subprocess
    import sys

    root = Path(__file__).parents[1]
    done = subprocess.run([sys.executable, "-m", "sn_trainer.verify", str(root / "tests" / "test_verify.py") + ":entry",
                           "workers=2", "batch_size=8", "seed=2", "--steps", "2"], capture_output=True, text=True,
                          timeout=200, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("verdict: exact: exact, verified at 2 steps (1, 2)\n2 workers against one plain "
                                  "process, 2 steps")
    assert "fc.weight" in done.stdout
    bad = subprocess.run([sys.executable, "-m", "sn_trainer.verify", "no_such_module:build"], capture_output=True,
                         text=True, timeout=60, cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.startswith("error: cannot import no_such_module")
    assert len(bad.stderr.strip().splitlines()) == 1
