"""Every ``auto`` decided, in one place: what the machine gives for the settings (workers, threads,
runtime, start method, precision, reducer, pinning) and what the model makes of them (memory
layout, compile, shards, prefetch). Each decision is a value of the settings themselves
(``dataclasses.replace``), so the run reports what it used as the settings it ran with, and a
``Decision`` with its reason: the run's placement carries them all, the log says each, and
summary.json lists them (``plan["decisions"]``). Where the workers decide at start-up (comm=auto,
by timing), the plan says what they chose once they have."""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

from torch import nn

from .. import tuner
from ..config import TrainerConfig
from ..engine import choose_reducer, starts_warm
from ..node.cluster import Cluster
from ..node.cpu import bf16_supported
from ..node.runtime import Runtime
from ..node.topology import OTHER_WORK_CORES, Topology, auto_threads, auto_workers, other_work, plan_pinning
from ..engine.plan import Decision, Placement
from ..errors import ConfigError
from ..optim import shard_kind

log = logging.getLogger(__name__)

SHARD_KINDS = ("elements", "tensors", "full")  # each exact for the optimizers the ones before it are


def place(config: TrainerConfig, topology: Topology, cluster: Cluster | None,
          tuned: dict[str, Any] | None = None) -> tuple[TrainerConfig, Placement]:
    """The settings with the machine's choices decided, and where the workers go, with every
    decision and its reason (``tuned``: the cached choice for a model, where workers, allocator or
    openmp are auto).

    Raises:
        ConfigError: settings this machine cannot run (a batch smaller than the workers, an
            unknown reducer, a runtime library that is not installed).
    """
    nodes = cluster.nodes if cluster else 1
    workers, threads, decided = workers_and_threads(config, topology, tuned)
    if config.batch_size < workers * nodes:
        raise ConfigError(f"batch_size={config.batch_size} is smaller than workers={workers}"
                          f"{f' x {nodes} nodes' if nodes > 1 else ''}: every worker needs at least one "
                          "sample; raise batch_size or lower workers")
    precision = config.precision
    if precision == "bf16" and not bf16_supported():
        precision = "fp32"
        decided.append(Decision("precision", precision, "precision=bf16 asked for, fp32 ran: this CPU has no native "
                                "bfloat16 (avx512_bf16 or AMX), and emulated bf16 is slower here than fp32", True))
    runtime = Runtime(config.allocator if config.allocator != "auto" else (tuned or {}).get("allocator", "system"),
                      config.openmp if config.openmp != "auto" else (tuned or {}).get("openmp", "gnu"))
    for name in ("allocator", "openmp"):
        if getattr(config, name) == "auto":
            decided.append(Decision(name, getattr(runtime, name), f"{name}=auto: " + (
                "what tuning measured fastest for this model and batch" if tuned and name in tuned else
                "the default, as tuning has measured nothing for this model and batch")))
    runtime.libraries()  # installed, or say how to install them
    start_method = config.start_method
    if start_method == "forkserver" and not starts_warm(start_method, runtime):
        start_method = "spawn"
        decided.append(Decision("start_method", start_method, f"{runtime}: this process's warm workers run another "
                                "allocator or OpenMP, so these workers were spawned (cold) with it", True))
    instead: list[str] = []
    comm = choose_reducer(config.comm, workers, instead)
    if instead:
        decided.append(Decision("comm", comm, instead[0], True))
    elif config.comm == "auto" and comm != "auto":
        decided.append(Decision("comm", comm, "comm=auto: one worker has nothing to sum"))
    compress = config.compress
    if compress != "none" and nodes == 1:
        compress = "none"
        decided.append(Decision("compress", compress, f"compress={config.compress} asked for, none ran: compress "
                                "applies between nodes only, and this run is one node (its workers sum exactly in "
                                "shared memory)", True))
    for decision in decided:
        if decision.fallback:
            log.warning(decision.why)
    pin, why = pinned(config.pin, topology)
    if why:
        decided.append(Decision("pin", pin, why))
    for decision in decided:
        if decision.setting in ("workers", "threads", "allocator", "openmp"):  # the others said as they were made
            log.info(decision.why)
    settings = dataclasses.replace(config, workers=workers, threads=threads, precision=precision, comm=comm,
                                   compress=compress, allocator=runtime.allocator, openmp=runtime.openmp,
                                   start_method=start_method, pin=pin)
    pinning = plan_pinning(topology, workers, threads) if pin else [() for _ in range(workers)]
    return settings, Placement(tuple(pinning), nodes, cluster.node_rank if cluster else 0, tuple(decided))


def pinned(pin: bool | str, topology: Topology) -> tuple[bool, str | None]:
    """Whether the workers are pinned: ``pin`` itself, or for ``auto`` whether this machine's usable cores
    are free of other work as the run starts (a pinned worker cannot move off a core that other work
    shares; an unpinned one can, where a core is free); and for auto, why (said in the log too)."""
    if pin != "auto":
        return bool(pin), None
    busy = other_work()
    if busy >= OTHER_WORK_CORES:
        why = (f"other processes keep {busy:.1f} of this machine's {topology.usable_cores} usable cores busy: the "
               "workers are not pinned (pin=auto), so that the OS can move each off a core that other work shares; "
               "pin=true pins them")
        log.warning(why)
        return False, why
    why = (f"the workers are pinned to cores of their own (pin=auto: other processes keep {busy:.1f} of the "
           f"{topology.usable_cores} usable cores busy)")
    log.info(why)
    return True, why


def workers_and_threads(config: TrainerConfig, topology: Topology, tuned: dict[str, Any] | None
                        ) -> tuple[int, int, list[Decision]]:
    """``workers`` and ``threads`` with their autos decided, and why: both auto, the tuned pair or one
    thread per usable core; one given, the other fills the usable cores (a single worker gets all of
    them, as one plain PyTorch process does)."""
    cores = f"{topology.usable_cores} usable cores"
    if config.workers != "auto":
        if config.threads != "auto":
            return config.workers, config.threads, []
        threads = auto_threads(topology, config.workers)
        return config.workers, threads, [Decision("threads", threads, f"threads=auto: {threads} per worker, the "
                                                  f"{cores} shared among workers={config.workers}")]
    if tuned and config.threads in ("auto", tuned["threads"]):
        why = (f"workers=auto: tuning measured {tuned['workers']} workers x {tuned['threads']} threads fastest for "
               "this model and batch")
        decided = [Decision("workers", tuned["workers"], why)]
        return tuned["workers"], tuned["threads"], decided + (
            [Decision("threads", tuned["threads"], why.replace("workers=auto", "threads=auto"))]
            if config.threads == "auto" else [])
    threads = 1 if config.threads == "auto" else config.threads
    workers = auto_workers(topology, threads)
    decided = [Decision("workers", workers, f"workers=auto: {workers} workers of {threads} thread(s) each on the "
                                            f"{cores}")]
    if config.threads == "auto":
        decided.append(Decision("threads", threads, "threads=auto: one intra-op thread per worker, as workers=auto "
                                                    "gives each worker a core"))
    return workers, threads, decided


def tuned_for(config: TrainerConfig, cluster: Cluster | None, model: nn.Module) -> dict[str, Any] | None:
    """What tuning cached for this model and batch, where workers, allocator or openmp are auto."""
    autos = [name for name in ("workers", "allocator", "openmp") if getattr(config, name) == "auto"]
    if not autos or cluster is not None:
        return None
    entry = tuner.load(tune_key(config, model))
    if entry is not None:
        log.info("%s: the tuned setting measured %s (%.0f samples/s): %d workers x %d threads, %s (%s)",
                 ", ".join(f"{name}=auto" for name in autos), entry["measured_at"], entry["samples_per_sec"],
                 entry["workers"], entry["threads"], Runtime(entry["allocator"], entry["openmp"]),
                 tuner.cache_path())
    return entry


def tune_key(config: TrainerConfig, model: nn.Module) -> str:
    """Where tuning caches its choice for this model at this batch, accumulation and precision."""
    return tuner.cache_key(model, config.batch_size, config.accumulate, config.precision)


def channels_last_helps(model: nn.Module) -> bool:
    """``channels_last=auto``: on for models with convolution (4-d) weights and no batch norm.

    oneDNN runs channels-last convolutions and pooling fastest on CPUs (results/.../layout.md);
    with batch norm the measured gain does not pay for its less accurate reductions there
    (results/.../batchnorm_layout.md).
    """
    has_conv = any(p.dim() == 4 for p in model.parameters() if p.requires_grad)
    has_bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    return has_conv and not has_bn


def for_model(settings: TrainerConfig, model: nn.Module) -> tuple[TrainerConfig, list[Decision]]:
    """The settings with the model's layout and compile decided, and why: as set, or for ``auto``
    what suits the model (channels_last) and what tuning measured faster for it (compile; eager
    where it measured nothing)."""
    decided = []
    channels_last = settings.channels_last
    if not isinstance(channels_last, bool):
        channels_last = channels_last_helps(model)
        decided.append(Decision("channels_last", channels_last, "channels_last=auto: " + (
            "the model has convolutions and no batch norm, which oneDNN runs fastest channels-last" if channels_last
            else "the model has batch norm, whose channels-last reductions cost more than they save here"
            if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
            else "the model has no convolution")))
    compiled = settings.compile
    if compiled == "auto":
        compiled, why = _compile(settings, model)
        decided.append(Decision("compile", compiled, why))
    return dataclasses.replace(settings, channels_last=channels_last, compile=compiled), decided


def _compile(settings: TrainerConfig, model: nn.Module) -> tuple[bool, str]:
    entry = tuner.load(tune_key(settings, model))
    rates = (entry or {}).get("compile_rates") or {}
    if not rates:
        why = ("compile=auto: eager, as tuning measured no compiled run of this model and batch "
               "(Trainer.tune with compile=auto, or tune=true, measures one)")
        log.info(why)
        return False, why
    why = (f"compile=auto: {'compiled' if rates['compiled'] > rates['eager'] else 'eager'} (tuning measured "
           f"{rates['compiled']:.0f} samples/s compiled, {rates['eager']:.0f} eager)")
    log.info(why)
    return rates["compiled"] > rates["eager"], why


def for_reading(settings: TrainerConfig, draws_random: bool, sets_generators: bool = False, *,
                global_workers: int) -> tuple[TrainerConfig, list[Decision]]:
    """The settings with prefetch decided, and why: prefetch=auto reads ahead where reading the
    training set touches no global random generator (a thread drawing from them, or seeding them for
    each sample and putting them back, beside the model's dropout would change which numbers each
    gets, and rewind the model's stream), each worker computes on one thread, and there are peers to
    wait for (the reading thread runs on the worker's own core, in the time a step waits for them).

    Raises:
        ConfigError: prefetch=true for data that draws from the global generators.
    """
    if draws_random and settings.prefetch is True:
        raise ConfigError("prefetch=true, and reading train_set draws from torch's, numpy's or random's global "
                          "random generator (augmentation): read ahead in a thread, its draws would interleave "
                          "with the model's; draw from a generator of the dataset's own, e.g. torch.Generator()"
                          ".manual_seed(hash((seed, epoch, index))) with set_epoch(epoch), or set prefetch=auto")
    if sets_generators and settings.prefetch is not False:
        # The reading thread's seeds would be set, and its restores put back, while the step's own
        # thread draws from the same generators: read where the step runs, before it.
        why = (f"prefetch={settings.prefetch}: reading inline, as reading train_set seeds the global random "
               "generators for each sample (sn_trainer.data.SeededPerSample, or a dataset of its own kind): in a "
               "reading thread, its seeds and restores would land between the step's own draws")
        (log.warning if settings.prefetch is True else log.info)(why)
        return dataclasses.replace(settings, prefetch=False), [Decision("prefetch", False, why)]
    if settings.prefetch != "auto":
        return settings, []
    prefetch, why = _read_ahead(settings, draws_random, global_workers)
    log.info(why)
    return dataclasses.replace(settings, prefetch=prefetch), [Decision("prefetch", prefetch, why)]


def _read_ahead(settings: TrainerConfig, draws_random: bool, global_workers: int) -> tuple[bool, str]:
    """prefetch=auto for data that seeds no global generator: whether a thread reads ahead, and why."""
    if draws_random:
        return False, ("prefetch=auto: off, as reading train_set draws global random numbers (augmentation); a "
                       "dataset that draws from generators of its own is read ahead")
    if global_workers == 1:
        # One worker waits for no peer: a reading thread has no idle time of the step's to fill and
        # only shares the step's own core, costing more than it reads (benchmarks/w1_bench.py, mlp).
        return False, ("prefetch=auto: off, as one worker has no peer to wait for, whose time a reading thread "
                       "would fill; prefetch=true reads ahead anyway")
    if settings.threads > 1:
        # The reading thread's copies and stacks would run on the cores the step's threads already
        # fill, and slow the step more than reading ahead saves (benchmarks/w1_bench.py, LeNet).
        return False, (f"prefetch=auto: off, as each worker's {settings.threads} intra-op threads fill its cores; "
                       "prefetch=true reads ahead on them anyway")
    return True, ("prefetch=auto: on, as reading train_set draws no global random number and each worker's one "
                  "thread waits for its peers in every step, time a reading thread fills")


def for_optimizers(settings: TrainerConfig, optimizer_classes: list[type | None]
                   ) -> tuple[TrainerConfig, tuple[str, ...], list[Decision]]:
    """The settings with shards decided: shards=auto takes the kind every phase's optimizer is
    proven exact with (``optim.shard_kind``), the most general of them. A kind set by hand that
    tests have not proven for an optimizer is kept, and said: the reasons are returned (the run
    verifies it, and says what it finds rather than stopping), and the decision for auto.

    Raises:
        ConfigError: an optimizer sn_trainer cannot run.
    """
    kind = max((shard_kind(c, settings.shards) for c in optimizer_classes), key=SHARD_KINDS.index,
               default="elements")
    unproven = []
    for cls in {c for c in optimizer_classes if c is not None}:
        proven = shard_kind(cls, "auto")
        if SHARD_KINDS.index(kind) < SHARD_KINDS.index(proven):
            unproven.append(f"shards={kind} was set for {cls.__name__}, which tests prove exact with shards={proven}")
    for reason in unproven:
        log.warning("%s: each worker steps its shard of it as set; steps are compared with one process's, and an "
                    "update that differs is said, not stopped", reason)
    decided = []
    if settings.shards == "auto":
        named = sorted({c.__name__ for c in optimizer_classes if c is not None}) or ["the optimizers"]
        decided.append(Decision("shards", kind, f"shards=auto: {kind}, the kind tests prove exact for "
                                                f"{', '.join(named)}"))
        log.info(decided[-1].why)
    return dataclasses.replace(settings, shards=kind), tuple(sorted(unproven)), decided
