"""The Trainer beside other work: sn_trainer at W workers, pinned and not, against DDP over gloo, pinned
and not, beside busy loops of the same priority, side by side in one run.

    python benchmarks/busy_bench.py [--busy 2] [--rounds 3] [--steps 60] [--warmup 10] [--cases 'lenet b128,...']

A workstation with an editor and a notebook, a shared server, a CI runner: the cores are not all the
run's. ``--busy N`` runs N ``sh -c 'while :; do :; done'`` for the whole run (0: an idle machine, for
the same table without them). Each round runs every variant of every case in turn, so that drift hits
all alike; samples/s after the warm-up, medians over the rounds [min-max]. Variants:

- sn pinned / sn unpinned: ``Trainer(workers=W, threads=1, pin=True / False)``;
- sn auto: ``pin=auto`` (the default: pinned unless other work keeps the cores busy as the run starts);
- ddp pinned / ddp unpinned: DDP over gloo, W processes of one thread, each pinned to its core or not
  (torchrun pins nothing).
"""
from __future__ import annotations

import statistics
import tempfile

from bench import Case, Timing, ddp_worker, make_data, make_model, sgd, spawn
from sn_trainer import Trainer
from sn_trainer.node.topology import plan_pinning, read_topology
from sn_trainer.models.gpt import language_model_step

import harness

RESULT = "busy_bench"
VARIANTS = ("sn pinned", "sn unpinned", "sn auto", "ddp pinned", "ddp unpinned")
CASES = {case.label: case for case in (Case("lenet", 128), Case("cifar10_quick", 100), Case("gpt", 32))}


def measure(variant: str, case: Case, workers: int, timing: Timing, topology, data) -> float:
    if variant.startswith("ddp"):
        pinning = plan_pinning(topology, workers, 1)
        if variant == "ddp unpinned":
            every = tuple(cpu for cpus in pinning for cpu in cpus)
            pinning = [every] * workers
        with tempfile.TemporaryDirectory() as tmp:
            return spawn(ddp_worker, workers, case, timing, pinning, f"{tmp}/store", data)[0]
    pin = {"sn pinned": True, "sn unpinned": False, "sn auto": "auto"}[variant]
    result = Trainer(workers=workers, threads=1, pin=pin, batch_size=case.batch, max_steps=timing.warmup + timing.steps,
                     measure_after=timing.warmup, log_every=10**9, verify_every=0).fit(
        make_model(case), data, optimizer=sgd(), step_fn=language_model_step if case.model == "gpt" else None)
    return result.samples_per_sec


def main() -> None:
    parser = harness.options(__doc__, RESULT)
    parser.add_argument("--busy", type=int, default=2, help="busy loops beside the run (default: 2)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--workers", type=int, default=None, help="default: all physical cores")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    args = parser.parse_args()
    if args.tiny:
        args.rounds, args.steps, args.warmup, args.busy, args.cases = 1, 2, 1, 1, "lenet b128"
    topology = read_topology()
    workers = args.workers or topology.physical_cores
    unknown = set(args.cases.split(",")) - set(CASES)
    if unknown:
        parser.error(f"unknown case {sorted(unknown)}; the cases: {', '.join(CASES)}")
    cases = [CASES[label] for label in args.cases.split(",")]
    data = {case.label: make_data(case) for case in cases}
    for tensors in data.values():
        for tensor in tensors.tensors:
            tensor.share_memory_()
    samples: dict[str, dict[str, list[float]]] = {case.label: {v: [] for v in VARIANTS} for case in cases}
    with harness.busy_loops(args.busy):
        for round_index in range(args.rounds):
            for case in cases:
                timing = Timing(args.warmup, args.steps).for_case(case)
                for variant in VARIANTS:
                    rate = measure(variant, case, workers, timing, topology, data[case.label])
                    samples[case.label][variant].append(rate)
                    print(f"round {round_index + 1}: {case.label:18s} {variant:12s} {rate:9.1f} samples/s", flush=True)
    machine = harness.describe()
    beside = (f"beside {args.busy} busy loop(s) of the same priority (`{' '.join(harness.BUSY_LOOP)}`)" if args.busy
              else "on an idle machine (no busy loops)")
    lines = [f"# The Trainer beside other work: W={workers}, {beside}", "",
             f"{harness.machine_line(machine)} `{harness.command()}`: {args.rounds} rounds of {args.steps} steps after "
             f"{args.warmup} warm-up steps, one thread per process, SGD momentum 0.9, synthetic data made once; "
             "samples/s, medians over the rounds [min-max]; ratios of medians.", "",
             "| case | " + " | ".join(VARIANTS) + " | sn auto / ddp unpinned | sn auto / best ddp | pinned / unpinned (sn) |",
             "|---|" + "---:|" * (len(VARIANTS) + 3)]
    rows = []
    for case in cases:
        med = {v: statistics.median(samples[case.label][v]) for v in VARIANTS}
        best_ddp = max(med["ddp pinned"], med["ddp unpinned"])
        row = {"case": case.label, "median": med, "samples": samples[case.label],
               "auto_over_ddp_unpinned": med["sn auto"] / med["ddp unpinned"], "auto_over_best_ddp": med["sn auto"] / best_ddp,
               "pinned_over_unpinned": med["sn pinned"] / med["sn unpinned"]}
        rows.append(row)
        lines.append(f"| {case.label} | " + " | ".join(harness.spread(samples[case.label][v]) for v in VARIANTS)
                     + f" | {row['auto_over_ddp_unpinned']:.2f} | {row['auto_over_best_ddp']:.2f} "
                       f"| {row['pinned_over_unpinned']:.2f} |")
    harness.write(harness.out_of(args, RESULT + ("" if args.busy else "_idle")),
                  {"machine": machine, "workers": workers, "busy_loops": args.busy, "rounds": args.rounds,
                   "steps": args.steps, "warmup": args.warmup, "rows": rows, "command": harness.command()},
                  "\n".join(lines))


if __name__ == "__main__":
    main()
