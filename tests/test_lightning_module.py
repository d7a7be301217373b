"""A LightningModule handed to ``Trainer.fit``: its own training_step, configure_optimizers,
validation_step with ``self.log`` and hooks, against its own plain loop and Lightning's Trainer.

The reference loop calls the same module's training_step on each global batch (from torch's own
DataLoader), steps its optimizer and steps its scheduler where Lightning would; parameters are
compared in float64 at 1e-10 relative (``assert_exact``).
"""
import copy
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from helpers import assert_exact, plain_batches
from sn_trainer import ConfigError, Trainer

L = pytest.importorskip("lightning.pytorch")

pytestmark = pytest.mark.timeout(180)
F64 = torch.float64


def regression_set(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g, dtype=F64)
    return TensorDataset(x, x.sum(1, keepdim=True).sin() + 0.1 * torch.randn(n, 1, generator=g, dtype=F64))


class Regression(L.LightningModule):
    """A loss weighed by the batch's index in its epoch (a wrong batch_idx shows) and by what
    on_fit_start set, a dict with "loss", SGD with momentum and a StepLR stepped per step, two
    metrics logged in validation, and on_train_end reading global_step."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 1)).to(F64)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y) * (1 + 0.1 * batch_idx) * self.scale
        self.log("train_loss", loss)
        return {"loss": loss}

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_mse", F.mse_loss(self(x), y))
        self.log("val_mae", F.l1_loss(self(x), y), prog_bar=True)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def setup(self, stage):
        self.stages = [stage]

    def on_fit_start(self):
        self.scale = 0.5  # set before the workers start: they train with it

    def teardown(self, stage):
        self.stages.append(f"teardown {stage}")

    def on_train_end(self):
        self.ended_after = self.global_step


def its_own_loop(module, dataset, batch_size, steps, seed):
    """The module trained as Lightning trains it: training_step(batch, batch_idx) on each global
    batch, backward, the optimizer's step, then the scheduler's (interval "step")."""
    config = module.configure_optimizers()
    module.on_fit_start()
    optimizer, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
    per_epoch = len(dataset) // batch_size
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # self.log without a Lightning Trainer warns
        for step, batch in zip(range(steps), plain_batches(dataset, batch_size, seed)):
            optimizer.zero_grad(set_to_none=True)
            module.training_step(batch, step % per_epoch)["loss"].backward()
            optimizer.step()
            scheduler.step()
    return module


@pytest.mark.parametrize("workers", [1, pytest.param(2, marks=pytest.mark.quick), 3])
def test_its_training_step_optimizer_and_scheduler_are_exact(workers):
    train, held_out = regression_set(30, 1), regression_set(11, 2)
    module = Regression()
    reference = its_own_loop(copy.deepcopy(module), train, batch_size=7, steps=6, seed=3)
    result = Trainer(workers=workers, batch_size=7, max_steps=6, seed=3, eval_batch_size=4).fit(
        module, train, eval_set=held_out)
    assert_exact(module, reference)  # 4 steps an epoch: step 5 and 6 are batch_idx 0 and 1 again
    x, y = held_out.tensors
    with torch.no_grad():
        assert result.eval_metrics["eval_val_mse"] == pytest.approx(F.mse_loss(reference(x), y).item(), rel=1e-10)
        assert result.eval_metrics["eval_val_mae"] == pytest.approx(F.l1_loss(reference(x), y).item(), rel=1e-10)
    assert module.ended_after == 6  # on_train_end ran on the trained model, after the last step
    assert module.stages == ["fit", "teardown fit"]


class Stepping(L.LightningModule):
    """Uses what Lightning's Trainer tells a module (batch_idx, current_epoch, global_step) and
    configure_optimizers' ([optimizers], [schedulers]) form, whose scheduler steps per epoch."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.net = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 1)).to(F64)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y) * (1 + 0.1 * batch_idx + 0.2 * self.current_epoch + 0.01 * self.global_step)

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=0.02)
        return [optimizer], [torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.5)]


@pytest.mark.parametrize("accumulate", [1, 2])
def test_equals_lightnings_own_trainer(accumulate):
    train, micro = regression_set(24, 4), 6 // accumulate
    module, theirs = Stepping(), Stepping()
    L.Trainer(accelerator="cpu", devices=1, max_steps=9, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=accumulate).fit(
        theirs, DataLoader(train, batch_size=micro, shuffle=False, drop_last=True))
    Trainer(workers=1, batch_size=micro, accumulate=accumulate, max_steps=9, shuffle=False).fit(module, train)
    # 4 steps an epoch: epochs 0, 1 and 2, the learning rate halved after each; with accumulate=2
    # batch_idx counts the 8 micro-batches of an epoch, as Lightning's does.
    assert_exact(module, theirs)


def test_evaluate_uses_its_training_step_and_validation_step():
    module, held_out = Regression(), regression_set(13, 5)
    module.scale = 1.0  # an evaluation calls no fit hooks
    metrics = Trainer(workers=2, eval_batch_size=4).evaluate(module, held_out)
    x, y = held_out.tensors
    with torch.no_grad():
        assert metrics["eval_val_mse"] == pytest.approx(F.mse_loss(module(x), y).item(), rel=1e-10)
        assert metrics["eval_val_mae"] == pytest.approx(F.l1_loss(module(x), y).item(), rel=1e-10)


class TwoOptimizers(L.LightningModule):
    """A GAN's shape under Lightning: manual optimization, D's step, then G's on D's new weights."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(2)
        self.d, self.g = nn.Linear(4, 1).to(F64), nn.Linear(3, 4).to(F64)

    def training_step(self, batch, batch_idx):
        opt_d, opt_g = self.optimizers()
        x, z = batch
        loss_d = F.softplus(-self.d(x)).mean() + F.softplus(self.d(self.g(z).detach())).mean()
        opt_d.zero_grad()
        self.manual_backward(loss_d)
        opt_d.step()
        loss_g = F.softplus(-self.d(self.g(z))).mean()
        opt_g.zero_grad()
        self.manual_backward(loss_g)
        opt_g.step()

    def configure_optimizers(self):
        return [torch.optim.SGD(self.d.parameters(), lr=0.1, momentum=0.9),
                torch.optim.SGD(self.g.parameters(), lr=0.05, momentum=0.5)]


def gan_loop(module, dataset, batch_size, steps, seed):
    """The DCGAN loop of plain PyTorch: D's loss, backward and step, then G's."""
    d, g = module.d, module.g
    opt_d = torch.optim.SGD(d.parameters(), lr=0.1, momentum=0.9)
    opt_g = torch.optim.SGD(g.parameters(), lr=0.05, momentum=0.5)
    for _, (x, z) in zip(range(steps), plain_batches(dataset, batch_size, seed)):
        opt_d.zero_grad()
        (F.softplus(-d(x)).mean() + F.softplus(d(g(z).detach())).mean()).backward()
        opt_d.step()
        opt_g.zero_grad()
        F.softplus(-d(g(z))).mean().backward()
        opt_g.step()
    return module


@pytest.mark.parametrize("workers", [1, 3])
def test_manual_optimization_with_two_optimizers_trains_as_phases_exactly(workers):
    g = torch.Generator().manual_seed(6)
    data = TensorDataset(torch.randn(21, 4, generator=g, dtype=F64), torch.randn(21, 3, generator=g, dtype=F64))
    module = TwoOptimizers()
    reference = gan_loop(copy.deepcopy(module), data, batch_size=7, steps=4, seed=1)
    result = Trainer(workers=workers, batch_size=7, max_steps=4, seed=1).fit(module, data)
    assert_exact(module, reference)
    assert [phase["name"] for phase in result.plan["phases"]] == ["optimizer0", "optimizer1"]


class ManualWithScheduler(TwoOptimizers):
    def configure_optimizers(self):
        optimizers = super().configure_optimizers()
        return optimizers, [torch.optim.lr_scheduler.StepLR(optimizers[0], 1)]


class TwoAutomatic(Regression):
    def configure_optimizers(self):
        return [torch.optim.SGD(self.net[0].parameters(), lr=0.1), torch.optim.SGD(self.net[2].parameters(), lr=0.1)]


class EpochHook(Regression):
    def on_train_epoch_end(self):
        self.seen = True


class ClipsItself(Regression):
    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.clip_gradients(optimizer, 1.0)


class ReadsItsTrainer(Regression):
    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx)["loss"] / self.trainer.max_epochs


@pytest.mark.parametrize("module, refusal", [
    (ManualWithScheduler(), r"uses manual optimization with a scheduler, .* sn_trainer\.Phase"),
    (TwoAutomatic(), r"returned 2 optimizers; with automatic optimization Lightning takes one"),
    (EpochHook(), r"EpochHook\.on_train_epoch_end has no counterpart .* sn_trainer\.Callback"),
    (ClipsItself(), r"ClipsItself\.configure_gradient_clipping has no counterpart .*Trainer\(clip_grad_norm=\.\.\.\)"),
])
def test_what_does_not_map_is_refused_in_one_line(module, refusal):
    with pytest.raises(ConfigError, match=refusal):
        Trainer(workers=2, batch_size=6, max_steps=2).fit(module, regression_set(12, 1))


def test_a_trainer_attribute_it_reads_is_named():
    with pytest.raises(ConfigError, match=r"reads self\.trainer\.max_epochs, and no Lightning Trainer runs here"):
        Trainer(workers=2, batch_size=6, max_steps=2).fit(ReadsItsTrainer(), regression_set(12, 1))


def test_fit_arguments_beside_its_own_steps_are_refused():
    with pytest.raises(ConfigError, match=r"leave out step_fn, optimizer"):
        Trainer(workers=1, batch_size=6, max_steps=2).fit(Regression(), regression_set(12, 1),
                                                          step_fn=lambda m, b: m(b[0]).mean(),
                                                          optimizer=torch.optim.SGD)
    with pytest.raises(ConfigError, match=r"optimizes manually .* call it in training_step after the optimizer's step"):
        Trainer(workers=1, batch_size=6, max_steps=2).fit(TwoOptimizers(), regression_set(12, 1),
                                                          after_update=lambda m: None)


def test_a_plain_module_never_imports_lightning():
    code = ("import sys, torch; from sn_trainer import Trainer; from sn_trainer.integrations import lightning; "
            "from sn_trainer.integrations.lightning_module import lightning_root; "
            "assert lightning_root(torch.nn.Linear(2, 2)) is None; "
            "assert not [m for m in sys.modules if m.startswith(('lightning', 'pytorch_lightning'))]")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
