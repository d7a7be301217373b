"""The core promise: W workers give the parameters one process gets from the same global batches."""
import copy
import functools

import pytest
import torch

from helpers import SmallConvNet, assert_exact, cross_entropy, plain_fit, tiny_dataset
from sn_trainer import Trainer

pytestmark = [pytest.mark.timeout(120), pytest.mark.contract]

OPTIMIZERS = {
    "sgd": functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9, weight_decay=1e-3),
    "adamw": functools.partial(torch.optim.AdamW, lr=0.01, weight_decay=0.01),
}
F64 = torch.float64


def fit_both(workers, batch_size, optimizer, steps=5, trainer_batch=None, accumulate=1, dtype=F64, **kwargs):
    """sn_trainer and an independent plain-PyTorch loop from the same initial model, in ``dtype``."""
    torch.manual_seed(0)
    model = SmallConvNet().to(dtype)
    reference = plain_fit(copy.deepcopy(model), tiny_dataset(dtype=dtype), batch_size, steps, seed=3,
                          optimizer=lambda m: optimizer(m.parameters()), loss=cross_entropy,
                          scheduler=kwargs.get("scheduler"), clip=kwargs.get("clip_grad_norm"))
    trainer = Trainer(workers=workers, threads=1, batch_size=trainer_batch or batch_size, max_steps=steps,
                      seed=3, accumulate=accumulate, clip_grad_norm=kwargs.get("clip_grad_norm"),
                      comm=kwargs.get("comm", "auto"), reduce=kwargs.get("reduce", "all_reduce"),
                      bucket_kb=kwargs.get("bucket_kb", 256),
                      channels_last=kwargs.get("channels_last", False), precision=kwargs.get("precision", "fp32"))
    result = trainer.fit(model, tiny_dataset(dtype=dtype), optimizer=optimizer, scheduler=kwargs.get("scheduler"))
    return model, reference, result


@pytest.mark.parametrize("workers, batch_size, optimizer", [
    pytest.param(*case, marks=pytest.mark.quick) if case == (2, 7, "adamw") else case
    for case in [(w, b, o) for w in (1, 2, 3) for b in (12, 7) for o in sorted(OPTIMIZERS)]])
def test_workers_match_one_process(workers, batch_size, optimizer):
    model, reference, result = fit_both(workers, batch_size, OPTIMIZERS[optimizer])
    assert result.steps == 5 and result.workers == workers
    assert not torch.equal(model.fc.weight, SmallConvNet().fc.weight.double())  # it did train
    assert_exact(model, reference)


def test_accumulate_two_half_batches_equals_one_batch():
    model, reference, _ = fit_both(2, 12, OPTIMIZERS["sgd"], trainer_batch=6, accumulate=2)
    assert_exact(model, reference)


@pytest.mark.parametrize("comm, reduce", [("shm", "all_reduce"), ("gloo", "all_reduce"), ("gloo", "reduce_scatter")])
def test_every_reducer_matches(comm, reduce):
    model, reference, _ = fit_both(3, 7, OPTIMIZERS["adamw"], comm=comm, reduce=reduce)
    assert_exact(model, reference)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_gloo_buckets_sent_during_the_backward_pass_match(accumulate):
    # 1 KiB buckets split SmallConvNet in three (float64): the fc layer leaves while the conv runs backward.
    model, reference, _ = fit_both(3, 12, OPTIMIZERS["sgd"], trainer_batch=12 // accumulate, accumulate=accumulate,
                                   comm="gloo", bucket_kb=1)
    assert_exact(model, reference)


@pytest.mark.parametrize("comm", ["shm", "gloo"])
def test_clip_by_global_norm_across_shards_and_scheduler(comm):
    scheduler = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=2, gamma=0.5)
    model, reference, _ = fit_both(2, 12, OPTIMIZERS["sgd"], clip_grad_norm=0.05, scheduler=scheduler, comm=comm)
    assert_exact(model, reference)
    unclipped, _, _ = fit_both(2, 12, OPTIMIZERS["sgd"], scheduler=scheduler, comm=comm)
    assert not torch.allclose(unclipped.fc.weight, model.fc.weight)  # the clip did bite


def test_channels_last_matches_and_hands_back_a_contiguous_model():
    model, reference, _ = fit_both(2, 7, OPTIMIZERS["sgd"], channels_last=True)
    assert_exact(model, reference)
    assert model.conv.weight.is_contiguous()


# float32: summation order differs between one process and W workers, so results differ by
# rounding. The tolerance is measured in the test itself: plain PyTorch in float32 against the
# same loop in float64 is how far float32 rounding alone moves the parameters; sn_trainer in
# float32 must stay within 4x that, per tensor. results/amd-epyc-2c/fp32_baseline.md (a script since
# retired; the file names its commit) measured at most 1.6x for SGD and AdamW, and plain PyTorch itself with 2 threads instead of 1
# up to 1.9x. Adam and RMSprop are tested in float64 only: they turn rounding noise in a
# near-zero gradient into a full step (RMSprop reached 7.3x), so no fp32 tolerance is both tight
# and portable.
FP32_FACTOR = 4.0


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("workers", [2, 3])
def test_float32_stays_within_float32s_own_rounding(workers, optimizer):
    model, reference, _ = fit_both(workers, 7, OPTIMIZERS[optimizer], dtype=torch.float32)
    torch.manual_seed(0)
    exact = plain_fit(SmallConvNet().double(), tiny_dataset(dtype=F64), 7, 5, seed=3,
                      optimizer=lambda m: OPTIMIZERS[optimizer](m.parameters()), loss=cross_entropy)
    for (name, mine), theirs, truth in zip(model.named_parameters(), reference.parameters(), exact.parameters()):
        assert mine.dtype == torch.float32
        rounding = max((theirs.double() - truth).norm().item(), 1e-7 * truth.norm().item())
        assert (mine.double() - truth).norm().item() <= FP32_FACTOR * rounding, name


def test_bf16_trains_close_to_fp32():
    from sn_trainer.node.cpu import bf16_supported

    model, reference, result = fit_both(2, 12, OPTIMIZERS["sgd"], precision="bf16", channels_last=True,
                                        dtype=torch.float32)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # fp32 master weights
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0.05, atol=0.02)  # bf16 keeps ~3 significant digits
    if bf16_supported():
        assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))


def test_what_ran_is_reported_with_its_fallback(monkeypatch):
    """bf16 asked for on a CPU without it: fp32 runs, and FitResult (hence summary.json) says so."""
    import sn_trainer.fit.decide

    monkeypatch.setattr(sn_trainer.fit.decide, "bf16_supported", lambda: False)
    torch.manual_seed(0)
    result = Trainer(workers=2, batch_size=8, max_steps=2, precision="bf16").fit(
        SmallConvNet(), tiny_dataset(), optimizer=OPTIMIZERS["sgd"])
    assert result.precision == "fp32" and result.plan["precision"] == "fp32"
    assert any(note.startswith("precision=bf16 asked for, fp32 ran") for note in result.plan["notes"])
    assert result.comm in ("shm", "gloo") and result.plan["comm"] == result.comm  # what comm=auto chose


@pytest.mark.parametrize("workers", [2, 3])
def test_evaluate_is_exact_over_the_whole_set(workers):
    torch.manual_seed(0)
    model = SmallConvNet().double()
    dataset = tiny_dataset(n=29, dtype=F64)  # split 15/14 or 10/10/9, in chunks smaller than a slice
    inputs, targets = dataset.tensors
    with torch.no_grad():
        outputs = model(inputs)
    expected_loss = torch.nn.functional.cross_entropy(outputs, targets).item()
    expected_accuracy = (outputs.argmax(1) == targets).sum().item() / 29
    metrics = Trainer(workers=workers, batch_size=8, eval_batch_size=4).evaluate(model, dataset)
    assert metrics["eval_samples"] == 29
    assert metrics["eval_loss"] == pytest.approx(expected_loss, rel=1e-12)
    assert metrics["eval_accuracy"] == pytest.approx(expected_accuracy, abs=1e-12)


def test_fit_reports_eval_metrics_loss_and_phases():
    model, _, _ = fit_both(1, 12, OPTIMIZERS["sgd"], dtype=torch.float32)
    result = Trainer(workers=2, batch_size=12, epochs=2, seed=3).fit(
        model, tiny_dataset(), eval_set=tiny_dataset(n=30, seed=9), optimizer=OPTIMIZERS["sgd"])
    assert result.steps == 2 * (84 // 12)
    assert result.eval_accuracy is not None and 0.0 <= result.eval_accuracy <= 1.0
    assert result.final_loss > 0 and result.samples_per_sec > 0 and result.per_worker_batch == 6.0
    assert set(result.stage_seconds) == {"data", "forward", "backward", "reduce", "update", "verify", "wait"}
    assert all(v >= 0 for v in result.stage_seconds.values()) and result.stage_seconds["forward"] > 0
    epochs_evaluated = [r["epoch"] for r in result.history if "eval_loss" in r]
    assert epochs_evaluated == [1.0, 2.0]
