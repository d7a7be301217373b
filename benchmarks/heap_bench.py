"""glibc's malloc as it ships against a worker that keeps freed memory: page faults and samples/s.

glibc gives freed memory back to the kernel once the free space at the top of its heap passes a
threshold, and maps big blocks from the kernel afresh; a training step that frees its activations
and allocates them again in the next then faults them back in, page by page, every step. A worker
of sn_trainer keeps freed memory where its allocator is the C library's and that is glibc
(``sn_trainer.node.runtime.keep_freed_memory``). Side by side, each in a process of its own:

- one process: plain PyTorch's loop on the whole batch, one thread, pinned: ms per step and minor
  page faults per step (what the kernel did for it), glibc as it ships and with the same thresholds
  a worker sets (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``);
- the ideal: W independent pinned processes on B/W samples each (benchmarks/bench.py's), both ways;
- sn_trainer at W workers, as it runs by default and with glibc's malloc left as it ships (a malloc
  setting of the user's, here ``GLIBC_TUNABLES=glibc.malloc.perturb=0``, glibc's default, leaves it so).

    python benchmarks/heap_bench.py [--rounds 3] [--steps 60] [--warmup 10] [--cases 'lenet b64 cl,...']
"""
from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time

import harness

RESULT = "heap_bench"
MODES = ("shipped", "kept")
KINDS = ("one", "ideal", "sn")
SHIPPED_ENV = {"GLIBC_TUNABLES": "glibc.malloc.perturb=0"}


def one_process(case, steps: int, warmup: int) -> dict:
    """Plain PyTorch on the whole batch in this process, one thread on one core: ms and faults per step."""
    import bench

    bench._pin({min(os.sched_getaffinity(0))}, 1)
    data = bench.make_data(case)
    bench.timed_loop(bench.make_model(case), data, case.batch, bench.Timing(warmup, 0), case)
    model = bench.make_model(case)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    seconds = bench.timed_loop(model, data, case.batch, bench.Timing(0, steps), case)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    return {"rate": case.batch * steps / seconds, "ms": 1000 * seconds / steps, "faults": faults / steps}


def measure(kind: str, label: str, workers: int, steps: int, warmup: int) -> dict:
    """In this (child) process: one figure of ``kind`` for the case ``label``."""
    import bench

    case = next(c for c in cases(tiny=True) + cases() if c.label == label)
    timing = bench.Timing(warmup, steps)
    if kind == "one":
        return one_process(case, steps, warmup)
    return {"rate": bench.measure(kind, case, workers, timing, bench.read_topology())}  # the ideal, or sn_trainer


def cases(tiny: bool = False) -> list:
    from bench import Case

    if tiny:
        return [Case("lenet", 8, "fp32", True)]
    return [Case("lenet", 64, "fp32", True), Case("cifar10_quick", 200, "fp32", True), Case("gpt", 32)]


def child(kind: str, label: str, mode: str, workers: int, steps: int, warmup: int) -> dict:
    """One figure, measured in a fresh process with glibc's environment of ``mode``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    # sn_trainer's workers and the ideal's processes (bench.ideal_worker) keep freed memory themselves where
    # the environment sets nothing of glibc's malloc; one process of plain PyTorch is told by the environment.
    if mode == "shipped":
        env.update(SHIPPED_ENV)
    elif kind == "one":
        from sn_trainer.node.runtime import kept_malloc_environment

        env.update(kept_malloc_environment())
    proc = subprocess.run([sys.executable, __file__, "--child", kind, label, str(workers), str(steps), str(warmup)],
                          env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode:
        raise SystemExit(f"{kind} {label} ({mode}) failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        kind, label, workers, steps, warmup = sys.argv[2:7]
        print(json.dumps(measure(kind, label, int(workers), int(steps), int(warmup))))
        return
    parser = harness.rounds_options(harness.options(__doc__, RESULT))
    args = parser.parse_args()
    if args.tiny:
        args.rounds, args.steps, args.warmup = 1, 2, 1
    from sn_trainer.node.topology import read_topology

    workers = args.workers or read_topology().physical_cores
    chosen = harness.picked(parser, cases(tiny=args.tiny), args.cases)
    load = os.getloadavg()[0]
    started = time.perf_counter()
    got: dict[str, dict[str, list[dict]]] = {c.label: {} for c in chosen}
    for round_index in range(args.rounds):
        for case in chosen:
            for kind in KINDS:
                for mode in MODES if round_index % 2 == 0 else MODES[::-1]:  # alternate which goes first
                    figure = child(kind, case.label, mode, workers, args.steps, args.warmup)
                    got[case.label].setdefault(f"{kind}_{mode}", []).append(figure)
                    extra = f", {figure['faults']:.0f} faults/step" if "faults" in figure else ""
                    print(f"round {round_index + 1}: {case.label:22s} {kind:5s} {mode:7s} "
                          f"{figure['rate']:9.1f} samples/s{extra}", flush=True)
    report(args, chosen, got, workers, load, time.perf_counter() - started)


def report(args, chosen, got, workers: int, load: float, seconds: float) -> None:
    def rates(label, key):
        return [f["rate"] for f in got[label][key]]

    def med(label, key, field="rate"):
        return statistics.median(f[field] for f in got[label][key])

    machine = harness.describe()
    lines = ["# glibc's malloc as it ships against memory kept for the next step", "",
             f"{harness.machine_line(machine)} {os.confstr('CS_GNU_LIBC_VERSION') or 'a C library other than glibc'}. "
             f"`{harness.command()}`: {args.rounds} rounds of {args.steps} steps after {args.warmup}, each figure "
             f"in a fresh process, the two ways alternating which goes first; one thread per process, SGD momentum "
             f"0.9, synthetic data; medians over rounds [min-max]. Load average at the start: {load:.2f} on "
             f"{os.cpu_count()} CPUs" + (" (other processes were running)" if load > 0.5 else "") +
             f"; {seconds / 60:.1f} minutes in all.", "",
             "One process, plain PyTorch's loop on the whole batch:", "",
             "| case | ms/step, shipped | ms/step, kept | page faults/step, shipped | page faults/step, kept "
             "| kept / shipped (speed) |", "|---|---:|---:|---:|---:|---:|"]
    for c in chosen:
        ms = {m: [f["ms"] for f in got[c.label][f"one_{m}"]] for m in MODES}
        lines.append(f"| {c.label} | {harness.spread(ms['shipped'], 1)} | {harness.spread(ms['kept'], 1)} "
                     f"| {med(c.label, 'one_shipped', 'faults'):.0f} | {med(c.label, 'one_kept', 'faults'):.0f} "
                     f"| {med(c.label, 'one_shipped', 'ms') / med(c.label, 'one_kept', 'ms'):.2f} |")
    lines += ["", f"W={workers}: the ideal ({workers} independent pinned processes) and sn_trainer, each way "
              "(samples/s; sequences of 64 tokens for the GPT):", "",
              "| case | ideal, shipped | ideal, kept | sn_trainer, shipped | sn_trainer (kept, its default) "
              "| sn kept / shipped | sn / ideal, shipped | sn / ideal, kept |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for c in chosen:
        cell = {key: harness.spread(rates(c.label, key)) for key in got[c.label]}
        m = {key: med(c.label, key) for key in got[c.label]}
        lines.append(f"| {c.label} | {cell['ideal_shipped']} | {cell['ideal_kept']} | {cell['sn_shipped']} "
                     f"| {cell['sn_kept']} | {m['sn_kept'] / m['sn_shipped']:.2f} "
                     f"| {m['sn_shipped'] / m['ideal_shipped']:.2f} | {m['sn_kept'] / m['ideal_kept']:.2f} |")
    harness.write(harness.out_of(args, RESULT),
                  {"machine": machine, "rounds": args.rounds, "steps": args.steps, "warmup": args.warmup,
                   "workers": workers, "load_average": load, "command": harness.command(), "figures": got},
                  "\n".join(lines))


if __name__ == "__main__":
    main()
