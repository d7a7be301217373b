"""A small GPT on the characters of any text, trained by sn_trainer.

Written the way nanoGPT is: ``forward(idx, targets)`` returns ``(logits, loss)``, the output layer
shares the embedding's weights, and ``configure_optimizers`` puts every 2-d weight in a group with
weight decay and the rest (biases, layer norms) in one without, then builds AdamW from the groups.
That method is handed to sn_trainer unchanged, as ``param_groups``. As nanoGPT does, it evaluates
every ``--eval-every`` steps on a bounded number of held-out batches, and keeps a moving average of
the weights (``--ema-decay``), evaluated beside them. At the end the trained model writes a sample.

    python examples/char_gpt.py                      # Debian's licence texts, ~1.5 min on 2 cores
    python examples/char_gpt.py --text my.txt --max-steps 2000
"""
from __future__ import annotations

import sn_trainer

if __name__ == "__main__":
    sn_trainer.warm_up()  # first: the warm workers' server imports torch while this script does

import argparse
import functools
import inspect
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from sn_trainer import Trainer


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd),
                                 nn.Dropout(dropout))
        self.n_head, self.dropout = n_head, dropout

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                           is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size: int, block_size: int = 64, n_layer: int = 2, n_head: int = 4, n_embd: int = 128,
                 dropout: float = 0.0):
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList([Block(n_embd, n_head, dropout) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx, targets=None):
        _, t = idx.shape
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(t, device=idx.device)))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        param_dict = {pn: p for pn, p in self.named_parameters() if p.requires_grad}
        # Every 2-d parameter is weight decayed (matmul weights, embeddings); biases and norms are not.
        decay_params = [p for n, p in param_dict.items() if p.dim() >= 2]
        nodecay_params = [p for n, p in param_dict.items() if p.dim() < 2]
        optim_groups = [{"params": decay_params, "weight_decay": weight_decay},
                        {"params": nodecay_params, "weight_decay": 0.0}]
        print(f"num decayed parameter tensors: {len(decay_params)}, "
              f"with {sum(p.numel() for p in decay_params):,} parameters")
        print(f"num non-decayed parameter tensors: {len(nodecay_params)}, "
              f"with {sum(p.numel() for p in nodecay_params):,} parameters")
        fused_available = "fused" in inspect.signature(torch.optim.AdamW).parameters
        extra_args = dict(fused=True) if fused_available and device_type == "cuda" else dict()
        return torch.optim.AdamW(optim_groups, lr=learning_rate, betas=betas, **extra_args)

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.block_size :])
            logits = logits[:, -1, :] / temperature
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("inf")
            idx = torch.cat((idx, torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)), dim=1)
        return idx


class CharWindows(Dataset):
    """Every window of ``block_size`` characters, and the same window one character on."""

    def __init__(self, data: torch.Tensor, block_size: int):
        self.data, self.block_size = data, block_size

    def __len__(self):
        return len(self.data) - self.block_size

    def __getitem__(self, i):
        chunk = self.data[i : i + self.block_size + 1]
        return chunk[:-1], chunk[1:]

    def get_batch(self, indices: torch.Tensor):
        offsets = indices.view(-1, 1) + torch.arange(self.block_size + 1)
        chunk = self.data[offsets]
        return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()

    def share_memory_(self):
        self.data.share_memory_()
        return self


def step(model: GPT, batch) -> torch.Tensor:
    _, loss = model(*batch)
    return loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text", type=Path, default=Path("/usr/share/common-licenses"), help="a file or a folder")
    parser.add_argument("--max-steps", type=int, default=600)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--sample-chars", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=200, help="evaluate every this many steps")
    parser.add_argument("--eval-batches", type=int, default=None, help="evaluate on this many batches only")
    parser.add_argument("--ema-decay", type=float, default=0.99, help="0 for none")
    parser.add_argument("--workers", default="auto")
    args = parser.parse_args()

    files = sorted(p for p in args.text.iterdir() if p.is_file()) if args.text.is_dir() else [args.text]
    text = "\n".join(p.read_text(errors="replace") for p in files)
    chars = sorted(set(text))
    encode = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([encode[c] for c in text], dtype=torch.long)
    split = int(len(data) * 0.95)
    train, test = CharWindows(data[:split], args.block_size), CharWindows(data[split:], args.block_size)
    print(f"{len(text)} characters, vocabulary of {len(chars)}")

    torch.manual_seed(0)
    model = GPT(len(chars), args.block_size, args.n_layer, n_embd=args.n_embd)
    trainer = Trainer(workers=args.workers if args.workers == "auto" else int(args.workers),
                      batch_size=args.batch_size, max_steps=args.max_steps, log_every=50, eval_batch_size=256,
                      eval_every=args.eval_every, max_eval_batches=args.eval_batches,
                      ema_decay=args.ema_decay or None)
    # nanoGPT's method, unchanged: its groups and its AdamW reach every worker's shard.
    groups = functools.partial(GPT.configure_optimizers, weight_decay=0.1, learning_rate=2e-3, betas=(0.9, 0.95),
                               device_type="cpu")
    heldout = torch.utils.data.Subset(test, range(0, len(test), args.block_size))  # windows that do not overlap
    result = trainer.fit(model, train, eval_set=heldout, step_fn=step, param_groups=groups)
    print(f"held-out loss {result.eval_loss:.3f} (perplexity {math.exp(result.eval_loss):.2f}), "
          f"{result.samples_per_sec * args.block_size:.0f} tokens/s ({result.workers} workers)")
    for record in result.history:
        if "eval_loss" in record:
            ema = f", the weights' moving average {record['eval_ema_loss']:.3f}" if "eval_ema_loss" in record else ""
            print(f"step {record['step']}: held-out loss {record['eval_loss']:.3f}{ema}")
    model.eval()
    start = torch.tensor([[encode["\n"]]])
    sample = model.generate(start, args.sample_chars, temperature=0.8, top_k=10)[0].tolist()
    print("sample:\n" + "".join(chars[i] for i in sample))


if __name__ == "__main__":
    main()
