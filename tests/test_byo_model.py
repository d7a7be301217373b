"""Bring your own model and loss: any batch, any forward, any loss denominator, against plain PyTorch.

Every test trains the same model twice over the same global batches: once with sn_trainer's
workers, once in an independent plain-PyTorch loop (``plain_fit``), and compares parameters in
float64 (``assert_exact``: 1e-10 relative).
"""
import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from helpers import SmallConvNet, TinyGPT, assert_exact, plain_fit, plain_indices, tiny_dataset, token_dataset
from sn_trainer import Trainer, UserCodeError

pytestmark = pytest.mark.timeout(180)
ADAMW = functools.partial(torch.optim.AdamW, lr=0.01, weight_decay=0.05)
SGD = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9, weight_decay=1e-3)
F64 = torch.float64


def gpt_step(model, batch):
    """nanoGPT's way: the model takes the targets and returns (logits, loss)."""
    idx, targets = batch
    _, loss = model(idx, targets)
    return loss


def gpt_token_sums(model, batch):
    """Tokens with target -1 are padding: the loss is a sum over the kept tokens, and their count."""
    idx, targets = batch
    logits, _ = model(idx)
    loss_sum = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1, reduction="sum")
    return loss_sum, (targets != -1).sum()


def mean_of(step_fn):
    """The plain-PyTorch loss of a whole batch, from a step function's (sum, count) or mean."""
    def loss(model, batch):
        value = step_fn(model, batch)
        return value[0] / value[1] if isinstance(value, tuple) else value
    return loss


@pytest.mark.parametrize("workers, batch_size", [(1, 6), (2, 7), (3, 7)])
def test_gpt_forward_with_targets_and_tied_weights(workers, batch_size):
    torch.manual_seed(0)
    model = TinyGPT().double()
    assert model.head.weight is model.wte.weight
    data = token_dataset()
    reference = plain_fit(copy.deepcopy(model), data, batch_size, steps=4, seed=2,
                          optimizer=lambda m: ADAMW(m.parameters()), loss=mean_of(gpt_step))
    result = Trainer(workers=workers, batch_size=batch_size, max_steps=4, seed=2).fit(
        model, data, optimizer=ADAMW, step_fn=gpt_step)
    assert model.head.weight is model.wte.weight  # still tied after the run
    assert_exact(model, reference)
    assert result.final_loss == pytest.approx(result.history[-1]["loss"])


@pytest.mark.parametrize("workers", [1, pytest.param(2, marks=pytest.mark.quick), 3])
def test_token_sums_with_padding_divide_by_the_global_count(workers):
    torch.manual_seed(0)
    model = TinyGPT().double()
    data = token_dataset(pad_fraction=0.5)
    reference = plain_fit(copy.deepcopy(model), data, 7, steps=4, seed=2, optimizer=lambda m: SGD(m.parameters()),
                          loss=mean_of(gpt_token_sums))
    Trainer(workers=workers, batch_size=7, max_steps=4, seed=2).fit(model, data, optimizer=SGD,
                                                                    step_fn=gpt_token_sums)
    assert_exact(model, reference)


def weighted_ignoring_dataset(batch_size: int, seed: int) -> TensorDataset:
    """Targets with a class weight per class, a third ignored (-1), and in step 1 the first half of
    the batch ignored: worker 0's whole slice for 2 or 3 workers, whose count is then 0 while the
    global batch's is not."""
    data = tiny_dataset(n=84, dtype=torch.float64)
    targets = data.tensors[1].clone()
    g = torch.Generator().manual_seed(5)
    targets[torch.rand(len(targets), generator=g) < 0.33] = -1
    step1 = plain_indices(len(targets), batch_size, seed, step=1)
    targets[step1[: batch_size // 2]] = -1
    targets[step1[batch_size // 2 :]] = torch.arange(batch_size - batch_size // 2) % 3
    return TensorDataset(data.tensors[0], targets)


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_cross_entropy_with_class_weights_and_ignore_index_is_exact(workers):
    torch.manual_seed(0)
    model = SmallConvNet().double()
    data = weighted_ignoring_dataset(8, seed=3)
    loss_fn = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.5, 0.5], dtype=F64), ignore_index=-1)
    reference = plain_fit(copy.deepcopy(model), data, 8, steps=5, seed=3, optimizer=lambda m: SGD(m.parameters()),
                          loss=lambda m, b: loss_fn(m(b[0]), b[1]))
    result = Trainer(workers=workers, batch_size=8, max_steps=5, seed=3).fit(model, data, optimizer=SGD,
                                                                             loss_fn=loss_fn)
    assert result.skipped_steps == 0  # worker 0's empty count at step 1 is no divergence
    assert_exact(model, reference)
    inputs, targets = data.tensors
    with torch.no_grad():
        expected = loss_fn(model(inputs), targets).item()
    metrics = Trainer(workers=workers, batch_size=8, eval_batch_size=5).evaluate(model, data, loss_fn=loss_fn)
    assert metrics["eval_loss"] == pytest.approx(expected, rel=1e-12)
    kept = targets != -1
    accuracy = (model(inputs).argmax(1)[kept] == targets[kept]).sum().item() / kept.sum().item()
    assert metrics["eval_accuracy"] == pytest.approx(accuracy, abs=1e-9)


def test_a_sum_reduced_loss_trains_and_reports_the_global_sum_for_any_worker_count():
    losses = []
    for workers in (1, 2, 3):
        torch.manual_seed(0)
        model = SmallConvNet().double()
        loss_fn = nn.CrossEntropyLoss(reduction="sum")
        reference = plain_fit(copy.deepcopy(model), tiny_dataset(dtype=F64), 7, steps=3, seed=3,
                              optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.002),
                              loss=lambda m, b: loss_fn(m(b[0]), b[1]))
        result = Trainer(workers=workers, batch_size=7, max_steps=3, seed=3, log_every=1).fit(
            model, tiny_dataset(dtype=F64), optimizer=functools.partial(torch.optim.SGD, lr=0.002), loss_fn=loss_fn)
        assert_exact(model, reference)
        losses.append([r["loss"] for r in result.history if "loss" in r])
    assert losses[1] == pytest.approx(losses[0], rel=1e-12) and losses[2] == pytest.approx(losses[0], rel=1e-12)
    assert losses[0][0] > 3  # a sum over 7 samples, not a mean (ln 3 = 1.1 per sample)


@pytest.mark.parametrize("workers", [1, 3])
def test_a_float64_model_computes_in_float64(workers):
    torch.manual_seed(0)
    model = SmallConvNet().double()
    inputs, targets = tiny_dataset().tensors
    data = TensorDataset(inputs.double(), targets)
    reference = plain_fit(copy.deepcopy(model), data, 7, steps=4, seed=3, optimizer=lambda m: SGD(m.parameters()),
                          loss=lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    Trainer(workers=workers, batch_size=7, max_steps=4, seed=3).fit(model, data, optimizer=SGD)
    assert all(p.dtype == torch.float64 for p in model.parameters())
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-13)  # fp32 anywhere would show at ~1e-7


class Outputs(nn.Module):
    """A VAE-like forward: a tuple out, and a loss that needs all of it."""

    def __init__(self):
        super().__init__()
        self.net = SmallConvNet(classes=4)

    def forward(self, x):
        h = self.net(x)
        return h[:, :2], h[:, 2:]


def two_headed_step(model, batch):
    inputs, targets = batch
    mu, logvar = model(inputs)
    return ((mu - targets.float().unsqueeze(1)) ** 2).mean() + 0.1 * logvar.exp().mean()


def square_error_metric(model, batch):
    inputs, targets = batch
    mu, _ = model(inputs)
    far = ((mu - targets.float().unsqueeze(1)).abs() > 0.5).sum()
    return {"mse": (((mu - targets.float().unsqueeze(1)) ** 2).sum(), mu.numel()), "far": (far, mu.numel())}


def test_tuple_outputs_with_a_step_function_and_custom_metrics():
    torch.manual_seed(0)
    model = Outputs().double()
    reference = plain_fit(copy.deepcopy(model), tiny_dataset(dtype=F64), 7, steps=3, seed=3,
                          optimizer=lambda m: SGD(m.parameters()), loss=two_headed_step)
    result = Trainer(workers=2, batch_size=7, max_steps=3, seed=3).fit(
        model, tiny_dataset(dtype=F64), eval_set=tiny_dataset(n=29, seed=4, dtype=F64), optimizer=SGD,
        step_fn=two_headed_step, metric_fn=square_error_metric)
    assert_exact(model, reference)
    inputs, targets = tiny_dataset(n=29, seed=4, dtype=F64).tensors
    with torch.no_grad():
        mu, _ = model(inputs)
        expected = ((mu - targets.float().unsqueeze(1)) ** 2).mean().item()
    assert result.eval_metrics["eval_mse"] == pytest.approx(expected, rel=1e-12)
    far = ((mu - targets.float().unsqueeze(1)).abs() > 0.5).sum().item() / mu.numel()
    assert result.eval_metrics["eval_far"] == pytest.approx(far, abs=1e-12)  # (sum, count): sums over counts
    assert result.eval_accuracy is None  # no class scores here: no accuracy, and no crash


class LanguageModelShapes(nn.Module):
    """Outputs [N, T, V] for targets [N, T]: not classification shapes for cross-entropy."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 11)

    def forward(self, idx):
        return self.emb(idx)


def test_a_broken_step_fails_up_front_with_the_users_traceback(no_leaks):
    data = token_dataset()
    with pytest.raises(UserCodeError) as caught:
        Trainer(workers=2, batch_size=6, max_steps=2).fit(LanguageModelShapes(), data, optimizer=SGD)
    message = str(caught.value)
    assert "the training step (on a first slice of 3 samples) failed before any worker started" in message
    assert "cross_entropy" in message and "Traceback" in message


def bad_metric(model, batch):
    raise RuntimeError("metric bug")


def test_a_broken_evaluation_fails_before_training_not_after():
    with pytest.raises(UserCodeError, match="evaluation .* failed before any worker started: RuntimeError: metric bug"):
        Trainer(workers=2, batch_size=6, max_steps=2).fit(SmallConvNet(), tiny_dataset(), eval_set=tiny_dataset(),
                                                          optimizer=SGD, metric_fn=bad_metric)


class FailsOnLargeEval(nn.Module):
    """Fine on the first evaluation chunk, broken beyond it: what the up-front check cannot see."""

    def __init__(self):
        super().__init__()
        self.net = SmallConvNet()

    def forward(self, x):
        if not self.training and len(x) < 4:
            raise RuntimeError("a short last chunk breaks this model")
        return self.net(x)


def test_evaluation_that_fails_after_training_keeps_the_result():
    result = Trainer(workers=2, batch_size=8, max_steps=2, eval_batch_size=4).fit(
        FailsOnLargeEval(), tiny_dataset(), eval_set=tiny_dataset(n=13), optimizer=SGD)
    assert result.steps == 2 and result.eval_loss is None
    assert "a short last chunk breaks this model" in result.eval_error


def two_metrics(model, batch):
    inputs, targets = batch
    logits = model(inputs)
    return {"margin": ((logits.max(1).values - logits.min(1).values).sum(), len(targets)),
            "first_class": ((logits.argmax(1) == 0).sum(), len(targets))}


@pytest.mark.parametrize("comm", ["shm", "gloo"])
def test_evaluation_with_more_metrics_than_the_scratch_block_holds(comm):
    """Loss, accuracy and two metrics: ten sums through comm=shm's small-sum block (8 wide before)."""
    torch.manual_seed(0)
    model = SmallConvNet().double()
    evaluation = tiny_dataset(n=29, seed=4, dtype=F64)
    result = Trainer(workers=2, batch_size=7, max_steps=2, seed=3, comm=comm, eval_batch_size=4).fit(
        model, tiny_dataset(dtype=F64), eval_set=evaluation, optimizer=SGD, metric_fn=two_metrics)
    inputs, targets = evaluation.tensors
    with torch.no_grad():
        logits = model(inputs)
    assert result.comm == comm
    assert result.eval_loss == pytest.approx(F.cross_entropy(logits, targets).item(), rel=1e-12)
    assert result.eval_accuracy == pytest.approx((logits.argmax(1) == targets).double().mean().item(), abs=1e-12)
    margin = (logits.max(1).values - logits.min(1).values).mean().item()
    assert result.eval_metrics["eval_margin"] == pytest.approx(margin, rel=1e-12)
    first = (logits.argmax(1) == 0).double().mean().item()
    assert result.eval_metrics["eval_first_class"] == pytest.approx(first, abs=1e-12)
