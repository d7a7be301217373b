"""The tuner against an exhaustive sweep of the same grid (workers x threads x allocator x OpenMP), side by side.

For each case, every point of the grid is measured (``--rounds`` alternating rounds, medians),
and the tuner (``Trainer.tune``, as it ships) runs once in between: its choice is then read off
the sweep's own measurements. Reported: the tuned choice against the sweep's best, and the
tuner's wall time against ONE pass of the sweep (what an exhaustive search costs; the rounds
only steady the medians), with the time of all rounds beside it.

    python benchmarks/tune_check.py [--rounds 2]
"""
from __future__ import annotations

import functools
import os
import statistics
import tempfile
import time

import torch
from torch.utils.data import TensorDataset

from sn_trainer import Trainer, tuner
from sn_trainer.node.runtime import available_allocators, available_openmps
from sn_trainer.node.topology import read_topology
from sn_trainer.models import build_model

import harness

RESULT = "tune"
CASES = [("lenet", (1, 28, 28), 128), ("cifar10_quick", (3, 32, 32), 200)]
SGD = functools.partial(torch.optim.SGD, lr=0.01, momentum=0.9)


def model_and_data(name, shape):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    return build_model(name, shape, 10), TensorDataset(torch.randn(4096, *shape, generator=g),
                                                      torch.randint(0, 10, (4096,), generator=g))


def sweep_point(name, shape, batch, workers, threads, allocator, openmp, steps, warmup) -> float:
    model, data = model_and_data(name, shape)
    result = Trainer(workers=workers, threads=threads, batch_size=batch, allocator=allocator, openmp=openmp,
                     max_steps=warmup + steps, measure_after=warmup, log_every=10**9, verify_every=0).fit(
        model, data, optimizer=SGD)
    return result.samples_per_sec


def main() -> None:
    parser = harness.options(__doc__, RESULT)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args()
    cores = read_topology().physical_cores
    allocators, openmps = available_allocators(), available_openmps()
    cases, tuning = CASES, {}  # the tuner as it ships
    if args.tiny:  # LeNet at a batch of 8, the default runtime only, the tuner's measurements as short as it takes
        args.rounds, args.steps, args.warmup = 1, 2, 1
        allocators, openmps, cases = ["system"], ["gnu"], [("lenet", (1, 28, 28), 8)]
        tuning = dict(steps=2, warmup=1, window_s=0.0, top=1, allocators=allocators, openmps=openmps)
    report = {"machine": harness.describe(), "rounds": args.rounds, "steps": args.steps, "warmup": args.warmup,
              "allocators": allocators, "openmps": openmps, "cases": [], "command": harness.command()}
    for name, shape, batch in cases:
        grid = [(w, t, a, o) for w, t in tuner.candidates(cores, batch) for a in allocators for o in openmps]
        samples: dict[tuple, list[float]] = {point: [] for point in grid}
        sweep_seconds = 0.0
        tuned = None
        for _ in range(args.rounds):
            started = time.monotonic()
            for point in grid:
                samples[point].append(sweep_point(name, shape, batch, *point, args.steps, args.warmup))
            sweep_seconds += time.monotonic() - started
            if tuned is None:  # the tuner, as it ships, on a cache of its own
                with tempfile.TemporaryDirectory() as cache:
                    os.environ["XDG_CACHE_HOME"] = cache
                    model, data = model_and_data(name, shape)
                    tuned = Trainer(batch_size=batch).tune(model, data, optimizer=SGD, **tuning)
                    del os.environ["XDG_CACHE_HOME"]
        medians = {point: statistics.median(v) for point, v in samples.items()}
        best = max(medians, key=medians.get)
        choice = (tuned.workers, tuned.threads, tuned.allocator, tuned.openmp)
        row = {"model": name, "batch": batch, "sweep": [{"workers": w, "threads": t, "allocator": a, "openmp": o,
                                                         "samples_per_sec": medians[(w, t, a, o)],
                                                         "rounds": samples[(w, t, a, o)]} for w, t, a, o in grid],
               "sweep_best": {"point": list(best), "samples_per_sec": medians[best]},
               "tuned": {"point": list(choice), "samples_per_sec_in_sweep": medians[choice],
                         "table": tuned.table(), "seconds": tuned.seconds},
               "tuned_over_best": medians[choice] / medians[best],
               "sweep_seconds": sweep_seconds, "sweep_pass_seconds": sweep_seconds / args.rounds,
               "tuner_over_one_pass": tuned.seconds / (sweep_seconds / args.rounds)}
        report["cases"].append(row)
        print(f"{name} b{batch}: sweep best {best} {medians[best]:.0f}/s; tuned {choice} {medians[choice]:.0f}/s "
              f"({row['tuned_over_best']:.2f}x) in {tuned.seconds:.0f} s against {row['sweep_pass_seconds']:.0f} s "
              f"for one pass of the sweep ({row['tuner_over_one_pass']:.2f})", flush=True)
    harness.write(harness.out_of(args, RESULT), report, markdown(report))


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = ["# The tuner against an exhaustive sweep", "",
             f"{harness.machine_line(m)} "
             f"`{report['command']}`: every point of workers x threads x allocator ({', '.join(report['allocators'])}) "
             f"x OpenMP ({', '.join(report['openmps'])}), "
             f"{report['rounds']} alternating rounds of {report['steps']} steps after {report['warmup']}, medians; "
             "the tuner (`Trainer.tune` as it ships) ran once, between the rounds, and its choice is read off the "
             "sweep's own measurements.", "",
             "| case | sweep's best | samples/s | tuned choice | its samples/s in the sweep | tuned / best "
             "| tuner's seconds | one pass of the sweep, seconds | tuner / one pass | all rounds, seconds |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for c in report["cases"]:
        best, tuned = c["sweep_best"], c["tuned"]
        lines.append(f"| {c['model']} b{c['batch']} | {' x '.join(map(str, best['point']))} | "
                     f"{best['samples_per_sec']:.0f} | {' x '.join(map(str, tuned['point']))} | "
                     f"{tuned['samples_per_sec_in_sweep']:.0f} | {c['tuned_over_best']:.2f} | {tuned['seconds']:.0f} | "
                     f"{c['sweep_pass_seconds']:.0f} | {c['tuner_over_one_pass']:.2f} | {c['sweep_seconds']:.0f} |")
    lines += ["", "Every point (workers x threads allocator/OpenMP: samples/s, median):", ""]
    for c in report["cases"]:
        lines.append(f"- {c['model']} b{c['batch']}: " + "; ".join(
            f"{p['workers']}x{p['threads']} {p['allocator']}/{p['openmp']} {p['samples_per_sec']:.0f}"
            for p in c["sweep"]))
    lines += ["", "The tuner's own tables:", ""]
    for c in report["cases"]:
        lines += [f"{c['model']} b{c['batch']}:", "```", c["tuned"]["table"], "```"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
