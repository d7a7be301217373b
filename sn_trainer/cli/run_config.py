"""The command line's settings: what to train (model, dataset, optimizer), benchmark mode, loggers.

Hydra's composed config becomes a ``RunConfig`` here: the Trainer's settings (``TrainerConfig``,
its parts as groups such as ``checkpoint.*``) at the top level, and the command line's own
groups. The shipped YAML, ``--help`` and the README's options table come from these defaults and
help texts, and the tests check them against each other.
"""
from __future__ import annotations

import difflib
import math
from dataclasses import InitVar, dataclass, field, fields
from typing import Any

from ..config import TrainerConfig, default_of, is_int, is_part, one_of, option, positive_int, require, setting_rows
from ..errors import ConfigError

SCHEDULES = ("constant", "cosine", "step")
AUGMENTATIONS = ("crop_flip", "resized_crop")  # beside true (crop_flip), false and null (the dataset's default)
LOGGERS = ("none", "tensorboard", "mlflow")

# Keys that were renamed: the old key, its new name, and why (a line for whoever still writes the old one).
RENAMED = {"dataset.seed": ("dataset.data_seed", "it seeds the synthetic data, the folder split and a folder's "
                                                 "augmentation; `seed` is the run's own, the sample order and the "
                                                 "workers' random state")}

__all__ = ["RunConfig", "ModelConfig", "DatasetConfig", "OptimConfig", "BenchConfig", "option_rows"]


@dataclass
class ModelConfig:
    name: str = option("lenet", "`lenet`, `cifar10_quick`, `cifar10_quick_bn`, `mlp`, `gpt` (with dataset=text), "
                                "or any torchvision classification model (with model=torchvision)")
    hidden: list[int] | None = option(None, "mlp: sizes of the hidden layers")
    n_layer: int = option(3, "gpt: transformer blocks")
    n_head: int = option(4, "gpt: attention heads per block")
    n_embd: int = option(128, "gpt: width of the embeddings (a multiple of n_head)")
    dropout: float = option(0.0, "gpt: dropout probability")
    bias: bool = option(False, "gpt: biases in linear layers and layer norms")

    def __post_init__(self) -> None:
        require(isinstance(self.name, str) and bool(self.name), "model.name must be a non-empty string")
        require(self.hidden is None or (self.name == "mlp" and all(is_int(h) and h > 0 for h in self.hidden)),
                 f"model.hidden applies to model=mlp only, as positive sizes; got {self.hidden!r} for {self.name}")
        for key in ("n_layer", "n_head", "n_embd"):
            positive_int(getattr(self, key), f"model.{key}")
        require(self.n_embd % self.n_head == 0,
                 f"model.n_embd={self.n_embd} must be a multiple of model.n_head={self.n_head}")
        require(0 <= self.dropout < 1, f"model.dropout must be in [0, 1), got {self.dropout!r}")


@dataclass
class DatasetConfig:
    name: str = option("fashion_mnist", "`fashion_mnist`, `mnist`, `cifar10`, `synthetic`, `folder` or `text`")
    root: str | None = option(None, "where the files are (or go, with download=true)")
    path: str | None = option(None, "text: a UTF-8 text file, or a folder of them")
    tokenizer: str = option("char", "text: `char` (one token per character) or `gpt2` (tiktoken's BPE)")
    block_size: int = option(64, "text: tokens per training window (the model's context)")
    download: bool = option(False, "let torchvision download the dataset into root when it is not found "
                                   "(needs internet)")
    augment: bool | str | None = option(None, "`true` (or `crop_flip`): a crop at a random offset of the zero-padded "
                                              "image, and a flip; `resized_crop` (folder): ImageNet's "
                                              "RandomResizedCrop to crop_size and a flip, and for testing a center "
                                              "crop; `false`; default: crop_flip for cifar10 only")
    shape: list[int] = option([1, 28, 28], "synthetic: [C, H, W] of the images")
    num_classes: int = option(10, "synthetic: number of classes")
    train_size: int = option(8192, "synthetic: training samples")
    test_size: int = option(1024, "synthetic: test samples")
    image_size: int = option(32, "folder: images are resized to image_size x image_size")
    crop_size: int | None = option(None, "folder with augment=resized_crop: the side of training's random crops "
                                         "and testing's center crop, of the image_size image (as torchvision's "
                                         "reference: 224 of 256); default image_size")
    preload: bool = option(False, "folder: decode every image into memory up front (`false`: each worker reads, "
                                  "decodes and augments its samples from the files as it trains)")
    test_fraction: float = option(0.1, "folder without train/ and test/, and text: the share held out for testing "
                                       "(text: its tail)")
    data_seed: int = option(0, "synthetic data, the folder split and a folder's augmentation (per sample); not the "
                               "sample order or the workers' random state, which `seed` decides")
    seed: InitVar[int | None] = None  # data_seed's old name: refused with the new one, never silently ignored

    def __post_init__(self, seed: int | None) -> None:
        if seed is not None:
            raise renamed("dataset.seed")
        positive_int(self.train_size, "dataset.train_size")
        positive_int(self.test_size, "dataset.test_size")
        positive_int(self.image_size, "dataset.image_size")
        positive_int(self.block_size, "dataset.block_size")
        require(0 < self.test_fraction < 1, f"dataset.test_fraction must be in (0, 1), got {self.test_fraction}")
        require(self.augment is None or isinstance(self.augment, bool) or self.augment in AUGMENTATIONS,
                f"dataset.augment must be true, false, null, crop_flip or resized_crop, got {self.augment!r}")
        positive_int(self.crop_size, "dataset.crop_size", nullable=True)
        if self.augment == "resized_crop":
            require(self.name == "folder", f"dataset.augment=resized_crop applies to dataset=folder, got "
                                           f"dataset={self.name}; use dataset.augment=true (crop_flip)")
            require(not self.preload, "dataset.augment=resized_crop reads each image where it lies as a worker asks "
                                      "for it; set dataset.preload=false")
            require(self.crop_size is None or self.crop_size <= self.image_size,
                    f"dataset.crop_size={self.crop_size} must be at most dataset.image_size={self.image_size}: it "
                    "is cut from the image resized to image_size")
        else:
            require(self.crop_size is None, f"dataset.crop_size applies to dataset.augment=resized_crop, got "
                                            f"dataset.augment={self.augment}")


@dataclass
class OptimConfig:
    name: str = option("sgd", "`sgd` or `adamw`")
    lr: float = option(0.02, "base learning rate (before scale_lr)")
    momentum: float = option(0.9, "sgd: momentum")
    nesterov: bool = option(False, "sgd: Nesterov momentum")
    weight_decay: float = option(5e-4, "weight decay")
    betas: list[float] = option([0.9, 0.999], "adamw: betas")
    schedule: str = option("cosine", "`constant`, `cosine` (to zero at the last step) or `step` (times gamma every "
                                     "step_every steps)")
    warmup_steps: int = option(100, "linear warm-up from lr/warmup_steps to lr over this many steps, before the "
                                    "schedule")
    step_every: int = option(1000, "step schedule: optimizer steps between decays")
    gamma: float = option(0.1, "step schedule: decay factor")
    scale_lr: bool = option(False, "linear scaling rule: lr x batch_size x accumulate / reference_batch")
    reference_batch: int = option(256, "the batch the base lr was tuned for (scale_lr)")

    def __post_init__(self) -> None:
        require(self.name in ("sgd", "adamw"), f"unknown optimizer {self.name!r}; choose one of sgd, adamw")
        require(isinstance(self.lr, (int, float)) and self.lr > 0, f"optim.lr must be > 0, got {self.lr!r}")
        require(math.isfinite(self.lr), f"optim.lr must be finite, got {self.lr!r}")
        require(self.momentum >= 0, f"optim.momentum must be >= 0, got {self.momentum}")
        require(not self.nesterov or self.momentum > 0, "optim.nesterov=true needs optim.momentum > 0")
        require(self.weight_decay >= 0, f"optim.weight_decay must be >= 0, got {self.weight_decay}")
        require(self.schedule in SCHEDULES, f"unknown schedule {self.schedule!r}; choose one of {', '.join(SCHEDULES)}")
        positive_int(self.warmup_steps, "optim.warmup_steps", minimum=0)
        positive_int(self.step_every, "optim.step_every")
        require(0 < self.gamma <= 1, f"optim.gamma must be in (0, 1], got {self.gamma}")
        positive_int(self.reference_batch, "optim.reference_batch")


@dataclass
class BenchConfig:
    enabled: bool = option(False, "benchmark mode: no evaluation, time bench.steps optimizer steps after "
                                  "bench.warmup")
    steps: int = option(30, "benchmark mode: measured steps")
    warmup: int = option(5, "benchmark mode: steps before measuring")
    skip_oversubscribed: bool = option(False, "skip (at once, writing why) a job whose workers x threads exceed the "
                                              "physical cores")

    def __post_init__(self) -> None:
        positive_int(self.steps, "bench.steps")
        positive_int(self.warmup, "bench.warmup", minimum=0)


@dataclass
class RunConfig:
    """One command-line run: the Trainer's settings at the top level, plus what to train."""

    trainer: TrainerConfig
    model: ModelConfig
    dataset: DatasetConfig
    optim: OptimConfig
    bench: BenchConfig = field(default_factory=BenchConfig)
    profile: bool = option(False, "write a torch.profiler trace of a few steps per worker into the output directory")
    tune: bool = option(False, "first measure which workers x threads (and runtime) trains this model and batch "
                               "fastest here, print the table, then train with it; the choice is cached for "
                               "workers=auto")
    logger: str | list[str] = option("tensorboard", "`tensorboard`: loss, lr, speed, milliseconds per stage, "
                                                    "per-core CPU and evaluation as TensorBoard events in the output "
                                                    "directory, written by the launcher; `mlflow`: params, the same "
                                                    "metrics and the summary as an MLflow run (MLFLOW_TRACKING_URI, "
                                                    "else mlflow.db beside the run or sweep), best-effort: a "
                                                    "server that takes no connection within 5 s, or a store that "
                                                    "fails later, is said in one warning line and the run trains "
                                                    "on untracked; a list such as `[tensorboard,mlflow]`; `none`")

    SECTIONS = {"model": ModelConfig, "dataset": DatasetConfig, "optim": OptimConfig, "bench": BenchConfig}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "RunConfig":
        """Build from a plain dict (Hydra's resolved config); unknown keys are errors."""
        raw = dict(raw)
        sections = {key: _build(kind, raw.pop(key, None) or {}, key) for key, kind in cls.SECTIONS.items()}
        parts = {f.name: _build(f.default_factory, raw.pop(f.name, None) or {}, f.name)
                 for f in fields(TrainerConfig) if is_part(f)}
        raw.pop("hydra", None)
        profile = raw.pop("profile", False)
        require(isinstance(profile, bool), f"profile must be true or false, got {profile!r}")
        logger = raw.pop("logger", "tensorboard")
        for name in logger if isinstance(logger, list) else [logger]:
            one_of(name, "logger", LOGGERS)
        tune = raw.pop("tune", False)
        require(isinstance(tune, bool), f"tune must be true or false, got {tune!r}")
        for row in setting_rows():
            if row.part is not None and row.keyword in raw:
                raise ConfigError(f"unknown setting {row.keyword}; use {row.part}.{row.name}")
        api_only = sorted(row.keyword for row in setting_rows() if not row.cli and row.keyword in raw)
        if api_only:
            raise ConfigError(f"{api_only[0]} is a Trainer argument, not a command-line setting")
        trainer = _build(TrainerConfig, {**raw, **parts}, None)
        return cls(trainer=trainer, profile=profile, logger=logger, tune=tune, **sections)


def _groups() -> dict[str, type]:
    """Every group of keys the command line has: its own sections, then the Trainer's parts."""
    return {**RunConfig.SECTIONS, **{f.name: f.default_factory for f in fields(TrainerConfig) if is_part(f)}}


def renamed(key: str) -> ConfigError:
    """The error for a key that was renamed (``dataset.seed``): its new name, and why."""
    new, why = RENAMED[key]
    return ConfigError(f"{key} is now called {new} ({why})")


def unknown_setting(key: str) -> ConfigError:
    """The error for a command-line key no setting has (``batchsize``, ``optim.momentm``): the
    new name of a renamed one, else the nearest real key, else every valid one (of the key's
    group, for a key in a group)."""
    if key in RENAMED:
        return renamed(key)
    group, _, name = key.rpartition(".")
    if group in _groups():  # the group is right: the nearest of its own keys
        nearest = [f"{group}.{n}" for n in difflib.get_close_matches(name, [f.name for f in fields(_groups()[group])],
                                                                      n=1)]
    else:
        nearest = difflib.get_close_matches(key, [row[0] for row in option_rows()], n=1)
    if nearest:
        return ConfigError(f"unknown setting {key}; did you mean {nearest[0]}? (every key: python -m sn_trainer "
                           "--help)")
    if group in _groups():
        shown = [f"{group}.{f.name}" for f in sorted(fields(_groups()[group]), key=lambda f: f.name)]
    else:
        shown = sorted({row.keyword for row in setting_rows() if row.cli and row.part is None}
                       | {"profile", "logger", "tune", *(f"{group}.*" for group in _groups())})
    return ConfigError(f"unknown setting {key}; valid ones: {', '.join(shown)}")


def not_in_option(group: str, name: str, option: str, its_names: list[str], options_with_it: list[str]) -> ConfigError:
    """The error for a group's key that the group's chosen option does not read
    (``dataset.data_seed`` with ``dataset=fashion_mnist``): the option's own keys, and the options
    that have it."""
    having = [f"{group}={o}" for o in options_with_it]
    if not having:
        advice = f"no {group} option reads it: leave it out"
    elif len(having) == 1:
        advice = f"{having[0]} has it: choose it, or leave it out"
    else:
        advice = f"{', '.join(having[:-1])} and {having[-1]} have it: choose one of them, or leave it out"
    return ConfigError(f"{group}.{name} does not apply to {group}={option} (its settings: {', '.join(its_names)}); "
                       f"{advice}")


def _build(kind: type, values: dict[str, Any], prefix: str | None):
    known = {f.name for f in fields(kind)}
    where = f"{prefix}." if prefix else ""
    unknown = sorted(set(values) - known)
    if unknown:
        held = values[unknown[0]]  # a misspelt group (chekpoint.dir) is named by its key, as written
        raise unknown_setting(where + unknown[0] + (f".{next(iter(held))}" if isinstance(held, dict) and held else ""))
    for f in fields(kind):  # a value of the wrong type, named before a check compares it with a number
        expected = _unlike(values[f.name], str(f.type)) if f.name in values else None
        if expected:
            raise ConfigError(f"{where}{f.name} must be {expected}, got {values[f.name]!r}")
    try:
        return kind(**values)
    except TypeError as exc:
        raise ConfigError(f"bad setting: {exc}") from None


# What each type a setting is declared with accepts, and how an error names it.
_KINDS = {"int": (["an integer"], "integers", is_int),
          "float": (["a number"], "numbers", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)),
          "bool": (["true", "false"], "true or false", lambda v: isinstance(v, bool)),
          "str": (["a string"], "strings", lambda v: isinstance(v, str)),
          "None": (["null"], "nulls", lambda v: v is None)}


def _unlike(value: Any, annotation: str) -> str | None:
    """What a value of ``annotation`` (a field's, as written: ``float | None``, ``list[int]``) is,
    where ``value`` is none of it; None where it is one, or the annotation is not one of these."""
    wanted = []
    for alternative in (a.strip() for a in annotation.split("|")):
        inner = alternative[5:-1] if alternative.startswith("list[") and alternative.endswith("]") else None
        kind = _KINDS.get(inner if inner is not None else alternative)
        if kind is None:
            return None  # a type this check does not know: the dataclass's own check decides
        names, plural, accepts = kind
        if inner is not None:
            if isinstance(value, list) and all(accepts(v) for v in value):
                return None
            wanted.append(f"a list of {plural}")
        elif accepts(value):
            return None
        else:
            wanted += names
    return ", ".join(wanted[:-1]) + " or " + wanted[-1] if len(wanted) > 1 else wanted[0]


def option_rows() -> list[tuple[str, Any, str]]:
    """Every command-line key with its default and help, in the order docs/reference/settings.md lists them."""
    rows = [(row.keyword, row.default, row.help) for row in setting_rows() if row.cli and row.part is None]
    rows.append(("profile", False, _help(RunConfig, "profile")))
    rows.append(("tune", False, _help(RunConfig, "tune")))
    rows.append(("logger", "tensorboard", _help(RunConfig, "logger")))
    for group, kind in _groups().items():
        for f in fields(kind):
            rows.append((f"{group}.{f.name}", default_of(f), f.metadata["help"]))
    return rows


def _help(kind: type, name: str) -> str:
    return next(f.metadata["help"] for f in fields(kind) if f.name == name)


# Where the command line's default differs from the Trainer's: (as the docs show it, as the YAML sets it).
CLI_DEFAULTS = {"checkpoint.dir": ("<output dir>/checkpoints", "${hydra:runtime.output_dir}/checkpoints")}


def yaml_value(value: Any) -> str:
    """A default as YAML writes it (null, true, [1, 2])."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(yaml_value(v) for v in value) + "]"
    return str(value)


def options_markdown() -> str:
    """The command line's options table (docs/reference/settings.md), generated from the help texts above."""
    lines = ["| key | default | meaning |", "|---|---|---|"]
    for key, default, help_text in option_rows():
        shown = CLI_DEFAULTS[key][0] if key in CLI_DEFAULTS else yaml_value(default)
        lines.append(f"| `{key}` | `{shown}` | {help_text} |")
    return "\n".join(lines)


def help_text(groups: dict[str, list[str]], width: int = 100) -> str:
    """``python -m sn_trainer --help``: every key, its default and what it does; then the groups."""
    import textwrap

    lines = ["usage: python -m sn_trainer [key=value ...]        one run",
             "       python -m sn_trainer --multirun key=a,b ...  a sweep, one job per combination", "",
             "Trains on every physical core of this machine (see README.md). Settings, as key (default): meaning", ""]
    for key, default, text in option_rows():
        shown = CLI_DEFAULTS[key][0] if key in CLI_DEFAULTS else yaml_value(default)
        lines += textwrap.wrap(f"{key} (default {shown}): {text.replace('`', '')}", width,
                               initial_indent="  ", subsequent_indent="      ", break_on_hyphens=False)
    lines += ["", "Config groups (choose one with group=option; each sets the group's keys above):"]
    lines += [f"  {group}: {', '.join(options)}" for group, options in groups.items()]
    lines += ["", "Hydra's own options (--cfg job, -m, hydra.run.dir=...): python -m sn_trainer --hydra-help"]
    return "\n".join(lines)
