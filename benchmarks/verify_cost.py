"""What verifying "exact" on the run costs: training with and without it, side by side.

Where a run splits its batches, worker 0 compares steps with what one process computes on the same
global batch (``sn_trainer.engine.step.verification``): the global batch read again, its forward
and backward on every core of the node (the other workers sleep meanwhile), the optimizer's step
from the gathered state, and the comparisons. Per case, runs of ``--steps`` steps alternate,
``--rounds`` times, between verify_every at its default (every 100th step, the first and the last)
and 0 (never). Two figures: the ratio of the two kinds' median times, which a shared machine's
drift between runs moves by several percent; and, inside each verified run, how much longer its
verified steps took than its median step (every step's time from a progress record a step),
against the run's time: the cost itself, free of that drift. A check's seconds against a step's
give the cost of any length and verify_every.

    python benchmarks/verify_cost.py [--rounds 3] [--steps 1000] [--workers 2]
"""
from __future__ import annotations

import functools
import os
import statistics

import torch
from torch.utils.data import TensorDataset

from sn_trainer import Trainer
from sn_trainer.config import TrainerConfig
from sn_trainer.engine.step.verification import Schedule
from sn_trainer.models import build_model
from sn_trainer.models.gpt import GPT as GPTModel
from sn_trainer.models.gpt import language_model_step

import harness

RESULT = "verify_cost"
DEFAULT_EVERY = TrainerConfig().verify_every
GPT = {"vocab": 96, "block": 64, "n_layer": 3, "n_head": 4, "n_embd": 128}  # the gpt_text preset's size
# case: (model, input shape or None for the GPT, global batch, steps as a fraction of --steps)
CASES = {"lenet b64": ("lenet", (1, 28, 28), 64, 1.0), "cifar10_quick b100": ("cifar10_quick", (3, 32, 32), 100, 0.4),
         "gpt b32": ("gpt", None, 32, 0.4)}


def case_inputs(name: str, shape, batch: int):
    """The model, its data (synthetic, 50 batches) and its step function."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    if name == "gpt":
        tokens = torch.randint(0, GPT["vocab"], (batch * 50, GPT["block"] + 1), generator=g)
        data = TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
        return GPTModel(GPT["vocab"], GPT["block"], GPT["n_layer"], GPT["n_head"], GPT["n_embd"]), data, \
            language_model_step
    data = TensorDataset(torch.randn(batch * 50, *shape, generator=g), torch.randint(0, 10, (batch * 50,), generator=g))
    return build_model(name, shape, 10), data, None


def run(case: tuple, steps: int, every: int, workers: int) -> dict:
    """One run: its time, and each step's seconds (a progress record every step), split into the
    verified steps' and the others'."""
    name, shape, batch, _ = case
    model, data, step_fn = case_inputs(name, shape, batch)
    result = Trainer(workers=workers, threads=1, batch_size=batch, max_steps=steps, seed=0, verify_every=every,
                     measure_after=0, log_every=1).fit(
        model, data, optimizer=functools.partial(torch.optim.SGD, lr=0.01, momentum=0.9), step_fn=step_fn)
    seconds = {r["step"]: batch / r["samples_per_sec"] for r in result.history if "samples_per_sec" in r}
    verified = set(result.verified_steps)
    usual = statistics.median(t for s, t in seconds.items() if s not in verified and s != 1)
    extra = [seconds[s] - usual for s in sorted(verified) if s != 1]
    return {"seconds": result.train_seconds, "checks": len(verified), "step_s": usual, "extra_s": extra,
            "first_s": seconds[1],
            "other_cpu_percent": result.other_cpu_percent, "exactness": result.plan["exactness"]}


def main() -> None:
    parser = harness.options(__doc__, RESULT)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=1000, help="steps of the LeNet runs (the others run fewer)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    if args.tiny:
        args.rounds, args.steps = 1, 10
    load = os.getloadavg()[0]
    rows = {}
    for label in [c.strip() for c in args.cases.split(",")]:
        case = CASES[label]
        steps = max(2, round(args.steps * case[3]))
        on, off = [], []
        for _ in range(args.rounds):  # alternated, so that drift on a shared machine hits both alike
            on.append(run(case, steps, DEFAULT_EVERY, args.workers))
            off.append(run(case, steps, 0, args.workers))
        step_s = statistics.median(r["step_s"] for r in on)
        first_s = statistics.median(r["first_s"] for r in off)  # a first step's own warm-up, checked or not
        for r in on:
            r["extra_s"].insert(0, r["first_s"] - first_s)
        check_s = statistics.median(sum(r["extra_s"]) / r["checks"] for r in on)  # the first check's included
        share = statistics.median(sum(r["extra_s"]) / r["seconds"] for r in on)
        ratio = statistics.median(r["seconds"] for r in on) / statistics.median(r["seconds"] for r in off) - 1
        rows[label] = {"steps": steps, "step_s": step_s, "check_s": check_s, "checks": on[0]["checks"],
                       "share": share, "ratio": ratio, "on": on, "off": off}
        print(f"{label}: step {step_s * 1e3:.1f} ms, a check {check_s * 1e3:.1f} ms ({check_s / step_s:.2f} steps); "
              f"{steps} steps, {on[0]['checks']} checks: verifying {share:.1%} of the run; on/off {ratio:+.1%}",
              flush=True)
    machine = harness.describe()
    checks = {n: len(Schedule(DEFAULT_EVERY, 0, n - 1).steps()) for n in (1000, 10000)}
    others = max((r["other_cpu_percent"] or 0.0) for row in rows.values() for r in row["on"] + row["off"])
    lines = ["# What verifying \"exact\" on the run costs", "",
             f"{harness.machine_line(machine)} `{harness.command()}`: {args.workers} workers, one thread each, "
             f"synthetic data, SGD momentum 0.9, {args.rounds} rounds alternating runs with verify_every="
             f"{DEFAULT_EVERY} (the default: the first step, every {DEFAULT_EVERY}th, the last) and 0. Medians. "
             "\"Verifying\" is how much longer the verified steps of a verified run took than its median step "
             "(each step timed by a progress record), against the run's time: the cost, free of the drift between "
             "runs that moves the on/off ratio of whole runs. A check is that over the run's checks (the first "
             "pays once for the global batch's new kernel shapes: its step against the unverified runs' first); "
             "the default checks "
             f"{checks[1000]} steps of 1,000 and {checks[10000]} of 10,000. "
             f"Load average at the start: {load:.2f} on {os.cpu_count()} CPUs; other processes took up to "
             f"{others:.0f}% of the CPU during a run" + (" (the machine was shared)." if others > 5 else "."), "",
             "| case | steps | a step | a check | a check, in steps | verifying, of the run | on/off, whole runs "
             "| projected: 10,000 steps |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for label, row in rows.items():
        in_steps = row["check_s"] / row["step_s"]
        lines.append(f"| {label} | {row['steps']} | {row['step_s'] * 1e3:.1f} ms | {row['check_s'] * 1e3:.1f} ms | "
                     f"{in_steps:.2f} | {row['share']:.1%} | {row['ratio']:+.1%} | "
                     f"{in_steps * checks[10000] / 10000:.1%} |")
    harness.write(harness.out_of(args, RESULT),
                  {"machine": machine, "rounds": args.rounds, "workers": args.workers, "verify_every": DEFAULT_EVERY,
                   "rows": rows, "checks_in": checks, "load_average": load, "other_cpu_percent": others,
                   "command": harness.command()},
                  "\n".join(lines))


if __name__ == "__main__":
    main()
