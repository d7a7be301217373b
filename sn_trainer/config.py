"""The Trainer's settings: each one's default, help and validation, declared once, here.

``TrainerConfig`` holds every setting; a component's settings live in a part of their own
(``checkpoint: CheckpointConfig``). The Trainer takes them as one ``TrainerConfig`` or as keyword
arguments, a part's settings as ``<part>_<key>`` (``checkpoint_dir``); the command line composes
the same fields, a part as a group (``checkpoint.dir``). Standard library only: ``--help`` and
the warm workers' server read it before torch is imported.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
from collections.abc import Iterator, Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from .errors import ConfigError

REDUCE_MODES = ("all_reduce", "reduce_scatter")
PRECISIONS = ("fp32", "bf16")
SHARDS = ("auto", "elements", "tensors", "full")
START_METHODS = ("forkserver", "spawn")
ALLOCATORS = ("system", "jemalloc", "tcmalloc")  # the libraries each needs: node/runtime.py
OPENMPS = ("gnu", "intel")
SPLITS = ("exact", "like_ddp")
COMPRESSIONS = ("none", "powersgd")

__all__ = ["CheckpointConfig", "ConfigError", "TrainerConfig", "option", "part", "setting_rows"]


def option(default: Any, help: str, cli: bool = True):
    """A dataclass field with its help text; ``cli=False``: an API-only setting."""
    metadata = {"help": help, "cli": cli}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def part(kind: type, help: str):
    """A field holding a component's own settings (a dataclass of options)."""
    return field(default_factory=kind, metadata={"help": help, "part": True})


def is_part(f: dataclasses.Field) -> bool:
    return bool(f.metadata.get("part"))


def default_of(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not MISSING else f.default


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def positive_int(value: Any, name: str, minimum: int = 1, nullable: bool = False) -> None:
    if nullable and value is None:
        return
    require(is_int(value) and value >= minimum, f"{name} must be >= {minimum}{' or null' if nullable else ''}, "
                                                f"got {value!r}")


def one_of(value: Any, name: str, choices: tuple[str, ...]) -> None:
    require(value in choices, f"{name} must be one of {', '.join(choices)}, got {value!r}")


def true_false_or_auto(value: Any, name: str) -> None:
    require(isinstance(value, bool) or value == "auto", f"{name} must be true, false or auto, got {value!r}")


def boolean(value: Any, name: str) -> None:
    require(isinstance(value, bool), f"{name} must be true or false, got {value!r}")


@dataclass(frozen=True)
class CheckpointConfig:
    """Checkpoints: where they go, how often they are written, how many are kept."""

    dir: str | None = option(None, "where checkpoints go; none are written without it (the command line's default: "
                                   "checkpoints/ in the run's output directory)")
    every_steps: int | None = option(None, "also checkpoint every this many optimizer steps")
    every_epochs: int | None = option(1, "checkpoint every this many epochs (and after the last step, and when a "
                                         "signal stops the run)")
    keep: int = option(3, "keep the last this many checkpoints")

    def __post_init__(self) -> None:
        positive_int(self.every_steps, "checkpoint_every_steps", nullable=True)
        positive_int(self.every_epochs, "checkpoint_every_epochs", nullable=True)
        positive_int(self.keep, "checkpoint_keep")


@dataclass(frozen=True)
class TrainerConfig:
    """Every setting of a run: the Trainer's keyword arguments, and the command line's keys."""

    batch_size: int = option(64, "global batch per micro-step, split across the workers (and nodes)")
    workers: int | str = option("auto", "worker processes; `auto` = physical cores // threads (the cores a "
                                        "container's CPU quota and cpuset allow)")
    threads: int | str = option("auto", "intra-op threads per worker, each on a physical core of its own; `auto` = 1 "
                                        "where workers is auto, else the usable physical cores // workers (one worker "
                                        "gets the whole machine, as plain PyTorch does)")
    pin: bool | str = option("auto", "pin each worker to its physical cores: `true`, `false` (the OS places them; "
                                     "threads are still set), or `auto` (pinned unless other processes keep this "
                                     "machine's cores busy as the run starts: a pinned worker cannot move off a "
                                     "core that other work shares; the log says which and why)")
    epochs: int = option(8, "passes over the training set (ignored when max_steps is set)")
    max_steps: int | None = option(None, "when set, stop after this many optimizer steps")
    seed: int = option(0, "decides the sample order and each worker's random state")
    shuffle: bool = option(True, "read a map-style training set in an order drawn anew each epoch from (seed, epoch); "
                                 "`false`: in index order, every epoch (a stream is read in its own order either way)")
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
    split: str = option("exact", "how a scalar loss is split over the workers: `exact` (a per-sample mean, a sum or "
                                 "(loss_sum, count), weighed exactly; any other loss is refused where the batch is "
                                 "split) or `like_ddp` (a loss with no exact split, such as a detector's, is weighed "
                                 "as DDP weighs it: each worker's mean, averaged over the workers; like DDP, not "
                                 "exact)")
    verify_every: int = option(100, "where the batch is split, compare a step with what one process computes on the "
                                    "same global batch (loss, gradients, buffers, the optimizer's update) at steps 1, "
                                    "2, 4, ... below this, every this many steps and the last: a step that differs "
                                    "stops the run (with split=like_ddp, relabels it like DDP); `0`: never (the run is "
                                    "labelled unverified)")
    compress: str = option("none", "between nodes only: `powersgd` sends each shard's gradient as low-rank factors "
                                   "with error feedback (approximate; summary.json says so), `none` sends it whole "
                                   "(exact)")
    compress_rank: int = option(2, "with compress=powersgd, the rank of the factors (1 to 4 are typical); a matrix "
                                   "whose smaller side is at most this goes uncompressed")
    compress_after: int = option(10, "with compress=powersgd, optimizer steps sent uncompressed (exact) first")
    sync_batchnorm: bool = option(False, "batch norm statistics over the global batch (exact), instead of each "
                                         "worker's slice (like DDP)")
    ema_decay: float | None = option(None, "keep an exponential moving average of the weights (ema = d x ema + (1 - "
                                           "d) x weights after every step, each worker averaging its shard); "
                                           "evaluation then also reports eval_ema_*")
    start_method: str = option("forkserver", "how workers start: `forkserver` (warm: forked from a server that "
                                             "has imported torch once per process) or `spawn` (a fresh interpreter "
                                             "each)")
    allocator: str = option("system", "the workers' memory allocator: `system` (the C library's; glibc's keeps what a "
                                      "step freed for the next instead of giving it back to the kernel), "
                                      "`jemalloc`, `tcmalloc`, or `auto` (what tuning measured fastest for this "
                                      "model, else system)")
    openmp: str = option("gnu", "the workers' OpenMP runtime: `gnu` (torch's own), `intel` (libiomp5 from the "
                                "intel-openmp package, preloaded), or `auto` (what tuning measured fastest for this "
                                "model, else gnu)")
    compile: bool | str = option(False, "torch.compile the model in each worker (inductor; the workers share its "
                                        "cache): `true`, `false`, or `auto` (what tuning measured faster for this "
                                        "model, else false); the compile time is reported apart (compile_seconds)")
    prefetch: bool | str = option("auto", "each worker reads the next step's slice in a thread while this step "
                                          "computes; `auto`: where reading draws no global random numbers, "
                                          "each worker has one thread and there are several workers")
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
    checkpoint: CheckpointConfig = part(CheckpointConfig, "checkpoints: where, how often, how many")
    resume: str | None = option(None, "continue from a checkpoint: `latest` (in the checkpoint directory), a "
                                      "checkpoint directory, or a file")
    resume_strict: bool = option(True, "refuse to resume with another batch_size, accumulate, seed, shuffle, "
                                       "drop_last or training-set size (`false`: a warning)")
    max_restarts: int = option(0, "when a worker dies or hangs, restart all from the last checkpoint, up to this "
                                  "many times")
    rewarmup_steps: int = option(0, "after the nodes or workers change (an elastic restart, a resume at another "
                                    "size), ramp the learning rate linearly again over this many steps")
    worker_timeout: float = option(300.0, "seconds a worker may go without progress before the run ends, naming it")
    on_nan: str = option("stop", "a non-finite loss or gradient: `stop` (naming the step) or `skip` that update")

    def __post_init__(self) -> None:
        for name in ("workers", "threads"):
            value = getattr(self, name)
            if isinstance(value, str):
                require(value == "auto", f"{name} must be a positive integer or 'auto', got {value!r}")
            else:
                require(is_int(value) and value >= 1, f"{name} must be >= 1 (or 'auto'), got {value!r}")
        for name in ("batch_size", "epochs", "accumulate", "log_every", "eval_batch_size", "profile_steps"):
            positive_int(getattr(self, name), name)
        for name in ("max_steps", "eval_every", "max_eval_batches"):
            positive_int(getattr(self, name), name, nullable=True)
        for name in ("bucket_kb", "measure_after", "max_restarts", "rewarmup_steps", "compress_after", "verify_every"):
            positive_int(getattr(self, name), name, minimum=0)
        require(is_int(self.seed) and self.seed >= 0, f"seed must be a non-negative integer, got {self.seed!r}")
        for name in ("shuffle", "drop_last", "sync_batchnorm", "resume_strict"):
            boolean(getattr(self, name), name)
        for name in ("channels_last", "compile", "prefetch", "pin"):
            true_false_or_auto(getattr(self, name), name)
        clip = self.clip_grad_norm
        require(clip is None or (isinstance(clip, (int, float)) and not isinstance(clip, bool) and clip > 0),
                f"clip_grad_norm must be > 0 or null, got {self.clip_grad_norm!r}")
        # comm names a reducer: the registry (engine/collectives/registry.py) knows them; the placement checks it.
        require(isinstance(self.comm, str) and bool(self.comm), f"comm must name a reducer, got {self.comm!r}")
        one_of(self.precision, "precision", PRECISIONS)
        one_of(self.shards, "shards", SHARDS)
        one_of(self.split, "split", SPLITS)
        one_of(self.start_method, "start_method", START_METHODS)
        one_of(self.allocator, "allocator", (*ALLOCATORS, "auto"))
        one_of(self.openmp, "openmp", (*OPENMPS, "auto"))
        one_of(self.reduce, "reduce", REDUCE_MODES)
        one_of(self.on_nan, "on_nan", ("stop", "skip"))
        one_of(self.compress, "compress", COMPRESSIONS)
        positive_int(self.compress_rank, "compress_rank")
        require(self.ema_decay is None or (isinstance(self.ema_decay, (int, float))
                                           and not isinstance(self.ema_decay, bool) and 0 < self.ema_decay < 1),
                f"ema_decay must be between 0 and 1 (e.g. 0.999) or null, got {self.ema_decay!r}")
        require(isinstance(self.worker_timeout, (int, float)) and not isinstance(self.worker_timeout, bool)
                and self.worker_timeout > 0, f"worker_timeout must be > 0 seconds, got {self.worker_timeout!r}")
        require(self.resume is None or isinstance(self.resume, str),
                f"resume must be latest, a directory or a file, got {self.resume!r}")
        require(isinstance(self.checkpoint, CheckpointConfig),
                f"checkpoint must be a CheckpointConfig, got {type(self.checkpoint).__name__}")

    # --- the keyword form: what the Trainer takes, a part's settings as <part>_<key> ----------------

    @classmethod
    def from_keywords(cls, settings: Mapping[str, Any], base: "TrainerConfig | None" = None) -> "TrainerConfig":
        """The settings ``settings`` names (``checkpoint_dir=...`` for a part's), over ``base`` (default:
        the defaults).

        Raises:
            ConfigError: an unknown setting (naming the nearest valid one), or a bad value.
        """
        base = base if base is not None else cls()
        known = {row.keyword: row for row in setting_rows()}
        for name in settings:
            if name not in known:
                nearest = difflib.get_close_matches(name, known, n=1)
                hint = f"; did you mean {nearest[0]}?" if nearest else ""
                raise ConfigError(f"unknown setting {name}{hint} (every setting: help(sn_trainer.TrainerConfig))")
        changes: dict[str, Any] = {}
        parts: dict[str, dict[str, Any]] = {}
        for name, value in settings.items():
            row = known[name]
            if row.part is None:
                changes[name] = value
            else:
                parts.setdefault(row.part, {})[row.name] = value
        for name, values in parts.items():
            changes[name] = _replace(getattr(base, name), values)
        return _replace(base, changes)

    def keywords(self) -> dict[str, Any]:
        """The settings as the Trainer's keyword arguments take them (a part's as ``<part>_<key>``)."""
        return {row.keyword: row.value_in(self) for row in setting_rows()}


def _replace(config: Any, changes: Mapping[str, Any]) -> Any:
    try:
        return dataclasses.replace(config, **changes)
    except TypeError as exc:
        raise ConfigError(f"bad setting: {exc}") from None


@dataclass(frozen=True)
class SettingRow:
    """One setting as the Trainer takes it: its keyword, where it lives, its default and help."""

    keyword: str  # checkpoint_dir
    name: str  # dir
    part: str | None  # checkpoint (None: a field of TrainerConfig itself)
    default: Any
    annotation: str
    help: str
    cli: bool

    def value_in(self, config: TrainerConfig) -> Any:
        holder = getattr(config, self.part) if self.part else config
        return getattr(holder, self.name)


def setting_rows() -> Iterator[SettingRow]:
    """Every setting, in TrainerConfig's order, a part's in its place."""
    for f in fields(TrainerConfig):
        if is_part(f):
            for sub in fields(f.default_factory):
                yield SettingRow(f"{f.name}_{sub.name}", sub.name, f.name, default_of(sub), str(sub.type),
                                 sub.metadata["help"], sub.metadata.get("cli", True))
        else:
            yield SettingRow(f.name, f.name, None, default_of(f), str(f.type), f.metadata["help"],
                             f.metadata.get("cli", True))


def settings_markdown() -> str:
    """Every Trainer setting as a Markdown table (the docs' settings reference, checked by a test)."""
    lines = ["| keyword | in `TrainerConfig` | default | meaning |", "|---|---|---|---|"]
    for row in setting_rows():
        field = f"{row.part}.{row.name}" if row.part else row.name
        lines.append(f"| `{row.keyword}` | `{field}` | `{row.default!r}` | {row.help} |")
    return "\n".join(lines)


def settings_text(width: int = 96) -> str:
    """Every setting with its default and help, for a docstring (``help(Trainer)``)."""
    import textwrap

    lines = []
    for row in setting_rows():
        lines += textwrap.wrap(f"{row.keyword} (default {row.default!r}): {row.help.replace('`', '')}", width,
                               initial_indent="    ", subsequent_indent="        ", break_on_hyphens=False)
    return "\n".join(lines)
