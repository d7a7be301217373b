"""First throughput figure of the engine: LeNet on synthetic 28x28 data, 1 worker vs 2.

Rounds alternate between the worker counts so that drift on a shared machine hits both
alike; the ratio of medians is the figure to quote.

    python scripts/throughput.py [--rounds 3] [--steps 150] [--batch 64 128 256]
"""
from __future__ import annotations

import argparse
import functools
import statistics

import torch
from torch.utils.data import TensorDataset

from sn_trainer import Trainer
from sn_trainer.models import build_model
from sn_trainer.engine.node.machine import describe_machine
from sn_trainer.report.results import write_result


def measure(workers: int, batch: int, steps: int, data: TensorDataset) -> float:
    torch.manual_seed(0)
    model = build_model("lenet", (1, 28, 28), 10)
    trainer = Trainer(workers=workers, threads=1, batch_size=batch, max_steps=steps, log_every=10**9)
    result = trainer.fit(model, data, optimizer=functools.partial(torch.optim.SGD, lr=0.01, momentum=0.9))
    return result.samples_per_sec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--out", default="results/engine_throughput")
    args = parser.parse_args()

    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(16384, 1, 28, 28, generator=generator),
                         torch.randint(0, 10, (16384,), generator=generator))
    samples = {(b, w): [] for b in args.batch for w in args.workers}
    for round_index in range(args.rounds):
        for batch in args.batch:
            for workers in args.workers:
                rate = measure(workers, batch, args.steps, data)
                samples[(batch, workers)].append(rate)
                print(f"round {round_index + 1}: batch {batch:4d} workers {workers}: {rate:9.1f} samples/s",
                      flush=True)

    rows = []
    for batch in args.batch:
        base = statistics.median(samples[(batch, args.workers[0])])
        for workers in args.workers:
            runs = samples[(batch, workers)]
            rows.append({"batch_size": batch, "workers": workers, "per_worker_batch": batch / workers,
                         "samples_per_sec_median": statistics.median(runs), "min": min(runs), "max": max(runs),
                         "speedup_vs_first": statistics.median(runs) / base})
    report = {"machine": describe_machine(), "model": "lenet", "data": "synthetic 1x28x28, 10 classes",
              "optimizer": "SGD momentum 0.9", "threads_per_worker": 1, "steps_per_run": args.steps,
              "settings": "Trainer defaults: comm=auto, channels_last=auto (on for LeNet), fp32",
              "rounds": args.rounds, "rows": rows}
    machine = report["machine"]
    lines = [f"# Engine throughput: LeNet, synthetic 28x28, {args.steps} steps per run, {args.rounds} rounds",
             "", f"Machine: {machine['cpu_model']}, {machine['physical_cores']} physical cores, "
             f"torch {machine['torch']}. Command: `python scripts/throughput.py`. {report['settings']}.", "",
             "| batch | workers | per-worker batch | samples/s (median) | min | max | speedup |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['batch_size']} | {r['workers']} | {r['per_worker_batch']:g} | {r['samples_per_sec_median']:.0f} "
              f"| {r['min']:.0f} | {r['max']:.0f} | {r['speedup_vs_first']:.2f}x |" for r in rows]
    write_result(args.out, report, "\n".join(lines))


if __name__ == "__main__":
    main()
