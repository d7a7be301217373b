"""torch.compile against eager on the bench cases, fp32 and bf16, side by side in one run.

Each case trains on synthetic images of its shape with 2 workers, eager and ``compile=true``, in
fp32 and ``precision=bf16`` (autocast; fp32 where the CPU has no native bf16). The compile falls in
the warm-up steps, left out of samples/s; its time (the first step's beyond a measured step's) is
reported apart, for the first compiled run of each case (a cold inductor cache of this run's own)
and the later ones (from the cache the workers share). Rounds
alternate the variants, so that drift on a shared machine hits all alike; medians.

    python benchmarks/compile_bench.py [--rounds 2] [--workers 2]
"""
from __future__ import annotations

import functools
import os
import statistics
import tempfile

import torch
from torch.utils.data import TensorDataset

from sn_trainer import Trainer
from sn_trainer.models import build_model

import harness

RESULT = "compile_bench"
CASES = {"lenet b64": ("lenet", (1, 28, 28), 64), "lenet b128": ("lenet", (1, 28, 28), 128),
         "cifar10_quick b200": ("cifar10_quick", (3, 32, 32), 200)}
PRECISIONS = ("fp32", "bf16")
WARMUP, STEPS = 5, 40


def run(case: tuple[str, tuple[int, ...], int], precision: str, compiled: bool, workers: int, warmup: int,
        steps: int) -> dict:
    name, shape, batch = case
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(4096, *shape, generator=g), torch.randint(0, 10, (4096,), generator=g))
    torch.manual_seed(0)
    result = Trainer(workers=workers, batch_size=batch, max_steps=warmup + steps, measure_after=warmup,
                     precision=precision, compile=compiled, log_every=10**9, verify_every=0).fit(
        build_model(name, shape, 10), data, optimizer=functools.partial(torch.optim.SGD, lr=0.01, momentum=0.9))
    return {"samples_per_sec": result.samples_per_sec, "compile_seconds": result.compile_seconds,
            "precision": result.precision}


def main() -> None:
    parser = harness.options(__doc__, RESULT)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    # A tiny run compiles the smallest model, an MLP, once in fp32: the compile is most of its time.
    cases, precisions = ({"mlp b8": ("mlp", (1, 28, 28), 8)}, ("fp32",)) if args.tiny else (CASES, PRECISIONS)
    warmup, steps = (1, 2) if args.tiny else (WARMUP, STEPS)
    rounds = 1 if args.tiny else args.rounds
    # A cache of this run's own: the first compiled run of each case compiles cold, the later ones
    # from what it left (the workers pass the variable on to their compiles).
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="sn_trainer-inductor-")
    variants = [(case, precision, compiled) for case in cases for precision in precisions
                for compiled in (False, True)]
    runs: dict[str, list[dict]] = {f"{c} {p} {'compiled' if k else 'eager'}": [] for c, p, k in variants}
    for round_index in range(rounds):
        for case, precision, compiled in variants:
            key = f"{case} {precision} {'compiled' if compiled else 'eager'}"
            runs[key].append(run(cases[case], precision, compiled, args.workers, warmup, steps))
            print(f"round {round_index + 1}: {key:36s} {runs[key][-1]['samples_per_sec']:8.0f} samples/s"
                  + (f", compile {runs[key][-1]['compile_seconds']:.1f} s" if compiled else ""), flush=True)
    machine = harness.describe()
    lines = ["# torch.compile against eager", "",
             f"{harness.machine_line(machine)} `{harness.command()}`: {args.workers} workers x 1 thread, {steps} "
             f"measured steps after {warmup} (the compile falls in those), {rounds} alternating rounds, medians "
             "[min-max].", "",
             "| case | precision ran | eager samples/s | compiled samples/s | compiled / eager | compile s, first run "
             "| compile s, later |", "|---|---|---:|---:|---:|---:|---:|"]
    ratios = {}
    for case in cases:
        for precision in precisions:
            eager, compiled = runs[f"{case} {precision} eager"], runs[f"{case} {precision} compiled"]
            e = statistics.median(r["samples_per_sec"] for r in eager)
            c = statistics.median(r["samples_per_sec"] for r in compiled)
            ratios[f"{case} {precision}"] = c / e
            later = [r["compile_seconds"] for r in compiled[1:]]
            lines.append(f"| {case} | {compiled[0]['precision']} | "
                         f"{harness.spread([r['samples_per_sec'] for r in eager])} | "
                         f"{harness.spread([r['samples_per_sec'] for r in compiled])} | {c / e:.3f} | "
                         f"{compiled[0]['compile_seconds']:.1f} | "
                         + (f"{statistics.median(later):.1f} |" if later else "- |"))
    harness.write(harness.out_of(args, RESULT), {"machine": machine, "workers": args.workers, "rounds": rounds,
                                                 "runs": runs, "compiled_over_eager": ratios,
                                                 "command": harness.command()}, "\n".join(lines))


if __name__ == "__main__":
    main()
