"""The same plain DDP training script (examples/ddp_train.py) under torchrun and sn_trainer.launch, side by
side in one run, against sn_trainer's own Trainer on the same model and global batch.

(a) torchrun + gloo        `python -m torch.distributed.run`: its defaults (OMP_NUM_THREADS=1, no pinning);
(b) sn_trainer.launch + gloo   each rank pinned to its own physical cores, threads = its cores;
(c) sn_trainer.launch + sn     the same, over the shared-memory backend (`--cpu-backend=sn`, the script as it is);
(d) sn_trainer.launch --no-pin + sn   the backend alone: threads set, affinity left to the OS;
(e) Trainer                sn_trainer's Trainer.fit, workers=N, threads=1.

Rounds alternate over every variant and case, so that drift on a shared machine hits all alike;
the table gives medians [min-max]. The machine's CPU time spent by other processes during the
run is measured and reported: a figure taken on a busy machine is marked as such.

    python benchmarks/ddp_bench.py                        # N = the physical cores
    python benchmarks/ddp_bench.py --nproc 16 --rounds 3  # on a bigger machine
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch
from torch.utils.data import TensorDataset

from sn_trainer import Trainer
from sn_trainer.models import build_model

import harness

RESULT = "ddp_bench"
ROOT = harness.ROOT
TRAIN = ROOT / "examples" / "ddp_train.py"
SHAPES = {"lenet": (1, 28, 28), "cifar10_quick": (3, 32, 32), "cifar10_quick_bn": (3, 32, 32)}
VARIANTS = ("torchrun_gloo", "launch_gloo", "launch_sn", "launch_sn_unpinned", "trainer")
LABELS = {"torchrun_gloo": "torchrun + gloo", "launch_gloo": "sn_trainer.launch + gloo",
          "launch_sn": "sn_trainer.launch + sn", "launch_sn_unpinned": "sn_trainer.launch --no-pin + sn",
          "trainer": "sn_trainer Trainer"}
DEFAULT_CASES = "lenet b64 cl,cifar10_quick b200 cl"


def parse_case(label: str) -> dict:
    """``lenet b64 cl`` -> model, global batch, channels_last."""
    words = label.split()
    return {"label": label, "model": words[0], "batch": int(words[1][1:]), "channels_last": "cl" in words[2:]}


def launcher_command(variant: str, case: dict, nproc: int, steps: int, warmup: int, out: str) -> list[str]:
    launcher = "torch.distributed.run" if variant == "torchrun_gloo" else "sn_trainer.launch"
    flags = ["--cpu-backend=sn"] if variant.startswith("launch_sn") else []  # the script's gloo group made on "sn"
    flags += ["--no-pin"] if variant == "launch_sn_unpinned" else []
    return [sys.executable, "-m", launcher, f"--nproc-per-node={nproc}", *flags, str(TRAIN), "--model", case["model"],
            "--batch", str(case["batch"]), "--steps", str(steps), "--warmup", str(warmup), "--backend", "gloo",
            *(["--channels-last"] if case["channels_last"] else []), "--out", out]


def run_ddp(variant: str, case: dict, nproc: int, steps: int, warmup: int) -> dict:
    """One launch of the DDP script: rank 0's JSON line (samples/s, its threads and affinity)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/result.json"
        done = subprocess.run(launcher_command(variant, case, nproc, steps, warmup, out), env=env, cwd=tmp,
                              capture_output=True, text=True, timeout=900)
        if done.returncode != 0 and not (Path(out).exists() and "SIGABRT" in done.stderr):
            raise RuntimeError(f"{variant} {case['label']} failed:\n{done.stderr[-3000:]}")
        # A rank that aborts after the measurement was written, in Python's teardown (torch's gloo race at
        # exit: "terminate called without an active exception"), leaves it standing; the report counts them.
        return {**json.loads(Path(out).read_text()), "aborted_at_exit": done.returncode != 0}


def run_trainer(case: dict, nproc: int, steps: int, warmup: int) -> dict:
    torch.manual_seed(0)
    model = build_model(case["model"], SHAPES[case["model"]], 10)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(4096, *SHAPES[case["model"]], generator=g), torch.randint(0, 10, (4096,),
                                                                                              generator=g))
    result = Trainer(workers=nproc, threads=1, batch_size=case["batch"], max_steps=warmup + steps,
                     measure_after=warmup, channels_last=case["channels_last"], log_every=10**9,
                     verify_every=0).fit(  # speed alone: verify_cost.md has what a check costs
        model, data, optimizer=functools.partial(torch.optim.SGD, lr=0.01, momentum=0.9))
    return {"samples_per_sec": result.samples_per_sec}


def measure(variant: str, case: dict, nproc: int, steps: int, warmup: int) -> dict:
    if variant == "trainer":
        return run_trainer(case, nproc, steps, warmup)
    return run_ddp(variant, case, nproc, steps, warmup)


def busy_seconds() -> float:
    """CPU seconds the whole machine has spent on anything but idling, since boot."""
    times = psutil.cpu_times()
    return sum(times) - times.idle - getattr(times, "iowait", 0.0)


class TreeCpu:
    """CPU seconds of this process and all its descendants, each child's last reading kept: a
    sampler, since DDP ranks and the Trainer's workers (children of its fork server) are not all
    children this process waits for."""

    def __init__(self) -> None:
        self.seen: dict[tuple[int, float], float] = {}  # (pid, start time) -> CPU seconds
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        me = psutil.Process()
        while self.running:
            for proc in [me, *me.children(recursive=True)]:
                try:
                    t = proc.cpu_times()
                    self.seen[(proc.pid, proc.create_time())] = t.user + t.system
                except psutil.Error:
                    continue
            time.sleep(0.5)  # sampling other processes' counters: there is nothing to wait on instead

    def stop(self) -> float:
        self.running = False
        self.thread.join()
        return sum(self.seen.values())


def markdown(report: dict) -> str:
    m, load = report["machine"], report["load"]
    lines = [f"# The same DDP script: torchrun + gloo, sn_trainer.launch + gloo / + sn, and sn_trainer's Trainer, "
             f"N={report['nproc']}", "",
             f"{harness.machine_line(m, memory=True)} `{report['command']}`: {report['rounds']} rounds x "
             f"{report['steps']} steps after {report['warmup']} warm-up, SGD momentum 0.9, synthetic data in memory, "
             "global batch split evenly over the ranks. Samples/s (rank 0's count over the slowest rank's time; "
             "the Trainer's own samples_per_sec), medians over rounds [min-max].", "",
             f"**Shared machine**: other processes used {load['others_cpu_seconds']:.0f} CPU s of the "
             f"{load['machine_cpu_seconds']:.0f} CPU s the machine spent during the {load['wall_seconds']:.0f} s run "
             f"({load['others_share']:.0%}; this run's process tree sampled every 0.5 s); the figures are lower and noisier than on an idle machine"
             + (", and pinned processes cannot move off cores that others keep busy: these rows cannot judge one "
                "variant against another; rerun on an idle machine." if load["others_share"] > 0.25 else "."), "",
             "| case | " + " | ".join(LABELS[v] for v in VARIANTS) + " | launch+sn / torchrun+gloo | "
             "launch+sn / Trainer |", "|---|" + "---:|" * (len(VARIANTS) + 2)]
    for label, row in report["rows"].items():
        med = {v: statistics.median(row[v]) for v in VARIANTS}
        lines.append(f"| {label} | " + " | ".join(harness.spread(row[v]) for v in VARIANTS)
                     + f" | {med['launch_sn'] / med['torchrun_gloo']:.2f} | {med['launch_sn'] / med['trainer']:.2f} |")
    lines += ["", "Placement as each DDP rank 0 reported it: " + "; ".join(
        f"{LABELS[v]}: {report['placement'][v]}" for v in VARIANTS if v in report["placement"])]
    launches = report["rounds"] * len(report["rows"])
    lines += ["", "Launches in which a rank aborted at its exit, after the measurement (SIGABRT in Python's teardown "
              "while gloo's thread still held the backward's last work): " + "; ".join(
                  f"{LABELS[v]} {report['aborted_at_exit'][v]} of {launches}" for v in VARIANTS if v != "trainer")]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict:
    cases = [parse_case(label.strip()) for label in args.cases.split(",")]
    rows = {case["label"]: {v: [] for v in VARIANTS} for case in cases}
    placement, aborted = {}, {v: 0 for v in VARIANTS}
    start_wall, start_busy, tree = time.perf_counter(), busy_seconds(), TreeCpu()
    for round_index in range(args.rounds):
        for case in cases:
            for variant in VARIANTS:
                got = measure(variant, case, args.nproc, args.steps, args.warmup)
                rows[case["label"]][variant].append(got["samples_per_sec"])
                aborted[variant] += got.get("aborted_at_exit", False)
                if "affinity" in got:
                    placement[variant] = f"{got['threads']} thread(s), cpus {got['affinity']}"
                print(f"round {round_index} {case['label']} {variant}: {got['samples_per_sec']:.0f}", flush=True)
    own = tree.stop()
    wall, busy = time.perf_counter() - start_wall, busy_seconds() - start_busy
    load = {"wall_seconds": wall, "machine_cpu_seconds": busy, "others_cpu_seconds": max(0.0, busy - own),
            "others_share": max(0.0, busy - own) / busy if busy else 0.0}
    return {"machine": harness.describe(), "nproc": args.nproc, "rounds": args.rounds, "steps": args.steps,
            "warmup": args.warmup, "command": harness.command(),
            "rows": rows, "placement": placement, "load": load, "aborted_at_exit": aborted}


def main() -> None:
    parser = harness.options(__doc__, RESULT)
    parser.add_argument("--nproc", type=int, default=psutil.cpu_count(logical=False) or 1,
                        help="processes (DDP ranks, Trainer workers); default: the physical cores")
    parser.add_argument("--cases", default=DEFAULT_CASES, help="comma-separated: '<model> b<global batch> [cl]'")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args()
    if args.tiny:  # each launch once, a step or two of LeNet on a few samples
        args.cases, args.rounds, args.steps, args.warmup = "lenet b8 cl", 1, 2, 1
    report = run(args)
    harness.write(harness.out_of(args, RESULT), report, markdown(report))


if __name__ == "__main__":
    main()
