"""The tuner's cost model: the speed of W workers x T threads on a machine, from a few timings.

The model of one optimizer step with W
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

import math
from dataclasses import dataclass


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




def prediction_table(cal: Calibration, machine: Machine, batch: int, title: str) -> str:
    """Predicted samples/s, speed-up and efficiency for 1, 2, 4... workers (1 thread each) on
    ``machine``, up to its cores, and where the knee is."""
    one = predict(cal, machine, batch, 1, 1)
    lines = [title, f"{'workers':>7s} {'per-worker':>10s} {'samples/s':>10s} {'speed-up':>8s} {'efficiency':>10s}"]
    workers, best = 1, (0.0, 1)
    while workers <= min(machine.cores, batch):
        rate = predict(cal, machine, batch, workers, 1)
        lines.append(f"{workers:7d} {batch / workers:10.1f} {rate:10.0f} {rate / one:7.2f}x "
                     f"{rate / one / workers:10.2f}")
        best = max(best, (rate, workers))
        workers *= 2
    lines.append(f"knee: {best[1]} workers ({batch / best[1]:.0f} samples each); beyond it, more workers are slower")
    return "\n".join(lines)
