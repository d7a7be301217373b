"""compile=true: each worker trains (and evaluates) inductor's compilation of the model, exactly as
eager plain PyTorch does; compile=auto compiles where tuning measured it faster."""
import copy
import functools
import logging

import pytest
import torch
from torch import nn

from helpers import EXACT, SmallConvNet, cross_entropy, plain_fit, tiny_dataset
from sn_trainer import Trainer, tuner
from sn_trainer.engine.node.runtime import Runtime
from sn_trainer.fit import decide

pytestmark = pytest.mark.timeout(300)

SGD = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)


class NotesCompiling(nn.Module):
    """SmallConvNet that writes 1 into a buffer when its forward runs compiled: the buffer tells,
    after fit, whether the workers ran a compiled graph (the model ends with worker 0's buffers)."""

    def __init__(self):
        super().__init__()
        self.net = SmallConvNet()
        self.register_buffer("compiled", torch.zeros((), dtype=torch.float64))

    def forward(self, x):
        if torch.compiler.is_compiling():
            self.compiled.fill_(1.0)
        return self.net(x)


@pytest.mark.parametrize("compiled", [True, False])
def test_a_compiled_model_trains_and_evaluates_as_eager_plain_pytorch(compiled):
    torch.manual_seed(0)
    model = NotesCompiling().double()
    data, test = tiny_dataset(dtype=torch.float64), tiny_dataset(n=30, seed=5, dtype=torch.float64)
    reference = plain_fit(copy.deepcopy(model), data, 12, 6, 3, lambda m: SGD(m.parameters()), cross_entropy)
    # verify_every=0: the buffer records how the forward ran, and the verification's one process runs
    # eager (a model that computes otherwise compiled would be found to differ at its first step).
    result = Trainer(workers=2, batch_size=12, max_steps=6, seed=3, compile=compiled, verify_every=0).fit(
        model, data, eval_set=test, optimizer=SGD)
    assert result.plan["compile"] is compiled and model.compiled.item() == float(compiled)
    assert (result.compile_seconds is not None) is compiled
    assert result.measured_steps == (5 if compiled else 6)  # the compiling first step is left out of samples/s
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, **EXACT, msg=lambda m: f"{name}: {m}")
    with torch.no_grad():
        expected = cross_entropy(reference.eval(), test.tensors).item()
    assert result.eval_loss == pytest.approx(expected, rel=1e-10)


def test_evaluate_compiles_as_fit_does():
    """evaluate() is resolved as fit is: compile=true evaluates the compiled model, to the same loss."""
    torch.manual_seed(0)
    model, test = NotesCompiling().double(), tiny_dataset(n=30, seed=5, dtype=torch.float64)
    metrics = Trainer(workers=2, batch_size=12, compile=True).evaluate(model, test)
    assert model.compiled.item() == 1.0  # worker 0's forward ran compiled
    with torch.no_grad():
        expected = cross_entropy(model.eval(), test.tensors).item()
    assert metrics["eval_loss"] == pytest.approx(expected, rel=1e-10) and metrics["eval_samples"] == 30


@pytest.mark.parametrize("rates, chosen", [({"eager": 100.0, "compiled": 130.0}, True),
                                           ({"eager": 100.0, "compiled": 90.0}, False), ({}, False)])
def test_compile_auto_follows_what_tuning_measured(tmp_path, monkeypatch, caplog, rates, chosen):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model = SmallConvNet()
    trainer = Trainer(workers=1, batch_size=8, max_steps=1, compile="auto")
    result = tuner.TuneResult(1, 1, Runtime("system", "gnu"), 100.0, [],
                              tuner.Calibration({1: (0.0, 1e-3)}, 0.0, 0.0), 1.0, compile_rates=rates)
    tuner.store(tuner.cache_key(model, 8, 1, "fp32"), result)
    with caplog.at_level(logging.INFO, logger="sn_trainer"):
        assert decide.for_model(trainer.settings, model).compile is chosen
    assert ("compile=auto: compiled" if chosen else "compile=auto: eager") in caplog.text
