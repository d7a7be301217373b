"""The tuner's search: calibrate the cost model with short real fits, predict every workers x
threads, verify the best few, then the runtimes (allocator, OpenMP) and compile at the winner."""
from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..node.runtime import Runtime, default_runtime
from . import cache
from .model import Calibration, Machine, candidates, fit_line, predict

log = logging.getLogger(__name__)

# measure(workers, threads, batch, runtime, compiled) -> (samples/s, seconds per step): a short real fit.
Measure = Callable[..., tuple[float, float]]


@dataclass
class TuneResult:
    """The winner, and every candidate with its predicted (and, for the best few, measured) speed."""

    workers: int
    threads: int
    runtime: Runtime
    samples_per_sec: float
    rows: list[dict[str, Any]]
    calibration: Calibration
    seconds: float  # what tuning took
    runtimes: dict[str, float] = field(default_factory=dict)  # samples/s at the winner, by runtime
    compile_rates: dict[str, float] = field(default_factory=dict)  # at the winner: eager and compiled samples/s

    @property
    def allocator(self) -> str:
        return self.runtime.allocator

    @property
    def openmp(self) -> str:
        return self.runtime.openmp

    @property
    def compile(self) -> bool:
        """Whether compile=auto compiles: it measured faster than eager."""
        return bool(self.compile_rates) and self.compile_rates["compiled"] > self.compile_rates["eager"]

    def table(self) -> str:
        lines = [f"{'workers':>7s} {'threads':>7s} {'per-worker':>10s} {'predicted':>10s} {'measured':>10s}"]
        for r in sorted(self.rows, key=lambda r: -r["predicted"]):
            measured = f"{r['measured']:10.0f}" if r.get("measured") else f"{'-':>10s}"
            lines.append(f"{r['workers']:7d} {r['threads']:7d} {r['per_worker_batch']:10.1f} {r['predicted']:10.0f} "
                         f"{measured}")
        if self.runtimes:
            lines.append("runtimes at the best measured: "
                         + ", ".join(f"{k} {v:.0f}" for k, v in self.runtimes.items()))
        for r in self.rows:
            if r.get("with_runtime"):
                lines.append(f"the runner-up, {r['workers']} x {r['threads']}, with {r['with_runtime']['runtime']}: "
                             f"{r['with_runtime']['measured']:.0f}")
        if self.compile_rates:
            lines.append(f"at the best measured: eager {self.compile_rates['eager']:.0f}, compiled "
                         f"{self.compile_rates['compiled']:.0f} "
                         f"(compile=auto: {'compiled' if self.compile else 'eager'})")
        lines.append(f"best: workers={self.workers} threads={self.threads} {self.runtime} "
                     f"({self.samples_per_sec:.0f} samples/s; tuning took {self.seconds:.0f} s)")
        return "\n".join(lines)


def tune(measure: Measure, cores: int, batch: int, allocators: list[str], openmps: list[str], top: int,
         compile_auto: bool, cache_key: str | None) -> TuneResult:
    """Search (``search``), then, with ``compile_auto``, the winner compiled against eager (its
    compile falls in the warm-up); store the choice under ``cache_key`` (None: not cached).

    ``measure(workers, threads, batch, runtime, compiled) -> (samples/s, seconds per step)`` runs a
    short real fit.
    """
    started = time.monotonic()
    calibration, rows, by_runtime = search(measure, cores, batch, allocators, openmps, top)
    workers, threads, runtime, rate = winner(rows, by_runtime)
    compiled = {}
    if compile_auto:
        compiled = {"eager": rate, "compiled": measure(workers, threads, batch, runtime, True)[0]}
    result = TuneResult(workers, threads, runtime, rate, rows, calibration, time.monotonic() - started,
                        runtimes={str(r): speed for r, speed in by_runtime.items()}, compile_rates=compiled)
    if cache_key is not None:
        path = cache.store(cache_key, result)
        log.info("tune: cached in %s for workers=auto", path)
    return result


def search(measure: Measure, cores: int, batch: int, allocators: list[str], openmps: list[str] = ("gnu",),
           top: int = 3, thread_counts=(1, 2, 4)) -> tuple[Calibration, list[dict[str, Any]], dict[Runtime, float]]:
    """Calibrate, predict every candidate, verify the best ``top``, then the runtimes at the winner:
    each allocator, then each OpenMP runtime with the fastest allocator, then the fastest runtime
    (when it is not the default) at the runner-up.

    Returns the calibration, one row per candidate, and samples/s per runtime.
    """
    threads = [t for t in thread_counts if t <= cores]
    measured: dict[tuple[int, int], float] = {}
    cal = calibrate(measure, cores, batch, threads, measured)
    machine, default = Machine(cores), default_runtime()
    rows = [{"workers": w, "threads": t, "per_worker_batch": batch / w, "predicted": predict(cal, machine, batch, w, t)}
            for w, t in candidates(cores, batch, tuple(threads))]
    rows.sort(key=lambda r: -r["predicted"])
    for r in rows[:top]:
        key = (r["workers"], r["threads"])
        if key not in measured:
            measured[key] = measure(key[0], key[1], batch, default)[0]
    for r in rows:
        r["measured"] = measured.get((r["workers"], r["threads"]))
    return cal, rows, _runtimes(measure, batch, rows, allocators, openmps)


def calibrate(measure: Measure, cores: int, batch: int, threads: list[int],
              measured: dict[tuple[int, int], float]) -> Calibration:
    """The cost model's constants, from one worker on one core at the global batch and at the
    smallest per-worker batch, one worker per thread count, and 2 (and 4) workers; what each of
    those measured goes into ``measured`` by (workers, threads)."""
    default = default_runtime()
    points = []
    for b in sorted({batch, max(1, batch // cores)}):
        rate, seconds = measure(1, 1, b, default)
        points.append((b, seconds))
        if b == batch:
            measured[(1, 1)] = rate
    alpha, beta = fit_line(points)
    compute = {1: (alpha, beta)}
    for t in threads[1:]:
        rate, seconds = measure(1, t, batch, default)
        measured[(1, t)] = rate
        compute[t] = (alpha, max(0.0, seconds - alpha) / batch)
    sync_two = sync_per_doubling = 0.0
    if cores >= 2 and batch >= 2:
        rate, seconds = measure(2, 1, batch, default)
        measured[(2, 1)] = rate
        sync_two = max(0.0, seconds - (alpha + beta * batch / 2))
        sync_per_doubling = sync_two  # an assumption, until a machine with 4 cores measures it
        if cores >= 4 and batch >= 4:
            rate, seconds = measure(4, 1, batch, default)
            measured[(4, 1)] = rate
            sync_per_doubling = max(0.0, (seconds - (alpha + beta * batch / 4)) - sync_two)
    return Calibration(compute, sync_two, sync_per_doubling)


def _runtimes(measure: Measure, batch: int, rows: list[dict[str, Any]], allocators: list[str],
              openmps: list[str]) -> dict[Runtime, float]:
    """Samples/s at the fastest measured candidate for each runtime; the fastest one also at the
    runner-up (recorded in its row), where it is not the default."""
    default = default_runtime()
    best, runner_up = (_by_measured_speed(rows) + [None])[:2]
    at_winner = functools.partial(measure, best["workers"], best["threads"], batch)
    by_runtime = {default: best["measured"]}
    for allocator in allocators:
        if allocator != default.allocator:
            by_runtime[Runtime(allocator, default.openmp)] = at_winner(Runtime(allocator, default.openmp))[0]
    allocator = max(by_runtime, key=by_runtime.get).allocator
    for openmp in openmps:
        if openmp != default.openmp:
            by_runtime[Runtime(allocator, openmp)] = at_winner(Runtime(allocator, openmp))[0]
    fastest = max(by_runtime, key=by_runtime.get)
    if fastest != default and runner_up is not None:
        # A runtime can favour other workers x threads (Intel's OpenMP, more threads): the runner-up
        # runs with it too, and wins if it is faster.
        rate = measure(runner_up["workers"], runner_up["threads"], batch, fastest)[0]
        runner_up["with_runtime"] = {"runtime": str(fastest), "measured": rate}
    return by_runtime


def winner(rows: list[dict[str, Any]], by_runtime: dict[Runtime, float]) -> tuple[int, int, Runtime, float]:
    """What ``search`` found fastest: workers, threads, runtime and its samples/s."""
    best = _by_measured_speed(rows)[0]
    runtime = max(by_runtime, key=by_runtime.get)
    choice = (best["workers"], best["threads"], runtime, by_runtime[runtime])
    for r in rows:
        other = r.get("with_runtime")
        if other and other["measured"] > choice[3]:
            choice = (r["workers"], r["threads"], runtime, other["measured"])
    return choice


def _by_measured_speed(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The candidates that were measured, fastest first."""
    return sorted((r for r in rows if r["measured"]), key=lambda r: -r["measured"])
