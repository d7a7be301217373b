"""sn_trainer of two checkouts side by side, in one run: the same fits, alternating, and their ratio.

    git worktree add ../base <commit>                      # the checkout to compare with
    python benchmarks/ab_checkouts.py ../base [--rounds 5]

Every measurement is a fresh process importing sn_trainer from one checkout (PYTHONPATH), training
a model of sn_trainer's own on synthetic data with every physical core as a worker, through the
public API both have (``Trainer(...).fit``, ``measure_after``). Rounds alternate the checkouts and
the cases, so that drift on a shared machine hits both alike; ratios are of medians.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import harness

HERE = harness.ROOT
sys.path.insert(0, str(HERE))  # this checkout's sn_trainer describes the machine and writes the results

RESULT = "ab_checkouts"
CASES = [("lenet", 128, (1, 28, 28)), ("lenet", 256, (1, 28, 28)), ("cifar10_quick", 100, (3, 32, 32)),
         ("cifar10_quick_bn", 100, (3, 32, 32))]
WARMUP, STEPS = 5, 60

FIT = """
import functools, json, sys, torch
from torch.utils.data import TensorDataset
from sn_trainer import Trainer
from sn_trainer.models import build_model
if __name__ == "__main__":
    name, batch, shape, warmup, steps = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4]), \\
        int(sys.argv[5])
    torch.manual_seed(0)
    model = build_model(name, tuple(shape), 10)
    n = batch * (warmup + steps)
    data = TensorDataset(torch.randn(n, *shape), torch.randint(0, 10, (n,)))
    result = Trainer(batch_size=batch, max_steps=warmup + steps, measure_after=warmup, log_every=10**9, seed=0).fit(
        model, data, optimizer=functools.partial(torch.optim.SGD, lr=0.01, momentum=0.9))
    print(json.dumps({"samples_per_sec": result.samples_per_sec, "workers": result.workers,
                      "other_cpu_percent": result.other_cpu_percent}))
"""


def measure(checkout: Path, name: str, batch: int, shape: tuple[int, ...], warmup: int, steps: int) -> dict:
    proc = subprocess.run([sys.executable, "-c", FIT, name, str(batch), json.dumps(list(shape)), str(warmup),
                           str(steps)], env={**os.environ, "PYTHONPATH": str(checkout)}, cwd=checkout,
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"{checkout}: {name} b{batch} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def commit_of(checkout: Path) -> str:
    """The commit a checkout is at, for the results file (never its path)."""
    found = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(checkout), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return (found.stdout.strip() or "unknown") + (" with uncommitted changes" if dirty else "")


def main() -> None:
    parser = harness.options(__doc__, RESULT)
    parser.add_argument("base", nargs="?", help="the other checkout (a folder holding sn_trainer/); with --tiny, "
                                                "this one by default")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cases", help="a comma-separated subset of the cases, e.g. 'lenet b128,cifar10_quick b100'")
    args = parser.parse_args()
    if args.base is None and not args.tiny:
        parser.error("the base checkout to compare with is needed (git worktree add ../base <commit>)")
    cases = [c for c in CASES if not args.cases or f"{c[0]} b{c[1]}" in [x.strip() for x in args.cases.split(",")]]
    warmup, steps = WARMUP, STEPS
    if args.tiny:  # one round of a few steps of LeNet at a batch of 8
        cases, warmup, steps, args.rounds = [("lenet", 8, (1, 28, 28))], 1, 2, 1
    checkouts = {"this": HERE, "base": Path(args.base or HERE).resolve()}
    samples: dict[tuple[str, str], list[float]] = {}
    others: list[float] = []  # other processes' share of the CPU during each measurement
    workers = None
    for round_index in range(args.rounds):
        order = list(checkouts.items()) if round_index % 2 == 0 else list(reversed(checkouts.items()))
        for name, batch, shape in cases:
            for label, checkout in order:
                found = measure(checkout, name, batch, shape, warmup, steps)
                workers = found["workers"]
                others.append(found["other_cpu_percent"] or 0.0)
                samples.setdefault((f"{name} b{batch}", label), []).append(found["samples_per_sec"])
                print(f"round {round_index + 1}: {name} b{batch} {label}: {found['samples_per_sec']:.0f} samples/s",
                      flush=True)
    machine = harness.describe()
    rows = []
    for name, batch, _ in cases:
        case = f"{name} b{batch}"
        this, base = samples[(case, "this")], samples[(case, "base")]
        rows.append({"case": case, "this": this, "base": base,
                     "ratio": statistics.median(this) / statistics.median(base)})
    commits = {label: commit_of(checkout) for label, checkout in checkouts.items()}
    shown = harness.command({args.base: "<base checkout>"} if args.base else {})
    lines = [f"# Two checkouts side by side: {commits['this']} (this) against {commits['base']} (base)", "",
             f"{harness.machine_line(machine)} `{shown}`: "
             f"{workers} workers, {warmup} warm-up steps then {steps} measured, SGD, synthetic data; "
             f"{args.rounds} rounds alternating the checkouts; samples/s, medians [min-max]. Other processes used "
             f"{statistics.median(others):.1f}% of the CPU during the median measurement (at most {max(others):.1f}%).",
             "",
             "| case | base | this | this / base |", "|---|---:|---:|---:|"]
    for row in rows:
        lines.append(f"| {row['case']} | {harness.spread(row['base'])} | {harness.spread(row['this'])} | "
                     f"{row['ratio']:.3f} |")
    harness.write(harness.out_of(args, RESULT),
                  {"machine": machine, "commits": commits, "rounds": args.rounds, "warmup": warmup, "steps": steps,
                   "workers": workers, "other_cpu_percent": others, "rows": rows, "command": shown}, "\n".join(lines))


if __name__ == "__main__":
    main()
