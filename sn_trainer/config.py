"""Typed, validated settings: what the Trainer takes, and what the command line composes."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

# Which collective turns the workers' gradients into each worker's summed shard (engine/comm.py).
# all_reduce measured faster than gloo's reduce_scatter on the development machine (LeNet's
# 1.7 MB gradient, 2 workers: ~3.6 ms vs ~8.5 ms), so it is the default; both stay selectable.
REDUCE_MODES = ("all_reduce", "reduce_scatter")
COMMS = ("auto", "shm", "gloo")
PRECISIONS = ("fp32", "bf16")


class ConfigError(ValueError):
    """A setting is wrong; the message says which, and how to fix it."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


@dataclass
class TrainerConfig:
    """How the engine trains; the Trainer's keyword arguments."""

    workers: int | str = "auto"
    """Worker processes; "auto" = physical cores // threads."""
    threads: int = 1
    """Intra-op threads per worker, each on a physical core of its own."""
    batch_size: int = 64
    """Global batch per micro-step, split across the workers."""
    epochs: int = 1
    """Passes over the training set (ignored when max_steps is set)."""
    max_steps: int | None = None
    """Optimizer steps to run; when set, it decides the length of the run."""
    seed: int = 0
    """Decides the sample order and each worker's random state."""
    accumulate: int = 1
    """Micro-batches per optimizer step: the step's batch is batch_size x accumulate."""
    clip_grad_norm: float | None = None
    """Clip the averaged gradient to this global L2 norm (over all shards)."""
    comm: str = "auto"
    """How gradients are summed: shm (shared memory), gloo, or auto (measures both, keeps the faster)."""
    reduce: str = "all_reduce"
    """gloo's collective: all_reduce or reduce_scatter."""
    bucket_kb: int = 256
    """With gloo's all_reduce, gradients leave in buckets of about this many KiB while the backward
    pass computes the rest; 0 sends them in one piece after it. 256 lets LeNet's fully connected
    layers (1.6 MB) travel while its convolutions run backward."""
    precision: str = "fp32"
    """fp32, or bf16: autocast to bfloat16 for compute, parameters and gradients stay fp32."""
    channels_last: bool | str = "auto"
    """Lay out 4-d weights and inputs channels-last (oneDNN's preferred format for convolutions);
    auto: on for models with 4-d (convolution) weights."""
    log_every: int = 50
    """Report loss and samples/s every this many optimizer steps."""
    eval_batch_size: int = 512
    """Samples per forward pass in evaluation, per worker."""
    measure_after: int = 0
    """Warm-up steps left out of samples/s, phase seconds and CPU utilisation."""
    profile_dir: str | None = None
    """When set, each worker writes a torch.profiler Chrome trace of profile_steps steps here."""
    profile_steps: int = 3
    """Steps traced by the profiler, from the end of the warm-up."""
    checkpoint_dir: str | None = None
    """Where checkpoints go; none are written without it."""
    checkpoint_every_steps: int | None = None
    """Checkpoint every this many optimizer steps (besides the last step and a stop by signal)."""
    checkpoint_every_epochs: int | None = None
    """Checkpoint every this many epochs."""
    checkpoint_keep: int = 3
    """Keep the last this many checkpoints."""
    resume: str | None = None
    """Continue from a checkpoint: "latest" (in checkpoint_dir), a checkpoint directory, or a file."""
    max_restarts: int = 0
    """When a worker dies, restart all from the last checkpoint up to this many times."""
    on_nan: str = "stop"
    """A non-finite loss or gradient: stop (naming the step), or skip that update and count it."""

    def __post_init__(self) -> None:
        if isinstance(self.workers, str):
            _require(self.workers == "auto", f"workers must be a positive integer or 'auto', got {self.workers!r}")
        else:
            _require(_is_int(self.workers) and self.workers >= 1,
                     f"workers must be >= 1 (or 'auto'), got {self.workers!r}")
        _require(_is_int(self.threads) and self.threads >= 1, f"threads must be >= 1, got {self.threads!r}")
        _require(_is_int(self.batch_size) and self.batch_size >= 1,
                 f"batch_size must be >= 1, got {self.batch_size!r}")
        if _is_int(self.workers):
            _require(self.batch_size >= self.workers,
                     f"batch_size={self.batch_size} is smaller than workers={self.workers}: every worker needs "
                     f"at least one sample; raise batch_size or lower workers")
        _require(_is_int(self.epochs) and self.epochs >= 1, f"epochs must be >= 1, got {self.epochs!r}")
        _require(self.max_steps is None or (_is_int(self.max_steps) and self.max_steps >= 1),
                 f"max_steps must be >= 1 or null, got {self.max_steps!r}")
        _require(_is_int(self.seed) and self.seed >= 0, f"seed must be a non-negative integer, got {self.seed!r}")
        _require(_is_int(self.accumulate) and self.accumulate >= 1,
                 f"accumulate must be >= 1, got {self.accumulate!r}")
        _require(self.clip_grad_norm is None or self.clip_grad_norm > 0,
                 f"clip_grad_norm must be > 0 or null, got {self.clip_grad_norm!r}")
        _require(self.comm in COMMS, f"comm must be one of {', '.join(COMMS)}, got {self.comm!r}")
        _require(self.precision in PRECISIONS,
                 f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        _require(isinstance(self.channels_last, bool) or self.channels_last == "auto",
                 f"channels_last must be true, false or auto, got {self.channels_last!r}")
        _require(_is_int(self.bucket_kb) and self.bucket_kb >= 0, f"bucket_kb must be >= 0, got {self.bucket_kb!r}")
        _require(self.reduce in REDUCE_MODES, f"reduce must be one of {', '.join(REDUCE_MODES)}, got {self.reduce!r}")
        _require(_is_int(self.log_every) and self.log_every >= 1, f"log_every must be >= 1, got {self.log_every!r}")
        _require(_is_int(self.eval_batch_size) and self.eval_batch_size >= 1,
                 f"eval_batch_size must be >= 1, got {self.eval_batch_size!r}")
        _require(_is_int(self.measure_after) and self.measure_after >= 0,
                 f"measure_after must be >= 0, got {self.measure_after!r}")
        _require(_is_int(self.profile_steps) and self.profile_steps >= 1,
                 f"profile_steps must be >= 1, got {self.profile_steps!r}")
        for key in ("checkpoint_every_steps", "checkpoint_every_epochs"):
            value = getattr(self, key)
            _require(value is None or (_is_int(value) and value >= 1), f"{key} must be >= 1 or null, got {value!r}")
        _require(_is_int(self.checkpoint_keep) and self.checkpoint_keep >= 1,
                 f"checkpoint_keep must be >= 1, got {self.checkpoint_keep!r}")
        _require(_is_int(self.max_restarts) and self.max_restarts >= 0,
                 f"max_restarts must be >= 0, got {self.max_restarts!r}")
        _require(self.on_nan in ("stop", "skip"), f"on_nan must be stop or skip, got {self.on_nan!r}")
        _require(self.resume is None or isinstance(self.resume, str),
                 f"resume must be latest, a directory or a file, got {self.resume!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class ModelConfig:
    name: str = "lenet"
    """lenet, cifar10_quick, mlp, or any torchvision classification model (resnet18...)."""
    hidden: list[int] | None = None
    """mlp only: sizes of the hidden layers."""

    def __post_init__(self) -> None:
        _require(isinstance(self.name, str) and bool(self.name), "model.name must be a non-empty string")
        _require(self.hidden is None or (self.name == "mlp" and all(_is_int(h) and h > 0 for h in self.hidden)),
                 f"model.hidden applies to model=mlp only, as positive sizes; got {self.hidden!r} for {self.name}")


@dataclass
class DatasetConfig:
    name: str = "fashion_mnist"
    """fashion_mnist, mnist, cifar10, synthetic or folder."""
    root: str | None = None
    """Where the files are (or go, with download=true)."""
    download: bool = False
    """Let torchvision download the dataset into root when it is not found (needs internet)."""
    augment: bool | None = None
    """Random crop + flip; default: on for cifar10 only."""
    shape: list[int] = field(default_factory=lambda: [1, 28, 28])
    """synthetic: [C, H, W] of the images."""
    num_classes: int = 10
    """synthetic: number of classes."""
    train_size: int = 8192
    """synthetic: training samples."""
    test_size: int = 1024
    """synthetic: test samples."""
    image_size: int = 32
    """folder: images are resized to image_size x image_size."""
    test_fraction: float = 0.1
    """folder without train/ and test/ sub-folders: share held out for testing."""
    seed: int = 0
    """synthetic data and the folder split."""

    def __post_init__(self) -> None:
        _require(_is_int(self.train_size) and self.train_size >= 1, "dataset.train_size must be >= 1")
        _require(_is_int(self.test_size) and self.test_size >= 1, "dataset.test_size must be >= 1")
        _require(_is_int(self.image_size) and self.image_size >= 1, "dataset.image_size must be >= 1")
        _require(0 < self.test_fraction < 1, f"dataset.test_fraction must be in (0, 1), got {self.test_fraction}")


SCHEDULES = ("constant", "cosine", "step")


@dataclass
class OptimConfig:
    name: str = "sgd"
    """sgd or adamw."""
    lr: float = 0.02
    """Base learning rate (before scale_lr)."""
    momentum: float = 0.9
    """sgd only."""
    nesterov: bool = False
    """sgd only."""
    weight_decay: float = 5e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """adamw only."""
    schedule: str = "cosine"
    """constant, cosine (to zero at the last step) or step (times gamma every step_every steps)."""
    warmup_steps: int = 0
    """Linear warm-up from lr/warmup_steps to lr over this many steps, before the schedule."""
    step_every: int = 1000
    """step schedule: optimizer steps between decays."""
    gamma: float = 0.1
    """step schedule: decay factor."""
    scale_lr: bool = False
    """Linear scaling rule: lr = base lr x (batch_size x accumulate) / reference_batch."""
    reference_batch: int = 256

    def __post_init__(self) -> None:
        _require(self.name in ("sgd", "adamw"), f"unknown optimizer {self.name!r}; choose one of sgd, adamw")
        _require(isinstance(self.lr, (int, float)) and self.lr > 0, f"optim.lr must be > 0, got {self.lr!r}")
        _require(self.momentum >= 0, f"optim.momentum must be >= 0, got {self.momentum}")
        _require(not self.nesterov or self.momentum > 0, "optim.nesterov=true needs optim.momentum > 0")
        _require(self.weight_decay >= 0, f"optim.weight_decay must be >= 0, got {self.weight_decay}")
        _require(self.schedule in SCHEDULES, f"unknown schedule {self.schedule!r}; choose one of {', '.join(SCHEDULES)}")
        _require(_is_int(self.warmup_steps) and self.warmup_steps >= 0, "optim.warmup_steps must be >= 0")
        _require(_is_int(self.step_every) and self.step_every >= 1, "optim.step_every must be >= 1")
        _require(0 < self.gamma <= 1, f"optim.gamma must be in (0, 1], got {self.gamma}")
        _require(_is_int(self.reference_batch) and self.reference_batch >= 1, "optim.reference_batch must be >= 1")


@dataclass
class BenchConfig:
    enabled: bool = False
    """Benchmark mode: no evaluation; time bench.steps optimizer steps after bench.warmup."""
    steps: int = 30
    warmup: int = 5
    skip_oversubscribed: bool = False
    """Skip (quickly, writing why) a job whose workers x threads exceed the physical cores."""

    def __post_init__(self) -> None:
        _require(_is_int(self.steps) and self.steps >= 1, f"bench.steps must be >= 1, got {self.steps!r}")
        _require(_is_int(self.warmup) and self.warmup >= 0, f"bench.warmup must be >= 0, got {self.warmup!r}")


@dataclass
class CheckpointConfig:
    dir: str | None = None
    """Where this run's checkpoints go (default: checkpoints/ in the run's output directory)."""
    every_steps: int | None = None
    every_epochs: int | None = 1
    keep: int = 3


@dataclass
class RunConfig:
    """One command-line run: the trainer's settings at the top level, plus what to train."""

    trainer: TrainerConfig
    model: ModelConfig
    dataset: DatasetConfig
    optim: OptimConfig
    bench: BenchConfig = field(default_factory=BenchConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    profile: bool = False
    """Write a torch.profiler trace of a few steps per worker into the output directory."""

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "RunConfig":
        """Build from a plain dict (Hydra's resolved config); unknown keys are errors."""
        raw = dict(raw)
        sections = {"model": ModelConfig, "dataset": DatasetConfig, "optim": OptimConfig, "bench": BenchConfig,
                    "checkpoint": CheckpointConfig}
        parts = {key: _build(kind, raw.pop(key, None) or {}, key) for key, kind in sections.items()}
        raw.pop("hydra", None)
        profile = raw.pop("profile", False)
        _require(isinstance(profile, bool), f"profile must be true or false, got {profile!r}")
        for key in [k for k in raw if k.startswith("checkpoint_")]:
            raise ConfigError(f"unknown setting {key}; use checkpoint.{key[len('checkpoint_'):]}")
        ckpt = parts["checkpoint"]
        trainer = _build(TrainerConfig, {**raw, "checkpoint_dir": ckpt.dir, "checkpoint_every_steps": ckpt.every_steps,
                                         "checkpoint_every_epochs": ckpt.every_epochs,
                                         "checkpoint_keep": ckpt.keep}, None)
        return cls(trainer=trainer, profile=profile, **parts)


def _build(kind: type, values: dict[str, Any], prefix: str | None):
    known = {f.name for f in fields(kind)}
    unknown = sorted(set(values) - known)
    if unknown:
        where = f"{prefix}." if prefix else ""
        # checkpoint_* are set through the checkpoint.* section on the command line
        shown = sorted({k if not k.startswith("checkpoint_") else "checkpoint.*" for k in known})
        raise ConfigError(f"unknown setting {where}{unknown[0]}; valid ones: {', '.join(where + k for k in shown)}")
    try:
        return kind(**values)
    except TypeError as exc:
        raise ConfigError(f"bad setting: {exc}") from None
