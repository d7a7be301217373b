"""A folder of JPEG files read, decoded and augmented per sample inside the workers, against the
same images preloaded as tensors, side by side in one run.

Two sets are generated from Fashion-MNIST (tinted per class, so that the files are colour JPEGs
of a realistic size): 20,000 at 32x32 and 2,000 at 224x224, in class folders. For each, with
cifar10_quick (random crop and flip on):

- preloaded: ``dataset.preload=true``, the images decoded into shared memory once, augmented a
  slice at a time;
- files: ``dataset.preload=false``, each worker reads and augments its samples per step, inline
  (``prefetch=false``) or the next step read ahead in a thread (``prefetch=true``).

Also the cost of reading one sample alone (open, decode, augment, normalise) in one process.
Rounds alternate the variants, so that drift on a shared machine hits all alike; medians.

    python benchmarks/folder_bench.py [--rounds 3] [--workers 2] [--images DIR]
"""
from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time
from pathlib import Path

import torch

from sn_trainer import Trainer
from sn_trainer.cli.run_config import DatasetConfig
from sn_trainer.cli.named_datasets import load_datasets
from sn_trainer.engine.processes.stages import STEP_STAGES
from sn_trainer.models import build_model

import harness

RESULT = "folder_bench"
SETS = {"32x32": (32, 20_000, 200, 40), "224x224": (224, 2_000, 32, 12)}  # size, images, batch, measured steps
TINY_SETS = {"32x32": (32, 64, 16, 2)}
WARMUP = 4
TINTS = torch.tensor([[1.0, 0.6, 0.6], [0.6, 1.0, 0.6], [0.6, 0.6, 1.0], [1.0, 1.0, 0.5], [1.0, 0.5, 1.0],
                      [0.5, 1.0, 1.0], [0.9, 0.7, 0.5], [0.5, 0.7, 0.9], [0.8, 0.8, 0.8], [1.0, 0.8, 0.6]])


def generate(root: Path, size: int, count: int) -> Path:
    """``count`` Fashion-MNIST images as size x size colour JPEGs in root/<class>/ (kept if there)."""
    from PIL import Image

    folder = root / f"{size}x{size}"
    if folder.is_dir() and sum(1 for _ in folder.rglob("*.jpg")) == count:
        return folder
    source = load_datasets(DatasetConfig(name="fashion_mnist")).train
    images = source.images[:count].float()
    images = torch.nn.functional.interpolate(images, size=(size, size), mode="bilinear", align_corners=False) \
        if size != 28 else images
    for i in range(count):
        label = int(source.labels[i])
        pixels = (images[i, 0, :, :, None] * TINTS[label]).clamp(0, 255).to(torch.uint8).numpy()
        (folder / str(label)).mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels).save(folder / str(label) / f"{i:05d}.jpg", quality=90)
    return folder


def read_cost(dataset, samples: int = 500) -> float:
    """Microseconds to read one sample alone (this process, one thread)."""
    torch.set_num_threads(1)
    picked = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(0))[:samples].tolist()
    started = time.perf_counter()
    for i in picked:
        dataset[i]
    return 1e6 * (time.perf_counter() - started) / samples


def train(data, size: int, batch: int, steps: int, warmup: int, workers: int, prefetch: bool) -> dict:
    torch.manual_seed(0)
    model = build_model("cifar10_quick", (3, size, size), data.num_classes)
    result = Trainer(workers=workers, batch_size=batch, max_steps=warmup + steps, measure_after=warmup,
                     prefetch=prefetch, log_every=10**9, verify_every=0).fit(
        model, data.train, optimizer=functools.partial(torch.optim.SGD, lr=0.01, momentum=0.9))
    return {"samples_per_sec": result.samples_per_sec, "prefetch": result.plan["prefetch"],
            "stage_ms": {s: 1000 * result.stage_seconds[s] / result.measured_steps for s in STEP_STAGES}}


def main() -> None:
    parser = harness.options(__doc__, RESULT)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--images", default=str(Path(tempfile.gettempdir()) / "sn_trainer-folder-bench"),
                        help="where the generated image sets are kept between runs")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:  # a tiny run's few images, not kept
        images = Path(scratch) if args.tiny else Path(args.images)
        measure(args, TINY_SETS if args.tiny else SETS, images, 1 if args.tiny else args.rounds,
                1 if args.tiny else WARMUP, 50 if args.tiny else 500)


def measure(args: argparse.Namespace, sets: dict, images: Path, rounds: int, warmup: int, read_samples: int) -> None:
    """Each set of ``sets``, generated under ``images``, read every way; the results written."""
    report, lines = {}, []
    for name, (size, count, batch, steps) in sets.items():
        folder = generate(images, size, count)
        common = dict(name="folder", root=str(folder), image_size=size, augment=True, test_fraction=0.01)
        variants = {"preloaded": (load_datasets(DatasetConfig(**common, preload=True)), False),
                    "files, inline": (load_datasets(DatasetConfig(**common)), False),
                    "files, read ahead": (load_datasets(DatasetConfig(**common)), True)}
        runs: dict[str, list[dict]] = {variant: [] for variant in variants}
        for round_index in range(rounds):
            for variant, (data, prefetch) in variants.items():
                runs[variant].append(train(data, size, batch, steps, warmup, args.workers, prefetch))
                print(f"{name} round {round_index + 1}: {variant:18s} "
                      f"{runs[variant][-1]['samples_per_sec']:8.0f} samples/s", flush=True)
        costs = {"preloaded": read_cost(variants["preloaded"][0].train, read_samples),
                 "files": read_cost(variants["files, inline"][0].train, read_samples)}
        median = {v: statistics.median(r["samples_per_sec"] for r in rs) for v, rs in runs.items()}
        stages = {v: {s: statistics.median(r["stage_ms"][s] for r in rs) for s in STEP_STAGES} for v, rs in runs.items()}
        report[name] = {"images": count, "batch_size": batch, "measured_steps": steps, "runs": runs,
                        "median_samples_per_sec": median, "median_stage_ms": stages, "read_us_per_sample": costs,
                        "files_inline_over_preloaded": median["files, inline"] / median["preloaded"],
                        "files_ahead_over_preloaded": median["files, read ahead"] / median["preloaded"]}
        lines += [f"## {count:,} JPEG files at {name}, cifar10_quick, batch {batch}", "",
                  "| variant | samples/s | / preloaded | " + " | ".join(f"{s} ms" for s in STEP_STAGES) + " |",
                  "|---|---:|---:|" + "---:|" * len(STEP_STAGES)]
        for variant in variants:
            lines.append(f"| {variant} | {harness.spread([r['samples_per_sec'] for r in runs[variant]])} | "
                         f"{median[variant] / median['preloaded']:.3f} | "
                         + " | ".join(f"{stages[variant][s]:.1f}" for s in STEP_STAGES) + " |")
        lines += ["", f"Reading one sample alone (one process, one thread): preloaded {costs['preloaded']:.0f} µs, "
                      f"from its file {costs['files']:.0f} µs (open, decode, crop and flip, normalise).", ""]
    machine = harness.describe()
    head = ["# Images read per sample from files, against preloaded", "",
            f"{harness.machine_line(machine)} `{harness.command()}`: {args.workers} workers x 1 thread, {warmup} "
            f"warm-up steps, {rounds} alternating rounds, medians [min-max]; stage columns: milliseconds per step in "
            "each stage, averaged over the workers (`data`: waiting for this step's slice).", ""]
    harness.write(harness.out_of(args, RESULT), {"machine": machine, "workers": args.workers, "rounds": rounds,
                                                 "sets": report, "command": harness.command()},
                  "\n".join(head + lines))


if __name__ == "__main__":
    main()
