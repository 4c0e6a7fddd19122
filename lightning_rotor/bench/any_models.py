"""Models written as users write them, for `lightning-rotor bench` and the acceptance tests.

None is an `nn.Sequential` chain: a torchvision-style ResNet with a hand-written forward,
a nanoGPT-style GPT (a ModuleList looped in `forward`, an `assert` on the sequence
length, dropout, a tied LM head, int64 tokens) and a Hugging Face transformers GPT-2
built from a small config (no download; needs `pip install transformers`). rotor finds
their chains by discovery (docs/discovery.md). `ANY_MODELS` maps a bench name to a
builder `(batch_size, **sizes) -> (model, input, target, loss_fn, block class)`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


# -- torchvision-style ResNet with a hand-written forward ------------------------------------------
class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes, planes, stride=1, downsample=None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x):
        identity = x
        out = self.conv1(x)
        out = self.bn1(out)
        out = self.relu(out)
        out = self.conv2(out)
        out = self.bn2(out)
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        out = self.relu(out)
        return out


class ResNet(nn.Module):
    def __init__(self, layers=(1, 1, 1, 1), num_classes=10, width=8):
        super().__init__()
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = self._make_layer(width, layers[0])
        self.layer2 = self._make_layer(width * 2, layers[1], stride=2)
        self.layer3 = self._make_layer(width * 4, layers[2], stride=2)
        self.layer4 = self._make_layer(width * 8, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(width * 8, num_classes)

    def _make_layer(self, planes, blocks, stride=1):
        downsample = None
        if stride != 1 or self.inplanes != planes:
            downsample = nn.Sequential(nn.Conv2d(self.inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))
        layers = [BasicBlock(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes
        layers += [BasicBlock(planes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.conv1(x)
        x = self.bn1(x)
        x = self.relu(x)
        x = self.maxpool(x)
        x = self.layer1(x)
        x = self.layer2(x)
        x = self.layer3(x)
        x = self.layer4(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        x = self.fc(x)
        return x


# -- nanoGPT-style GPT -------------------------------------------------------------------------------
class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, block_size, dropout):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)
        self.n_head = n_head
        self.n_embd = n_embd
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, n_embd, dropout):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, n_embd, n_head, block_size, dropout):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, block_size, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd, dropout)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16, dropout=0.1):
        super().__init__()
        self.block_size = block_size
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(vocab_size, n_embd),
                wpe=nn.Embedding(block_size, n_embd),
                drop=nn.Dropout(dropout),
                h=nn.ModuleList([Block(n_embd, n_head, block_size, dropout) for _ in range(n_layer)]),
                ln_f=nn.LayerNorm(n_embd),
            )
        )
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying

    def forward(self, idx):
        device = idx.device
        b, t = idx.size()
        assert t <= self.block_size, f"Cannot forward sequence of length {t}, block size is only {self.block_size}"
        pos = torch.arange(0, t, dtype=torch.long, device=device)
        tok_emb = self.transformer.wte(idx)
        pos_emb = self.transformer.wpe(pos)
        x = self.transformer.drop(tok_emb + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        return self.lm_head(x)


def gpt2(n_layer=2, n_embd=16, n_head=2, vocab_size=64, n_positions=32):
    """A transformers GPT-2 from a small config (no download)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=vocab_size,
        n_positions=n_positions,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        attn_pdrop=0.1,
        use_cache=False,
    )  # training: no key-value cache, as gradient checkpointing requires
    config._attn_implementation = "eager"
    return GPT2LMHeadModel(config)


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
