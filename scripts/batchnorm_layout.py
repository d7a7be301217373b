"""Batch-norm nets and channels_last, on one core: how far fp32 gradients fall from float64, and speed.

Where the error comes from: each layer kind alone (convolution, batch norm, the whole net) in
both layouts, every fp32 gradient against the same computation in float64. Then the speed of
a training step in both layouts, for the nets of the bench (resnet18 and cifar10_quick with
batch norm). This is what ``channels_last=auto`` decides on for nets with batch norm.

    python scripts/batchnorm_layout.py [--rounds 3] [--out results/batchnorm_layout]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch import nn

from sn_trainer.models import build_model
from sn_trainer.engine.node.machine import describe_machine
from sn_trainer.report.results import write_result


def relative_error(model_fn, shape, batch: int, channels_last: bool, seed: int = 0) -> float:
    """The fp32 gradient's distance from the float64 one, relative to its size: ||g32 - g64|| / ||g64||
    over every parameter at once (a per-parameter ratio would divide by gradients that are zero but
    for rounding, such as a convolution's bias before batch norm)."""
    torch.manual_seed(seed)
    reference = model_fn().double()
    fp32 = model_fn()
    fp32.load_state_dict({k: v.float() for k, v in reference.state_dict().items()})
    x64 = torch.randn(batch, *shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    y = torch.randint(0, 10, (batch,), generator=torch.Generator().manual_seed(seed + 1))
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    fp32 = fp32.to(memory_format=fmt)
    for model, x in ((reference, x64), (fp32, x64.float().contiguous(memory_format=fmt))):
        model.train()
        out = model(x)
        out = out.flatten(1)[:, :10] if out.dim() > 2 else out
        nn.functional.cross_entropy(out, y).backward()
    g64 = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
    g32 = torch.cat([p.grad.double().reshape(-1) for p in fp32.parameters()])
    return ((g32 - g64).norm() / g64.norm()).item()


class ConvOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1),
                                 nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))

    def forward(self, x):
        return self.net(x)


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                                 nn.Conv2d(64, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                                 nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))

    def forward(self, x):
        return self.net(x)


class BNOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm2d(64)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))

    def forward(self, x):
        return self.head(torch.relu(self.bn(x)))


SEEDS = 7


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.1e} [{min(values):.1e}-{max(values):.1e}]"


def step_ms(model_fn, shape, batch: int, channels_last: bool, reps: int = 10) -> float:
    torch.manual_seed(0)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    model = model_fn().to(memory_format=fmt)
    x, y = torch.randn(batch, *shape).contiguous(memory_format=fmt), torch.randint(0, 10, (batch,))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    times = []
    for i in range(3 + reps):
        start = time.perf_counter()
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if i >= 3:
            times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


class Shifted(nn.Module):
    """Batch norm of inputs whose mean is 20 standard deviations from 0, as after a ReLU and a convolution."""

    def __init__(self):
        super().__init__()
        self.inner = BNOnly()

    def forward(self, x):
        return self.inner(x * 0.5 + 10)


ACCURACY = [("convolutions only", ConvOnly, (3, 32, 32), 16), ("batch norm only", BNOnly, (64, 16, 16), 16),
            ("batch norm of inputs with mean 20 x std", Shifted, (64, 16, 16), 16),
            ("convolutions + batch norm", ConvBN, (3, 32, 32), 16),
            ("resnet18", lambda: build_model("resnet18", (3, 64, 64), 10), (3, 64, 64), 16)]
SPEED = [("resnet18", lambda: build_model("resnet18", (3, 64, 64), 10), (3, 64, 64), 32),
         ("cifar10_quick_bn", lambda: build_model("cifar10_quick_bn", (3, 32, 32), 10), (3, 32, 32), 100)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="results/batchnorm_layout")
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    torch.set_num_threads(1)
    accuracy = []
    for name, fn, shape, batch in ACCURACY:
        errors = {layout: sorted(relative_error(fn, shape, batch, layout == "channels_last", seed) for seed in range(SEEDS))
                  for layout in ("contiguous", "channels_last")}
        accuracy.append({"model": name, **errors})
        print(f"{name:28s} " + "  ".join(f"{k} {_spread(v)}" for k, v in errors.items()), flush=True)
    samples: dict[tuple[str, bool], list[float]] = {}
    for _ in range(args.rounds):
        for name, fn, shape, batch in SPEED:
            for channels_last in (False, True):
                samples.setdefault((name, channels_last), []).append(step_ms(fn, shape, batch, channels_last))
    speed = []
    for name, _, _, batch in SPEED:
        contiguous, nhwc = (statistics.median(samples[(name, cl)]) for cl in (False, True))
        speed.append({"model": name, "batch": batch, "contiguous_ms": contiguous, "channels_last_ms": nhwc,
                      "speedup": contiguous / nhwc})
    machine = describe_machine()
    report = {"machine": machine, "threads": 1, "rounds": args.rounds, "accuracy": accuracy, "speed": speed,
              "command": "python scripts/batchnorm_layout.py"}
    lines = ["# Batch-norm nets on one core: fp32 gradient error and speed, contiguous against channels_last", "",
             f"Machine: {machine['cpu_model']}, torch {machine['torch']}, 1 thread pinned to one core. "
             f"`{report['command']}`.", "",
             "The fp32 gradient against the same net's in float64, ||g32 - g64|| / ||g64|| over all parameters "
             f"(training mode, batch 16; median of {SEEDS} seeds [min-max]):", "",
             "| net | contiguous | channels_last |", "|---|---:|---:|"]
    lines += [f"| {r['model']} | {_spread(r['contiguous'])} | {_spread(r['channels_last'])} |" for r in accuracy]
    lines += ["", f"A training step (SGD, median of {args.rounds} rounds of 10 steps):", "",
              "| net | batch | contiguous ms | channels_last ms | speedup |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['model']} | {r['batch']} | {r['contiguous_ms']:.1f} | {r['channels_last_ms']:.1f} "
              f"| {r['speedup']:.2f}x |" for r in speed]
    write_result(args.out, report, "\n".join(lines))


if __name__ == "__main__":
    main()
