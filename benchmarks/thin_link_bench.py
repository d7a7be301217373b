"""Two nodes over a thin link, with and without compress=powersgd, side by side in one run.

Two network namespaces on this machine, joined by a veth pair whose both ends are shaped with
``tc qdisc ... netem delay 1ms rate R`` (1 Gbit/s, then 100 Mbit/s; where the kernel has no
netem, ``tbf rate R`` with no delay added, and the results say which), are the two nodes: one
torchrun in each, meeting at a static rendezvous on one end's address, one worker per node.
For LeNet, cifar10_quick and the GPT preset (bench.py's sizes) it measures the step time
(after a warm-up that also holds the compress_after steps) and the bytes each end of the pair
put on the wire per measured step (the interface's tx_bytes, read by each node's launcher when
worker 0's progress records of the first and the last measured step arrive: a step of skew at
most). Then LeNet on Fashion-MNIST for 3 epochs (or a subset, --train-samples), with and without
compression: the test accuracy after it. Needs root (ip netns, tc).

    python benchmarks/thin_link_bench.py                 # everything: results/<machine>/thin_link.md (--out)
    python benchmarks/thin_link_bench.py --quick         # 100 Mbit/s only, fewer steps, no accuracy
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import harness

RESULT = "thin_link"
ROOT = harness.ROOT
RATES = ("1gbit", "100mbit")
MODELS = {"lenet": 64, "cifar10_quick": 100, "gpt": 32}  # batch of each: the presets' (gpt_text: 32)
FASHION = Path("/usr/share/datasets/fashion-mnist")


# --- the two hosts -----------------------------------------------------------------------------

def sh(*command: str) -> str:
    return subprocess.run(command, check=True, capture_output=True, text=True, timeout=60).stdout


@contextlib.contextmanager
def veth_pair():
    """Two namespaces joined by a veth pair, made here and removed after: ``{side: (ns, device, address)}``."""
    tag = uuid.uuid4().hex[:6]
    pair = {side: (f"tl{tag}{side}", f"t{tag}{side}", f"10.232.{int(tag[:2], 16)}.{host}")
            for side, host in (("a", 1), ("b", 2))}
    try:
        sh("ip", "netns", "add", pair["a"][0])
        sh("ip", "netns", "add", pair["b"][0])
        sh("ip", "link", "add", pair["a"][1], "type", "veth", "peer", "name", pair["b"][1])
        for ns, device, address in pair.values():
            sh("ip", "link", "set", device, "netns", ns)
            sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{address}/24", "dev", device)
            sh("ip", "netns", "exec", ns, "ip", "link", "set", device, "up")
            sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        yield pair
    finally:
        for ns, _, _ in pair.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=60)


RATE_BITS = {"1gbit": 10**9, "100mbit": 10**8}


def shape(pair, rate: str) -> str:
    """Both ends: ``rate`` at most, and a millisecond of delay where the kernel has netem; what was set."""
    for ns, device, _ in pair.values():
        netem = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", device, "root", "netem",
                                "delay", "1ms", "rate", rate], capture_output=True, timeout=60)
        if netem.returncode != 0:  # no sch_netem in this kernel: a token bucket sets the rate, with no delay added
            burst = RATE_BITS[rate] // 8 // 100  # 10 ms of the rate
            sh("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", device, "root", "tbf", "rate", rate,
               "burst", str(burst), "latency", "100ms")
    return f"netem delay 1ms rate {rate}" if netem.returncode == 0 else \
        f"tbf rate {rate} burst {RATE_BITS[rate] // 8 // 100} latency 100ms (no netem in this kernel: no delay added)"


def two_nodes(pair, out: Path, *node_args: str) -> list[dict]:
    """This script's --as-node as two torchrun nodes, one per namespace; each node's JSON result."""
    port = 29500 + int(uuid.uuid4().hex[:3], 16)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    nodes = []
    for rank, (ns, device, _) in enumerate(pair.values()):
        nodes.append(subprocess.Popen(
            ["ip", "netns", "exec", ns, "env", f"GLOO_SOCKET_IFNAME={device}", sys.executable, "-m",
             "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1", f"--node-rank={rank}",
             f"--master-addr={pair['a'][2]}", f"--master-port={port}", "--max-restarts=0", __file__, "--as-node",
             "--device", device, "--node-out", str(out / f"node{rank}.json"), *node_args],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for node in nodes:
        _, stderr = node.communicate(timeout=3600)
        if node.returncode != 0:
            raise RuntimeError(f"a node failed:\n{stderr[-3000:]}")
    return [json.loads((out / f"node{rank}.json").read_text()) for rank in range(2)]


# --- one node ----------------------------------------------------------------------------------

def node_main(args) -> None:
    """One node's run (under torchrun, in its namespace)."""
    import torch

    from sn_trainer import Callback, Cluster, Trainer

    wire = Path(f"/sys/class/net/{args.device}/statistics/tx_bytes")

    class Wire(Callback):
        """tx_bytes when the first and the last measured step's records arrive."""

        def __init__(self):
            self.marks: dict[int, int] = {}

        def on_step_end(self, trainer, record) -> None:
            self.marks[record.step] = int(wire.read_text())

    model, data, evaluation, step_fn = build(args)
    steps = args.warmup + args.steps if args.epochs is None else None
    optimizer = functools.partial(torch.optim.AdamW, lr=0.002) if args.model == "gpt" else \
        functools.partial(torch.optim.SGD, lr=0.02, momentum=0.9)
    wire_marks = Wire()
    result = Trainer(cluster=Cluster.from_env(os.environ), workers=1, batch_size=MODELS[args.model],
                     max_steps=steps, epochs=args.epochs or 1, measure_after=args.warmup if steps else 0,
                     log_every=1 if steps else 100, compress=args.compress, compress_rank=args.rank,
                     compress_after=args.after, seed=0, verify_every=0).fit(
        model, data, eval_set=evaluation, optimizer=optimizer, step_fn=step_fn,
        callbacks=[wire_marks])
    marks = wire_marks.marks
    per_step = ((marks[max(marks)] - marks[args.warmup]) / (max(marks) - args.warmup)
                if steps and args.warmup in marks and max(marks) > args.warmup else None)
    Path(args.node_out).write_text(json.dumps({
        "step_seconds": result.train_seconds / max(1, result.measured_steps), "steps": result.steps,
        "wire_bytes_per_step": per_step, "eval_accuracy": result.eval_accuracy, "compression": result.compression,
        "train_seconds": result.train_seconds, "other_cpu_percent": result.other_cpu_percent,
        "stage_seconds": result.stage_seconds}))


def build(args):
    """The model, training set, evaluation set (accuracy runs only) and step function of ``args.model``."""
    import torch
    from torch.utils.data import Subset, TensorDataset

    from sn_trainer.models import build_model

    torch.manual_seed(0)
    if args.model == "gpt":
        from sn_trainer.models.gpt import GPT, language_model_step

        tokens = torch.randint(0, 96, (2048, 65), generator=torch.Generator().manual_seed(0))
        return (GPT(96, 64, 3, 4, 128), TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()),
                None, language_model_step)
    shapes = {"lenet": (1, 28, 28), "cifar10_quick": (3, 32, 32)}
    model = build_model(args.model, shapes[args.model], 10)
    if args.epochs is None:  # speed only: random images
        g = torch.Generator().manual_seed(0)
        return model, TensorDataset(torch.randn(4096, *shapes[args.model], generator=g),
                                    torch.randint(0, 10, (4096,), generator=g)), None, None
    from sn_trainer.data.datasets import image_splits, read_idx

    def pair(images, labels):
        return read_idx(FASHION / images).unsqueeze(1), read_idx(FASHION / labels).long()

    splits = image_splits(pair("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
                          pair("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"), 10, str(FASHION), False)
    train = splits.train if args.train_samples is None else Subset(splits.train, range(args.train_samples))
    return model, train, splits.test, None


# --- the whole comparison ----------------------------------------------------------------------

def speeds(pair, rates, models, warmup: int, steps: int, rank: int) -> list[dict]:
    """Each rate x model x compression: step time and bytes per step; the variants of one case
    run back to back, so that the machine's load hits both alike."""
    rows = []
    for rate in rates:
        link = shape(pair, rate)
        for model in models:
            for compress in ("none", "powersgd"):
                with tempfile.TemporaryDirectory() as tmp:
                    nodes = two_nodes(pair, Path(tmp), "--model", model, "--compress", compress, "--rank", str(rank),
                                      "--after", str(max(0, warmup - 1)), "--warmup", str(warmup), "--steps",
                                      str(steps))
                rows.append({"rate": rate, "link": link, "model": model, "compress": compress,
                             "step_seconds": max(n["step_seconds"] for n in nodes),
                             "wire_bytes_per_step": [n["wire_bytes_per_step"] for n in nodes],
                             "other_cpu_percent": nodes[0]["other_cpu_percent"]})
                print(json.dumps(rows[-1]), flush=True)
    return rows


def accuracies(pair, rank: int, after: int, train_samples: int | None) -> list[dict]:
    rows = []
    shape(pair, "1gbit")
    for compress in ("none", "powersgd"):
        with tempfile.TemporaryDirectory() as tmp:
            started = time.monotonic()
            args = ["--train-samples", str(train_samples)] if train_samples else []
            nodes = two_nodes(pair, Path(tmp), "--model", "lenet", "--compress", compress, "--rank", str(rank),
                              "--after", str(after), "--epochs", "3", *args)
        rows.append({"compress": compress, "eval_accuracy": nodes[0]["eval_accuracy"], "steps": nodes[0]["steps"],
                     "seconds": time.monotonic() - started, "compression": nodes[0]["compression"],
                     "other_cpu_percent": nodes[0]["other_cpu_percent"]})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _percent(row: dict) -> str:
    """Other processes' share of the machine's CPU while node 0 measured (its summary's other_cpu_percent):
    node 1's processes count among them, about half the machine while it computes."""
    return f"{row['other_cpu_percent']:.0f} %" if row.get("other_cpu_percent") is not None else "?"


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = ["# Two nodes over a thin link (benchmarks/thin_link_bench.py)", "",
             f"`{report['command']}`", "",
             f"Machine: {m['cpu_model']}, {m['physical_cores']} physical cores, {m['memory_gib']} GiB, torch "
             f"{m['torch']}; both nodes on it, one worker each, in two network namespaces joined by a veth pair, "
             f"each end shaped with tc: {', '.join(sorted({r['link'] for r in report['speeds']}))}. \"others' CPU\" is node 0's other_cpu_percent: "
             "the machine's CPU used by processes other than node 0's, node 1's included (up to about 50 % while it "
             "computes); well above that, other work shared the machine.", "",
             f"compress=powersgd rank {report['rank']}; speed runs ({report.get('speeds_measured', 'in this run')}): "
             f"{report['warmup']} warm-up steps (all but the last sent whole), then {report['steps']} measured "
             "steps, compressed.", "",
             "| link | model | compress | step (s) | bytes on the wire per step (each end) | speed-up | others' CPU |",
             "|---|---|---|---|---|---|---|"]
    plain = {(r["rate"], r["model"]): r["step_seconds"] for r in report["speeds"] if r["compress"] == "none"}
    for r in report["speeds"]:
        sent = " / ".join(f"{b / 1e3:.0f} kB" if b is not None else "?" for b in r["wire_bytes_per_step"])
        lines.append(f"| {r['rate']} | {r['model']} | {r['compress']} | {r['step_seconds']:.3f} | {sent} | "
                     f"{plain[(r['rate'], r['model'])] / r['step_seconds']:.2f}x | {_percent(r)} |")
    if report["accuracy"]:
        lines += ["", f"LeNet on Fashion-MNIST, 3 epochs ({report['train_samples'] or 60000} training images), "
                      "batch 64, SGD lr 0.02 momentum 0.9, at 1 Gbit/s; test accuracy on the 10,000 test images:", "",
                  "| compress | test accuracy | steps | wall (s) | others' CPU |", "|---|---|---|---|---|"]
        for r in report["accuracy"]:
            lines.append(f"| {r['compression']} | {100 * r['eval_accuracy']:.2f} % | {r['steps']} | {r['seconds']:.0f} | "
                         f"{_percent(r)} |")
    return "\n".join(lines)


def main() -> None:
    parser = harness.options(__doc__, RESULT)
    parser.add_argument("--as-node", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--device"), parser.add_argument("--node-out"), parser.add_argument("--model", default="lenet")
    parser.add_argument("--compress", default="none"), parser.add_argument("--after", type=int, default=0)
    parser.add_argument("--epochs", type=int), parser.add_argument("--train-samples", type=int)
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--speeds-from", help="take the speed rows from this file (JSON lines, as a run prints "
                                              "them) instead of measuring them again")
    args = parser.parse_args()
    if args.as_node:
        return node_main(args)
    sys.path.insert(0, str(ROOT))
    # --quick: 100 Mbit/s only, no accuracy; --tiny: that, LeNet only, a step or two.
    warmup, steps = (1, 2) if args.tiny else (3, 4) if args.quick else (args.warmup, args.steps)
    short = args.quick or args.tiny
    with veth_pair() as pair:
        report = {"machine": harness.describe(), "command": harness.command(), "rank": args.rank, "warmup": warmup,
                  "steps": steps, "train_samples": args.train_samples,
                  "speeds": [json.loads(line) for line in Path(args.speeds_from).read_text().splitlines()]
                  if args.speeds_from else speeds(pair, ("100mbit",) if short else RATES,
                                                  ["lenet"] if args.tiny else list(MODELS), warmup, steps, args.rank),
                  "speeds_measured": "earlier, in the run that printed them" if args.speeds_from else "in this run"}
        after = (3 * (args.train_samples or 60000) // 64) // 10  # ~10% of the steps sent whole first
        report["accuracy"] = [] if short else accuracies(pair, args.rank, after, args.train_samples)
    harness.write(harness.out_of(args, RESULT), report, markdown(report))


if __name__ == "__main__":
    main()
