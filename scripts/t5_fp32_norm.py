"""Why a Hugging Face T5 cannot reach 1e-10 in float64: T5LayerNorm computes its variance in
float32 even in a float64 model. A tiny T5 trained a few steps by a plain loop, and by sn_trainer
at 1 and 2 workers; then again with each T5LayerNorm replaced by the same norm in float64.

    python scripts/t5_fp32_norm.py [STEPS]

Prints the largest relative difference of any parameter against the plain loop.
"""
from __future__ import annotations

import copy
import functools
import itertools
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

from sn_trainer import Trainer

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 30
BATCH, SEED = 8, 3
SGD = functools.partial(torch.optim.SGD, lr=0.5)


class Float64Norm(nn.Module):
    """T5LayerNorm with its variance in the model's dtype (T5's own casts it to float32)."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.weight, self.variance_epsilon = norm.weight, norm.variance_epsilon

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def tiny_t5(float64_norm: bool) -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config(vocab_size=32, d_model=16, d_kv=8, d_ff=32, num_layers=1,
                                                num_decoder_layers=1, num_heads=2, dropout_rate=0.0,
                                                decoder_start_token_id=0, pad_token_id=0)).double()
    if float64_norm:
        for name, module in list(model.named_modules()):
            if type(module).__name__ == "T5LayerNorm":
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, child, Float64Norm(module))
    return model


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randint(1, 32, (64, 6), generator=g), torch.randint(1, 32, (64, 5), generator=g))


def step(model, batch):
    inputs, labels = batch
    return model(input_ids=inputs, labels=labels).loss  # every label kept: a mean over equal-length samples


def plain(model: nn.Module) -> nn.Module:
    """Plain PyTorch over the global batches sn_trainer documents (seed * 1_000_003 + epoch)."""
    dataset = data()
    optimizer = SGD(model.parameters())

    def batches():
        for epoch in itertools.count():
            sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(SEED * 1_000_003 + epoch))
            yield from DataLoader(dataset, batch_size=BATCH, sampler=sampler, drop_last=True)

    for _, batch in zip(range(STEPS), batches()):
        optimizer.zero_grad()
        step(model, batch).backward()
        optimizer.step()
    return model


def worst(model: nn.Module, reference: nn.Module) -> float:
    return max(((p - q).abs() / q.abs().clamp_min(1e-12)).max().item()
               for p, q in zip(model.parameters(), reference.parameters()))


def main() -> None:
    print("| T5LayerNorm variance | against the plain loop: W=1 | W=2 | W=1 against W=2 |")
    print("|---|---:|---:|---:|")
    for float64_norm in (False, True):
        reference = plain(tiny_t5(float64_norm))
        trained = {}
        for workers in (1, 2):
            model = tiny_t5(float64_norm)
            Trainer(workers=workers, batch_size=BATCH, max_steps=STEPS, seed=SEED).fit(model, data(), step_fn=step,
                                                                                       optimizer=SGD)
            trained[workers] = model
        label = "float64 (replaced)" if float64_norm else "float32 (T5's own)"
        print(f"| {label} | {worst(trained[1], reference):.2g} | {worst(trained[2], reference):.2g} | "
              f"{worst(trained[1], copy.deepcopy(trained[2])):.2g} |")


if __name__ == "__main__":
    main()
