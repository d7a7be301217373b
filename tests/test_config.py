"""Every config error names the setting and says what would be right."""
import pytest

from sn_trainer.cli.run_config import ConfigError, RunConfig
from sn_trainer.cli.named_optim import LRSchedule, build_optimizer, effective_lr
from sn_trainer.cli.run_config import OptimConfig

pytestmark = pytest.mark.unit  # the unit tier: starts no process


@pytest.mark.parametrize("raw, message", [
    ({"batchsize": 3}, r"^unknown setting batchsize; did you mean batch_size\? \(every key: python -m sn_trainer "
                       r"--help\)$"),
    ({"model": {"nme": "x"}}, r"^unknown setting model.nme; did you mean model.name\?"),
    ({"chekpoint": {"dir": "x"}}, r"^unknown setting chekpoint.dir; did you mean checkpoint.dir\?"),
    ({"zzz": 3}, "^unknown setting zzz; valid ones: accumulate, allocator, batch_size"),
    ({"model": {"zzzzz": "x"}}, "^unknown setting model.zzzzz; valid ones: model.bias, model.dropout, model.hidden, "
                                "model.n_embd, model.n_head, model.n_layer, model.name$"),
    ({"optim": {"momentum": "abc"}}, "^optim.momentum must be a number, got 'abc'$"),
    ({"optim": {"weight_decay": "abc"}}, "^optim.weight_decay must be a number, got 'abc'$"),
    ({"optim": {"gamma": "abc"}}, "^optim.gamma must be a number, got 'abc'$"),
    ({"optim": {"betas": [0.9, "x"]}}, r"^optim.betas must be a list of numbers, got \[0.9, 'x'\]$"),
    ({"clip_grad_norm": "abc"}, "^clip_grad_norm must be a number or null, got 'abc'$"),
    ({"dataset": {"num_classes": "abc"}}, "^dataset.num_classes must be an integer, got 'abc'$"),
    ({"dataset": {"augment": "yes"}},
     "^dataset.augment must be true, false, null, crop_flip or resized_crop, got 'yes'$"),
    ({"checkpoint": {"keep": 2.5}}, "^checkpoint.keep must be an integer, got 2.5$"),
    ({"optim": {"name": "lion"}}, "unknown optimizer 'lion'; choose one of sgd, adamw"),
    ({"optim": {"lr": 0}}, "optim.lr must be > 0, got 0"),
    ({"optim": {"lr": -0.1}}, "optim.lr must be > 0"),
    ({"optim": {"lr": float("inf")}}, "optim.lr must be finite, got inf"),
    ({"optim": {"schedule": "linear"}}, "unknown schedule 'linear'; choose one of constant, cosine, step"),
    ({"optim": {"nesterov": True, "momentum": 0}}, "optim.nesterov=true needs optim.momentum > 0"),
    ({"optim": {"gamma": 2}}, r"optim.gamma must be in \(0, 1\]"),
    ({"epochs": 0}, "epochs must be >= 1, got 0"),
    ({"epochs": -1}, "epochs must be >= 1"),
    ({"max_steps": 0}, "max_steps must be >= 1 or null"),
    ({"workers": 0}, "workers must be >= 1"),
    ({"threads": 0}, "threads must be >= 1"),
    ({"batch_size": 0}, "batch_size must be >= 1"),
    ({"seed": -1}, "seed must be a non-negative integer"),
    ({"clip_grad_norm": 0}, "clip_grad_norm must be > 0 or null"),
    ({"model": {"name": "lenet", "hidden": [10]}}, "model.hidden applies to model=mlp only"),
    ({"dataset": {"test_fraction": 1.5}}, r"dataset.test_fraction must be in \(0, 1\)"),
    ({"channels_last": "yes"}, "channels_last must be true, false or auto, got 'yes'"),
    ({"dataset": {"seed": 3}}, r"^dataset.seed is now called dataset.data_seed \(it seeds the synthetic data, the folder "
                               r"split and a folder's augmentation; `seed` is the run's own, .*\)$"),
])
@pytest.mark.quick
def test_config_errors(raw, message):
    with pytest.raises(ConfigError, match=message):
        RunConfig.from_dict(raw)


def test_the_old_name_of_data_seed_is_refused_with_the_new_one():
    """dataset.seed was data_seed's name: passed to the dataset's config, it is one ConfigError naming
    data_seed, not a TypeError and not ignored; the run's own seed keeps its name."""
    from sn_trainer.cli.run_config import DatasetConfig

    for old in (0, 3):
        with pytest.raises(ConfigError, match="^dataset.seed is now called dataset.data_seed "):
            DatasetConfig(seed=old)
    built = RunConfig.from_dict({"seed": 5, "dataset": {"data_seed": 3}})
    assert (built.trainer.seed, built.dataset.data_seed) == (5, 3)


def test_defaults_build():
    cfg = RunConfig.from_dict({"model": {"name": "lenet"}, "dataset": {"name": "fashion_mnist"}})
    assert cfg.trainer.workers == "auto" and cfg.optim.name == "sgd"


def test_channels_last_auto_follows_the_model():
    from sn_trainer.models import build_model
    from sn_trainer.fit.decide import channels_last_helps

    assert channels_last_helps(build_model("lenet", (1, 28, 28), 10)) is True  # convolutions
    assert channels_last_helps(build_model("mlp", (1, 28, 28), 10)) is False  # none
    assert channels_last_helps(build_model("cifar10_quick_bn", (3, 32, 32), 10)) is False  # batch norm


def test_linear_lr_scaling_and_schedules():
    cfg = OptimConfig(lr=0.1, scale_lr=True, reference_batch=256)
    assert effective_lr(cfg, 512) == pytest.approx(0.2)
    assert build_optimizer(cfg, 128).keywords["lr"] == pytest.approx(0.05)
    warm_cosine = LRSchedule("cosine", total_steps=110, warmup_steps=10)
    assert [warm_cosine(s) for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])
    assert warm_cosine(10) == pytest.approx(1.0) and warm_cosine(60) == pytest.approx(0.5)
    assert warm_cosine(110) == pytest.approx(0.0)
    step = LRSchedule("step", total_steps=100, step_every=30, gamma=0.5)
    assert [step(s) for s in (0, 29, 30, 60)] == pytest.approx([1, 1, 0.5, 0.25])
