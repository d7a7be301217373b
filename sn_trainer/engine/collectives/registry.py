"""The reducers by the name ``comm=`` gives them, and the choice of one: the launcher's, and comm=auto's
timing in the workers.

A new reducer is one class following ``reducer.py``'s ``Reducer`` protocol, listed in ``REDUCERS``.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from ...errors import ConfigError
from .in_node import LocalReducer, ShmReducer
from .over_gloo import GlooReducer
from .reducer import Reducer, ReducerSetup

# By name, in the order comm=auto times them.
REDUCERS: dict[str, type] = {kind.name: kind for kind in (LocalReducer, ShmReducer, GlooReducer)}


def auto_candidates() -> list[str]:
    """The reducers comm=auto times against each other here."""
    return [name for name, kind in REDUCERS.items() if kind.timed and kind.unavailable() is None]


def choose_reducer(comm: str, workers: int, notes: list[str]) -> str:
    """What ``comm`` runs with ``workers`` workers here: the one-worker reducer for one, a
    registered reducer's name, or ``auto`` (the workers time the candidates at start-up); a
    fallback goes in ``notes``.

    Raises:
        ConfigError: no reducer of that name, or the one-worker reducer for several workers.
    """
    if comm != "auto" and comm not in REDUCERS:
        raise ConfigError(f"comm must be one of auto, {', '.join(REDUCERS)}, got {comm!r}")
    if workers == 1:
        return LocalReducer.name
    if comm == LocalReducer.name:
        raise ConfigError(f"comm={comm} sums nothing: it is one worker's; with workers={workers} use auto, "
                          f"{', '.join(name for name in REDUCERS if name != comm)}")
    why = REDUCERS[comm].unavailable() if comm != "auto" else None
    if why:
        fallback = REDUCERS[comm].fallback
        notes.append(f"comm={comm} asked for, {fallback} ran: {why}")
        return fallback
    return comm


def calibrate(candidates: list[Reducer], rounds: int = 8) -> list[float]:
    """Median seconds per reduce + barrier over ``rounds`` for each reducer (same in all workers)."""
    timings = []
    for reducer in candidates:
        samples = []
        for _ in range(rounds):
            reducer.barrier()
            start = time.perf_counter()
            reducer.reduce()
            reducer.barrier()
            samples.append(time.perf_counter() - start)
        samples.sort()
        timings.append(samples[len(samples) // 2])
    return timings


def make_reducer(comm: str, setup: ReducerSetup, kinds: dict[str, tuple[type, Any]]) -> Reducer:
    """The reducer ``comm`` names, of the ``kinds`` the launcher chose for the run (by name: each
    class, and what the launcher allocated for it); ``auto`` times them against each other here and
    keeps the fastest. Every worker must call this with the same arguments but its own rank in
    ``setup``.
    """
    if comm != "auto":
        kind, shared = kinds[comm]
        return kind(dataclasses.replace(setup, shared=shared))
    candidates = [kind(dataclasses.replace(setup, shared=shared)) for kind, shared in kinds.values()]
    if len(candidates) == 1:
        return candidates[0]
    seconds = calibrate(candidates)
    # Rank 0's measurement decides, so that every worker picks the same reducer.
    decision = torch.tensor([1.0 + seconds.index(min(seconds)) if setup.rank == 0 else 0.0], dtype=torch.float64)
    candidates[-1].sum_in_node(decision)
    chosen = candidates[int(decision.item()) - 1]
    for candidate in candidates:
        candidate.grad_flat.zero_()
        if candidate is not chosen:
            candidate.close()
    return chosen
