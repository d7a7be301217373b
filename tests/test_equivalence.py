"""The core promise: W workers give the parameters one process gets from the same global batches."""
import copy
import functools

import pytest
import torch

from helpers import SmallConvNet, reference_fit, tiny_dataset
from sn_trainer import Trainer

pytestmark = pytest.mark.timeout(120)

OPTIMIZERS = {
    "sgd": functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9, weight_decay=1e-3),
    "adamw": functools.partial(torch.optim.AdamW, lr=0.01, weight_decay=0.01),
}


def fit_both(workers, batch_size, optimizer, steps=5, trainer_batch=None, accumulate=1, **kwargs):
    torch.manual_seed(0)
    model = SmallConvNet()
    reference = reference_fit(copy.deepcopy(model), tiny_dataset(), batch_size, steps, seed=3,
                              optimizer=optimizer, scheduler=kwargs.get("scheduler"),
                              clip=kwargs.get("clip_grad_norm"))
    trainer = Trainer(workers=workers, threads=1, batch_size=trainer_batch or batch_size, max_steps=steps,
                      seed=3, accumulate=accumulate, clip_grad_norm=kwargs.get("clip_grad_norm"),
                      reduce=kwargs.get("reduce", "all_reduce"))
    result = trainer.fit(model, tiny_dataset(), optimizer=optimizer, scheduler=kwargs.get("scheduler"))
    return model, reference, result


def assert_same_parameters(model, reference):
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("batch_size", [12, 7])
@pytest.mark.parametrize("workers", [1, 2, 3])
def test_workers_match_one_process(workers, batch_size, optimizer):
    model, reference, result = fit_both(workers, batch_size, OPTIMIZERS[optimizer])
    assert result.steps == 5 and result.workers == workers
    assert not torch.equal(model.fc.weight, SmallConvNet().fc.weight)  # it did train
    assert_same_parameters(model, reference)


def test_accumulate_two_half_batches_equals_one_batch():
    model, reference, _ = fit_both(2, 12, OPTIMIZERS["sgd"], trainer_batch=6, accumulate=2)
    assert_same_parameters(model, reference)


def test_reduce_scatter_matches_too():
    model, reference, _ = fit_both(3, 7, OPTIMIZERS["adamw"], reduce="reduce_scatter")
    assert_same_parameters(model, reference)


def test_clip_by_global_norm_across_shards_and_scheduler():
    scheduler = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=2, gamma=0.5)
    model, reference, _ = fit_both(2, 12, OPTIMIZERS["sgd"], clip_grad_norm=0.05, scheduler=scheduler)
    assert_same_parameters(model, reference)
    unclipped, _, _ = fit_both(2, 12, OPTIMIZERS["sgd"], scheduler=scheduler)
    assert not torch.allclose(unclipped.fc.weight, model.fc.weight)  # the clip did bite


@pytest.mark.parametrize("optimizer", [
    functools.partial(torch.optim.Adam, lr=0.01),
    functools.partial(torch.optim.RMSprop, lr=0.01),
    functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9, nesterov=True),
])
def test_other_elementwise_optimizers(optimizer):
    model, reference, _ = fit_both(2, 7, optimizer)
    assert_same_parameters(model, reference)


@pytest.mark.parametrize("workers", [2, 3])
def test_evaluate_is_exact_over_the_whole_set(workers):
    torch.manual_seed(0)
    model = SmallConvNet()
    dataset = tiny_dataset(n=29)  # split 15/14 or 10/10/9, in chunks smaller than a slice
    inputs, targets = dataset.tensors
    with torch.no_grad():
        outputs = model(inputs)
    expected_loss = torch.nn.functional.cross_entropy(outputs, targets).item()
    expected_accuracy = (outputs.argmax(1) == targets).sum().item() / 29
    metrics = Trainer(workers=workers, batch_size=8, eval_batch_size=4).evaluate(model, dataset)
    assert metrics["eval_samples"] == 29
    assert metrics["eval_loss"] == pytest.approx(expected_loss, rel=1e-6)
    assert metrics["eval_accuracy"] == pytest.approx(expected_accuracy, abs=1e-12)


def test_fit_reports_eval_metrics_loss_and_phases():
    model, _, _ = fit_both(1, 12, OPTIMIZERS["sgd"])
    result = Trainer(workers=2, batch_size=12, epochs=2, seed=3).fit(
        model, tiny_dataset(), eval_set=tiny_dataset(n=30, seed=9), optimizer=OPTIMIZERS["sgd"])
    assert result.steps == 2 * (84 // 12)
    assert result.eval_accuracy is not None and 0.0 <= result.eval_accuracy <= 1.0
    assert result.final_loss > 0 and result.samples_per_sec > 0 and result.per_worker_batch == 6.0
    assert set(result.phase_seconds) == {"data", "forward", "backward", "reduce", "update", "wait"}
    assert all(v >= 0 for v in result.phase_seconds.values()) and result.phase_seconds["forward"] > 0
    epochs_evaluated = [r["epoch"] for r in result.history if "eval_loss" in r]
    assert epochs_evaluated == [1.0, 2.0]
