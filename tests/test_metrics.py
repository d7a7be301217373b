"""torchmetrics Metrics returned from metric_fn: every worker's states merged, computed once, equal
to torchmetrics over the whole evaluation set in one plain pass; other values refused in one line."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

from sn_trainer import ConfigError, Trainer

from helpers import SmallConvNet, tiny_dataset

torchmetrics = pytest.importorskip("torchmetrics")
from torchmetrics.classification import (  # noqa: E402 - only where torchmetrics is installed
    MulticlassAccuracy,
    MulticlassAUROC,
    MulticlassF1Score,
)

pytestmark = pytest.mark.timeout(240)
F64 = torch.float64
CLASSES = 3


class Scores:
    """metric_fn's Metrics, made once and updated in metric_fn, as a torchmetrics user writes it:
    macro accuracy and F1 (summed counts), their sum (a metric of metrics), AUROC (concatenated
    scores), a mean whose states are updated in place (``self.weight += ...``: each worker's must
    be its own), and a (sum, count) term."""

    def __init__(self):
        self.accuracy = MulticlassAccuracy(num_classes=CLASSES)  # average="macro", torchmetrics' default
        self.f1 = MulticlassF1Score(num_classes=CLASSES)
        self.auroc = MulticlassAUROC(num_classes=CLASSES)
        self.top = torchmetrics.MeanMetric().set_dtype(F64)
        self.both = self.f1 + self.accuracy  # a CompositionalMetric: its parts merged, then added

    def __call__(self, model, batch):
        inputs, targets = batch
        logits = model(inputs)
        for metric in (self.accuracy, self.f1, self.auroc):
            metric.update(logits, targets)
        self.top.update(logits.max(1).values)
        return {"f1_plus_accuracy": self.both, "macro_accuracy": self.accuracy, "f1": self.f1, "auroc": self.auroc, "top": self.top,
                "hits": ((logits.argmax(1) == targets).sum(), len(targets))}


def once_over(model, dataset) -> dict[str, float]:
    """torchmetrics over the whole set in one plain pass: fresh metrics, one update, one compute."""
    inputs, targets = dataset.tensors
    with torch.no_grad():
        logits = model(inputs)
    accuracy = MulticlassAccuracy(num_classes=CLASSES)(logits, targets)
    f1 = MulticlassF1Score(num_classes=CLASSES)(logits, targets)
    return {"f1_plus_accuracy": (f1 + accuracy).item(), "macro_accuracy": accuracy.item(), "f1": f1.item(),
            "auroc": MulticlassAUROC(num_classes=CLASSES)(logits, targets).item(),
            "top": torchmetrics.MeanMetric().set_dtype(F64)(logits.max(1).values).item(),
            "hits": (logits.argmax(1) == targets).double().mean().item()}


@pytest.mark.parametrize("workers,comm", [(1, "auto"), pytest.param(2, "shm", marks=pytest.mark.quick), (2, "gloo"),
                                         (3, "shm")])
def test_torchmetrics_merged_over_workers_and_chunks_equal_one_pass(workers, comm):
    """37 samples in chunks of 5: slices of 37, 19/18 and 13/12/12 samples, each ending in a short chunk."""
    torch.manual_seed(0)
    model = SmallConvNet().double()
    evaluation = tiny_dataset(n=37, seed=4, dtype=F64)
    found = Trainer(workers=workers, eval_batch_size=5, comm=comm).evaluate(model, evaluation, metric_fn=Scores())
    expected = once_over(model, evaluation)
    assert found["eval_samples"] == 37
    for name, value in expected.items():
        assert found[f"eval_{name}"] == pytest.approx(value, rel=1e-12, abs=1e-12), name
    # What averaging per-chunk F1 over chunks gives (what metric_fn's numbers were before): not it.
    inputs, targets = evaluation.tensors
    with torch.no_grad():
        chunked = [(MulticlassF1Score(num_classes=CLASSES)(model(inputs[i : i + 5]), targets[i : i + 5]).item(),
                    len(targets[i : i + 5])) for i in range(0, 37, 5)]
    assert abs(sum(f * n for f, n in chunked) / 37 - expected["f1"]) > 1e-2


def test_a_worker_with_nothing_to_evaluate_merges_its_metric_as_built():
    torch.manual_seed(0)
    model = SmallConvNet().double()
    evaluation = tiny_dataset(n=2, seed=5, dtype=F64)  # at W=3 the last worker's slice is empty
    found = Trainer(workers=3, eval_batch_size=5).evaluate(model, evaluation, metric_fn=Scores())
    expected = once_over(model, evaluation)
    for name in ("f1_plus_accuracy", "macro_accuracy", "f1", "top", "hits"):
        assert found[f"eval_{name}"] == pytest.approx(expected[name], rel=1e-12, abs=1e-12), name


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, CLASSES))

    def forward(self, x):
        return self.net(x)


def classification(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 10, generator=g, dtype=F64)
    return TensorDataset(x, (x[:, :3].argmax(1) + (torch.rand(n, generator=g) < 0.3)) % CLASSES)


def f1_metric_fn(**options):
    f1 = MulticlassF1Score(num_classes=CLASSES, **options)

    def metric_fn(model, batch):
        inputs, targets = batch
        f1.update(model(inputs), targets)
        return {"f1": f1}

    return metric_fn


def test_a_classifier_project_reports_each_epochs_f1_as_a_plain_loop_does():
    """A tiny classifier trained 2 epochs at W=2, F1 evaluated after each: each equals torchmetrics
    after each epoch of a plain float64 loop over the same batches (the second evaluation starts
    from a reset metric, not from the first one's states)."""
    torch.manual_seed(0)
    model, train, evaluation = MLP().double(), classification(48, 1), classification(23, 2)
    reference = MLP().double()
    reference.load_state_dict(model.state_dict())
    result = Trainer(workers=2, batch_size=12, epochs=2, seed=3, eval_batch_size=4).fit(
        model, train, eval_set=evaluation, optimizer=lambda p: torch.optim.SGD(p, lr=0.5),
        loss_fn=nn.CrossEntropyLoss(), metric_fn=f1_metric_fn())

    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    expected = []
    for epoch in range(2):
        sampler = RandomSampler(train, generator=torch.Generator().manual_seed(3 * 1_000_003 + epoch))
        for inputs, targets in DataLoader(train, batch_size=12, sampler=sampler, drop_last=True):
            optimizer.zero_grad()
            F.cross_entropy(reference(inputs), targets).backward()
            optimizer.step()
        with torch.no_grad():
            expected.append(MulticlassF1Score(num_classes=CLASSES)(reference(evaluation.tensors[0]),
                                                                   evaluation.tensors[1]).item())
    found = [r["eval_f1"] for r in result.history if "eval_f1" in r]
    assert found == pytest.approx(expected, rel=1e-12, abs=1e-12)
    assert result.eval_metrics["eval_f1"] == found[-1]


def margin(model, batch):
    inputs, _ = batch
    logits = model(inputs)
    return {"margin": (logits.max(1).values - logits.min(1).values).mean()}


def test_a_single_number_from_metric_fn_is_refused_in_one_line():
    with pytest.raises(ConfigError) as caught:
        Trainer(workers=1).evaluate(SmallConvNet(), tiny_dataset(n=10), metric_fn=margin)
    message = str(caught.value)
    assert "metric_fn's 'margin' is a single number" in message and "(sum, count)" in message
    assert "torchmetrics Metric" in message and "\n" not in message


class MeanOfBatches(torchmetrics.Metric):
    """A state merged by "mean": the mean of each worker's mean, whatever each counted."""

    full_state_update = False

    def __init__(self):
        super().__init__()
        self.add_state("average", default=torch.tensor(0.0, dtype=F64), dist_reduce_fx="mean")
        self.add_state("batches", default=torch.tensor(0), dist_reduce_fx="sum")

    def update(self, value):
        self.average = (self.average * self.batches + value) / (self.batches + 1)
        self.batches += 1

    def compute(self):
        return self.average


def batch_means():
    metric = MeanOfBatches()

    def metric_fn(model, batch):
        inputs, _ = batch
        metric.update(model(inputs).mean())
        return {"batch_mean": metric}

    return metric_fn


def test_a_metric_merged_by_a_mean_is_refused_over_workers_and_computed_alone():
    torch.manual_seed(0)
    model, evaluation = SmallConvNet().double(), tiny_dataset(n=10, seed=4, dtype=F64)
    with pytest.raises(ConfigError) as caught:
        Trainer(workers=2, eval_batch_size=4).evaluate(model, evaluation, metric_fn=batch_means())
    message = str(caught.value)
    assert "metric_fn's 'batch_mean' cannot be evaluated over 2 workers exactly" in message
    assert "'average' (MeanOfBatches)" in message and "mean" in message and "\n" not in message
    found = Trainer(workers=1, eval_batch_size=4).evaluate(model, evaluation, metric_fn=batch_means())
    with torch.no_grad():  # one worker: the metric's own arithmetic over the chunks, nothing merged
        chunks = [model(evaluation.tensors[0][i : i + 4]).mean() for i in (0, 4, 8)]
    reference = MeanOfBatches()
    for chunk in chunks:
        reference.update(chunk)
    assert found["eval_batch_mean"] == pytest.approx(reference.compute().item(), rel=1e-12)


def test_a_metric_of_several_numbers_is_refused_in_one_line():
    with pytest.raises(ConfigError) as caught:
        Trainer(workers=1).evaluate(SmallConvNet(), tiny_dataset(n=10), metric_fn=f1_metric_fn(average=None))
    message = str(caught.value)
    assert "metric_fn's 'f1' (MulticlassF1Score) computes a tensor of shape (3,), not one number" in message
    assert "\n" not in message


def fresh_metric_each_batch(model, batch):
    inputs, targets = batch
    f1 = MulticlassF1Score(num_classes=CLASSES)
    f1.update(model(inputs), targets)
    return {"f1": f1}


def test_a_new_metric_each_batch_is_an_evaluation_error_that_says_so():
    found = Trainer(workers=1, eval_batch_size=4).evaluate(SmallConvNet(), tiny_dataset(n=10),
                                                         metric_fn=fresh_metric_each_batch)
    assert "create the Metric once, outside metric_fn" in found["eval_error"]
