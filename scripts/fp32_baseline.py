"""How far float32 rounding alone moves a training run: the baseline the fp32 equivalence tests use.

For the equivalence tests' model and data (tests/helpers.py: SmallConvNet, 84 samples, batch 7,
5 steps), per optimizer and seed, each parameter tensor's distance (L2) to the same plain-PyTorch
loop run in float64:

- plain PyTorch in float32 with 1 intra-op thread, and with 2 (the same code, other sums);
- sn_trainer in float32 with 2 and 3 workers;

and the ratio the tests bound: sn_trainer's distance over plain float32's (floored at 1e-7 of
the tensor's norm). tests/test_equivalence.py allows 4x for SGD and AdamW; Adam and RMSprop are
tested in float64 only, because the ratio has no bound worth a test for them.

    python scripts/fp32_baseline.py [--seeds 5] [--out results/fp32_baseline]
"""
from __future__ import annotations

import argparse
import copy
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from helpers import SmallConvNet, cross_entropy, plain_fit, tiny_dataset  # noqa: E402

from sn_trainer import Trainer  # noqa: E402
from sn_trainer.engine.node.machine import describe_machine  # noqa: E402
from sn_trainer.report.results import write_result  # noqa: E402

OPTIMIZERS = {
    "sgd": functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9, weight_decay=1e-3),
    "adamw": functools.partial(torch.optim.AdamW, lr=0.01, weight_decay=0.01),
    "adam": functools.partial(torch.optim.Adam, lr=0.01),
    "rmsprop": functools.partial(torch.optim.RMSprop, lr=0.01),
}
BATCH, STEPS, SEED = 7, 5, 3


def plain(model, optimizer, dtype, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return plain_fit(copy.deepcopy(model).to(dtype), tiny_dataset(dtype=dtype), BATCH, STEPS, SEED,
                         lambda m: optimizer(m.parameters()), cross_entropy)
    finally:
        torch.set_num_threads(before)


def distances(model, exact) -> list[float]:
    return [(p.detach().double() - q.detach()).norm().item() for p, q in zip(model.parameters(), exact.parameters())]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--out", default="results/fp32_baseline")
    args = parser.parse_args()
    rows = []
    for name, optimizer in OPTIMIZERS.items():
        for seed in range(args.seeds):
            torch.manual_seed(seed)
            model = SmallConvNet()
            exact = plain(model, optimizer, torch.float64, 1)
            floor = [1e-7 * q.norm().item() for q in exact.parameters()]
            row = {"optimizer": name, "seed": seed,
                   "plain_1_thread": distances(plain(model, optimizer, torch.float32, 1), exact),
                   "plain_2_threads": distances(plain(model, optimizer, torch.float32, 2), exact)}
            rounding = [max(d, f) for d, f in zip(row["plain_1_thread"], floor)]
            row["ratio_plain_2_threads"] = [d / r for d, r in zip(row["plain_2_threads"], rounding)]
            for workers in (2, 3):
                trained = copy.deepcopy(model)
                Trainer(workers=workers, batch_size=BATCH, max_steps=STEPS, seed=SEED, channels_last=False,
                        log_every=10**9).fit(trained, tiny_dataset(), optimizer=optimizer)
                row[f"sn_{workers}_workers"] = distances(trained, exact)
                row[f"ratio_{workers}_workers"] = [d / r for d, r in zip(row[f"sn_{workers}_workers"], rounding)]
            rows.append(row)
            print(name, seed, " ".join(f"{r:.2f}" for w in (2, 3) for r in row[f"ratio_{w}_workers"]), flush=True)
    machine = describe_machine()
    lines = ["# float32's own rounding, the baseline of the fp32 equivalence tests", "",
             f"Machine: {machine['cpu_model']}, {machine['physical_cores']} physical cores "
             f"({', '.join(machine['isa'])}), torch {machine['torch']}. `python scripts/fp32_baseline.py --seeds "
             f"{args.seeds}`: SmallConvNet, batch {BATCH}, {STEPS} steps; per parameter tensor, the L2 distance to "
             "the same loop in float64. Ratio: sn_trainer's distance over plain float32's (1 thread), the figure "
             "tests/test_equivalence.py bounds by 4; beside it the same ratio for plain PyTorch itself with 2 "
             "threads instead of 1.", "",
             "| optimizer | largest ratio, sn_trainer 2 workers | sn_trainer 3 workers | plain PyTorch, 2 threads |",
             "|---|---:|---:|---:|"]
    for name in OPTIMIZERS:
        group = [r for r in rows if r["optimizer"] == name]
        largest = {k: max(max(r[k]) for r in group) for k in ("ratio_2_workers", "ratio_3_workers",
                                                                "ratio_plain_2_threads")}
        lines.append(f"| {name} | {largest['ratio_2_workers']:.2f} | {largest['ratio_3_workers']:.2f} | "
                     f"{largest['ratio_plain_2_threads']:.2f} |")
    write_result(args.out, {"machine": machine, "seeds": args.seeds, "rows": rows,
                            "command": f"python scripts/fp32_baseline.py --seeds {args.seeds}"}, "\n".join(lines))


if __name__ == "__main__":
    main()
