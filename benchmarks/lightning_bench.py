"""Lightning's own fit at 2 processes over gloo against "sn": samples/s side by side in one run.

Each measurement is ``Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(
process_group_backend=...))`` started the way Lightning starts itself (this script re-run as its
processes), training an MLP on synthetic data; samples/s over the steps after the warm-up, timed
on rank 0. Rounds alternate the backends; other processes' share of the CPU is reported, since a
figure taken on a busy machine says less.

    python benchmarks/lightning_bench.py [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

import harness

RESULT = "lightning_bench"
BACKENDS = ("gloo", "sn")
# The MLP's width, each process's batch, the warm-up steps and the timed ones; a smoke run's (--tiny).
SIZES = {"width": 1024, "batch": 64, "warmup": 10, "steps": 40}
TINY_SIZES = {"width": 16, "batch": 4, "warmup": 1, "steps": 2}


def lightning_fit(backend: str, out: Path, sizes: dict[str, int]) -> None:
    """One measurement, run in each of Lightning's processes; rank 0 writes samples/s to ``out``."""
    width, batch_size, warmup, steps = sizes["width"], sizes["batch"], sizes["warmup"], sizes["steps"]
    import lightning as L
    import torch
    from lightning.pytorch.strategies import DDPStrategy
    from torch import nn
    from torch.nn import functional as F

    if backend == "sn":
        import sn_trainer.distributed  # noqa: F401  (registers the backend)

    class Timer(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if batch_idx == warmup:
                self.started = time.perf_counter()

        def on_train_end(self, trainer, module):
            rate = (steps * batch_size * trainer.world_size) / (time.perf_counter() - self.started)
            if trainer.global_rank == 0:
                out.write_text(json.dumps({"samples_per_sec": rate, "backend": torch.distributed.get_backend()}))

    class MLP(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(784, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                                     nn.Linear(width, 10))

        def training_step(self, batch, _):
            return F.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    n = (warmup + steps) * batch_size * 2
    data = torch.utils.data.TensorDataset(torch.randn(n, 784), torch.randint(0, 10, (n,)))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(process_group_backend=backend),
                        max_steps=warmup + steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[Timer()])
    trainer.fit(MLP(), torch.utils.data.DataLoader(data, batch_size=batch_size))


def busy_seconds() -> float:
    times = psutil.cpu_times()
    return times.user + times.nice + times.system + getattr(times, "irq", 0) + getattr(times, "softirq", 0)


def run_watched(command: list[str]) -> float:
    """Runs ``command`` to its end; returns the CPU seconds of its whole process tree.

    Lightning's processes are not all waited for by the one started here, so the tree is sampled
    while it runs (each process as last seen: a slight undercount of ours).
    """
    with tempfile.TemporaryFile("w+") as errors:
        process, seen = psutil.Popen(command, stdout=subprocess.DEVNULL, stderr=errors), {}
        while process.poll() is None:
            for member in [process, *process.children(recursive=True)]:
                try:
                    times = member.cpu_times()
                    seen[member.pid] = times.user + times.system
                except psutil.Error:
                    pass
            time.sleep(0.2)
        if process.returncode != 0:
            errors.seek(0)
            raise RuntimeError(f"the fit failed: {errors.read()[-3000:]}")
    return sum(seen.values())


def measure(backend: str, scratch: Path, tiny: bool) -> tuple[float, float]:
    """samples/s of one fit, and other processes' share of the CPU meanwhile (percent)."""
    out = scratch / f"{backend}-{time.monotonic_ns()}.json"
    busy_before, started = busy_seconds(), time.perf_counter()
    ours = run_watched([sys.executable, os.path.abspath(__file__), "--fit", backend, "--result", str(out),
                        *(["--tiny"] if tiny else [])])
    wall = time.perf_counter() - started
    others = max(0.0, busy_seconds() - busy_before - ours) / (wall * psutil.cpu_count()) * 100
    found = json.loads(out.read_text())
    assert found["backend"] == backend, found  # the group Lightning made is the one asked for
    return found["samples_per_sec"], others


def report(machine: dict, samples: dict[str, list[float]], others: list[float], rounds: int, sizes: dict) -> str:
    med = {backend: statistics.median(rates) for backend, rates in samples.items()}
    lines = ["# Lightning's fit over gloo and over \"sn\"", "",
             f"{harness.machine_line(machine)} `{harness.command()}`: "
             "`Trainer(accelerator=\"cpu\", devices=2, strategy=DDPStrategy(process_group_backend=...))` started by "
             f"Lightning itself, an MLP 784-{sizes['width']}-{sizes['width']}-10 in float32, {sizes['batch']} samples per "
             f"process, SGD, synthetic data, {sizes['warmup']} warm-up steps then {sizes['steps']} timed on rank 0; {rounds} rounds "
             "alternating the backends; samples/s, medians [min-max]. Other processes used "
             f"{statistics.median(others):.1f}% of the CPU during the median measurement (at most "
             f"{max(others):.1f}%): the machine was shared with other work while this ran.", "",
             "| backend | samples/s |", "|---|---:|"]
    for backend, rates in samples.items():
        lines.append(f"| {backend} | {harness.spread(rates)} |")
    lines += ["", f"sn / gloo: {med['sn'] / med['gloo']:.3f}."]
    return "\n".join(lines)


def main() -> None:
    parser = harness.options(__doc__, RESULT)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fit", choices=BACKENDS, help=argparse.SUPPRESS)  # one measurement (Lightning's processes)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    # Lightning runs this script again as its other process, with the same arguments: both size alike.
    sizes = TINY_SIZES if args.tiny else SIZES
    if args.fit:
        return lightning_fit(args.fit, Path(args.result), sizes)
    rounds = 1 if args.tiny else args.rounds
    samples: dict[str, list[float]] = {backend: [] for backend in BACKENDS}
    others: list[float] = []
    with tempfile.TemporaryDirectory() as scratch:
        for round_index in range(rounds):
            for backend in BACKENDS if round_index % 2 == 0 else reversed(BACKENDS):
                rate, busy = measure(backend, Path(scratch), args.tiny)
                samples[backend].append(rate)
                others.append(busy)
                print(f"round {round_index + 1}: {backend}: {rate:.0f} samples/s", flush=True)
    machine = harness.describe()
    harness.write(harness.out_of(args, RESULT),
                  {"machine": machine, "rounds": rounds, **sizes, "samples": samples, "other_cpu_percent": others,
                   "command": harness.command()}, report(machine, samples, others, rounds, sizes))


if __name__ == "__main__":
    main()
