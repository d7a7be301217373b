"""One worker process's life: set itself up, then train its share of every global batch (or evaluate)."""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import psutil
import torch

from ..data import random_state
from ..node.runtime import keep_freed_memory
from .events import CheckpointPart, Evaluation, Progress, WorkerResult
from .memory.peak import pss_bytes
from .processes.stages import STEP_STAGES, StageTimer
from .step.replica import Replica
from .step.worker_spec import WorkerSpec


def pin_and_set_threads(cpus: tuple[int, ...], threads: int) -> None:
    """Pin this process to its cores and give torch exactly ``threads`` intra-op threads."""
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already fixed: only possible before the first parallel work
        pass


class CpuClock:
    """CPU seconds over the measured steps: this process's, and the whole machine's busy and total.

    The launcher subtracts what the run's own processes used from what the machine did, and
    so tells a shared machine from an idle one.
    """

    def start(self) -> None:
        self._own, self._machine = self._read()
        self._queued = _run_queue_seconds()

    def stop(self) -> dict[str, float]:
        if not hasattr(self, "_own"):
            return {}
        own, machine = self._read()
        # Linux counts guest time inside user and nice as well: summed again, it would count twice.
        busy = {k: machine[k] - self._machine[k] for k in machine if k not in ("guest", "guest_nice")}
        return {"own": own - self._own, "machine_busy": sum(v for k, v in busy.items() if k not in ("idle", "iowait")),
                "machine_total": sum(busy.values()), "run_queue": _run_queue_seconds() - self._queued}

    @staticmethod
    def _read() -> tuple[float, dict[str, float]]:
        mine = psutil.Process().cpu_times()
        return mine.user + mine.system, psutil.cpu_times()._asdict()


def _run_queue_seconds() -> float:
    """Seconds the calling thread (the training loop's) was ready to run while its CPU ran something
    else (the kernel's schedstat): what a busy machine cost this worker; 0 where the kernel does not say."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def run_worker(spec: WorkerSpec, send: Callable[[Any], None]) -> WorkerResult:
    """The worker's whole life: set up, train (and/or evaluate), return what it measured."""
    plan = spec.shared.plan
    spec.shared.heartbeats.beat(spec.rank, plan.start_step, "setup")
    pin_and_set_threads(plan.placement.pinning[spec.rank], plan.settings.threads)
    keep_freed_memory(plan.settings.allocator)
    random_state.seed(plan.settings.seed * 1000 + plan.placement.node_rank * plan.workers + spec.rank)
    replica = Replica(spec)
    try:
        if plan.evaluate_only:
            return WorkerResult(replica.reducer.name, replica.evaluator.evaluate(lambda stage: None))
        return train(replica, send)
    finally:
        replica.close()


class Profiler:
    """A torch.profiler trace of ``steps`` steps from ``first``, written as a Chrome trace."""

    def __init__(self, out_dir: str | None, first: int, steps: int, rank: int):
        self.out_dir, self.first, self.last, self.rank = out_dir, first, first + steps, rank
        self._profile = None

    def before(self, step: int) -> None:
        if self.out_dir and step == self.first:
            self._profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self._profile.__enter__()

    def after(self, step: int) -> None:
        if self._profile is not None and step + 1 == self.last:
            self.stop()

    def stop(self) -> None:
        if self._profile is not None:
            self._profile.__exit__(None, None, None)
            os.makedirs(self.out_dir, exist_ok=True)  # the profiler writes no folder of its own
            self._profile.export_chrome_trace(os.path.join(self.out_dir, f"trace_rank{self.rank}.json"))
            self._profile = None


class Meter:
    """What the training loop measures: seconds per stage, samples/s between progress records, the
    first step's time, CPU use; all from the end of the warm-up on."""

    def __init__(self, replica: Replica, beat: Callable[[str], None]):
        plan = replica.plan
        self.plan, self.measure_from = plan, plan.measure_from
        self.timer, self.beat = StageTimer(beat), beat
        self.eval_seconds, self.first_step_seconds = 0.0, 0.0
        self.started = self.last_log_time = time.perf_counter()
        self.last_log_step, self.last_log_stages = plan.start_step, dict(self.timer.seconds)
        self.cpu = CpuClock()

    def before(self, step: int) -> None:
        if step == self.measure_from:  # warm-up over (if any): measure from here
            self.timer, self.eval_seconds = StageTimer(self.beat), 0.0
            self.last_log_stages = dict(self.timer.seconds)
            self.started = time.perf_counter()
            psutil.cpu_percent(percpu=True)  # starts the per-core utilisation interval
            self.cpu.start()
        self._step_started = time.perf_counter()

    def after(self, step: int) -> None:
        if step == self.plan.start_step:
            self.first_step_seconds = time.perf_counter() - self._step_started

    def progress(self, done: int, losses: list[float], lr: float | None, names: list[str],
                 awaited: bool) -> Progress:
        """The record of step ``done``: its loss, and speed and stage times since the last record."""
        now = time.perf_counter()
        steps = done - self.last_log_step
        stage_ms = {s: 1000 * (self.timer.seconds[s] - self.last_log_stages[s]) / steps for s in STEP_STAGES}
        named = dict(zip(names, losses)) if len(losses) > 1 else {}
        record = Progress(done, done / self.plan.steps_per_epoch, losses[0], lr,
                          self.plan.samples(self.last_log_step, done) / (now - self.last_log_time), stage_ms, named,
                          awaited)
        self.last_log_step, self.last_log_time, self.last_log_stages = done, now, dict(self.timer.seconds)
        return record

    def evaluated(self, seconds: float) -> None:
        """An evaluation took ``seconds``: neither training time nor samples/s count them."""
        self.eval_seconds += seconds
        self.last_log_time += seconds

    def result(self, replica: Replica, last: int, **outcome: Any) -> WorkerResult:
        """What this worker measured, the run having ended after step ``last``."""
        train_seconds = time.perf_counter() - self.started - self.eval_seconds
        cpu_percent = psutil.cpu_percent(percpu=True) if last > self.measure_from else []  # since the warm-up
        return WorkerResult(replica.reducer.name, pss_bytes=pss_bytes(), stage_seconds=self.timer.seconds,
                            measured_steps=last - self.measure_from, cpu_seconds=self.cpu.stop(),
                            train_seconds=train_seconds, eval_seconds=self.eval_seconds,
                            cpu_percent_per_core=cpu_percent, first_step_seconds=self.first_step_seconds, **outcome)


def train(replica: Replica, send: Callable[[Any], None]) -> WorkerResult:
    """The training loop. Every worker runs it in lockstep; rank 0 also reports progress."""
    plan, shared, reporting = replica.plan, replica.shared, replica.rank == 0
    step = plan.start_step

    def beat(stage: str) -> None:
        shared.heartbeats.beat(replica.rank, step, stage)

    meter = Meter(replica, beat)
    profiler = Profiler(plan.settings.profile_dir, meter.measure_from, plan.settings.profile_steps, replica.rank)
    eval_metrics, loss, skipped, stopped_at, diverged_at = {}, float("nan"), 0, None, None
    for step in range(plan.start_step, plan.total_steps):
        meter.before(step)
        profiler.before(step)
        phase_totals = replica.train_step(step, meter.timer)
        meter.after(step)
        profiler.after(step)
        losses = replica.losses(phase_totals)
        loss, done = losses[0], step + 1
        if not all(totals.finite for totals in phase_totals):  # every worker saw the same checks: they agree
            if plan.settings.on_nan == "stop":
                diverged_at = done
                break
            skipped += 1
        stopping = shared.stop.stops_after(done)  # a signal (or a callback) asked, and worker 0 decided
        due = plan.evaluates_after(done)
        if plan.logs_after(done):
            # Awaited where a callback may act on it: what it asks then applies to this very step.
            awaited = plan.progress_awaited and not due and not stopping
            if reporting:
                send(meter.progress(done, losses, replica.lr_used, [phase.spec.name for phase in replica.phases],
                                    awaited))
            if awaited:
                with meter.timer("wait"):
                    stopping = replica.stop_agreement.after_event(done)
        evaluated = None
        # A stop is a state the uninterrupted run passes through too: an evaluation due at its step
        # is made; and where a callback ends the run, the model it returns is evaluated at its end.
        if due or (stopping and plan.evaluates and shared.stop.ends_run()):
            started = time.perf_counter()
            eval_metrics = evaluated = replica.evaluator.evaluate(beat)
            if reporting:
                beat("sync")
                send(Evaluation(done, done / plan.steps_per_epoch, eval_metrics))
            stopping = replica.stop_agreement.after_event(done)  # what the callbacks decide applies to this step
            meter.evaluated(time.perf_counter() - started)
        replica.scheduled_points(done, evaluated)
        # On every node, where due: the leader's checkpoint holds each node's.
        replica.checkpoint_share.keep_compression(done)
        if plan.checkpointing and (stopping or plan.checkpoint_due(done) or shared.stop.saves_at(done)):
            beat("checkpoint")
            send(CheckpointPart(replica.rank, done, replica.checkpoint_share.part(done)))
        if stopping:
            stopped_at = done
            break
    verification = replica.verification
    result = meter.result(replica, stopped_at or diverged_at or plan.total_steps, eval_metrics=eval_metrics,
                          final_loss=loss, skipped_steps=skipped, stopped_at=stopped_at, diverged_at=diverged_at,
                          verified=tuple(verification.verified) if verification else (),
                          relabelled=verification.relabelled if verification else None)
    profiler.stop()
    return result
