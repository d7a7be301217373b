"""The workers: what reads a resolved plan and trains it.

The rest of the house enters the engine here and nowhere else (tests/test_structure.py holds it
to that): through the three modules at its top, ``plan`` (what the launcher resolved, read as
is), ``worker`` (one worker process's life) and ``events`` (what workers tell the launcher), and
through the names of ``FACE`` below, each loaded from its room on first use: importing the engine
imports no torch, so that ``python -m sn_trainer`` starts its fork server first. Behind the face,
rooms, each importing only its own and the ones before it:

- ``memory/``: the parameters held once in shared memory, optimizer state by shard, peak memory;
- ``collectives/``: what workers exchange: gradient sums (the reducers), their compression
  between nodes;
- ``processes/``: starting workers (``spawn``), running them to their end (``supervise``), how
  they talk (``pickling``), stopping them on a signal at a step boundary (``signals``);
- ``step/``: one training step and evaluation in a worker: the replica, each optimizer's phase,
  batch norm, the board, the verification against one process.

What a step computes, the vocabulary both the launcher's side and the workers use (the objective,
gathering, the flat layout, schedules), is ``sn_trainer.recipe``; what the node is, is
``sn_trainer.node``.
"""
from __future__ import annotations

import importlib

# Every name the rest of the house may take from the engine, and the module of its room that
# holds it ("module:name"; a module alone: the module itself, under the name on the left).
FACE = {
    # start workers, run them to their end, stop them
    "run_workers": "processes.supervise:run_workers",
    "Heartbeats": "processes.supervise:Heartbeats",
    "Watchdog": "processes.supervise:Watchdog",
    "starts_warm": "processes.spawn:starts_warm",
    "warm_up": "processes.spawn:warm_up",
    "forkserver": "processes.forkserver",
    "StopFlags": "processes.signals:StopFlags",
    "graceful_stop": "processes.signals:graceful_stop",
    "STEP_STAGES": "processes.stages:STEP_STAGES",
    # what crosses between the launcher and its workers
    "WorkerPickler": "processes.pickling:WorkerPickler",
    "unpack": "processes.pickling:unpack",
    "Shared": "step.worker_spec:Shared",
    "WorkerSpec": "step.worker_spec:WorkerSpec",
    "Board": "step.board:Board",
    # memory: shared parameters, optimizer state by shard, peak memory
    "SharedParams": "memory.shared:SharedParams",
    "buffer_count": "memory.shared:buffer_count",
    "PeakMemory": "memory.peak:PeakMemory",
    "optimizer_state": "memory.state",
    "group_params": "memory.state:group_params",
    # the reducers and compression
    "REDUCERS": "collectives.registry:REDUCERS",
    "auto_candidates": "collectives.registry:auto_candidates",
    "choose_reducer": "collectives.registry:choose_reducer",
    "compression": "collectives.compression",
    # the step's parts the launcher's rehearsal and proof reuse
    "PhaseSpec": "step.phases:PhaseSpec",
    "max_channels": "step.batchnorm:max_channels",
    "tolerances": "step.reference:tolerances",
}

__all__ = sorted(FACE)


def __getattr__(name: str):
    if name not in FACE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, _, attribute = FACE[name].partition(":")
    value = importlib.import_module(f".{module}", __name__)
    value = getattr(value, attribute) if attribute else value
    globals()[name] = value
    return value
