"""A finished run read against the seeds' tables: where its step's time went, and what to change.

The input is what a run records, as summary.json holds it (``FitResult.summary()`` gives the same
keys): stage seconds over the measured steps (mean over the workers, and each worker's own),
other processes' CPU, peak memory, the plan, the losses logged; a command-line run adds its
config and the machine. A key an older sn_trainer did not write makes its check say so.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .findings import Finding, not_visible

STAGES = ("data", "forward", "backward", "reduce", "update", "wait")
WORK = ("data", "forward", "backward", "update")  # what a worker computes itself; the rest is waiting and summing
SAMPLES_PER_WORKER = 16  # the articles' rule of thumb: fewer per worker and per-step overheads dominate
BUSY_PERCENT = 5.0  # other processes' share of the machine above which the figures are a busy machine's
DATA_SHARE = 0.10  # a data stage above this share of the step is worth a fix
WAIT_SHARE = 0.05  # waiting for the slowest worker above this share of the step
HEADROOM = (0.20, 0.30)  # the articles' memory margin for the system and other processes
OLDER = "not recorded in this summary (written by an older sn_trainer)"


@dataclass(frozen=True)
class Knee:
    """The fastest per-worker batch measured for this run's model and global batch (a sweep's jobs,
    or the tuner's runs), and its speed."""

    per_worker_batch: float
    samples_per_sec: float
    source: str  # "the sweep's" / "the tuner's"
    this_rate: float | None = None  # the same source's speed at this run's workers x threads, if measured


@dataclass
class RunFacts:
    """What the checks read of one run: a summary's figures, normalised (None: not recorded)."""

    summary: dict[str, Any]
    cli: bool  # a command-line run: settings are named as its keys (dataset.preload, optim.scale_lr)
    losses: list[float] = field(default_factory=list)  # the logged training losses, in order
    knee: Knee | None = None

    def get(self, key: str, default: Any = None) -> Any:
        return self.summary.get(key, default)

    @property
    def plan(self) -> dict[str, Any]:
        return self.get("plan") or {}

    @property
    def config(self) -> dict[str, Any]:
        return self.get("config") or {}

    @property
    def steps(self) -> int:
        return max(1, self.get("measured_steps") or self.get("steps") or 1)

    @property
    def stage_seconds(self) -> dict[str, float] | None:
        seconds = self.get("stage_seconds") or self.get("phase_seconds")  # its name before sn_trainer 0.3
        return seconds if seconds and all(s in seconds for s in STAGES) else None

    @property
    def step_seconds(self) -> float | None:
        seconds = self.stage_seconds
        return sum(seconds.values()) / self.steps if seconds else None

    def setting(self, name: str) -> Any:
        """A Trainer setting as the run used it (the plan), else as configured."""
        if name in self.plan:
            return self.plan[name]
        return self.config.get(name, self.get(name))


def run_findings(facts: RunFacts) -> list[Finding]:
    """Every run check, in the order of the seeds' procedure (data, workers, batch, memory, loss)."""
    return [data_share(facts), slowest_worker(facts), per_worker_batch(facts), memory_headroom(facts),
            loss_after_batch(facts), compile_left_off(facts)]


def busy_machine(facts: RunFacts) -> Finding:
    """Other processes' CPU during the measured steps: not a cost of the run's settings but of the
    machine it ran on, said before them; its cost is the longest any worker was ready to run while
    another process held its CPU (the others waited for that one)."""
    other = facts.get("other_cpu_percent")
    if other is None:
        return not_visible("other processes' CPU", "not recorded in this summary")
    evidence = f"other processes used {other:.0f}% of the machine's CPU during the measured steps"
    queued = facts.get("run_queue_seconds") or []
    seconds = max(queued, default=0.0)
    if queued and seconds > 0:
        worst = queued.index(seconds)
        pinning = facts.plan.get("pinning") or []
        on = f" on CPU {','.join(map(str, pinning[worst]))}" if worst < len(pinning) else ""
        # The clock runs over the measured steps and the evaluations made among and after them.
        evidence += (f"; worker {worst}{on} waited {seconds:.3g} s for its CPU while another process ran (over "
                     f"the {facts.get('train_seconds') or 0:.3g} s of measured steps and the evaluations)")
    if other <= BUSY_PERCENT:
        return Finding("other processes' CPU", evidence)
    return Finding("other processes' CPU", evidence + ": the figures below are a busy machine's",
                   "measure again on an idle machine, or start the run on CPUs nothing else uses "
                   "(taskset -c <cpus> python -m sn_trainer ...: workers=auto takes the cores it is allowed)",
                   seconds=seconds)


def data_share(facts: RunFacts) -> Finding:
    seconds = facts.stage_seconds
    if seconds is None:
        return not_visible("data", OLDER + ": no stage_seconds")
    step = facts.step_seconds
    share = seconds["data"] / facts.steps / step if step else 0.0
    evidence = (f"the data stage takes {1000 * seconds['data'] / facts.steps:.3g} ms of a "
                f"{1000 * step:.3g} ms step ({100 * share:.0f}%)")
    if share <= DATA_SHARE:
        return Finding("data", evidence)
    return Finding("data", evidence, _data_fix(facts), seconds=seconds["data"])


def _data_fix(facts: RunFacts) -> str:
    fixes = []
    if facts.setting("prefetch") is False:
        fixes.append("prefetch=true (read the next step while this one computes)")
    dataset = facts.config.get("dataset") or {}
    if facts.cli and dataset.get("name") == "folder":
        if not dataset.get("preload"):
            fixes.append("dataset.preload=true (decode every image once, into memory)")
        if dataset.get("augment"):
            fixes.append("lighter augmentation (dataset.augment=false)")
        fixes.append("the files on a faster disk (the doctor's disk read lines for this folder say which bounds)")
    elif facts.cli and dataset.get("name") == "text":
        fixes.append("the token file on a faster disk (the doctor's disk read lines say whether it bounds)")
    else:
        fixes.append("a cheaper __getitem__ / get_batch (decode or augment once, ahead of training)")
    return "; or ".join(fixes)


def slowest_worker(facts: RunFacts) -> Finding:
    """The time the workers spent waiting for the slowest one: from each worker's own stage times,
    the mean over the workers of (the slowest's work - its own work)."""
    per_worker = facts.get("stage_seconds_per_worker")
    step = facts.step_seconds
    if not per_worker:
        if facts.stage_seconds is None or facts.get("workers", 1) <= 1:
            return not_visible("wait for the slowest worker", OLDER + ": no stage_seconds_per_worker")
        waited = facts.stage_seconds["wait"]
        evidence = (f"the barrier waits {1000 * waited / facts.steps:.3g} ms per step (each worker's own times: "
                    f"{OLDER.split(' (')[0]})")
    else:
        work = [sum(w[s] for s in WORK) for w in per_worker]
        slowest = max(range(len(work)), key=work.__getitem__)
        waited = sum(work[slowest] - w for w in work) / len(work)
        evidence = (f"worker {slowest} computes {1000 * work[slowest] / facts.steps:.3g} ms per step, the fastest "
                    f"{1000 * min(work) / facts.steps:.3g} ms: the others wait {1000 * waited / facts.steps:.3g} ms "
                    "per step for it")
    share = waited / facts.steps / step if step else 0.0
    if len(per_worker or [0, 0]) <= 1 or share <= WAIT_SHARE:
        return Finding("wait for the slowest worker", evidence)
    cause, fix = _why_slowest(facts, slowest if per_worker else None)
    return Finding("wait for the slowest worker", f"{evidence} ({100 * share:.0f}% of the step): {cause}", fix,
                   seconds=waited)


def _why_slowest(facts: RunFacts, slowest: int | None) -> tuple[str, str]:
    other = facts.get("other_cpu_percent") or 0.0
    workers, threads = facts.get("workers", 1), facts.get("threads", 1)
    cores = (facts.get("machine") or {}).get("physical_cores")
    pinning = facts.plan.get("pinning") or []
    where = f" (worker {slowest} runs on CPU {','.join(map(str, pinning[slowest]))})" \
        if slowest is not None and slowest < len(pinning) else ""
    if other > BUSY_PERCENT:
        return (f"a busy machine: other processes used {other:.0f}% of its CPU{where}",
                "stop what else runs there, or start the run on CPUs nothing else uses (taskset -c <cpus> ...), "
                "or fewer workers")
    if cores and workers * threads > cores:
        return (f"workers x threads = {workers * threads} share the {cores} physical cores (hyper-threads used as "
                "cores)", "workers=auto, or workers x threads at most the physical cores")
    if facts.get("batch_size", 0) % max(1, workers):
        return (f"uneven slices: batch_size={facts.get('batch_size')} over {workers} workers",
                f"a batch_size that is a multiple of workers={workers}")
    return ("its samples cost more than the others' (uneven sample sizes) or its core is slower",
            "check for another process on its core; samples of similar cost per step")


def per_worker_batch(facts: RunFacts) -> Finding:
    """The per-worker batch against a measured knee (a sweep's or the tuner's), else the rule of thumb."""
    pwb = facts.get("per_worker_batch")
    workers, batch = facts.get("workers"), facts.get("batch_size")
    if pwb is None or workers is None or batch is None:
        return not_visible("per-worker batch", OLDER + ": no per_worker_batch")
    knee = facts.knee
    if knee is not None:
        evidence = (f"{pwb:g} samples per worker; {knee.source} fastest measured ran {knee.per_worker_batch:g} "
                    f"per worker ({knee.samples_per_sec:.0f} samples/s)")
        rate = knee.this_rate if knee.this_rate is not None else facts.get("samples_per_sec")
        if pwb >= knee.per_worker_batch or not rate or rate >= knee.samples_per_sec:
            return Finding("per-worker batch", evidence)
        lost = (facts.get("train_seconds") or 0.0) * (1 - rate / knee.samples_per_sec)
        return Finding("per-worker batch", evidence + f", this run {rate:.0f}: below the knee",
                       _batch_fix(facts, knee.per_worker_batch), seconds=max(0.0, lost))
    evidence = f"{pwb:g} samples per worker (the articles' rule of thumb: at least {SAMPLES_PER_WORKER})"
    if pwb >= SAMPLES_PER_WORKER:
        return Finding("per-worker batch", evidence)
    seconds = facts.stage_seconds
    # What does not shrink with the batch: summing, the update, the barriers; at least that much is
    # the workers' overhead a per-worker batch this small pays every step.
    fixed = sum(seconds[s] for s in ("reduce", "update", "wait")) if seconds else 0.0
    return Finding("per-worker batch", evidence + ": below the knee, per-step overheads dominate",
                   _batch_fix(facts, SAMPLES_PER_WORKER), seconds=fixed)


def _batch_fix(facts: RunFacts, target: float) -> str:
    batch, workers = facts.get("batch_size"), facts.get("workers")
    fewer = max(1, int(batch // target))
    larger = int(math.ceil(target * workers))
    scale = "optim.scale_lr=true with optim.warmup_steps" if facts.cli else \
        "the learning rate scaled with it (the linear scaling rule) and a warm-up"
    options = [f"workers={fewer}"] if fewer < workers else []
    options.append(f"a larger global batch, batch_size={larger} ({scale})")
    return " or ".join(options)


def memory_headroom(facts: RunFacts) -> Finding:
    peak = facts.get("peak_memory_bytes")
    total_gib = (facts.get("machine") or {}).get("memory_gib")
    if not peak or not total_gib:
        return not_visible("memory headroom", OLDER + ": no peak_memory_bytes or machine memory")
    total = total_gib * 2**30
    headroom = 1 - peak / total
    evidence = (f"peak {peak / 2**30:.2f} GiB of {total_gib:g} GiB: {100 * headroom:.0f}% left (the articles keep "
                f"{100 * HEADROOM[0]:.0f}-{100 * HEADROOM[1]:.0f}% for the system)")
    if headroom >= HEADROOM[0]:
        return Finding("memory headroom", evidence)
    batch = facts.get("batch_size") or 0
    # Estimated as if memory grew in proportion to the batch: the model's own share makes it a bound.
    largest = max(1, int(batch * (1 - HEADROOM[1]) * total / peak))
    return Finding("memory headroom", evidence, f"batch_size={largest} or smaller (about the largest that keeps "
                   f"{100 * HEADROOM[1]:.0f}% free), or fewer workers")


def loss_after_batch(facts: RunFacts) -> Finding:
    """A loss that rose over the run (or went non-finite) after a batch larger than the learning
    rate was tuned for, without the linear scaling rule."""
    losses = [x for x in facts.losses if x is not None]
    if len(losses) < 3:
        final = facts.get("final_loss")
        if final is not None and not math.isfinite(final):
            losses = [final]
        else:
            return Finding("loss", f"{len(losses)} losses logged: too few to see a trend")
    first, last = losses[0], losses[-1]
    rose = not math.isfinite(last) or (len(losses) >= 3 and last > first)
    evidence = f"loss {first:.4g} at the first record, {last:.4g} at the last"
    if not rose:
        return Finding("loss", evidence)
    optim = facts.config.get("optim") or {}
    step_batch = (facts.get("batch_size") or 0) * (facts.setting("accumulate") or 1)
    reference = optim.get("reference_batch")
    cost = facts.get("train_seconds") or 0.0  # a run whose loss diverged trained for nothing
    if facts.cli and reference and step_batch > reference and not optim.get("scale_lr"):
        return Finding("loss", f"{evidence}: diverged with a batch of {step_batch} > optim.reference_batch="
                       f"{reference} at an unscaled lr", "optim.scale_lr=true (lr x batch / reference_batch) with "
                       "optim.warmup_steps, or a lower optim.lr", seconds=cost)
    if not facts.cli:
        return Finding("loss", evidence + ": diverged", "a learning rate scaled with the batch (the linear scaling "
                       "rule, with a warm-up), or a lower one; clip_grad_norm", seconds=cost)
    return Finding("loss", evidence + ": diverged", "a lower optim.lr, a longer optim.warmup_steps, or "
                   "clip_grad_norm", seconds=cost)


def compile_left_off(facts: RunFacts) -> Finding:
    rates = facts.get("compile_rates")
    if not rates:
        return not_visible("compile", "eager and compiled speeds not measured (tune measures them: compile=auto)")
    evidence = f"tune measured eager {rates['eager']:.0f}, compiled {rates['compiled']:.0f} samples/s"
    if facts.setting("compile") is True or rates["compiled"] <= rates["eager"]:
        return Finding("compile", evidence)
    lost = (facts.get("train_seconds") or 0.0) * (1 - rates["eager"] / rates["compiled"])
    return Finding("compile", evidence + ", the run ran eager", "compile=true (or compile=auto)", seconds=lost)
