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
from sn_trainer.node.runtime import Runtime
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


@pytest.mark.parametrize("compiled", [pytest.param(True, marks=pytest.mark.quick), False])
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
        assert decide.for_model(trainer.settings, model)[0].compile is chosen
    assert ("compile=auto: compiled" if chosen else "compile=auto: eager") in caplog.text


def compiled_ddp_over_sn_and_gloo(rank: int, world: int, store: str, out_dir: str) -> None:
    """torch.compile(DDP(model)) for 3 steps over "sn" (the default group), then over gloo, in the same
    processes: Dynamo's graph breaks counted for each, the weights each ends with, the warnings."""
    import os
    import warnings

    import torch._dynamo
    import torch.distributed as dist

    import sn_trainer.distributed  # noqa: F401  (registers "sn")

    dist.init_process_group("sn", init_method=f"file://{store}", rank=rank, world_size=world)
    got = {}
    for name, group in (("sn", None), ("gloo", dist.new_group(backend="gloo"))):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        compiled = torch.compile(torch.nn.parallel.DistributedDataParallel(model, process_group=group))
        optimizer = torch.optim.SGD(compiled.parameters(), lr=0.1)
        data = torch.Generator().manual_seed(rank)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                optimizer.zero_grad()
                compiled(torch.randn(4, 8, generator=data)).square().mean().backward()
                optimizer.step()
        got[name] = {"breaks": sum(torch._dynamo.utils.counters["graph_break"].values()),
                     "weights": [p.detach().clone() for p in model.parameters()],
                     "warnings": [str(w.message) for w in caught if "Dynamo" in str(w.message)]}
    torch.save(got, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_a_compiled_ddp_model_over_sn_breaks_no_more_graphs_than_over_gloo_and_trains_the_same(tmp_path):
    """torch's C++ (DDP's reducer) calls the "sn" backend's Python methods while the compiled forward runs;
    Dynamo must leave them out of its graphs: no more graph breaks than gloo's, no warning of its own."""
    from helpers import run_ranks, saved_results

    assert run_ranks(compiled_ddp_over_sn_and_gloo, 2, tmp_path, timeout_s=240) == [0, 0]
    for got in saved_results(tmp_path, 2):
        assert got["sn"]["breaks"] <= got["gloo"]["breaks"], (got["sn"]["breaks"], got["gloo"]["breaks"])
        assert got["sn"]["warnings"] == []
        assert all(torch.equal(a, b) for a, b in zip(got["sn"]["weights"], got["gloo"]["weights"]))
