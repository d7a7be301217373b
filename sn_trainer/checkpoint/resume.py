"""What a resume needs: where checkpoints go and which one a run goes on from, that checkpoint
checked against the run (same model, optimizer, sample order, steps left), and each worker's share."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from torch import nn

from ..config import TrainerConfig
from ..engine import PhaseSpec, optimizer_state
from ..recipe.flat_layout import FlatLayout
from ..node.cluster import Cluster
from ..errors import CheckpointError, ConfigError
from . import contents, loading
from .directory import CheckpointDir

log = logging.getLogger(__name__)

# The settings that decide which samples each step trains on: a resume must agree with them (and
# with the training set's size), or the steps it trains are not the steps the run would have.
SAMPLE_ORDER = ("batch_size", "accumulate", "seed", "shuffle", "drop_last")
# What a checkpoint written before a setting was recorded ran with.
RECORDED_LATER = {"shuffle": True}


def sample_order(settings: TrainerConfig, dataset_size: int | None) -> dict[str, Any]:
    """What a checkpoint records, and a resume checks, of the order of the samples."""
    return {**{name: getattr(settings, name) for name in SAMPLE_ORDER}, "dataset_size": dataset_size}


def locate(settings: TrainerConfig, cluster: Cluster | None) -> tuple[CheckpointDir | None, Path | None]:
    """Where this run writes checkpoints (None: it writes none here; only the global leader
    writes), and the checkpoint it resumes from (None: it starts afresh).

    Raises:
        ConfigError: the checkpoint directory cannot be written.
        CheckpointError: ``resume`` names nothing to resume from.
    """
    where = settings.checkpoint.dir
    leader = cluster is None or cluster.is_leader
    directory = CheckpointDir(where, settings.checkpoint.keep) if where and leader else None
    if directory is not None:
        directory.check_writable()
    resume_from = loading.resolve(settings.resume, where) if settings.resume else None
    if cluster is not None and resume_from is None and where and written_by_job(CheckpointDir(where), cluster):
        # torchrun restarted every node, after a failure or as nodes left or joined (then without
        # counting a restart, and a node that joins starts at 0), one node alone included: all go
        # on from the last checkpoint in the (shared) directory, which this torchrun job wrote.
        resume_from = Path(where)
    if directory is not None:
        _check_owned(directory, resume_from)
    return directory, resume_from


def written_by_job(directory: CheckpointDir, cluster: Cluster) -> bool:
    """Whether the newest checkpoint of ``directory`` that loads (the one a resume takes) was
    written under ``cluster``'s torchrun job (its rdzv id). torchrun's default id, ``none``, which
    every job without --rdzv-id has, names a job only to a restart (TORCHELASTIC_RESTART_COUNT >
    0): a first launch with it starts afresh."""
    if cluster.run_id in ("", "none") and cluster.restart_count == 0:
        return False
    for _, path in reversed(directory.steps()):
        try:
            return (loading.load(path).get("run") or {}).get("torchrun_run_id") == cluster.run_id
        except CheckpointError:  # damaged: resume passes over it to the one before, as here
            continue
    return False


def _check_owned(directory: CheckpointDir, resume_from: Path | None) -> None:
    """A run writes only into a checkpoint directory that is empty or holds the run it continues
    from its latest checkpoint: another run's files (or later ones of its own) would be pruned
    against its own, and ``latest`` would name theirs.

    Raises:
        CheckpointError: names what the directory holds, and the two ways on.
    """
    held = directory.steps()
    if not held:
        return
    latest = held[-1][1]
    target = resume_from.resolve() if resume_from is not None else None
    if target is not None and (target == directory.path.resolve() or target == latest.resolve()):
        return
    shown = ", ".join(str(step) for step, _ in held[-3:])
    if target is None:
        raise CheckpointError(f"{directory.path} already holds checkpoints (steps {shown}) of another run: resume=latest "
                              "goes on from them, or give this run a new checkpoint directory")
    raise CheckpointError(f"{directory.path} holds checkpoints (steps {shown}) later than or other than the one this "
                          f"run resumes from ({resume_from}): they would be pruned against this run's and latest would "
                          "name theirs; resume=latest, or give this run a new checkpoint directory")


class Resumable(Protocol):
    """What of a resolved run a resume checks a checkpoint against."""

    model: nn.Module
    layout: FlatLayout
    phases: list[PhaseSpec]
    sample_order: dict[str, Any]
    run_config: dict[str, Any] | None

    @property
    def optimizers(self) -> list[tuple[type | None, tuple[str, ...]]]:
        """Each phase's optimizer class and the state it keeps per parameter (None: no optimizer)."""

    @property
    def total_steps(self) -> int:
        ...


@dataclass(frozen=True)
class Resumed:
    """A checkpoint cut for a launch: the step it reached, the weights' moving average, each
    worker's share (its phases' optimizer and scheduler state, its random state, the stream's
    place), the run's stateful callbacks' states at that step, and its membership list."""

    step: int
    ema: dict[str, Any] | None
    shares: list[dict[str, Any]]
    callbacks: dict[str, dict[str, Any]]
    membership: list[dict[str, Any]]  # the run's nodes and workers until then (fit.membership)


def resume(target: Path, run: Resumable, settings: TrainerConfig, workers: int, one_node: bool) -> Resumed:
    """Load the checkpoint ``target`` names once, check it fits ``run``, load its weights into the
    model, and cut the rest into each of ``workers`` workers' share.

    Raises:
        CheckpointError: it cannot be used for this run (another model, optimizer or sample order).
        ConfigError: it has nothing left to train.
    """
    path, saved, passed = loading.load_resumable(target)
    for reason in passed:
        log.warning("passing over a damaged checkpoint: %s", reason)
    check_same_run(saved, path, run.sample_order, run.run_config, settings.resume_strict)
    loading.check_model(saved, run.model, path)
    optimizers, schedules = contents.phase_states(saved, [(s.name, s.shape) for s in run.layout.slots],
                                                  len(run.phases), path)
    for held, (optimizer_class, keys) in zip(optimizers, run.optimizers):
        if optimizer_class is not None:
            loading.check_optimizer(held, keys, optimizer_class.__name__, path)
    if saved["step"] >= run.total_steps:
        raise ConfigError(f"{path} is at step {saved['step']}, and this run has {run.total_steps} steps: nothing "
                          "left to train; raise epochs or max_steps to go on")
    same_streams = streams_resume(saved, workers, one_node)
    if not same_streams:
        then = ((saved.get("run") or {}).get("membership") or [{"nodes": 1, "workers": len(saved["rng"])}])[-1]
        log.warning("%s was written by %d workers on %d node(s), this run has %d%s: parameters and optimizer state "
                    "resume exactly, random streams (dropout, augmentation) do not", path, then["workers"],
                    then["nodes"], workers, " on this node" if one_node else " per node")
    run.model.load_state_dict(saved["model"])
    log.info("resuming from %s (step %d)", path, saved["step"])
    if settings.ema_decay is not None and saved.get("ema") is None:
        log.warning("%s holds no moving average of the weights (ema_decay): it starts from the weights resumed", path)
    stream = (saved.get("run") or {}).get("stream")
    compress = _compression_states(saved, settings, workers, path)
    shares = [{"compress": compress[rank] if compress else None,
               "phases": [{"optimizer": optimizer_state.scatter(held, run.layout, rank, phase.slot_groups) if held else {},
                           "schedule": schedule}
                          for phase, held, schedule in zip(run.phases, optimizers, schedules)],
               "rng": saved["rng"][rank] if same_streams else None, "stream": stream}
              for rank in range(workers)]
    return Resumed(saved["step"], saved.get("ema"), shares, saved.get("callbacks") or {},
                   (saved.get("run") or {}).get("membership") or [])


def streams_resume(saved: dict[str, Any], workers: int, one_node: bool) -> bool:
    """Whether each of ``workers`` workers of one node goes on with its own random streams from
    ``saved``: it holds every worker's (it was written by one node, of as many workers). A node of
    several keeps only its own workers' streams, and an elastic job shrunk to one node would take
    node 0's for all: those start afresh, as a resume by hand at another size would."""
    membership = (saved.get("run") or {}).get("membership") or []
    written_alone = not membership or int(membership[-1]["nodes"]) == 1
    return one_node and written_alone and len(saved["rng"]) == workers


def _compression_states(saved: dict[str, Any], settings: TrainerConfig, workers: int, path) -> list | None:
    """compress=powersgd: each worker's shard's error feedback (of every node) and warm-start Qs, where
    the checkpoint holds them for as many workers per node; else None, said (they start afresh)."""
    held = saved.get("compress")
    if settings.compress == "none":
        return None
    if held is None or len(held) != workers:
        log.warning("%s holds no compression state for %d workers per node: error feedback starts from zero and "
                    "the first compressed step draws new factors", path, workers)
        return None
    return held


def check_same_run(saved: dict[str, Any], path, order: dict[str, Any], run_config: dict[str, Any] | None,
                   strict: bool) -> None:
    """Refuse (or, not strict, warn about) a checkpoint of another model, dataset or sample order."""
    if run_config:
        for section in ("model", "dataset"):
            theirs = ((saved.get("config") or {}).get(section) or {}).get("name")
            mine = (run_config.get(section) or {}).get("name")
            if theirs is not None and mine is not None and theirs != mine:
                raise CheckpointError(f"{path} was written for {section}={theirs}, this run has {section}={mine}; "
                                      f"resume with {section}={theirs} or start afresh without resume")
    for key, mine in order.items():
        theirs = (saved.get("run") or {}).get(key, RECORDED_LATER.get(key))
        if theirs is not None and theirs != mine:
            what = "training-set size" if key == "dataset_size" else key
            message = (f"{path} was written with {what} {theirs}, this run has {mine}: the samples of each "
                       "step would differ from the run it continues")
            if strict:
                raise CheckpointError(f"{message}; resume with {key}={theirs}, or set resume_strict=false to go on "
                                      "anyway")
            log.warning("%s (resume_strict=false: going on)", message)
