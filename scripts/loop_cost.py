"""What shaping the loop costs, side by side in one run: the weights' moving average, and phases.

- EMA: LeNet b128 on synthetic 28x28 images, with ``ema_decay=0.999`` against without (each
  worker averages its own shard after every step).
- Phases: examples/dcgan.py's DCGAN at b128 with ``sync_batchnorm``, its two phases (D,
  then G: two sums of the gradient and two updates a step) against one phase doing the same
  forward and backward work (both losses at once, one sum, one update).

Rounds alternate the variants, so that drift on a shared machine hits both alike; medians.

    python scripts/loop_cost.py [--rounds 5] [--workers 2] [--out results/loop_cost]
"""
from __future__ import annotations

import argparse
import functools
import statistics
import sys
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from dcgan import DCGAN, LATENT, d_params, d_step, g_params, g_step  # noqa: E402

from sn_trainer import Phase, Trainer  # noqa: E402
from sn_trainer.models import build_model  # noqa: E402
from sn_trainer.engine.machine import describe_machine  # noqa: E402
from sn_trainer.report.results import write_result  # noqa: E402

ADAM = functools.partial(torch.optim.Adam, lr=2e-4, betas=(0.5, 0.999))


def both_losses(model, batch):
    """One phase with the two phases' forward and backward work: D's loss and G's, together."""
    return d_step(model, batch) + g_step(model, batch)


def lenet(workers: int, steps: int, warmup: int, ema: float | None) -> float:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(4096, 1, 28, 28, generator=g), torch.randint(0, 10, (4096,), generator=g))
    torch.manual_seed(0)
    return Trainer(workers=workers, batch_size=128, max_steps=warmup + steps, measure_after=warmup, ema_decay=ema,
                   log_every=10**9).fit(build_model("lenet", (1, 28, 28), 10), data,
                                        optimizer=functools.partial(torch.optim.SGD, lr=0.01, momentum=0.9)
                                        ).samples_per_sec


def gan(workers: int, steps: int, warmup: int, phased: bool) -> float:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(4096, 1, 28, 28, generator=g).tanh(), torch.randn(4096, LATENT, generator=g))
    torch.manual_seed(0)
    trainer = Trainer(workers=workers, batch_size=128, max_steps=warmup + steps, measure_after=warmup,
                      sync_batchnorm=True, log_every=10**9)
    if phased:
        return trainer.fit(DCGAN(), data, phases=[Phase(d_step, d_params, ADAM, name="D"),
                                                  Phase(g_step, g_params, ADAM, name="G")]).samples_per_sec
    return trainer.fit(DCGAN(), data, step_fn=both_losses, optimizer=ADAM).samples_per_sec


VARIANTS = {
    "lenet b128, no EMA": functools.partial(lenet, ema=None),
    "lenet b128, ema_decay=0.999": functools.partial(lenet, ema=0.999),
    "dcgan b128, one phase (both losses)": functools.partial(gan, phased=False),
    "dcgan b128, two phases (D, then G)": functools.partial(gan, phased=True),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default="results/loop_cost")
    args = parser.parse_args()
    rates: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for round_index in range(args.rounds):
        for name, measure in VARIANTS.items():
            rates[name].append(measure(args.workers, args.steps, args.warmup))
            print(f"round {round_index + 1}: {name:40s} {rates[name][-1]:8.0f} samples/s", flush=True)
    median = {name: statistics.median(values) for name, values in rates.items()}
    names = list(VARIANTS)
    ema_ratio = median[names[1]] / median[names[0]]
    phase_ratio = median[names[3]] / median[names[2]]
    machine = describe_machine()
    lines = ["# What shaping the loop costs", "",
             f"Machine: {machine['cpu_model']}, {machine['physical_cores']} physical cores "
             f"({', '.join(machine['isa'])}), torch {machine['torch']}. `python scripts/loop_cost.py --rounds "
             f"{args.rounds}`: {args.workers} workers, {args.steps} measured steps after {args.warmup}, "
             f"{args.rounds} alternating rounds, medians [min-max].", "",
             "| variant | samples/s | ratio |", "|---|---:|---:|"]
    for index, name in enumerate(names):
        base = median[names[index - index % 2]]
        lines.append(f"| {name} | {median[name]:.0f} [{min(rates[name]):.0f}-{max(rates[name]):.0f}] | "
                     f"{median[name] / base:.3f} |")
    lines += ["", f"EMA on / off: {ema_ratio:.3f}. Two phases / one phase of the same work: {phase_ratio:.3f}."]
    write_result(args.out, {"machine": machine, "workers": args.workers, "rounds": args.rounds, "steps": args.steps,
                            "warmup": args.warmup, "samples_per_sec": rates, "median": median,
                            "ema_over_no_ema": ema_ratio, "phases_over_one_phase": phase_ratio,
                            "command": f"python scripts/loop_cost.py --rounds {args.rounds}"}, "\n".join(lines))


if __name__ == "__main__":
    main()
