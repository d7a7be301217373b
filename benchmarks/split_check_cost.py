"""What verifying a loss's split while training costs: the check against a training step, in one process.

Each worker checks, on its first micro-batch of steps 1, 2, 4, 8, ..., that a scalar loss splits
as the probe found (``sn_trainer.engine.step.split_check``): three forward passes without gradient.
This times that check against the step it rides on (forward, backward and SGD's update of the
same micro-batch, in the same thread count), alternating the two, and gives the cost per checked
step and spread over runs of 1,000 and 10,000 steps (11 and 14 checks).

    python benchmarks/split_check_cost.py [--repeats 30]
"""
from __future__ import annotations

import os
import statistics
import time

import torch
import torch.nn.functional as F

from sn_trainer.engine.step import split_check
from sn_trainer.engine.step.objective import MEAN, Objective
from sn_trainer.models import build_model

import harness

RESULT = "split_check_cost"

CASES = {"lenet, micro-batch 32": ("lenet", (1, 28, 28), 32), "lenet, micro-batch 64": ("lenet", (1, 28, 28), 64),
         "cifar10_quick, micro-batch 100": ("cifar10_quick", (3, 32, 32), 100)}


def measure(model_name: str, shape: tuple[int, int, int], samples: int, repeats: int) -> tuple[float, float]:
    """Median seconds of a training step and of the check, on the same micro-batch, alternated."""
    torch.manual_seed(0)
    model = build_model(model_name, shape, 10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    batch = (torch.randn(samples, *shape), torch.randint(0, 10, (samples,)))
    objective = Objective(loss_fn=F.cross_entropy)
    objective.form = MEAN
    steps, checks = [], []
    for index in range(repeats + 3):  # the first three warm up
        started = time.perf_counter()
        optimizer.zero_grad()
        F.cross_entropy(model(batch[0]), batch[1]).backward()
        optimizer.step()
        middle = time.perf_counter()
        split_check.verify(objective, model, batch, samples, torch.float32, step=0, rank=0)
        ended = time.perf_counter()
        if index >= 3:
            steps.append(middle - started)
            checks.append(ended - middle)
    return statistics.median(steps), statistics.median(checks)


def main() -> None:
    parser = harness.options(__doc__, RESULT)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (a worker's, by default 1)")
    args = parser.parse_args()
    if args.tiny:
        args.repeats = 1
    torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]  # a ratio of two alternated timings holds up on a busy machine; say it anyway
    rows = {}
    for label, (name, shape, samples) in CASES.items():
        step, check = measure(name, shape, samples, args.repeats)
        rows[label] = {"step_s": step, "check_s": check}
        print(f"{label}: step {step * 1e3:.2f} ms, check {check * 1e3:.2f} ms", flush=True)
    machine = harness.describe()
    checks_in = {steps: sum(1 for s in range(steps) if split_check.due(s)) for steps in (1000, 10000)}
    lines = ["# What verifying the loss's split while training costs", "",
             f"{harness.machine_line(machine)} `{harness.command()}`: {args.repeats} repeats, one process, "
             f"{args.threads} intra-op thread(s), synthetic data, SGD momentum 0.9; medians of {args.repeats} "
             "alternated repeats. The check runs on a worker's first micro-batch of steps 1, 2, 4, 8, ...: "
             f"{checks_in[1000]} of 1,000 steps, {checks_in[10000]} of 10,000. Load average at the start: {load:.2f} "
             f"on {os.cpu_count()} CPUs" + (" (other processes were running)." if load > 0.5 else "."), "",
             "| case | training step | check | check / step, on a checked step | over 1,000 steps | "
             "over 10,000 steps |", "|---|---:|---:|---:|---:|---:|"]
    for label, row in rows.items():
        ratio = row["check_s"] / row["step_s"]
        lines.append(f"| {label} | {row['step_s'] * 1e3:.2f} ms | {row['check_s'] * 1e3:.2f} ms | {ratio:.1%} | "
                     f"{ratio * checks_in[1000] / 1000:.3%} | {ratio * checks_in[10000] / 10000:.4%} |")
    harness.write(harness.out_of(args, RESULT),
                  {"machine": machine, "repeats": args.repeats, "threads": args.threads, "rows": rows,
                   "checks_in": checks_in, "load_average": load, "command": harness.command()}, "\n".join(lines))


if __name__ == "__main__":
    main()
