"""Shape the training loop: callbacks, evaluation every N steps, early stopping, the best checkpoint;
each against an independent plain-PyTorch loop in float64 where it changes what is trained."""
import copy
import functools

import pytest
import torch
import torch.nn.functional as F

from helpers import SmallConvNet, assert_exact, cross_entropy, plain_batches, tiny_dataset
from sn_trainer import (BestCheckpoint, Callback, ConfigError, EarlyStopping, Phase, Trainer, UserCodeError,
                        WorkerFailed)
from sn_trainer import checkpoint
from sn_trainer.checkpoint import CheckpointDir

pytestmark = pytest.mark.timeout(240)
F64 = torch.float64
SGD = functools.partial(torch.optim.SGD, lr=0.2, momentum=0.9)


def eval_loss(model, data) -> float:
    """The plain evaluation loop: the whole set, in eval mode, the mean loss."""
    inputs, targets = data.tensors
    model.eval()
    with torch.no_grad():
        loss = F.cross_entropy(model(inputs), targets).item()
    model.train()
    return loss


def plain_with_evaluations(model, train, evaluation, steps, every, patience=None, min_delta=0.0):
    """A plain loop that evaluates every ``every`` steps (and after the last) and, with ``patience``,
    stops as early stopping's rule says. Returns the model, the evaluations and the last step."""
    opt = SGD(model.parameters())
    losses, best, waited = [], None, 0
    for step, batch in zip(range(1, steps + 1), plain_batches(train, 7, seed=3)):
        opt.zero_grad()
        cross_entropy(model, batch).backward()
        opt.step()
        if step % every == 0 or step == steps:
            losses.append((step, eval_loss(model, evaluation)))
            if patience is not None:
                if best is None or losses[-1][1] < best - min_delta:
                    best, waited = losses[-1][1], 0
                else:
                    waited += 1
                    if waited >= patience:
                        return model, losses, step
    return model, losses, steps


class Recorder(Callback):
    """Writes down every hook it is called with, in order."""

    def __init__(self):
        self.calls = []

    def on_fit_start(self, trainer, plan):
        self.calls.append(("fit_start", plan.total_steps))

    def on_step_end(self, trainer, record):
        self.calls.append(("step", record.step))

    def on_eval_end(self, trainer, evaluation):
        self.calls.append(("eval", evaluation.step, evaluation.metrics["eval_loss"]))

    def on_checkpoint(self, trainer, path):
        self.calls.append(("checkpoint", path.name))

    def on_fit_end(self, trainer, result):
        self.calls.append(("fit_end", result.steps))


@pytest.mark.parametrize("workers", [1, pytest.param(2, marks=pytest.mark.quick), 3])
def test_evaluation_every_n_steps_reports_what_a_plain_loop_measures(workers, tmp_path):
    torch.manual_seed(0)
    model = SmallConvNet().double()
    train, evaluation = tiny_dataset(dtype=F64), tiny_dataset(n=30, seed=9, dtype=F64)
    reference, losses, _ = plain_with_evaluations(copy.deepcopy(model), train, evaluation, steps=7, every=3)
    recorder = Recorder()
    result = Trainer(workers=workers, batch_size=7, max_steps=7, seed=3, eval_every=3, log_every=2,
                     checkpoint_dir=str(tmp_path), checkpoint_every_steps=5).fit(
        model, train, eval_set=evaluation, optimizer=SGD, callbacks=[recorder])
    assert_exact(model, reference)
    evaluations = [(c[1], c[2]) for c in recorder.calls if c[0] == "eval"]
    assert [step for step, _ in evaluations] == [3, 6, 7] == [step for step, _ in losses]
    for (_, mine), (_, theirs) in zip(evaluations, losses):
        assert mine == pytest.approx(theirs, rel=1e-12)
    assert recorder.calls[0] == ("fit_start", 7) and recorder.calls[-1] == ("fit_end", 7)
    assert [c[1] for c in recorder.calls if c[0] == "step"] == [2, 4, 6, 7]
    assert [c[1] for c in recorder.calls if c[0] == "checkpoint"] == ["step-000000005.pt", "step-000000007.pt"]
    assert [r["step"] for r in result.history if "eval_loss" in r] == [3, 6, 7]


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_early_stopping_stops_where_the_plain_loops_rule_does(workers, tmp_path):
    torch.manual_seed(0)
    model = SmallConvNet().double()
    train, evaluation = tiny_dataset(dtype=F64), tiny_dataset(n=30, seed=9, dtype=F64)
    rule = dict(patience=2, min_delta=0.02)
    reference, losses, last = plain_with_evaluations(copy.deepcopy(model), train, evaluation, steps=40, every=2, **rule)
    assert last < 40  # the rule did stop the plain loop
    stopper = EarlyStopping(monitor="eval_loss", mode="min", **rule)
    result = Trainer(workers=workers, batch_size=7, max_steps=40, seed=3, eval_every=2,
                     checkpoint_dir=str(tmp_path)).fit(model, train, eval_set=evaluation, optimizer=SGD,
                                                       callbacks=[stopper])
    assert result.stopped_early == last == stopper.stopped_after and result.steps == last
    assert_exact(model, reference)
    assert CheckpointDir(tmp_path).latest().name == f"step-{last:09d}.pt"  # it stopped with a checkpoint


@pytest.mark.parametrize("workers", [1, 2])
def test_the_best_checkpoint_is_kept_beside_the_latest(workers, tmp_path):
    torch.manual_seed(0)
    model = SmallConvNet().double()
    train, evaluation = tiny_dataset(dtype=F64), tiny_dataset(n=30, seed=9, dtype=F64)
    _, losses, _ = plain_with_evaluations(copy.deepcopy(model), train, evaluation, steps=24, every=2)
    best_step = min(losses, key=lambda item: item[1])[0]
    assert best_step < 24  # the best evaluation is not the last one: the latest checkpoint is not the best
    best = BestCheckpoint(monitor="eval_loss", mode="min")
    Trainer(workers=workers, batch_size=7, max_steps=24, seed=3, eval_every=2, checkpoint_dir=str(tmp_path),
            checkpoint_keep=1).fit(model, train, eval_set=evaluation, optimizer=SGD, callbacks=[best])
    assert best.best_step == best_step and best.path == tmp_path / "best.pt"
    assert [p.name for _, p in CheckpointDir(tmp_path).steps()] == ["step-000000024.pt"]  # keep=1 left best.pt
    saved = checkpoint.load(tmp_path / "best.pt")
    assert saved["step"] == best_step
    torch.manual_seed(0)
    reference, _, _ = plain_with_evaluations(SmallConvNet().double(), train, evaluation, steps=best_step, every=100)
    for name, value in reference.state_dict().items():  # the weights the plain loop had at its best step
        torch.testing.assert_close(saved["model"][name], value, rtol=1e-10, atol=1e-12)


class StopsAtStep(Callback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, trainer, record):
        if record.step >= self.step:
            trainer.should_stop = True


def test_a_stop_asked_on_a_logged_step_ends_the_run_normally_soon_after(tmp_path):
    result = Trainer(workers=2, batch_size=8, max_steps=200, log_every=1, checkpoint_dir=str(tmp_path)).fit(
        SmallConvNet(), tiny_dataset(), optimizer=SGD, callbacks=[StopsAtStep(3)])
    assert result.stopped_early is not None and 3 <= result.stopped_early < 200
    assert CheckpointDir(tmp_path).latest().name == f"step-{result.stopped_early:09d}.pt"


def test_callbacks_are_checked_and_a_missing_metric_is_named():
    # len, not print: a library in the same test process may put a function of its own in print's place
    # (Ray's progress bars do), and the message names the type it gets.
    with pytest.raises(ConfigError, match="callbacks must be sn_trainer.Callback objects, got builtin_function"):
        Trainer(workers=1, batch_size=8, max_steps=2).fit(SmallConvNet(), tiny_dataset(), callbacks=[len])
    with pytest.raises(ConfigError, match="BestCheckpoint needs checkpoints: set checkpoint_dir"):
        Trainer(workers=1, batch_size=8, max_steps=2).fit(SmallConvNet(), tiny_dataset(), callbacks=[BestCheckpoint()])
    with pytest.raises(ConfigError, match=r"EarlyStopping monitors eval_f1, which evaluation does not report \(it "
                                          r"reports eval_accuracy, eval_loss, eval_samples\)"):
        Trainer(workers=2, batch_size=8, max_steps=2).fit(SmallConvNet(), tiny_dataset(), eval_set=tiny_dataset(),
                                                          callbacks=[EarlyStopping(monitor="eval_f1")])


def test_evaluation_can_be_bounded_to_its_first_batches():
    torch.manual_seed(0)
    model = SmallConvNet().double()
    evaluation = tiny_dataset(n=40, seed=9, dtype=F64)
    metrics = Trainer(workers=2, batch_size=8, eval_batch_size=4, max_eval_batches=3).evaluate(model, evaluation)
    first = torch.utils.data.TensorDataset(*(t[:12] for t in evaluation.tensors))
    assert metrics["eval_samples"] == 12
    assert metrics["eval_loss"] == pytest.approx(eval_loss(model, first), rel=1e-12)


# --- schedulers of every kind ------------------------------------------------------------------------

def plateau(optimizer):
    return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0)


def cosine_per_epoch(optimizer):
    return {"scheduler": torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=3), "interval": "epoch"}


def timm_cosine(optimizer):
    from timm.scheduler import CosineLRScheduler

    return CosineLRScheduler(optimizer, t_initial=3, warmup_t=1, warmup_lr_init=0.02)


def plain_scheduled(model, train, evaluation, epochs, every, make):
    """A plain loop stepping its scheduler as each kind's own users do: a plateau on the evaluation
    loss after each evaluation, an epoch scheduler after each epoch, timm's step_update after each
    step and step(epoch) after each epoch. Returns the model and the lr each step used."""
    opt = SGD(model.parameters())
    built = make(opt)
    scheduler = built["scheduler"] if isinstance(built, dict) else built
    used, step = [], 0
    for epoch in range(epochs):
        for batch in plain_loader_epoch(train, epoch):
            used.append(opt.param_groups[0]["lr"])
            opt.zero_grad()
            cross_entropy(model, batch).backward()
            opt.step()
            step += 1
            if hasattr(scheduler, "step_update"):
                scheduler.step_update(num_updates=step)
            if every and step % every == 0 and isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                scheduler.step(eval_loss(model, evaluation))
        if isinstance(built, dict) or hasattr(scheduler, "step_update"):
            scheduler.step(epoch + 1) if hasattr(scheduler, "step_update") else scheduler.step()
    return model, used


def plain_loader_epoch(train, epoch):
    from helpers import plain_loader

    return plain_loader(train, 7, seed=3, epoch=epoch)


@pytest.mark.parametrize("make, every", [(plateau, 4), (cosine_per_epoch, None), (timm_cosine, None)],
                         ids=["plateau", "epoch-dict", "timm"])
@pytest.mark.parametrize("workers", [1, 2, 3])
def test_every_kind_of_scheduler_follows_the_plain_loops_learning_rates(make, every, workers):
    torch.manual_seed(0)
    model = SmallConvNet().double()
    train, evaluation = tiny_dataset(dtype=F64), tiny_dataset(n=30, seed=9, dtype=F64)
    reference, used = plain_scheduled(copy.deepcopy(model), train, evaluation, epochs=3, every=every, make=make)
    assert len(set(used)) > 2  # the schedule did move
    result = Trainer(workers=workers, batch_size=7, epochs=3, seed=3, log_every=1, eval_every=every).fit(
        model, train, eval_set=evaluation if every else None, optimizer=SGD, scheduler=make)
    assert [r["lr"] for r in result.history if "loss" in r] == pytest.approx(used, rel=1e-12)
    assert_exact(model, reference)


def test_a_scheduler_that_cannot_work_fails_before_any_worker_starts(no_leaks):
    with pytest.raises(ConfigError, match=r"^the scheduler steps on eval_loss after each evaluation, and this run "
                                          r"evaluates nothing: pass eval_set"):
        Trainer(workers=2, batch_size=8, max_steps=2).fit(SmallConvNet(), tiny_dataset(), scheduler=plateau)
    with pytest.raises(UserCodeError, match="building the scheduler failed before any worker started: ValueError: "
                                            "a scheduler's interval is 'step' or 'epoch', got 'batch'"):
        Trainer(workers=2, batch_size=8, max_steps=2).fit(
            SmallConvNet(), tiny_dataset(), scheduler=functools.partial(by_batch))


def by_batch(optimizer):
    return {"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1), "interval": "batch"}


def test_a_plateau_scheduler_resumes_where_the_checkpoint_left_it(tmp_path):
    def run(model, steps, **settings):
        return Trainer(workers=2, batch_size=7, max_steps=steps, seed=3, eval_every=2, log_every=1,
                       checkpoint_dir=str(tmp_path), checkpoint_every_steps=4, **settings).fit(
            model, tiny_dataset(dtype=F64), eval_set=tiny_dataset(n=30, seed=9, dtype=F64), optimizer=SGD,
            scheduler=plateau)

    torch.manual_seed(0)
    start = SmallConvNet().double()
    whole = run(copy.deepcopy(start), 12, checkpoint_keep=10)
    for path in sorted(tmp_path.iterdir())[1:]:
        path.unlink()  # keep step 4's checkpoint only
    resumed_model = copy.deepcopy(start)
    resumed = run(resumed_model, 12, resume="latest")
    lrs = {r["step"]: r["lr"] for r in whole.history if "loss" in r}
    assert {r["step"]: r["lr"] for r in resumed.history if "loss" in r} == {s: lrs[s] for s in range(5, 13)}
    assert len(set(lrs.values())) > 1


# --- a moving average of the weights, sharded -----------------------------------------------------------

@pytest.mark.parametrize("workers", [1, 2, 3])
def test_the_ema_equals_torchs_averaged_model_updated_after_every_step(workers):
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    torch.manual_seed(0)
    model = SmallConvNet().double()
    train, evaluation = tiny_dataset(dtype=F64), tiny_dataset(n=30, seed=9, dtype=F64)
    reference = copy.deepcopy(model)
    averaged = AveragedModel(reference, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    averaged.update_parameters(reference)  # from the initial weights
    opt = SGD(reference.parameters())
    for _, batch in zip(range(10), plain_batches(train, 7, seed=3)):
        opt.zero_grad()
        cross_entropy(reference, batch).backward()
        opt.step()
        averaged.update_parameters(reference)
    result = Trainer(workers=workers, batch_size=7, max_steps=10, seed=3, ema_decay=0.9).fit(
        model, train, eval_set=evaluation, optimizer=SGD)
    assert_exact(model, reference)  # the live weights train as without it
    ema = copy.deepcopy(model)
    ema.load_state_dict(result.ema_state_dict)
    assert_exact(ema, averaged.module)
    assert result.eval_metrics["eval_ema_loss"] == pytest.approx(eval_loss(averaged.module, evaluation), rel=1e-12)
    assert result.eval_loss == pytest.approx(eval_loss(reference, evaluation), rel=1e-12)


def test_the_ema_is_checkpointed_and_resumed(tmp_path):
    def run(model, **settings):
        return Trainer(workers=2, batch_size=7, max_steps=10, seed=3, ema_decay=0.8, checkpoint_dir=str(tmp_path),
                       checkpoint_every_steps=4, **settings).fit(model, tiny_dataset(dtype=F64), optimizer=SGD)

    torch.manual_seed(0)
    start = SmallConvNet().double()
    whole = run(copy.deepcopy(start), checkpoint_keep=10)
    assert checkpoint.load(tmp_path / "step-000000004.pt")["ema"]["fc.weight"].shape == (3, 144)
    for path in sorted(tmp_path.iterdir())[1:]:
        path.unlink()  # keep step 4's checkpoint only
    resumed = run(copy.deepcopy(start), resume="latest")
    for name, value in whole.ema_state_dict.items():
        torch.testing.assert_close(resumed.ema_state_dict[name], value, rtol=0, atol=0)


# --- several optimizers updated in turn (a GAN) ---------------------------------------------------------

class TinyGAN(torch.nn.Module):
    """pytorch/examples' DCGAN in miniature: a generator from noise to 8x8 images, a discriminator."""

    def __init__(self, latent: int = 4):
        super().__init__()
        self.G = torch.nn.Sequential(torch.nn.Linear(latent, 16), torch.nn.ReLU(), torch.nn.Linear(16, 64),
                                     torch.nn.Tanh())
        self.D = torch.nn.Sequential(torch.nn.Conv2d(1, 3, 3), torch.nn.LeakyReLU(0.2), torch.nn.Flatten(),
                                     torch.nn.Linear(3 * 6 * 6, 1))

    def generate(self, noise):
        return self.G(noise).view(-1, 1, 8, 8)


def discriminator_step(model, batch):
    """D learns real from fake; noise comes with the batch, so every run draws the same."""
    real, noise = batch
    fake = model.generate(noise).detach()
    ones, zeros = torch.ones(len(real), 1, dtype=real.dtype), torch.zeros(len(real), 1, dtype=real.dtype)
    return F.binary_cross_entropy_with_logits(model.D(real), ones) + \
        F.binary_cross_entropy_with_logits(model.D(fake), zeros)


def generator_step(model, batch):
    """G learns to pass for real, judged by the D just updated."""
    real, noise = batch
    return F.binary_cross_entropy_with_logits(model.D(model.generate(noise)), torch.ones(len(real), 1,
                                                                                        dtype=real.dtype))


def discriminator_params(model):
    return model.D.parameters()


def generator_params(model):
    return model.G.parameters()


ADAM = functools.partial(torch.optim.Adam, lr=0.01, betas=(0.5, 0.999))


def gan_data():
    g = torch.Generator().manual_seed(4)
    return torch.utils.data.TensorDataset(torch.randn(56, 1, 8, 8, generator=g, dtype=F64).tanh(),
                                          torch.randn(56, 4, generator=g, dtype=F64))


def plain_gan(after_d=None):
    """A fresh TinyGAN, and a copy trained 6 steps as DCGAN's loop trains: D's update (then
    ``after_d`` on the model), then G's, on each batch of 7."""
    torch.manual_seed(0)
    model = TinyGAN().double()
    reference = copy.deepcopy(model)
    opt_d, opt_g = ADAM(reference.D.parameters()), ADAM(reference.G.parameters())
    for _, batch in zip(range(6), plain_batches(gan_data(), 7, seed=3)):
        opt_d.zero_grad()
        discriminator_step(reference, batch).backward()
        opt_d.step()
        if after_d is not None:
            with torch.no_grad():
                after_d(reference)
        opt_g.zero_grad()
        generator_step(reference, batch).backward()
        opt_g.step()
    return model, reference


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_a_gan_updates_d_then_g_as_dcgans_loop_does(workers):
    model, reference = plain_gan()
    result = Trainer(workers=workers, batch_size=7, max_steps=6, seed=3, log_every=1).fit(
        model, gan_data(), phases=[Phase(discriminator_step, discriminator_params, ADAM, name="D"),
                                   Phase(generator_step, generator_params, ADAM, name="G")])
    assert_exact(model, reference)
    assert [p["name"] for p in result.plan["phases"]] == ["D", "G"]
    assert {"loss_D", "loss_G"} <= set(result.history[0]) and result.history[0]["loss"] == result.history[0]["loss_D"]


def test_phases_are_checked_before_any_worker_starts(no_leaks):

    data = gan_data()
    with pytest.raises(ConfigError, match=r"is in phases 'D' and 'all'; each parameter may be in one phase only"):
        Trainer(workers=2, batch_size=8, max_steps=2).fit(
            TinyGAN().double(), data, phases=[Phase(discriminator_step, discriminator_params, name="D"),
                                              Phase(generator_step, all_params, name="all")])
    with pytest.raises(ConfigError, match="give phases or step_fn, not both"):
        Trainer(workers=2, batch_size=8, max_steps=2).fit(TinyGAN().double(), data, step_fn=generator_step,
                                                          phases=[Phase(generator_step, generator_params)])


def all_params(model):
    return model.parameters()


# --- code after each update (a clamped temperature, clipped weights) ------------------------------------

BOUND = 0.05  # below the initial weights' range and a step's reach: the clamp bites every step


def clamp_weights(model):
    """A constraint after every update, as open_clip clamps logit_scale: every weight into +-BOUND."""
    for p in model.parameters():
        p.clamp_(-BOUND, BOUND)


def clamp_and_shrink(model):
    """Not idempotent: called twice (or in each of W workers) it would shrink twice."""
    clamp_weights(model)
    model.fc.weight.mul_(0.5)


@pytest.mark.parametrize("after", [clamp_weights, clamp_and_shrink])
@pytest.mark.parametrize("workers", [1, 2])
def test_after_update_runs_once_per_update_on_the_shared_weights_as_a_plain_loop_does(workers, after):

    torch.manual_seed(0)
    model = SmallConvNet().double()
    reference, unclamped = copy.deepcopy(model), copy.deepcopy(model)
    for net, called in ((reference, after), (unclamped, None)):
        opt = SGD(net.parameters())
        for _, batch in zip(range(6), plain_batches(tiny_dataset(dtype=F64), 12, seed=3)):
            opt.zero_grad()
            cross_entropy(net, batch).backward()
            opt.step()
            if called is not None:
                with torch.no_grad():
                    called(net)
    Trainer(workers=workers, batch_size=12, max_steps=6, seed=3).fit(model, tiny_dataset(dtype=F64), optimizer=SGD,
                                                                    after_update=after)
    assert_exact(model, reference)
    # It bit: weights sit on the bound, and the unclamped loop ends elsewhere.
    assert max(p.abs().max().item() for p in model.parameters()) == BOUND
    assert any((p - q).abs().max() > 1e-3 for p, q in zip(reference.parameters(), unclamped.parameters()))


def clip_critic(model):
    """WGAN's weight clipping, of the critic only."""
    for p in model.D.parameters():
        p.clamp_(-BOUND, BOUND)


def test_a_phases_after_update_runs_after_its_own_update_before_the_next_phase():
    """WGAN: the critic is clipped after the critic's step, and the generator's step sees it clipped."""
    model, reference = plain_gan(after_d=clip_critic)
    Trainer(workers=2, batch_size=7, max_steps=6, seed=3).fit(
        model, gan_data(), phases=[Phase(discriminator_step, discriminator_params, ADAM, name="D",
                                         after_update=clip_critic),
                                   Phase(generator_step, generator_params, ADAM, name="G")])
    assert_exact(model, reference)
    assert max(p.abs().max().item() for p in model.D.parameters()) == BOUND


def broken_constraint(model):
    raise ValueError("constraint bug")


def breaks_in_workers(model):
    """Fails only on the workers' shared weights (the rehearsal's copy is the launcher's own)."""
    if next(model.parameters()).is_shared():
        raise ValueError("constraint bug in a worker")


def test_an_after_update_that_raises_is_reported_naming_it(no_leaks):

    trainer = Trainer(workers=2, batch_size=8, max_steps=2)
    with pytest.raises(UserCodeError, match="after_update broken_constraint failed before any worker started: "
                                            "ValueError: constraint bug"):
        trainer.fit(SmallConvNet(), tiny_dataset(), after_update=broken_constraint)
    with pytest.raises(WorkerFailed, match=r"(?s)breaks_in_workers.*ValueError: constraint bug in a worker"):
        trainer.fit(SmallConvNet(), tiny_dataset(), after_update=breaks_in_workers)
    with pytest.raises(ConfigError, match="after_update must be a function of the model, got int"):
        trainer.fit(SmallConvNet(), tiny_dataset(), after_update=3)
    with pytest.raises(ConfigError, match="give phases or after_update, not both"):
        trainer.fit(TinyGAN(), gan_data(), after_update=clip_critic, phases=[Phase(generator_step, generator_params)])


# --- weights out, as safetensors --------------------------------------------------------------------------

def test_the_trained_weights_load_from_safetensors_into_a_fresh_model_ties_and_all(tmp_path):
    import subprocess
    import sys

    from safetensors import safe_open
    from safetensors.torch import load_model

    from helpers import TinyGPT, token_dataset

    torch.manual_seed(0)
    model = TinyGPT()
    result = Trainer(workers=2, batch_size=6, max_steps=3, ema_decay=0.5, checkpoint_dir=str(tmp_path / "ckpt")).fit(
        model, token_dataset(), optimizer=ADAM, step_fn=gpt_step)
    written = result.save(tmp_path / "out")
    assert [p.name for p in written] == ["model.safetensors", "model_ema.safetensors"]
    with safe_open(written[0], "pt") as f:
        names = set(f.keys())
    assert len({"wte.weight", "head.weight"} & names) == 1  # the tied weight, once
    fresh = TinyGPT()
    load_model(fresh, written[0])
    assert fresh.head.weight is fresh.wte.weight
    for (name, mine), theirs in zip(fresh.state_dict().items(), model.state_dict().values()):
        assert torch.equal(mine, theirs), name
    averaged = TinyGPT()
    load_model(averaged, written[1])
    for name, value in result.ema_state_dict.items():
        assert torch.equal(averaged.state_dict()[name], value), name
    # Any checkpoint converts the same way, from the command line.
    checkpoint_file = CheckpointDir(tmp_path / "ckpt").latest()
    done = subprocess.run([sys.executable, "-m", "sn_trainer.export", str(checkpoint_file), str(tmp_path / "conv")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    converted = TinyGPT()
    load_model(converted, tmp_path / "conv" / "model.safetensors")
    assert converted.head.weight is converted.wte.weight
    for (name, mine), theirs in zip(converted.state_dict().items(), model.state_dict().values()):
        assert torch.equal(mine, theirs), name
    converted_ema = TinyGPT()
    load_model(converted_ema, tmp_path / "conv" / "model_ema.safetensors")
    for name, value in result.ema_state_dict.items():
        assert torch.equal(converted_ema.state_dict()[name], value), name


def gpt_step(model, batch):
    idx, targets = batch
    _, loss = model(idx, targets)
    return loss


def _operators_per_step(events, steps: int) -> float:
    return sum(1 for name in events if name.startswith("aten::")) / steps


def test_a_steps_own_work_calls_few_torch_operators_beside_a_plain_loops(tmp_path):
    """sn_trainer's bookkeeping in a step (the board's sums and reads, the stop flags, the parameters
    a backward reached) runs on numpy views of shared memory, not as torch calls on tiny tensors,
    each of which costs microseconds. A step at W=1 of a small MLP, traced by ``profile_dir`` (a
    folder the worker makes), calls at most 48 more torch operators than the same plain step reading
    its batch alike: zeroing, summing and dividing its gradient buffer, accumulating into it,
    counting the kept targets, and reading three scalars, with the views they take."""
    import json

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(512, 32), torch.randint(0, 10, (512,)))
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    plain = copy.deepcopy(model)
    traced = tmp_path / "traces" / "new"
    Trainer(workers=1, threads=1, batch_size=32, max_steps=8, measure_after=2, profile_dir=str(traced),
            profile_steps=4).fit(model, data, optimizer=functools.partial(torch.optim.SGD, lr=0.01, momentum=0.9))
    trace = json.loads((traced / "trace_rank0.json").read_text())
    mine = _operators_per_step([e["name"] for e in trace["traceEvents"] if e.get("cat") == "cpu_op"], 4)

    opt = torch.optim.SGD(plain.parameters(), lr=0.01, momentum=0.9)
    inputs, targets = data.tensors
    order = torch.randperm(len(inputs))

    def step(i):  # a batch read as the Trainer reads a TensorDataset's: its tensors indexed by the batch's items
        items = order[32 * i : 32 * (i + 1)]
        opt.zero_grad()
        F.cross_entropy(plain(inputs[items]), targets[items]).backward()
        opt.step()

    for i in range(2):
        step(i)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        for i in range(4):
            step(i)
    plains = _operators_per_step([e.name for e in profile.events()], 4)
    assert plains < mine <= plains + 48, (mine, plains)


@pytest.mark.unit
def test_the_board_reads_what_the_workers_published_however_rare():
    """The board's reads take a short path where every parameter was reached, no buffer changed and
    every sum is finite; the rare cases still read exactly: a parameter no worker reached, a buffer
    one changed, and non-finite entries, also those whose sum would look finite (+inf and -inf)."""
    import numpy as np

    from sn_trainer.engine.step.board import Board

    board = Board.allocate(2, parameters=3, buffers=2)
    board.publish(0, 0, 1.0, 2.0, 0.5, np.array([1.0, 0.0, 1.0]), np.array([0.0, 1.0]))
    board.publish(0, 1, 3.0, 2.0, 0.5, np.array([1.0, 0.0, 0.0]))
    totals = board.read(board.totals(0))
    assert (totals.loss_sum, totals.count, totals.finite) == (4.0, 4.0, True)
    assert totals.unused == (1,) and totals.changed_buffers == (1,) and totals.one_batch

    board.publish(1, 0, 1.0, 2.0, float("inf"), np.ones(3), np.zeros(2))
    board.publish(1, 1, 1.0, 2.0, float("-inf"), np.ones(3))
    with np.errstate(invalid="ignore"):  # inf + -inf: numpy says so, as it did before the short path
        summed = board.totals(1)
    assert summed[2].item() == 2.0  # two non-finite entries, counted so that sums across nodes add them
    totals = board.read(summed)
    assert not totals.finite and totals.unused == () and totals.changed_buffers == ()
    board.publish(0, 0, float("nan"), 2.0, 0.5, np.ones(3), np.zeros(2))
    board.publish(0, 1, 1.0, 2.0, 0.5, np.ones(3))
    assert not board.read(board.totals(0)).finite


@pytest.mark.unit
def test_the_parameters_a_backward_reached_are_read_from_their_gradients_without_hooks():
    """Each parameter's ``.grad`` is its place in the flat gradient buffer, with a version counter
    of its own: the counters say which parameters a step's backward passes reached (several
    micro-batches, a branch taken in one of them), and no hook is left on the parameters."""
    from sn_trainer.recipe.flat_layout import FlatLayout
    from sn_trainer.engine.step.board import Reached

    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"a": torch.nn.Linear(3, 3), "b": torch.nn.Linear(3, 3), "c": torch.nn.Linear(3, 1)})
    layout = FlatLayout(model, 1)
    grad_flat = torch.zeros(layout.padded_numel)
    reached = Reached(layout.attach_gradients(model, grad_flat))
    x = torch.randn(4, 3)
    for branch in (False, True, False):  # three steps: 'b' reached in the second only
        grad_flat.zero_()
        reached.start()
        for micro in range(2):
            out = model["a"](x)
            if branch and micro == 1:
                out = model["b"](out)
            model["c"](out).sum().backward()
        assert reached.flags().tolist() == [1.0, 1.0] + [float(branch)] * 2 + [1.0, 1.0]
    assert torch.equal(layout.view(grad_flat, 0), model["a"].weight.grad) and grad_flat.abs().sum() > 0
    assert not any(p._post_accumulate_grad_hooks or p._backward_hooks for p in model.parameters())
