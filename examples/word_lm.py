"""A word-level LSTM language model on any text, trained by sn_trainer.

Written the way pytorch/examples' word_language_model trains: the text is cut into
``--batch-size`` columns, read ``--bptt`` words at a time in order, and the LSTM's hidden state
is carried from one chunk of a column to the next (detached, so gradients stop at the chunk), and
reset to zeros at each epoch's start; the decoder shares the embedding's weights, gradients are
clipped to 0.25. The last tenth of the text is held out.

    python examples/word_lm.py                         # Debian's licence texts, 6 epochs
    python examples/word_lm.py --text my.txt --epochs 5

How the carried state splits over workers: a sample is one column's chunk, so with
``shuffle=False`` global batch k is chunk k of every column, and each worker's slice is the
same columns every step. The state of every column lives in the model as a frozen parameter
(``carried``): sn_trainer keeps a frozen parameter as one tensor in shared memory for all
workers, each worker writes its own columns' state there and reads them back the next step, and
checkpoints keep it with the weights, so a resume goes on from the state it left. It is held
twice, by the chunk's parity: chunk k reads slot k % 2 and writes slot (k + 1) % 2, so a worker
already in the next step never writes what a checkpoint of this one is reading. The step
function returns ``(loss_sum, count)`` over the chunk's tokens. Evaluation starts every
held-out window from a zero state (pytorch/examples carries it through the test text too). It is
written for one node: across nodes, each node's state lies in its own memory, and a checkpoint
(node 0's) would hold node 0's columns only.
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
from torch.utils.data import Dataset

from sn_trainer import Trainer

IGNORED = -100  # the padded end of a last, shorter chunk


class RNNModel(nn.Module):
    """Embedding, LSTM, decoder tied to the embedding; the hidden state carried for ``columns``."""

    def __init__(self, ntoken: int, ninp: int = 128, nlayers: int = 2, dropout: float = 0.2, columns: int = 32):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, ninp, nlayers, dropout=dropout, batch_first=True)
        self.decoder = nn.Linear(ninp, ntoken)
        self.decoder.weight = self.encoder.weight  # tied, as the paper by Press & Wolf suggests
        self.nlayers, self.nhid = nlayers, ninp
        # [parity, (h, c), column, layer, unit]: state, not weights (never trained)
        self.carried = nn.Parameter(torch.zeros(2, 2, columns, nlayers, ninp), requires_grad=False)

    def forward(self, tokens, hidden):
        output, hidden = self.rnn(self.drop(self.encoder(tokens)), hidden)
        return self.decoder(self.drop(output)), hidden

    def init_hidden(self, batch_size: int):
        weight = next(self.parameters())
        return (weight.new_zeros(self.nlayers, batch_size, self.nhid),
                weight.new_zeros(self.nlayers, batch_size, self.nhid))

    def hidden_for(self, chunk: torch.Tensor, column: torch.Tensor):
        """The state chunk ``chunk`` of ``column`` starts from: zeros at an epoch's first chunk."""
        state = self.carried[chunk % 2, :, column].transpose(0, 1)  # [(h, c), batch, layer, unit]
        state = torch.where((chunk == 0).view(1, -1, 1, 1), torch.zeros_like(state), state)
        return tuple(s.transpose(0, 1).contiguous() for s in state)  # [layer, batch, unit] each

    @torch.no_grad()
    def keep_hidden(self, chunk: torch.Tensor, column: torch.Tensor, hidden) -> None:
        """What the next chunk of ``column`` starts from (detached: pytorch/examples' repackage_hidden)."""
        for which, state in enumerate(hidden):
            self.carried[(chunk + 1) % 2, which, column] = state.detach().transpose(0, 1)


def step(model: RNNModel, batch):
    """One chunk of every column in the slice: the summed cross-entropy of every next word, and how
    many there are. Training carries each column's state on; evaluation starts from zeros."""
    tokens, targets, chunk, column = batch
    hidden = model.hidden_for(chunk, column) if model.training else model.init_hidden(tokens.size(0))
    output, hidden = model(tokens, hidden)
    if model.training:
        model.keep_hidden(chunk, column, hidden)
    loss = nn.functional.cross_entropy(output.flatten(0, 1), targets.flatten(), ignore_index=IGNORED, reduction="sum")
    return loss, int(targets.ne(IGNORED).sum())


class Chunks(Dataset):
    """A token stream batchified into ``columns`` columns and read ``bptt`` rows at a time, as
    pytorch/examples' batchify and get_batch do. Item k * columns + c is chunk k of column c:
    (tokens, next tokens, k, c). The last chunk may be shorter: it is padded at its end (targets
    IGNORED there), so that every item has one length wherever a batch takes it from; the LSTM
    reads forward, and the state after the padding is the epoch's last, never carried on."""

    def __init__(self, ids: torch.Tensor, columns: int, bptt: int):
        rows = len(ids) // columns
        self.data = ids[: rows * columns].view(columns, rows).t().contiguous()  # [row, column]
        self.columns, self.bptt = columns, bptt
        self.chunks = len(range(0, rows - 1, bptt))

    def __len__(self) -> int:
        return self.chunks * self.columns

    def __getitem__(self, index: int):
        chunk, column = divmod(index, self.columns)
        start = chunk * self.bptt
        length = min(self.bptt, len(self.data) - 1 - start)
        tokens = torch.zeros(self.bptt, dtype=torch.long)
        targets = torch.full((self.bptt,), IGNORED)
        tokens[:length] = self.data[start : start + length, column]
        targets[:length] = self.data[start + 1 : start + 1 + length, column]
        return tokens, targets, chunk, column


def read_words(paths: list[Path]) -> list[str]:
    text = "\n".join(p.read_text(errors="replace") for p in paths)
    return re.findall(r"[a-z0-9']+|[^\sa-z0-9']", text.lower()) + ["<eos>"]


def text_files(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text", type=Path, default=Path("/usr/share/common-licenses"), help="a file or a folder")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--bptt", type=int, default=35)
    parser.add_argument("--batch-size", type=int, default=32, help="columns: the global batch")
    parser.add_argument("--emsize", type=int, default=128)
    parser.add_argument("--workers", default="auto")
    parser.add_argument("--checkpoint-dir", default=None, help="checkpoint each epoch here (the carried state too)")
    parser.add_argument("--resume", default=None, help="`latest`, or a checkpoint, to go on from")
    args = parser.parse_args()

    words = read_words(text_files(args.text))
    vocab = {w: i for i, w in enumerate(sorted(set(words)))}
    ids = torch.tensor([vocab[w] for w in words])
    split = int(len(ids) * 0.9)
    train, test = Chunks(ids[:split], args.batch_size, args.bptt), Chunks(ids[split:], 10, args.bptt)
    print(f"{len(words)} words, {len(vocab)} distinct; {train.chunks} chunks of {args.bptt} in {args.batch_size} "
          "columns")

    torch.manual_seed(0)
    model = RNNModel(len(vocab), args.emsize, columns=args.batch_size)
    # shuffle=False: chunk k of every column is global batch k, in order, as the state it carries needs
    trainer = Trainer(workers=args.workers if args.workers == "auto" else int(args.workers),
                      batch_size=args.batch_size, shuffle=False, epochs=args.epochs, max_steps=args.max_steps,
                      clip_grad_norm=0.25, log_every=20, checkpoint_dir=args.checkpoint_dir, resume=args.resume)
    result = trainer.fit(model, train, eval_set=test, step_fn=step,
                         optimizer=functools.partial(torch.optim.Adam, lr=3e-3))
    print(f"test loss {result.eval_loss:.3f}, perplexity {math.exp(result.eval_loss):.1f}, "
          f"{result.samples_per_sec * args.bptt:.0f} words/s ({result.workers} workers)")


if __name__ == "__main__":
    main()
