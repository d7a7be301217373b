"""The workers' launches for one run: the first, and after a failure a restart of all of them from
the last checkpoint (up to ``max_restarts``). What the workers of a launch share is allocated here,
before they start, and given back when they are gone."""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch

from ..callbacks import Callback, Callbacks
from ..checkpoint.resume import Resumed, resume
from ..checkpoint.writer import CheckpointWriter
from ..engine import (REDUCERS, Board, Heartbeats, PeakMemory, Shared, SharedParams, StopFlags, Watchdog, WorkerSpec,
                      auto_candidates, buffer_count, graceful_stop, max_channels, run_workers)
from ..engine.events import WorkerResult
from ..node.cluster import Cluster
from ..engine.plan import Plan
from ..recipe.objective import GATHERED
from ..engine.worker import run_worker
from ..errors import TrainingInterrupted, WorkerFailed
from . import membership
from .resolve import Run

log = logging.getLogger(__name__)
# sn_trainer.gather exchanges whole embeddings through the small sums' scratch, in pieces of its
# width: a wider one takes fewer barriers per gather, at a few kilobytes per worker.
_GATHER_WIDTH = 4096


@dataclass(frozen=True)
class Outcome:
    """The launch that finished: its plan, every worker's result, and what it cost."""

    plan: Plan
    results: list[WorkerResult]
    peak_bytes: int  # the largest PSS of the workers together, sampled while they ran
    launcher_cpu: float  # CPU seconds this process spent meanwhile
    restarts: int
    ema_state_dict: dict[str, torch.Tensor] | None = None


class StopRequests(Callback):
    """What the run's callbacks ask of the workers, passed on through the shared flags: a stop
    (``trainer.should_stop``), a checkpoint of the step just evaluated (``trainer.should_checkpoint``).
    The last of a run's callbacks: it reads what the others decided about each event."""

    essential = True  # the workers wait for its acknowledgements

    def __init__(self, stop: StopFlags):
        self.stop = stop

    def on_step_end(self, trainer, record) -> None:
        self._pass_on(trainer)
        if record.awaited:
            self.stop.acknowledge()  # worker 0 waits for this, then the workers go on

    def on_checkpoint_part(self, trainer, part) -> None:
        self._pass_on(trainer)

    def on_eval_end(self, trainer, evaluation) -> None:
        if trainer.should_checkpoint:
            self.stop.save_at(evaluation.step)
            trainer.should_checkpoint = False
        self._pass_on(trainer)
        self.stop.acknowledge()  # worker 0 waits for this, then the workers go on

    def _pass_on(self, trainer) -> None:
        if trainer.should_stop:
            self.stop.ask()


class Session:
    """A run's launches, with the run's callbacks: the checkpoint writer first, then ``hooks`` (the
    history, the user's), then the stop requests they make. ``trainer`` is what callbacks are
    called with; ``stop`` the flags shared with the workers."""

    def __init__(self, run: Run, trainer, hooks: Callbacks, stop: StopFlags, cluster: Cluster | None):
        self.run, self.trainer, self.stop, self.cluster = run, trainer, stop, cluster
        self.writer = CheckpointWriter(run.checkpoints, run.layout, run.phases, run.sample_order, run.run_config,
                                       hooks)
        self.callbacks = Callbacks([self.writer, *hooks.callbacks, StopRequests(stop)])

    def train(self) -> Outcome:
        """Launch the workers; when one fails, restart all from the last checkpoint, up to
        ``max_restarts`` times.

        Raises:
            WorkerFailed: after the last restart; TrainingInterrupted: a signal asked to stop.
        """
        run, stop, trainer = self.run, self.stop, self.trainer
        restarts, resume_from = 0, run.resume_from
        trainer.should_stop = trainer.should_checkpoint = False
        stop.reset()
        self.callbacks.call("on_fit_start", trainer, run.plan(0))
        initial = self.callbacks.states()  # what a restart from the initial parameters goes back to
        with graceful_stop(stop), run.checkpoints.claimed() if run.checkpoints else contextlib.nullcontext():
            while True:
                resumed = resume(resume_from, run, run.settings, run.first_plan.workers,
                                 not across_nodes(self.cluster)) if resume_from else None
                plan = self._plan(resumed)
                self.callbacks.load_states(resumed.callbacks if resumed else initial)
                if restarts:
                    self.callbacks.call("on_restart", trainer, plan.start_step)
                try:
                    launcher_cpu = -own_cpu_seconds()
                    results, peak, ema = launch_workers(run, plan, stop, self.cluster, self.deliver, resumed)
                    return Outcome(plan, results, peak, launcher_cpu + own_cpu_seconds(), restarts, ema)
                except WorkerFailed as failure:
                    if stop.signal:  # asked to stop: a restart would resurrect the run
                        raise TrainingInterrupted(stop.signal, None, self.writer.last_saved) from failure
                    if restarts >= run.settings.max_restarts:
                        raise
                    restarts += 1
                    resume_from = self._restart_from(failure, restarts, resume_from)
                    stop.clear_for_restart()

    def _plan(self, resumed: Resumed | None) -> Plan:
        """A launch's plan: from the checkpoint's step, under the membership it continues (the
        checkpoints it writes carry that on, and which torchrun job wrote them)."""
        plan = self.run.plan(resumed.step if resumed else 0)
        plan = dataclasses.replace(plan, membership=membership.continued(
            resumed.membership if resumed else [], plan.start_step, plan.placement))
        self.writer.carried = {"membership": membership.as_records(plan.membership),
                               **({"torchrun_run_id": self.cluster.run_id} if self.cluster else {})}
        return plan

    def deliver(self, rank: int, event) -> None:
        """A worker's event, to every callback's hook it names."""
        self.callbacks.event(self.trainer, event)

    def _restart_from(self, failure: WorkerFailed, restarts: int, resume_from: Path | None) -> Path | None:
        """Where restart number ``restarts`` goes on from: the last checkpoint, else where the run
        began (its checkpoint, or the initial parameters, put back into the model)."""
        run = self.run
        latest = run.checkpoints.latest() if run.checkpoints else None
        log.warning("%s\nrestart %d of %d, from %s", failure, restarts, run.settings.max_restarts,
                    latest or resume_from or "the initial parameters")
        if latest is not None:
            return run.checkpoints.path
        if resume_from is None:
            run.model.load_state_dict(run.initial_state)
        return resume_from


def launch_workers(run: Run, plan: Plan, stop: StopFlags, cluster: Cluster | None, deliver=None,
                   resumed: Resumed | None = None, target=run_worker
                   ) -> tuple[list[Any], int, dict[str, torch.Tensor] | None]:
    """One launch: the parameters put in shared memory, everything the workers share allocated,
    ``target`` run in every worker (``deliver(rank, event)`` gets what they send), and the
    parameters handed back to the caller's model as private memory.

    Returns:
        Every worker's result, the peak memory of them all, the moving average's state_dict (ema_decay).
    """
    cluster = cluster if across_nodes(cluster) else None  # a one-node torchrun job's workers have no peers
    rendezvous = rendezvous_dir()
    shared = SharedParams(run.model, run.layout, ema=plan.settings.ema_decay is not None,
                          ema_values=resumed.ema if resumed else None)
    reducers = {}
    try:
        reducers = reducer_kinds(run, plan, shared.flat.dtype)
        for source in (run.train, run.evaluation):
            if source is not None:
                source.share_memory()
        heartbeats = Heartbeats.allocate(plan.workers)
        shares = Shared(plan=plan, model=run.model, layout=run.layout, flat=shared.flat, train=run.train,
                        evaluation=run.evaluation, objective=run.objective, phases=run.phases,
                        board=Board.allocate(plan.workers, len(run.layout.slots), buffer_count(run.model)),
                        stop=stop, heartbeats=heartbeats, reducers=reducers,
                        ema=shared.ema, **verification_shares(run, plan, shared.flat.dtype))
        specs = [WorkerSpec(rank=r, store_path=f"{rendezvous}/store", shared=shares,
                            share=resumed.shares[r] if resumed else None, cluster=cluster) for r in range(plan.workers)]
        peak = PeakMemory()
        results = run_workers(target, specs, on_message=deliver, stop=stop, where=f"node {cluster.node_rank} " if cluster
                         else "", watchdog=Watchdog(heartbeats, plan.settings.worker_timeout, on_tick=peak),
                         start_method=plan.settings.start_method, runtime=plan.runtime)
        ema = shared.ema_state_dict(run.model, run.layout) if shared.ema is not None else None
        return results, peak.peak_bytes, ema
    finally:
        for _, held in reducers.values():  # the launcher's hold on what the workers shared (a segment)
            if hasattr(held, "release"):
                held.release()
        SharedParams.release(run.model)
        shutil.rmtree(rendezvous, ignore_errors=True)


def verification_shares(run: Run, plan: Plan, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """What the workers of a verified run share: every shard's summed gradient, laid out as the
    weights, and the word the others sleep on while worker 0 compares (``engine.step.verification``)."""
    if not plan.verifies:
        return {}
    return {"verify_grads": torch.zeros(run.layout.padded_numel, dtype=dtype).share_memory_(),
            "verify_bell": torch.zeros(1, dtype=torch.int32).share_memory_()}


def across_nodes(cluster: Cluster | None) -> bool:
    """Whether a launch has other nodes' workers to sum with (a one-node torchrun job has none)."""
    return cluster is not None and cluster.spans_nodes


def reducer_kinds(run: Run, plan: Plan, dtype: torch.dtype) -> dict[str, tuple[type, Any]]:
    """The reducers the workers may build, by name, each class with what it shares (allocated
    here): the one the plan names, or every candidate comm=auto times. The classes travel with the
    launch, so a reducer registered anywhere in this process is one the workers can build. Shared
    buffers are wide enough for the run's widest small sum: batch norm's statistics, evaluation's
    sums (a sum and a count per metric, the samples, the failures)."""
    settings = plan.settings
    names = auto_candidates() if settings.comm == "auto" else [settings.comm]
    width = max(2 * max_channels(run.model) + 1 if settings.sync_batchnorm else 0,
                2 * len(run.objective.eval_keys) + 2,
                _GATHER_WIDTH if any(phase.objective.form == GATHERED for phase in run.phases) else 0)
    return {name: (REDUCERS[name], REDUCERS[name].allocate(plan.workers, run.layout.padded_numel, dtype, width))
            for name in names}


def own_cpu_seconds() -> float:
    times = psutil.Process().cpu_times()
    return times.user + times.system


def rendezvous_dir() -> str:
    """A private temporary directory for the workers' rendezvous, named after this process.

    One left by a launcher that was SIGKILLed (no chance to remove it) is removed here, by the
    next run: its name says whose it was, and that process is gone.
    """
    base = Path(tempfile.gettempdir())
    for stale in base.glob("sn_trainer-*-*"):
        try:
            pid = int(stale.name.split("-")[1])
        except (IndexError, ValueError):
            continue
        try:
            if pid != os.getpid() and not psutil.pid_exists(pid) and stale.stat().st_uid == os.getuid():
                shutil.rmtree(stale, ignore_errors=True)
        except FileNotFoundError:  # another run starting beside this one removed it first
            continue
    return tempfile.mkdtemp(prefix=f"sn_trainer-{os.getpid()}-")
