"""Models written as users write them, as `lightning-rotor bench` builds them.

The models live in `lightning_rotor.models.as_written`: a torchvision-style ResNet with a
hand-written forward, a nanoGPT-style GPT and a Hugging Face transformers GPT-2 built
from a small config. rotor finds their chains by discovery (docs/discovery.md).
`ANY_MODELS` maps a bench name to a builder
`(batch_size, **sizes) -> (model, input, target, loss_fn, block class)`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_rotor.models.as_written import GPT, BasicBlock, Block, ResNet, gpt2

__all__ = ["ANY_MODELS", "GPT", "BasicBlock", "Block", "ResNet", "bench_gpt", "bench_gpt2", "bench_resnet", "gpt2"]


def _tokens_loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def bench_resnet(
    batch_size: int, layers: tuple[int, ...] = (2, 2, 2, 2), width: int = 32, image: int = 64
) -> tuple[nn.Module, torch.Tensor, torch.Tensor, Callable, type]:
    """The hand-written ResNet on `image`-pixel images, cross-entropy over 10 classes."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch_size, 3, image, image, generator=g)
    y = torch.randint(10, (batch_size,), generator=g)
    return ResNet(layers=tuple(layers), width=width), x, y, F.cross_entropy, BasicBlock


def bench_gpt(
    batch_size: int,
    n_layer: int = 6,
    n_embd: int = 256,
    n_head: int = 4,
    block_size: int = 256,
    vocab_size: int = 2048,
    dropout: float = 0.1,
) -> tuple[nn.Module, torch.Tensor, torch.Tensor, Callable, type]:
    """The nanoGPT-style GPT on `block_size` tokens, next-token cross-entropy."""
    g = torch.Generator().manual_seed(0)
    data = torch.randint(vocab_size, (batch_size, block_size + 1), generator=g)
    model = GPT(
        vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd, dropout=dropout
    )
    return model, data[:, :-1].contiguous(), data[:, 1:].contiguous(), _tokens_loss, Block


def bench_gpt2(
    batch_size: int,
    n_layer: int = 6,
    n_embd: int = 256,
    n_head: int = 4,
    n_positions: int = 256,
    vocab_size: int = 2048,
) -> tuple[nn.Module, torch.Tensor, torch.Tensor, Callable, type]:
    """transformers' GPT2LMHeadModel from a small config, next-token cross-entropy on its logits."""
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    g = torch.Generator().manual_seed(0)
    data = torch.randint(vocab_size, (batch_size, n_positions + 1), generator=g)
    model = gpt2(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab_size, n_positions=n_positions)
    return model, data[:, :-1].contiguous(), data[:, 1:].contiguous(), _tokens_loss, GPT2Block


ANY_MODELS: dict[str, Callable[..., tuple]] = {"resnet_any": bench_resnet, "gpt_any": bench_gpt, "gpt2_hf": bench_gpt2}
