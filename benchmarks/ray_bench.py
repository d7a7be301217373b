"""The same Ray Train script over gloo and over sn_trainer's SNConfig on one node: samples/s side by side in one run.

examples/ray_train.py's training function (LeNet on random Fashion-MNIST-shaped images, SGD with
momentum, Ray's ``prepare_model`` and ``prepare_data_loader``) under ``TorchTrainer`` with 2 workers
of 1 CPU each, on a local Ray of this machine's physical cores; once with Ray's
``TorchConfig(backend="gloo")`` (no pinning, Ray's own threads), once with ``SNConfig()`` (group "sn",
each worker pinned to a core of its own), rounds alternating which goes first. samples/s over the
steps after the warm-up, timed by the slowest worker (what the run reports). Other processes' share
of the CPU is reported, since a figure taken on a busy machine says less.

    python benchmarks/ray_bench.py [--rounds 4] [--batch-size 64]
"""
from __future__ import annotations

import os
import statistics
import sys
import threading
import time

import psutil

import harness

sys.path.insert(0, str(harness.ROOT / "examples"))
import ray_train  # noqa: E402  (the example whose training function this times)

RESULT = "ray_bench"
BACKENDS = ("gloo", "sn")
WORKERS = 2
# The warm-up steps, the timed ones and the random images the workers draw from; a smoke run's (--tiny).
SIZES = {"warmup": 10, "steps": 150, "images": 4096}
TINY_SIZES = {"warmup": 1, "steps": 2, "images": 64}


class TreeCPU:
    """CPU seconds of this process and everything it started (Ray's processes, its workers), sampled while
    they run: a worker that ends is counted as last seen (a slight undercount of ours)."""

    def __init__(self):
        self.seen: dict[tuple[int, float], float] = {}
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        me = psutil.Process()
        while not self.done.wait(0.25):
            for member in [me, *me.children(recursive=True)]:
                try:
                    times = member.cpu_times()
                    self.seen[(member.pid, member.create_time())] = times.user + times.system
                except psutil.Error:
                    pass

    def __enter__(self) -> "TreeCPU":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()

    def total(self) -> float:
        return sum(self.seen.values())


def busy_seconds() -> float:
    times = psutil.cpu_times()
    return times.user + times.nice + times.system + getattr(times, "irq", 0) + getattr(times, "softirq", 0)


def measure(backend: str, config: dict, tree: TreeCPU) -> tuple[dict, float]:
    """One run's metrics, and other processes' share of the CPU meanwhile (percent)."""
    busy_before, ours_before, started = busy_seconds(), tree.total(), time.perf_counter()
    metrics = ray_train.fit(backend, WORKERS, config)
    wall = time.perf_counter() - started
    others = max(0.0, (busy_seconds() - busy_before) - (tree.total() - ours_before)) / (wall * psutil.cpu_count())
    assert metrics["backend"] == backend, metrics  # the group the workers reduced over is the one asked for
    return metrics, others * 100


def report(machine: dict, samples: dict[str, list[float]], threads: dict[str, int], others: list[float], rounds: int,
           batch: int, sizes: dict) -> str:
    med = {backend: statistics.median(rates) for backend, rates in samples.items()}
    lines = ["# A Ray Train script over gloo and over SNConfig", "",
             f"{harness.machine_line(machine)} `{harness.command()}`: examples/ray_train.py's training function "
             f"under Ray Train's `TorchTrainer`, {WORKERS} workers of 1 CPU each on a local Ray of this machine, LeNet "
             f"in float32, a global batch of {batch} ({batch // WORKERS} per worker) of random 1x28x28 images, SGD "
             f"with momentum, {sizes['warmup']} warm-up steps then {sizes['steps']} timed by the slowest worker; "
             f"{rounds} rounds alternating which backend goes first; samples/s, medians [min-max]. gloo: "
             "`TorchConfig(backend=\"gloo\")`, the workers where the OS puts them; sn: `SNConfig()`, each worker "
             "pinned to a physical core of its own. Other processes used "
             f"{statistics.median(others):.1f}% of the CPU during the median measurement (at most {max(others):.1f}%).",
             "", "| torch_config | intra-op threads | samples/s |", "|---|---:|---:|"]
    names = {"gloo": 'TorchConfig(backend="gloo")', "sn": "SNConfig()"}
    for backend, rates in samples.items():
        lines.append(f"| `{names[backend]}` | {threads[backend]} | {harness.spread(rates)} |")
    lines += ["", f"SNConfig / gloo: {med['sn'] / med['gloo']:.3f}."]
    return "\n".join(lines)


def main() -> None:
    parser = harness.options(__doc__, RESULT)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=64, help="the global batch, split over the 2 workers")
    args = parser.parse_args()
    sizes = TINY_SIZES if args.tiny else SIZES
    rounds = 1 if args.tiny else args.rounds
    config = {"epochs": 10 ** 6, "max_steps": sizes["warmup"] + sizes["steps"], "warmup": sizes["warmup"],
              "batch_size": args.batch_size, "lr": 0.02, "data": "synthetic", "limit": sizes["images"], "root": None}
    import ray
    import ray.cloudpickle

    from sn_trainer.node.topology import read_topology

    ray.cloudpickle.register_pickle_by_value(ray_train)  # the workers cannot import the examples folder
    samples: dict[str, list[float]] = {backend: [] for backend in BACKENDS}
    threads: dict[str, int] = {}
    others: list[float] = []
    ray.init(address="local", num_cpus=read_topology().physical_cores, include_dashboard=False, log_to_driver=False)
    try:
        with TreeCPU() as tree:
            for round_index in range(rounds):
                for backend in BACKENDS if round_index % 2 == 0 else reversed(BACKENDS):
                    metrics, busy = measure(backend, config, tree)
                    samples[backend].append(metrics["samples_per_sec"])
                    threads[backend] = metrics["threads"]
                    others.append(busy)
                    print(f"round {round_index + 1}: {backend}: {metrics['samples_per_sec']:.0f} samples/s", flush=True)
    finally:
        ray.shutdown()
    machine = harness.describe()
    harness.write(harness.out_of(args, RESULT),
                  {"machine": machine, "rounds": rounds, "workers": WORKERS, "batch_size": args.batch_size, **sizes,
                   "samples": samples, "threads": threads, "other_cpu_percent": others, "command": harness.command(),
                   "load_average": os.getloadavg()},
                  report(machine, samples, threads, others, rounds, args.batch_size, sizes))


if __name__ == "__main__":
    main()
