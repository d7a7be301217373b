"""What verifying "exact" on the run costs: training with and without it, side by side.

Where a run splits its batches, worker 0 compares steps with what one process computes on the same
global batch (``sn_trainer.engine.step.verification``): the global batch's forward and backward on every
core of the node (the other workers sleep meanwhile), the optimizer's step from the gathered
state, and the comparisons. Per case, runs of ``--steps`` steps alternate, ``--rounds`` times,
between verify_every at its default (every 100th step, the first and the last) and 0 (never); a
run with verify_every=1 (every step) gives what one check costs against a step. The ratio of the
medians is the overhead of a run of that many steps; a check's cost in steps projects it to any
length and to any verify_every.

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
    name, shape, batch, _ = case
    model, data, step_fn = case_inputs(name, shape, batch)
    result = Trainer(workers=workers, threads=1, batch_size=batch, max_steps=steps, seed=0, verify_every=every,
                     measure_after=0, log_every=10**9).fit(
        model, data, optimizer=functools.partial(torch.optim.SGD, lr=0.01, momentum=0.9), step_fn=step_fn)
    return {"seconds": result.train_seconds, "checks": len(result.verified_steps),
            "verify_s": result.stage_seconds_per_worker[0]["verify"], "other_cpu_percent": result.other_cpu_percent,
            "exactness": result.plan["exactness"]}


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
        every_step = max(2, steps // 4)  # a shorter run, every step checked
        on, off, each = [], [], []
        for _ in range(args.rounds):  # alternated, so that drift on a shared machine hits both alike
            on.append(run(case, steps, DEFAULT_EVERY, args.workers))
            off.append(run(case, steps, 0, args.workers))
            each.append(run(case, every_step, 1, args.workers) | {"steps": every_step})
        step_s = statistics.median(r["seconds"] for r in off) / steps
        check_s = statistics.median((e["seconds"] - step_s * e["steps"]) / e["checks"] for e in each)
        overhead = statistics.median(r["seconds"] for r in on) / statistics.median(r["seconds"] for r in off) - 1
        rows[label] = {"steps": steps, "step_s": step_s, "check_s": check_s, "checks": on[0]["checks"],
                       "overhead": overhead, "on": on, "off": off, "every_step": each}
        print(f"{label}: step {step_s * 1e3:.1f} ms, a check {check_s * 1e3:.1f} ms ({check_s / step_s:.2f} steps); "
              f"{steps} steps with verify_every={DEFAULT_EVERY} ({on[0]['checks']} checks): {overhead:+.1%}",
              flush=True)
    machine = harness.describe()
    checks = {n: len(Schedule(DEFAULT_EVERY, 0, n - 1).steps()) for n in (1000, 10000)}
    lines = ["# What verifying \"exact\" on the run costs", "",
             f"{harness.machine_line(machine)} `{harness.command()}`: {args.workers} workers, one thread each, "
             f"synthetic data, SGD momentum 0.9, {args.rounds} rounds alternating runs with verify_every="
             f"{DEFAULT_EVERY} (the default: the first step, every {DEFAULT_EVERY}th, the last) and 0; a run with "
             "verify_every=1 gives one check's cost. Medians. The default checks "
             f"{checks[1000]} steps of 1,000 and {checks[10000]} of 10,000. Load average at the start: {load:.2f} on "
             f"{os.cpu_count()} CPUs" + (" (other processes were running)." if load > 0.5 else "."), "",
             f"| case | steps | a step | a check | a check, in steps | measured: {DEFAULT_EVERY} vs 0 | "
             "projected: 1,000 steps | projected: 10,000 steps |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for label, row in rows.items():
        ratio = row["check_s"] / row["step_s"]
        lines.append(f"| {label} | {row['steps']} | {row['step_s'] * 1e3:.1f} ms | {row['check_s'] * 1e3:.1f} ms | "
                     f"{ratio:.2f} | {row['overhead']:+.1%} | {ratio * checks[1000] / 1000:.1%} | "
                     f"{ratio * checks[10000] / 10000:.1%} |")
    harness.write(harness.out_of(args, RESULT),
                  {"machine": machine, "rounds": args.rounds, "workers": args.workers, "verify_every": DEFAULT_EVERY,
                   "rows": rows, "checks_in": checks, "load_average": load, "command": harness.command()},
                  "\n".join(lines))


if __name__ == "__main__":
    main()
