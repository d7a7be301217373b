"""Lightning's own fit at 2 processes over gloo against "sn": samples/s side by side in one run.

Each measurement is ``Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(
process_group_backend=...))`` started the way Lightning starts itself (this script re-run as its
processes), training an MLP on synthetic data; samples/s over the steps after the warm-up, timed
on rank 0. Rounds alternate the backends; other processes' share of the CPU is reported, since a
figure taken on a busy machine says less.

    python benchmarks/lightning_bench.py [--rounds 3] [--out results/<machine>/lightning_bench]
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

BACKENDS = ("gloo", "sn")
WIDTH, PER_PROCESS_BATCH, WARMUP, STEPS = 1024, 64, 10, 40


def lightning_fit(backend: str, out: Path) -> None:
    """One measurement, run in each of Lightning's processes; rank 0 writes samples/s to ``out``."""
    import lightning as L
    import torch
    from lightning.pytorch.strategies import DDPStrategy
    from torch import nn
    from torch.nn import functional as F

    if backend == "sn":
        import sn_trainer.distributed  # noqa: F401  (registers the backend)

    class Timer(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if batch_idx == WARMUP:
                self.started = time.perf_counter()

        def on_train_end(self, trainer, module):
            rate = (STEPS * PER_PROCESS_BATCH * trainer.world_size) / (time.perf_counter() - self.started)
            if trainer.global_rank == 0:
                out.write_text(json.dumps({"samples_per_sec": rate, "backend": torch.distributed.get_backend()}))

    class MLP(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(784, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(),
                                     nn.Linear(WIDTH, 10))

        def training_step(self, batch, _):
            return F.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    n = (WARMUP + STEPS) * PER_PROCESS_BATCH * 2
    data = torch.utils.data.TensorDataset(torch.randn(n, 784), torch.randint(0, 10, (n,)))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(process_group_backend=backend),
                        max_steps=WARMUP + STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[Timer()])
    trainer.fit(MLP(), torch.utils.data.DataLoader(data, batch_size=PER_PROCESS_BATCH))


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


def measure(backend: str, scratch: Path) -> tuple[float, float]:
    """samples/s of one fit, and other processes' share of the CPU meanwhile (percent)."""
    out = scratch / f"{backend}-{time.monotonic_ns()}.json"
    busy_before, started = busy_seconds(), time.perf_counter()
    ours = run_watched([sys.executable, os.path.abspath(__file__), "--fit", backend, "--result", str(out)])
    wall = time.perf_counter() - started
    others = max(0.0, busy_seconds() - busy_before - ours) / (wall * psutil.cpu_count()) * 100
    found = json.loads(out.read_text())
    assert found["backend"] == backend, found  # the group Lightning made is the one asked for
    return found["samples_per_sec"], others


def report(machine: dict, samples: dict[str, list[float]], others: list[float], rounds: int) -> str:
    med = {backend: statistics.median(rates) for backend, rates in samples.items()}
    lines = ["# Lightning's fit over gloo and over \"sn\"", "",
             f"{machine['cpu_model']}, {machine['physical_cores']} physical cores ({', '.join(machine['isa'])}), "
             f"torch {machine['torch']}. `python benchmarks/lightning_bench.py --rounds {rounds}`: "
             "`Trainer(accelerator=\"cpu\", devices=2, strategy=DDPStrategy(process_group_backend=...))` started by "
             f"Lightning itself, an MLP 784-{WIDTH}-{WIDTH}-10 in float32, {PER_PROCESS_BATCH} samples per process, "
             f"SGD, synthetic data, {WARMUP} warm-up steps then {STEPS} timed on rank 0; {rounds} rounds "
             "alternating the backends; samples/s, medians [min-max]. Other processes used "
             f"{statistics.median(others):.1f}% of the CPU during the median measurement (at most "
             f"{max(others):.1f}%): the machine was shared with other work while this ran.", "",
             "| backend | samples/s |", "|---|---:|"]
    for backend, rates in samples.items():
        lines.append(f"| {backend} | {med[backend]:.0f} [{min(rates):.0f}-{max(rates):.0f}] |")
    lines += ["", f"sn / gloo: {med['sn'] / med['gloo']:.3f}."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="results/lightning_bench")
    parser.add_argument("--fit", choices=BACKENDS, help=argparse.SUPPRESS)  # one measurement (Lightning's processes)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fit:
        return lightning_fit(args.fit, Path(args.result))
    from sn_trainer.engine.machine import describe_machine
    from sn_trainer.report.results import write_result

    samples: dict[str, list[float]] = {backend: [] for backend in BACKENDS}
    others: list[float] = []
    with tempfile.TemporaryDirectory() as scratch:
        for round_index in range(args.rounds):
            for backend in BACKENDS if round_index % 2 == 0 else reversed(BACKENDS):
                rate, busy = measure(backend, Path(scratch))
                samples[backend].append(rate)
                others.append(busy)
                print(f"round {round_index + 1}: {backend}: {rate:.0f} samples/s", flush=True)
    machine = describe_machine()
    write_result(args.out, {"machine": machine, "rounds": args.rounds, "width": WIDTH, "per_process_batch": PER_PROCESS_BATCH,
                            "warmup": WARMUP, "steps": STEPS, "samples": samples, "other_cpu_percent": others},
                 report(machine, samples, others, args.rounds))


if __name__ == "__main__":
    main()
