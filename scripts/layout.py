"""One core, fp32: a training step of each model with contiguous tensors against channels_last.

Why sn_trainer's channels_last=auto turns the layout on for conv nets. Alternating rounds,
median step times.

    python scripts/layout.py [--rounds 3] [--out results/layout]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from sn_trainer.models import build_model
from sn_trainer.engine.node.machine import describe_machine
from sn_trainer.report.results import write_result

CASES = [("lenet", (1, 28, 28), 32), ("lenet", (1, 28, 28), 128), ("cifar10_quick", (3, 32, 32), 50),
         ("cifar10_quick", (3, 32, 32), 100)]


def step_ms(name: str, shape: tuple[int, int, int], batch: int, channels_last: bool, reps: int = 30) -> float:
    """Median milliseconds of forward + backward + SGD step on one batch."""
    torch.manual_seed(0)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    model = build_model(name, shape, 10).to(memory_format=fmt)
    x, y = torch.randn(batch, *shape).contiguous(memory_format=fmt), torch.randint(0, 10, (batch,))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    times = []
    for i in range(5 + reps):
        start = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if i >= 5:
            times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="results/layout")
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    torch.set_num_threads(1)
    samples: dict[tuple[str, int, bool], list[float]] = {}
    for _ in range(args.rounds):
        for name, shape, batch in CASES:
            for channels_last in (False, True):
                samples.setdefault((name, batch, channels_last), []).append(step_ms(name, shape, batch, channels_last))
    rows = []
    for name, _, batch in CASES:
        contiguous = statistics.median(samples[(name, batch, False)])
        nhwc = statistics.median(samples[(name, batch, True)])
        rows.append({"model": name, "batch": batch, "contiguous_ms": contiguous, "channels_last_ms": nhwc,
                     "speedup": contiguous / nhwc})
    machine = describe_machine()
    report = {"machine": machine, "threads": 1, "rounds": args.rounds, "rows": rows,
              "command": "python scripts/layout.py"}
    lines = ["# One core, fp32: a training step, contiguous against channels_last", "",
             f"Machine: {machine['cpu_model']}, torch {machine['torch']}, 1 thread pinned to one core. "
             f"`python scripts/layout.py`: median of {args.rounds} alternating rounds of 30 steps.", "",
             "| model | batch | contiguous ms | channels_last ms | speedup |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['model']} | {r['batch']} | {r['contiguous_ms']:.1f} | {r['channels_last_ms']:.1f} "
              f"| {r['speedup']:.2f}x |" for r in rows]
    write_result(args.out, report, "\n".join(lines))


if __name__ == "__main__":
    main()
