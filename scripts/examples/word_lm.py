"""A word-level LSTM language model on any text, trained by sn_trainer.

Written the way pytorch/examples' word_language_model is: the model takes and returns a hidden
state, its decoder shares the embedding's weights, and the loss is computed from all of it in a
step function. Every window of ``--bptt`` words is a sample; the last tenth is held out.

    python scripts/examples/word_lm.py                         # Debian's licence texts, 6 epochs
    python scripts/examples/word_lm.py --text my.txt --epochs 5
"""
from __future__ import annotations

import sn_trainer

if __name__ == "__main__":
    sn_trainer.warm_up()  # first: the warm workers' server imports torch while this script does

import argparse
import functools
import math
import re
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

from sn_trainer import Trainer


class RNNModel(nn.Module):
    """Embedding, LSTM, decoder tied to the embedding."""

    def __init__(self, ntoken: int, ninp: int = 128, nlayers: int = 2, dropout: float = 0.2):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, ninp, nlayers, dropout=dropout, batch_first=True)
        self.decoder = nn.Linear(ninp, ntoken)
        self.decoder.weight = self.encoder.weight  # tied, as the paper by Press & Wolf suggests
        self.nlayers, self.nhid = nlayers, ninp

    def forward(self, tokens, hidden):
        output, hidden = self.rnn(self.drop(self.encoder(tokens)), hidden)
        return self.decoder(self.drop(output)), hidden

    def init_hidden(self, batch_size: int):
        weight = next(self.parameters())
        return (weight.new_zeros(self.nlayers, batch_size, self.nhid),
                weight.new_zeros(self.nlayers, batch_size, self.nhid))


def step(model: RNNModel, batch) -> torch.Tensor:
    """One batch of windows: the mean cross-entropy of every next word."""
    tokens, targets = batch
    output, _ = model(tokens, model.init_hidden(tokens.size(0)))
    return nn.functional.cross_entropy(output.flatten(0, 1), targets.flatten())


def read_words(paths: list[Path]) -> list[str]:
    text = "\n".join(p.read_text(errors="replace") for p in paths)
    return re.findall(r"[a-z0-9']+|[^\sa-z0-9']", text.lower()) + ["<eos>"]


def windows(ids: torch.Tensor, bptt: int) -> TensorDataset:
    n = (len(ids) - 1) // bptt
    return TensorDataset(ids[: n * bptt].view(n, bptt), ids[1 : n * bptt + 1].view(n, bptt))


def text_files(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text", type=Path, default=Path("/usr/share/common-licenses"), help="a file or a folder")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--bptt", type=int, default=35)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--emsize", type=int, default=128)
    parser.add_argument("--workers", default="auto")
    args = parser.parse_args()

    words = read_words(text_files(args.text))
    vocab = {w: i for i, w in enumerate(sorted(set(words)))}
    ids = torch.tensor([vocab[w] for w in words])
    split = int(len(ids) * 0.9)
    train, test = windows(ids[:split], args.bptt), windows(ids[split:], args.bptt)
    print(f"{len(words)} words, {len(vocab)} distinct; {len(train)} training windows of {args.bptt}")

    torch.manual_seed(0)
    model = RNNModel(len(vocab), args.emsize)
    trainer = Trainer(workers=args.workers if args.workers == "auto" else int(args.workers),
                      batch_size=args.batch_size, epochs=args.epochs, max_steps=args.max_steps, log_every=20)
    result = trainer.fit(model, train, eval_set=test, step_fn=step,
                         optimizer=functools.partial(torch.optim.Adam, lr=3e-3))
    print(f"test loss {result.eval_loss:.3f}, perplexity {math.exp(result.eval_loss):.1f}, "
          f"{result.samples_per_sec * args.bptt:.0f} words/s ({result.workers} workers)")


if __name__ == "__main__":
    main()
