"""One worker against plain PyTorch, side by side in one run: what sn_trainer costs where nothing is split.

At W=1 sn_trainer runs the plain loop's work in one worker process (its model in shared memory,
its gradient in one flat buffer, its data read by the Trainer's sampler and the dataset's
collate_fn): it should cost what plain PyTorch costs with the same threads. Cases:

- lstm b128: an embedding, a 2-layer LSTM over packed variable-length sequences (lengths 8-64)
  and a linear head, padded by a collate_fn and packed in the model;
- lstm b128 packed: the same network, its batch a PackedSequence packed by the collate_fn;
- lenet b64: LeNet on synthetic 28x28 images;
- mlp b32: a two-layer perceptron (32-64-10) on synthetic vectors, a step of a few hundred
  microseconds: what is left of it beside plain PyTorch's is sn_trainer's own cost per step.

The table's last column is that cost: the Trainer's time per step less plain PyTorch's, from the
medians (it reads ahead in a thread where ``prefetch=auto`` does; ``--prefetch`` decides it).

Each round runs plain PyTorch (this process, ``torch.set_num_threads(threads)``, the same global
batches) and ``Trainer(workers=1, threads=threads)`` alternately; samples/s over the steps after
the warm-up, medians over rounds. ``--threads auto`` compares the two as a user first meets them:
plain PyTorch with torch's default threads (every core) against ``Trainer(workers=1)`` with its
default, ``threads=auto`` (every usable core to the one worker); ``--sn-threads 1`` beside it gives
the Trainer the one thread that was its default before ``threads=auto``.

    python benchmarks/w1_bench.py [--rounds 3] [--steps 40] [--warmup 5] [--threads N|auto] [--sn-threads N|auto]
                                  [--prefetch auto|true|false] [--cases 'mlp b32,...']
"""
from __future__ import annotations

import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pack_sequence, pad_sequence
from torch.utils.data import Dataset, RandomSampler, TensorDataset

from sn_trainer import Trainer
from sn_trainer.models import build_model

import harness

RESULT = "w1_bench"
VOCAB, CLASSES = 1000, 10


class Sequences(Dataset):
    def __init__(self, n: int = 8192):
        g = torch.Generator().manual_seed(0)
        self.lengths = torch.randint(8, 65, (n,), generator=g)
        self.tokens = [torch.randint(0, VOCAB, (int(length),), generator=g) for length in self.lengths]
        self.labels = torch.randint(0, CLASSES, (n,), generator=g)

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return self.tokens[i], self.labels[i]


def pad(items):
    tokens, labels = zip(*items)
    return pad_sequence(tokens, batch_first=True), torch.tensor([len(t) for t in tokens]), torch.stack(labels)


class PackedLSTM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 64)
        self.lstm = nn.LSTM(64, 128, num_layers=2, batch_first=True)
        self.head = nn.Linear(128, CLASSES)

    def forward(self, tokens, lengths):
        packed = pack_padded_sequence(self.embed(tokens), lengths, batch_first=True, enforce_sorted=False)
        _, (hidden, _) = self.lstm(packed)
        return self.head(hidden[-1])


def pack(items):
    tokens, labels = zip(*items)
    return pack_sequence(list(tokens), enforce_sorted=False), torch.stack(labels)


class LSTMOverPacked(nn.Module):
    """The same network, its batch a PackedSequence the collate_fn packed."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 64)
        self.lstm = nn.LSTM(64, 128, num_layers=2)
        self.head = nn.Linear(128, CLASSES)

    def forward(self, packed):
        embedded = PackedSequence(self.embed(packed.data), packed.batch_sizes, packed.sorted_indices,
                                  packed.unsorted_indices)
        _, (hidden, _) = self.lstm(embedded)
        return self.head(hidden[-1])


def lstm_step(model, batch):
    tokens, lengths, labels = batch
    return F.cross_entropy(model(tokens, lengths), labels)


def packed_step(model, batch):
    packed, labels = batch
    return F.cross_entropy(model(packed), labels)


def mlp():
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, CLASSES))


def image_step(model, batch):
    images, labels = batch
    return F.cross_entropy(model(images), labels)


def cases(tiny: bool = False):
    """label -> (model builder, dataset, collate_fn, step_fn, global batch); a tiny run's at a batch of 8."""
    torch.manual_seed(0)
    samples, lstm, lenet, small = (512, 8, 8, 8) if tiny else (4096, 128, 64, 32)
    images = TensorDataset(torch.randn(samples, 1, 28, 28), torch.randint(0, 10, (samples,)))
    vectors = TensorDataset(torch.randn(16 * samples, 32), torch.randint(0, 10, (16 * samples,)))  # short steps: many
    sequences = Sequences(2 * samples)
    return {f"lstm b{lstm}": (PackedLSTM, sequences, pad, lstm_step, lstm),
            f"lstm b{lstm} packed": (LSTMOverPacked, sequences, pack, packed_step, lstm),
            f"lenet b{lenet}": (lambda: build_model("lenet", (1, 28, 28), 10), images, None, image_step, lenet),
            f"mlp b{small}": (mlp, vectors, None, image_step, small)}


def plain(build, data, collate, step, batch, steps, warmup) -> float:
    """Samples/s of plain PyTorch over the Trainer's global batches (its sampler, seed 0)."""
    torch.manual_seed(0)
    model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    order = list(RandomSampler(range(len(data)), generator=torch.Generator().manual_seed(0)))
    started = 0.0
    for index in range(warmup + steps):
        if index == warmup:
            started = time.perf_counter()
        picked = order[index * batch : (index + 1) * batch]
        items = [data[i] for i in picked]
        inputs = collate(items) if collate else tuple(torch.stack(x) for x in zip(*items))
        optimizer.zero_grad()
        step(model, inputs).backward()
        optimizer.step()
    return steps * batch / (time.perf_counter() - started)


def trainer(build, data, collate, step, batch, steps, warmup, threads, prefetch="auto") -> float:
    torch.manual_seed(0)
    result = Trainer(workers=1, threads=threads, batch_size=batch, max_steps=warmup + steps, measure_after=warmup,
                     seed=0, prefetch=prefetch).fit(build(), data, optimizer=lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9),
                                 step_fn=step, collate_fn=collate)
    return result.samples_per_sec


def main() -> None:
    parser = harness.options(__doc__, RESULT)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=lambda v: v if v == "auto" else int(v), default=1)
    parser.add_argument("--sn-threads", type=lambda v: v if v == "auto" else int(v), default=None,
                        help="the Trainer's threads, when not --threads")
    parser.add_argument("--prefetch", type=lambda v: v if v == "auto" else v == "true", default="auto",
                        help="the Trainer's prefetch: auto (its default), true or false")
    parser.add_argument("--cases", default="lstm b128,lstm b128 packed,lenet b64,mlp b32")
    args = parser.parse_args()
    if args.tiny:
        args.rounds, args.steps, args.warmup = 1, 2, 1
    if args.threads != "auto":
        torch.set_num_threads(args.threads)
    plain_threads = torch.get_num_threads()
    sn_threads = args.threads if args.sn_threads is None else args.sn_threads
    load = os.getloadavg()[0]
    chosen = cases(tiny=True) if args.tiny else {k: v for k, v in cases().items() if k in args.cases.split(",")}
    rows: dict[str, dict[str, list[float]]] = {k: {"plain": [], "sn": []} for k in chosen}
    for round_index in range(args.rounds):
        for label, (build, data, collate, step, batch) in chosen.items():
            rows[label]["plain"].append(plain(build, data, collate, step, batch, args.steps, args.warmup))
            rows[label]["sn"].append(trainer(build, data, collate, step, batch, args.steps, args.warmup,
                                             sn_threads, args.prefetch))
            print(f"round {round_index + 1} {label}: plain {rows[label]['plain'][-1]:.0f}, "
                  f"sn_trainer {rows[label]['sn'][-1]:.0f} samples/s", flush=True)
    machine = harness.describe()
    lines = ["# One worker against plain PyTorch", "",
             f"{harness.machine_line(machine)} `{harness.command()}`: {args.rounds} rounds of {args.steps} steps after "
             f"{args.warmup}, plain PyTorch {plain_threads} intra-op thread(s), sn_trainer threads={sn_threads} "
             f"prefetch={args.prefetch}, SGD "
             f"momentum 0.9, the same global batches; samples/s after {args.warmup} warm-up steps, medians over {args.rounds} alternated rounds "
             f"[min-max]. Load average at the start: {load:.2f} on {os.cpu_count()} CPUs"
             + (" (other processes were running)." if load > 0.5 else "."), "",
             "| case | plain PyTorch | sn_trainer, W=1 | sn / plain | sn_trainer's own per step |",
             "|---|---:|---:|---:|---:|"]
    for label, row in rows.items():
        p, s = statistics.median(row["plain"]), statistics.median(row["sn"])
        batch = chosen[label][4]
        own_us = (batch / s - batch / p) * 1e6  # the Trainer's seconds per step less plain PyTorch's
        lines.append(f"| {label} | {harness.spread(row['plain'])} | {harness.spread(row['sn'])} | {s / p:.2f} "
                     f"| {own_us:.0f} us |")
    harness.write(harness.out_of(args, RESULT),
                  {"machine": machine, "rounds": args.rounds, "steps": args.steps, "warmup": args.warmup,
                   "threads": args.threads, "sn_threads": sn_threads, "rows": rows, "load_average": load, "command": harness.command()},
                  "\n".join(lines))


if __name__ == "__main__":
    main()
