"""Typed, validated settings: each option's default and help live here, once.

The Trainer takes ``TrainerConfig``'s fields as keyword arguments; the command line composes
``RunConfig`` (the same fields at the top level, plus what to train). The shipped YAML and the
README's options table are checked against these defaults and help texts by the tests.
"""
from __future__ import annotations

import copy
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from .engine import runtime
from .errors import ConfigError

REDUCE_MODES = ("all_reduce", "reduce_scatter")
COMMS = ("auto", "shm", "gloo")
PRECISIONS = ("fp32", "bf16")
SHARDS = ("auto", "elements", "tensors", "full")
START_METHODS = ("forkserver", "spawn")
ALLOCATORS = (*runtime.ALLOCATORS, "auto")  # auto: what tuning measured fastest
OPENMPS = (*runtime.OPENMPS, "auto")
SCHEDULES = ("constant", "cosine", "step")
LOGGERS = ("none", "tensorboard", "mlflow")

__all__ = ["ConfigError", "TrainerConfig", "RunConfig", "ModelConfig", "DatasetConfig", "OptimConfig",
           "BenchConfig", "CheckpointConfig", "option_rows"]


def option(default: Any, help: str, cli: bool = True):
    """A dataclass field with its help text; ``cli=False``: an API-only setting."""
    metadata = {"help": help, "cli": cli}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(value: Any, name: str, minimum: int = 1, nullable: bool = False) -> None:
    if nullable and value is None:
        return
    _require(_is_int(value) and value >= minimum,
             f"{name} must be >= {minimum}{' or null' if nullable else ''}, got {value!r}")


def _one_of(value: Any, name: str, choices: tuple[str, ...]) -> None:
    _require(value in choices, f"{name} must be one of {', '.join(choices)}, got {value!r}")


@dataclass
class TrainerConfig:
    """How the engine trains: the Trainer's keyword arguments, and the command line's top-level keys."""

    batch_size: int = option(64, "global batch per micro-step, split across the workers (and nodes)")
    workers: int | str = option("auto", "worker processes; `auto` = physical cores // threads (the cores a "
                                        "container's CPU quota and cpuset allow)")
    threads: int = option(1, "intra-op threads per worker, each on a physical core of its own")
    epochs: int = option(8, "passes over the training set (ignored when max_steps is set)")
    max_steps: int | None = option(None, "when set, stop after this many optimizer steps")
    seed: int = option(0, "decides the sample order and each worker's random state")
    accumulate: int = option(1, "micro-batches per optimizer step: a step trains on batch_size x accumulate samples")
    drop_last: bool = option(True, "leave out the last, incomplete global batch of each epoch; `false` trains it too, "
                                   "exactly (each worker weighs its real share)")
    clip_grad_norm: float | None = option(None, "clip the averaged gradient to this global L2 norm (over all shards)")
    comm: str = option("auto", "how gradients are summed: `shm` (shared memory), `gloo`, or `auto` (times both at "
                               "start-up, keeps the faster; summary.json says which ran)")
    reduce: str = option("all_reduce", "gloo's collective: `all_reduce` or `reduce_scatter` (elementwise shards only)")
    bucket_kb: int = option(256, "with gloo's all_reduce, gradients leave in buckets of about this many KiB while the "
                                 "backward pass computes the rest (like DDP's); 0 sends them in one piece after it")
    precision: str = option("fp32", "`bf16`: autocast to bfloat16, fp32 master weights (fp32 where the CPU has no "
                                    "native bf16; summary.json says which ran)")
    channels_last: bool | str = option("auto", "NHWC layout for 4-d weights and inputs (oneDNN's preferred format); "
                                               "`auto`: on for conv nets without batch norm")
    shards: str = option("auto", "how the optimizer's work is split: `elements` (any slice; elementwise optimizers "
                                 "such as SGD and Adam), `tensors` (whole tensors, for optimizers that look at one "
                                 "tensor at a time, such as Adafactor), `full` (one worker steps the whole optimizer: "
                                 "exact for any, such as Lamb), or `auto` (elements or tensors for the optimizers "
                                 "tests prove so, else full)")
    sync_batchnorm: bool = option(False, "batch norm statistics over the global batch (exact), instead of each "
                                         "worker's slice (like DDP)")
    ema_decay: float | None = option(None, "keep an exponential moving average of the weights (ema = d x ema + (1 - "
                                           "d) x weights after every step, each worker averaging its shard); "
                                           "evaluation then also reports eval_ema_*")
    start_method: str = option("forkserver", "how workers start: `forkserver` (warm: forked from a server that "
                                             "has imported torch once per process) or `spawn` (a fresh interpreter "
                                             "each)")
    allocator: str = option("system", "the workers' memory allocator: `system` (the C library's), `jemalloc`, "
                                      "`tcmalloc`, or `auto` (what tuning measured fastest for this model, else "
                                      "system)")
    openmp: str = option("gnu", "the workers' OpenMP runtime: `gnu` (torch's own), `intel` (libiomp5 from the "
                                "intel-openmp package, preloaded), or `auto` (what tuning measured fastest for this "
                                "model, else gnu)")
    compile: bool | str = option(False, "torch.compile the model in each worker (inductor; the workers share its "
                                        "cache): `true`, `false`, or `auto` (what tuning measured faster for this "
                                        "model, else false); the compile time is reported apart (compile_seconds)")
    prefetch: bool | str = option("auto", "each worker reads the next step's slice in a thread while this step "
                                          "computes; `auto`: where reading draws no global random numbers")
    log_every: int = option(100, "optimizer steps between progress records")
    eval_batch_size: int = option(512, "samples per forward pass in evaluation, per worker")
    eval_every: int | None = option(None, "evaluate every this many optimizer steps (and after the last) instead of "
                                          "after each epoch")
    max_eval_batches: int | None = option(None, "evaluate on the first max_eval_batches x eval_batch_size samples of "
                                                "the evaluation set only (all of it when null)")
    measure_after: int = option(0, "warm-up steps left out of samples/s, phase seconds and CPU use", cli=False)
    profile_dir: str | None = option(None, "when set, each worker writes a torch.profiler Chrome trace of "
                                           "profile_steps steps here", cli=False)
    profile_steps: int = option(3, "steps traced by the profiler, from the end of the warm-up", cli=False)
    checkpoint_dir: str | None = option(None, "where checkpoints go; none are written without it")
    checkpoint_every_steps: int | None = option(None, "also checkpoint every this many optimizer steps")
    checkpoint_every_epochs: int | None = option(1, "checkpoint every this many epochs (and after the last step, and "
                                                    "when a signal stops the run)")
    checkpoint_keep: int = option(3, "keep the last this many checkpoints")
    resume: str | None = option(None, "continue from a checkpoint: `latest` (in the checkpoint directory), a "
                                      "checkpoint directory, or a file")
    resume_strict: bool = option(True, "refuse to resume with another batch_size, accumulate, seed, drop_last or "
                                       "training-set size (`false`: a warning)")
    max_restarts: int = option(0, "when a worker dies or hangs, restart all from the last checkpoint, up to this "
                                  "many times")
    worker_timeout: float = option(300.0, "seconds a worker may go without progress before the run ends, naming it")
    on_nan: str = option("stop", "a non-finite loss or gradient: `stop` (naming the step) or `skip` that update")

    def __post_init__(self) -> None:
        if isinstance(self.workers, str):
            _require(self.workers == "auto", f"workers must be a positive integer or 'auto', got {self.workers!r}")
        else:
            _require(_is_int(self.workers) and self.workers >= 1,
                     f"workers must be >= 1 (or 'auto'), got {self.workers!r}")
        _positive_int(self.threads, "threads")
        _positive_int(self.batch_size, "batch_size")
        _positive_int(self.epochs, "epochs")
        _positive_int(self.max_steps, "max_steps", nullable=True)
        _require(_is_int(self.seed) and self.seed >= 0, f"seed must be a non-negative integer, got {self.seed!r}")
        _positive_int(self.accumulate, "accumulate")
        _require(isinstance(self.drop_last, bool), f"drop_last must be true or false, got {self.drop_last!r}")
        _require(self.clip_grad_norm is None or self.clip_grad_norm > 0,
                 f"clip_grad_norm must be > 0 or null, got {self.clip_grad_norm!r}")
        _one_of(self.comm, "comm", COMMS)
        _one_of(self.precision, "precision", PRECISIONS)
        _one_of(self.shards, "shards", SHARDS)
        _one_of(self.start_method, "start_method", START_METHODS)
        _one_of(self.allocator, "allocator", ALLOCATORS)
        _one_of(self.openmp, "openmp", OPENMPS)
        _require(isinstance(self.channels_last, bool) or self.channels_last == "auto",
                 f"channels_last must be true, false or auto, got {self.channels_last!r}")
        _require(isinstance(self.compile, bool) or self.compile == "auto",
                 f"compile must be true, false or auto, got {self.compile!r}")
        _require(isinstance(self.prefetch, bool) or self.prefetch == "auto",
                 f"prefetch must be true, false or auto, got {self.prefetch!r}")
        _require(isinstance(self.sync_batchnorm, bool),
                 f"sync_batchnorm must be true or false, got {self.sync_batchnorm!r}")
        _positive_int(self.bucket_kb, "bucket_kb", minimum=0)
        _require(self.ema_decay is None or (isinstance(self.ema_decay, (int, float))
                                            and not isinstance(self.ema_decay, bool) and 0 < self.ema_decay < 1),
                 f"ema_decay must be between 0 and 1 (e.g. 0.999) or null, got {self.ema_decay!r}")
        _positive_int(self.eval_every, "eval_every", nullable=True)
        _positive_int(self.max_eval_batches, "max_eval_batches", nullable=True)
        _one_of(self.reduce, "reduce", REDUCE_MODES)
        _positive_int(self.log_every, "log_every")
        _positive_int(self.eval_batch_size, "eval_batch_size")
        _positive_int(self.measure_after, "measure_after", minimum=0)
        _positive_int(self.profile_steps, "profile_steps")
        _positive_int(self.checkpoint_every_steps, "checkpoint_every_steps", nullable=True)
        _positive_int(self.checkpoint_every_epochs, "checkpoint_every_epochs", nullable=True)
        _positive_int(self.checkpoint_keep, "checkpoint_keep")
        _positive_int(self.max_restarts, "max_restarts", minimum=0)
        _require(isinstance(self.worker_timeout, (int, float)) and not isinstance(self.worker_timeout, bool)
                 and self.worker_timeout > 0, f"worker_timeout must be > 0 seconds, got {self.worker_timeout!r}")
        _one_of(self.on_nan, "on_nan", ("stop", "skip"))
        _require(self.resume is None or isinstance(self.resume, str),
                 f"resume must be latest, a directory or a file, got {self.resume!r}")
        _require(isinstance(self.resume_strict, bool), f"resume_strict must be true or false, got {self.resume_strict!r}")


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
        _require(isinstance(self.name, str) and bool(self.name), "model.name must be a non-empty string")
        _require(self.hidden is None or (self.name == "mlp" and all(_is_int(h) and h > 0 for h in self.hidden)),
                 f"model.hidden applies to model=mlp only, as positive sizes; got {self.hidden!r} for {self.name}")
        for key in ("n_layer", "n_head", "n_embd"):
            _positive_int(getattr(self, key), f"model.{key}")
        _require(self.n_embd % self.n_head == 0,
                 f"model.n_embd={self.n_embd} must be a multiple of model.n_head={self.n_head}")
        _require(0 <= self.dropout < 1, f"model.dropout must be in [0, 1), got {self.dropout!r}")


@dataclass
class DatasetConfig:
    name: str = option("fashion_mnist", "`fashion_mnist`, `mnist`, `cifar10`, `synthetic`, `folder` or `text`")
    root: str | None = option(None, "where the files are (or go, with download=true)")
    path: str | None = option(None, "text: a UTF-8 text file, or a folder of them")
    tokenizer: str = option("char", "text: `char` (one token per character) or `gpt2` (tiktoken's BPE)")
    block_size: int = option(64, "text: tokens per training window (the model's context)")
    download: bool = option(False, "let torchvision download the dataset into root when it is not found "
                                   "(needs internet)")
    augment: bool | None = option(None, "random crop and flip; default: on for cifar10 only")
    shape: list[int] = option([1, 28, 28], "synthetic: [C, H, W] of the images")
    num_classes: int = option(10, "synthetic: number of classes")
    train_size: int = option(8192, "synthetic: training samples")
    test_size: int = option(1024, "synthetic: test samples")
    image_size: int = option(32, "folder: images are resized to image_size x image_size")
    preload: bool = option(False, "folder: decode every image into memory up front (`false`: each worker reads, "
                                  "decodes and augments its samples from the files as it trains)")
    test_fraction: float = option(0.1, "folder without train/ and test/, and text: the share held out for testing "
                                       "(text: its tail)")
    seed: int = option(0, "synthetic data and the folder split")

    def __post_init__(self) -> None:
        _positive_int(self.train_size, "dataset.train_size")
        _positive_int(self.test_size, "dataset.test_size")
        _positive_int(self.image_size, "dataset.image_size")
        _positive_int(self.block_size, "dataset.block_size")
        _require(0 < self.test_fraction < 1, f"dataset.test_fraction must be in (0, 1), got {self.test_fraction}")


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
        _require(self.name in ("sgd", "adamw"), f"unknown optimizer {self.name!r}; choose one of sgd, adamw")
        _require(isinstance(self.lr, (int, float)) and self.lr > 0, f"optim.lr must be > 0, got {self.lr!r}")
        _require(self.momentum >= 0, f"optim.momentum must be >= 0, got {self.momentum}")
        _require(not self.nesterov or self.momentum > 0, "optim.nesterov=true needs optim.momentum > 0")
        _require(self.weight_decay >= 0, f"optim.weight_decay must be >= 0, got {self.weight_decay}")
        _require(self.schedule in SCHEDULES, f"unknown schedule {self.schedule!r}; choose one of {', '.join(SCHEDULES)}")
        _positive_int(self.warmup_steps, "optim.warmup_steps", minimum=0)
        _positive_int(self.step_every, "optim.step_every")
        _require(0 < self.gamma <= 1, f"optim.gamma must be in (0, 1], got {self.gamma}")
        _positive_int(self.reference_batch, "optim.reference_batch")


@dataclass
class BenchConfig:
    enabled: bool = option(False, "benchmark mode: no evaluation, time bench.steps optimizer steps after "
                                  "bench.warmup")
    steps: int = option(30, "benchmark mode: measured steps")
    warmup: int = option(5, "benchmark mode: steps before measuring")
    skip_oversubscribed: bool = option(False, "skip (at once, writing why) a job whose workers x threads exceed the "
                                              "physical cores")

    def __post_init__(self) -> None:
        _positive_int(self.steps, "bench.steps")
        _positive_int(self.warmup, "bench.warmup", minimum=0)


@dataclass
class CheckpointConfig:
    """The command line's checkpoint.* keys; they become the Trainer's checkpoint_* settings."""

    dir: str | None = option(None, "where this run's checkpoints go (the command line's default: checkpoints/ in "
                                   "the run's output directory)")
    every_steps: int | None = option(None, "also checkpoint every this many optimizer steps")
    every_epochs: int | None = option(1, "checkpoint every this many epochs (and after the last step, and when a "
                                         "signal stops the run)")
    keep: int = option(3, "keep the last this many checkpoints")


# The command line's checkpoint.<key> is the Trainer's checkpoint_<key>.
_CHECKPOINT_KEYS = {f"checkpoint_{f.name}": f.name for f in fields(CheckpointConfig)}


@dataclass
class RunConfig:
    """One command-line run: the trainer's settings at the top level, plus what to train."""

    trainer: TrainerConfig
    model: ModelConfig
    dataset: DatasetConfig
    optim: OptimConfig
    bench: BenchConfig = field(default_factory=BenchConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    profile: bool = option(False, "write a torch.profiler trace of a few steps per worker into the output directory")
    tune: bool = option(False, "first measure which workers x threads (and runtime) trains this model and batch "
                               "fastest here, print the table, then train with it; the choice is cached for "
                               "workers=auto")
    logger: str | list[str] = option("tensorboard", "`tensorboard`: loss, lr, speed, milliseconds per phase, "
                                                    "per-core CPU and evaluation as TensorBoard events in the output "
                                                    "directory, written by the launcher; `mlflow`: params, the same "
                                                    "metrics and the summary as an MLflow run (MLFLOW_TRACKING_URI, "
                                                    "else mlflow.db beside the run or sweep); a list such as "
                                                    "`[tensorboard,mlflow]`; `none`")

    SECTIONS = {"model": ModelConfig, "dataset": DatasetConfig, "optim": OptimConfig, "bench": BenchConfig,
                "checkpoint": CheckpointConfig}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "RunConfig":
        """Build from a plain dict (Hydra's resolved config); unknown keys are errors."""
        raw = dict(raw)
        parts = {key: _build(kind, raw.pop(key, None) or {}, key) for key, kind in cls.SECTIONS.items()}
        raw.pop("hydra", None)
        profile = raw.pop("profile", False)
        _require(isinstance(profile, bool), f"profile must be true or false, got {profile!r}")
        logger = raw.pop("logger", "tensorboard")
        for name in logger if isinstance(logger, list) else [logger]:
            _one_of(name, "logger", LOGGERS)
        tune = raw.pop("tune", False)
        _require(isinstance(tune, bool), f"tune must be true or false, got {tune!r}")
        for key in [k for k in raw if k in _CHECKPOINT_KEYS]:
            raise ConfigError(f"unknown setting {key}; use checkpoint.{_CHECKPOINT_KEYS[key]}")
        api_only = sorted(k for k in raw if k in _api_only_keys())
        if api_only:
            raise ConfigError(f"{api_only[0]} is a Trainer argument, not a command-line setting")
        ckpt = parts["checkpoint"]
        trainer = _build(TrainerConfig, {**raw, **{key: getattr(ckpt, name) for key, name in _CHECKPOINT_KEYS.items()}},
                         None)
        return cls(trainer=trainer, profile=profile, logger=logger, tune=tune, **parts)


def _api_only_keys() -> set[str]:
    return {f.name for f in fields(TrainerConfig) if not f.metadata.get("cli", True)}


def _build(kind: type, values: dict[str, Any], prefix: str | None):
    known = {f.name for f in fields(kind)}
    unknown = sorted(set(values) - known)
    if unknown:
        where = f"{prefix}." if prefix else ""
        shown = sorted({("checkpoint.*" if k in _CHECKPOINT_KEYS else k) for k in known if k not in _api_only_keys()})
        if prefix is None:
            shown = sorted(set(shown) | {"profile", "logger", "tune", *(f"{s}.*" for s in RunConfig.SECTIONS if s != "checkpoint")})
        raise ConfigError(f"unknown setting {where}{unknown[0]}; valid ones: {', '.join(where + k for k in shown)}")
    try:
        return kind(**values)
    except TypeError as exc:
        raise ConfigError(f"bad setting: {exc}") from None


def _default(f) -> Any:
    return f.default_factory() if f.default_factory is not MISSING else f.default


def option_rows() -> list[tuple[str, Any, str]]:
    """Every command-line key with its default and help, in the order the README lists them."""
    rows = []
    for f in fields(TrainerConfig):
        if not f.metadata.get("cli", True) or f.name in _CHECKPOINT_KEYS:
            continue
        rows.append((f.name, _default(f), f.metadata["help"]))
    rows.append(("profile", False, _help(RunConfig, "profile")))
    rows.append(("tune", False, _help(RunConfig, "tune")))
    rows.append(("logger", "tensorboard", _help(RunConfig, "logger")))
    for section, kind in RunConfig.SECTIONS.items():
        for f in fields(kind):
            rows.append((f"{section}.{f.name}", _default(f), f.metadata["help"]))
    return rows


def _help(kind: type, name: str) -> str:
    return next(f.metadata["help"] for f in fields(kind) if f.name == name)


# Where the command line's default differs from the Trainer's: (as the README shows it, as the YAML sets it).
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
    """The README's options table, generated from the help texts above."""
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
