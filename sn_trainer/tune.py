"""Choosing workers x threads (and the runtime) for a model, batch and machine, as the paper advises.

A cost model calibrated on the spot predicts every candidate; the best few are verified by short
real runs; the answer is cached for ``workers=auto``. The model of one optimizer step with W
workers of T threads each, on a global batch B:

    step(W, T) = slow(W, T) x (alpha_T + beta_T x B / W) + sync(W)
    samples/s  = B / step(W, T)

``alpha_T + beta_T x b`` is one worker's compute on ``b`` samples with T threads (a few timings
of one worker; ``alpha`` is what does not shrink with the batch: the knee of the paper's figures
comes from it), ``sync(W)`` the reduction and barriers (timed with 2 workers, and 4 where there
are cores for it; each doubling of W adds the same time: the slowest of more workers is waited
for, and barriers poll more peers), and ``slow`` what sharing costs: cores shared when W x T
exceeds them, and memory bandwidth when the workers together stream more than the machine gives
(for predictions of other machines).
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .engine.runtime import Runtime
from .report.machine import describe_machine

log = logging.getLogger(__name__)

# 2: the OpenMP runtime is tuned too (entries of format 1 measured only the allocators).
CACHE_FORMAT = 2


@dataclass(frozen=True)
class Calibration:
    """What the cost model knows of one model and batch on this machine."""

    compute: dict[int, tuple[float, float]]  # threads -> (alpha s, beta s per sample) of one worker's step
    sync_two: float  # seconds a step of 2 workers spends in synchronisation
    sync_per_doubling: float  # what each doubling of the workers beyond 2 adds
    bytes_per_sample: float = 0.0  # memory traffic of one sample's forward and backward (estimate)


@dataclass(frozen=True)
class Machine:
    """A machine to predict for: its physical cores, NUMA nodes and memory bandwidth."""

    cores: int
    numa_nodes: int = 1
    bandwidth_gbs: float | None = None  # all NUMA nodes together; None: not a limit


def compute_seconds(cal: Calibration, threads: int, per_worker: float) -> float:
    """One worker's compute per step: measured thread counts as calibrated; others from the
    nearest measured one below, assuming threads split the batch-proportional part."""
    if threads in cal.compute:
        alpha, beta = cal.compute[threads]
    else:
        base = max(t for t in cal.compute if t <= threads)
        alpha, beta = cal.compute[base]
        beta = beta * base / threads
    return alpha + beta * per_worker


def sync_seconds(cal: Calibration, workers: int) -> float:
    return 0.0 if workers <= 1 else cal.sync_two + cal.sync_per_doubling * math.log2(workers / 2)


def predict(cal: Calibration, machine: Machine, batch: int, workers: int, threads: int) -> float:
    """Predicted samples/s of ``workers`` x ``threads`` on ``machine`` for a global ``batch``."""
    compute = compute_seconds(cal, threads, batch / workers)
    slow = max(1.0, workers * threads / machine.cores)  # cores shared
    if machine.bandwidth_gbs and cal.bytes_per_sample:
        demand = batch * cal.bytes_per_sample / compute  # bytes/s all workers stream at full speed
        slow *= max(1.0, demand / (machine.bandwidth_gbs * 1e9))
    numa = 1.0 + 0.05 * (machine.numa_nodes - 1) if workers > machine.cores // machine.numa_nodes else 1.0
    return batch / (compute * slow * numa + sync_seconds(cal, workers))


def candidates(cores: int, batch: int, thread_counts=(1, 2, 4)) -> list[tuple[int, int]]:
    """Every (workers, threads) that fits the cores without sharing them, with a sample per worker."""
    out = []
    for threads in thread_counts:
        for workers in range(1, cores // threads + 1):
            if workers <= batch:
                out.append((workers, threads))
    return out


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares ``seconds = alpha + beta x samples`` through (samples, seconds) points."""
    if len(points) == 1:
        b, t = points[0]
        return 0.0, t / b
    n = len(points)
    mx = sum(b for b, _ in points) / n
    my = sum(t for _, t in points) / n
    sxx = sum((b - mx) ** 2 for b, _ in points)
    beta = sum((b - mx) * (t - my) for b, t in points) / sxx if sxx else my / mx
    alpha = max(0.0, my - beta * mx)
    return alpha, max(beta, 0.0)


@dataclass
class TuneResult:
    """The winner, and every candidate with its predicted (and, for the best few, measured) speed."""

    workers: int
    threads: int
    allocator: str
    samples_per_sec: float
    rows: list[dict[str, Any]]
    calibration: Calibration
    seconds: float  # what tuning took
    cached: bool = False  # read from the cache, not measured now
    openmp: str = "gnu"
    runtimes: dict[str, float] = field(default_factory=dict)  # samples/s at the winner, by runtime
    compile_rates: dict[str, float] = field(default_factory=dict)  # at the winner: eager and compiled samples/s

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
                         f"{self.compile_rates['compiled']:.0f} (compile=auto: {'compiled' if self.compile else 'eager'})")
        lines.append(f"best: workers={self.workers} threads={self.threads} {Runtime(self.allocator, self.openmp)} "
                     f"({self.samples_per_sec:.0f} samples/s; tuning took {self.seconds:.0f} s)")
        return "\n".join(lines)


# --- the cache ----------------------------------------------------------------------------------

def cache_path() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "sn_trainer" / "tune.json"


def machine_key() -> dict[str, Any]:
    m = describe_machine()
    return {"cpu_model": m["cpu_model"], "physical_cores": m["physical_cores"],
            "cpus": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None}


def model_key(model) -> str:
    """A model's fingerprint: its class and the names and shapes of its parameters and buffers."""
    digest = hashlib.sha256(f"{type(model).__module__}.{type(model).__qualname__}".encode())
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        digest.update(f"{name}{tuple(t.shape)}{t.dtype}".encode())
    return digest.hexdigest()[:16]


def cache_key(model, batch_size: int, accumulate: int, precision: str) -> str:
    parts = {"machine": machine_key(), "model": model_key(model), "batch": batch_size, "accumulate": accumulate,
             "precision": precision}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def versions() -> dict[str, str]:
    import torch

    from . import __version__

    return {"format": CACHE_FORMAT, "torch": torch.__version__, "sn_trainer": __version__}


def load(key: str, path: Path | None = None) -> dict[str, Any] | None:
    """The cached choice for ``key``; None when there is none, or it is stale (another torch or
    sn_trainer, or another cache format): speeds measured with other software do not carry over."""
    path = path or cache_path()
    try:
        entry = json.loads(path.read_text()).get(key)
    except (OSError, ValueError):
        return None
    if entry is None:
        return None
    if entry.get("versions") != versions():
        log.info("the tuned setting cached for this model was measured with %s, not %s: ignored",
                 entry.get("versions"), versions())
        return None
    return entry


def store(key: str, result: TuneResult, path: Path | None = None) -> Path:
    path = path or cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    cache[key] = {"workers": result.workers, "threads": result.threads, "allocator": result.allocator,
                  "openmp": result.openmp, "compile_rates": result.compile_rates,
                  "samples_per_sec": result.samples_per_sec, "calibration": asdict(result.calibration),
                  "rows": result.rows, "measured_at": time.strftime("%Y-%m-%d %H:%M"), "versions": versions()}
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(cache, indent=1))
    os.replace(tmp, path)
    return path


def calibration_of(entry: dict[str, Any]) -> Calibration:
    raw = entry["calibration"]
    return Calibration({int(k): tuple(v) for k, v in raw["compute"].items()}, raw["sync_two"],
                       raw["sync_per_doubling"], raw.get("bytes_per_sample", 0.0))


def bytes_per_sample(model, sample_batch) -> float:
    """Memory traffic of one sample through forward and backward, estimated from the activations:
    every module's output written once and read back twice (backward), in 4-byte floats."""
    import torch

    total = [0]

    def count(_module, _inputs, output):
        if isinstance(output, torch.Tensor):
            total[0] += output.numel()

    handles = [m.register_forward_hook(count) for m in model.modules() if not list(m.children())]
    try:
        with torch.no_grad():
            inputs = sample_batch[0] if isinstance(sample_batch, (tuple, list)) else sample_batch
            model(inputs)
    finally:
        for h in handles:
            h.remove()
    samples = len(sample_batch[0]) if isinstance(sample_batch, (tuple, list)) else len(sample_batch)
    return 3 * 4 * total[0] / max(1, samples)


# --- the search ---------------------------------------------------------------------------------

def search(measure, cores: int, batch: int, allocators: list[str], openmps: list[str] = ("gnu",), top: int = 3,
           thread_counts=(1, 2, 4)) -> tuple[Calibration, list[dict[str, Any]], dict[Runtime, float]]:
    """Calibrate, predict every candidate, verify the best ``top``, then the runtimes at the winner:
    each allocator, then each OpenMP runtime with the fastest allocator, then the fastest runtime
    (when it is not the default) at the runner-up.

    ``measure(workers, threads, batch, runtime) -> (samples/s, seconds per step)`` runs a short
    real fit. Returns the calibration, one row per candidate, and samples/s per runtime.
    """
    default = Runtime()
    threads = [t for t in thread_counts if t <= cores]
    measured: dict[tuple[int, int], float] = {}
    # One worker on one core, at the global batch and at the smallest per-worker batch.
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
    cal = Calibration(compute, sync_two, sync_per_doubling)
    machine = Machine(cores)
    rows = [{"workers": w, "threads": t, "per_worker_batch": batch / w, "predicted": predict(cal, machine, batch, w, t)}
            for w, t in candidates(cores, batch, tuple(threads))]
    rows.sort(key=lambda r: -r["predicted"])
    for r in rows[:top]:
        key = (r["workers"], r["threads"])
        if key not in measured:
            measured[key] = measure(key[0], key[1], batch, default)[0]
    for r in rows:
        r["measured"] = measured.get((r["workers"], r["threads"]))
    best, runner_up = (_by_measured_speed(rows) + [None])[:2]
    at_winner = functools.partial(measure, best["workers"], best["threads"], batch)
    by_runtime = {default: best["measured"]}
    for allocator in allocators:
        if allocator != default.allocator:
            by_runtime[Runtime(allocator)] = at_winner(Runtime(allocator))[0]
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
    return cal, rows, by_runtime


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
