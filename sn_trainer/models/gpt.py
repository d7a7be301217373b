"""A small decoder-only transformer for ``model=gpt``: tied embeddings, pre-norm blocks, causal attention."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd, bias=bias), nn.GELU(),
                                 nn.Linear(4 * n_embd, n_embd, bias=bias), nn.Dropout(dropout))
        self.resid_drop = nn.Dropout(dropout)
        self.n_head, self.dropout = n_head, dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        x = x + self.resid_drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Tokens in, next-token logits out: ``forward(idx) -> [N, T, vocab]``."""

    def __init__(self, vocab_size: int, block_size: int, n_layer: int = 4, n_head: int = 4, n_embd: int = 128,
                 dropout: float = 0.0, bias: bool = False):
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} must be a multiple of n_head={n_head}")
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList([Block(n_embd, n_head, dropout, bias) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.head.weight = self.wte.weight  # tied: one matrix reads and writes tokens
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(t, device=idx.device)))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, new_tokens: int, temperature: float = 0.8, top_k: int | None = 20,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """``idx`` continued by ``new_tokens`` sampled tokens."""
        for _ in range(new_tokens):
            logits = self(idx[:, -self.block_size :])[:, -1, :] / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            idx = torch.cat([idx, torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)], dim=1)
        return idx


def language_model_step(model: nn.Module, batch) -> torch.Tensor:
    """Next-token cross-entropy, the mean over every token of the slice."""
    tokens, targets = batch
    logits = model(tokens)
    # bf16 logits (autocast) are raised to fp32 for the loss; float64 ones stay float64.
    return F.cross_entropy(logits.flatten(0, 1).to(torch.promote_types(logits.dtype, torch.float32)),
                           targets.flatten())


def decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on 2-d weights (matmuls and embeddings) only; none on biases and norms."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
