"""A GPT-style decoder-only transformer as a chain: embedding, blocks, final norm, LM head.

Written in the spirit of nanoGPT, as one nn.Sequential so every block is a stage:
`embed` (token + position embeddings, dropout), `blocks` (pre-norm transformer
blocks: causal self-attention and an MLP, each with a residual and dropout),
`ln_f`, `lm_head`. Attention is plain torch ops (a masked softmax), so its memory
is what the memory model sees. The defaults are GPT-2 small's shape without
weight tying; pass smaller sizes for tests and CPU benchmarks.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch
from torch import nn
from torch.nn import functional as F


class Embedding(nn.Module):
    """Token ids (batch, time) -> token plus position embeddings (batch, time, n_embd)."""

    def __init__(self, vocab_size: int, block_size: int, n_embd: int, dropout: float):
        super().__init__()
        self.block_size = block_size
        self.tok = nn.Embedding(vocab_size, n_embd)
        self.pos = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.block_size}")
        pos = torch.arange(t, device=idx.device)
        return self.drop(self.tok(idx) + self.pos(pos))


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t sees positions <= t only."""

    mask: torch.Tensor  # (block_size, block_size) lower triangle, a buffer

    def __init__(self, n_embd: int, n_head: int, block_size: int, dropout: float):
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd ({n_embd}) must be a multiple of n_head ({n_head})")
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.attn_drop = nn.Dropout(dropout)
        self.resid_drop = nn.Dropout(dropout)
        mask = torch.ones(block_size, block_size, dtype=torch.bool).tril()
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.shape[-1]))
        att = att.masked_fill(~self.mask[:t, :t], float("-inf"))
        att = self.attn_drop(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.proj(y))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, n_embd: int, n_head: int, block_size: int, dropout: float):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, block_size, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def gpt(
    *,
    vocab_size: int = 50257,
    block_size: int = 1024,
    n_layer: int = 12,
    n_head: int = 12,
    n_embd: int = 768,
    dropout: float = 0.1,
) -> nn.Sequential:
    """A GPT-style model mapping token ids (batch, time) to logits (batch, time, vocab_size)."""
    blocks = nn.Sequential(*(Block(n_embd, n_head, block_size, dropout) for _ in range(n_layer)))
    return nn.Sequential(
        OrderedDict(
            embed=Embedding(vocab_size, block_size, n_embd, dropout),
            blocks=blocks,
            ln_f=nn.LayerNorm(n_embd),
            lm_head=nn.Linear(n_embd, vocab_size, bias=False),
        )
    )


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy over every position."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
