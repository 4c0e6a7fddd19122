"""The architectures of `benchmarks/gpu_chains.py`, written compactly as nn.Sequential chains (no torchvision).

DenseNet-121 and Inception-v3 follow torchvision's layer shapes (Inception-v3 without its auxiliary
classifier); ResNet-101 and the GPT-2-medium-like model are `lightning_rotor.models`'; the Llama-like
model is a pre-norm decoder with RMSNorm, rotary positions, grouped-query attention (through
`scaled_dot_product_attention`, as Llama training runs it) and a SwiGLU MLP.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn
from torch.nn import functional as F


def conv_bn(cin: int, cout: int, kernel: int | tuple[int, int], stride: int = 1, padding=0) -> nn.Sequential:
    """Inception's BasicConv2d: convolution, batch norm (eps 1e-3), ReLU."""
    return nn.Sequential(
        nn.Conv2d(cin, cout, kernel, stride=stride, padding=padding, bias=False),
        nn.BatchNorm2d(cout, eps=1e-3),
        nn.ReLU(),
    )


class DenseLayer(nn.Module):
    """x -> cat(x, conv3x3(relu(bn(conv1x1(relu(bn(x))))))): DenseNet's layer as one chain stage."""

    def __init__(self, cin: int, growth: int = 32, bn_size: int = 4):
        super().__init__()
        self.body = nn.Sequential(
            nn.BatchNorm2d(cin),
            nn.ReLU(),
            nn.Conv2d(cin, bn_size * growth, 1, bias=False),
            nn.BatchNorm2d(bn_size * growth),
            nn.ReLU(),
            nn.Conv2d(bn_size * growth, growth, 3, padding=1, bias=False),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, self.body(x)], 1)


class Transition(nn.Sequential):
    def __init__(self, cin: int, cout: int):
        super().__init__(nn.BatchNorm2d(cin), nn.ReLU(), nn.Conv2d(cin, cout, 1, bias=False), nn.AvgPool2d(2, 2))


def densenet121(num_classes: int = 1000) -> nn.Sequential:
    """DenseNet-121 (growth 32, blocks 6-12-24-16): every dense layer and transition a stage."""
    parts: OrderedDict[str, nn.Module] = OrderedDict(
        conv0=nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False),
        norm0=nn.BatchNorm2d(64),
        relu0=nn.ReLU(inplace=True),
        pool0=nn.MaxPool2d(3, stride=2, padding=1),
    )
    width = 64
    for i, count in enumerate((6, 12, 24, 16)):
        for j in range(count):
            parts[f"block{i + 1}_{j + 1}"] = DenseLayer(width + 32 * j)
        width += 32 * count
        if i < 3:
            parts[f"transition{i + 1}"] = Transition(width, width // 2)
            width //= 2
    parts["norm5"] = nn.BatchNorm2d(width)
    parts["relu5"] = nn.ReLU(inplace=True)
    parts["head"] = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(1), nn.Linear(width, num_classes))
    return nn.Sequential(parts)


class Branches(nn.Module):
    """Inception block: branches run on one input, their outputs concatenated along channels."""

    def __init__(self, *branches: nn.Module):
        super().__init__()
        self.branches = nn.ModuleList(branches)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([b(x) for b in self.branches], 1)


def pool_branch(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.AvgPool2d(3, stride=1, padding=1), conv_bn(cin, cout, 1))


def inception_a(cin: int, pool: int) -> Branches:
    return Branches(
        conv_bn(cin, 64, 1),
        nn.Sequential(conv_bn(cin, 48, 1), conv_bn(48, 64, 5, padding=2)),
        nn.Sequential(conv_bn(cin, 64, 1), conv_bn(64, 96, 3, padding=1), conv_bn(96, 96, 3, padding=1)),
        pool_branch(cin, pool),
    )


def inception_b(cin: int) -> Branches:
    return Branches(
        conv_bn(cin, 384, 3, stride=2),
        nn.Sequential(conv_bn(cin, 64, 1), conv_bn(64, 96, 3, padding=1), conv_bn(96, 96, 3, stride=2)),
        nn.MaxPool2d(3, stride=2),
    )


def inception_c(cin: int, c7: int) -> Branches:
    def row(a: int, b: int) -> nn.Sequential:
        return conv_bn(a, b, (1, 7), padding=(0, 3))

    def col(a: int, b: int) -> nn.Sequential:
        return conv_bn(a, b, (7, 1), padding=(3, 0))

    return Branches(
        conv_bn(cin, 192, 1),
        nn.Sequential(conv_bn(cin, c7, 1), row(c7, c7), col(c7, 192)),
        nn.Sequential(conv_bn(cin, c7, 1), col(c7, c7), row(c7, c7), col(c7, c7), row(c7, 192)),
        pool_branch(cin, 192),
    )


def inception_d(cin: int) -> Branches:
    return Branches(
        nn.Sequential(conv_bn(cin, 192, 1), conv_bn(192, 320, 3, stride=2)),
        nn.Sequential(
            conv_bn(cin, 192, 1),
            conv_bn(192, 192, (1, 7), padding=(0, 3)),
            conv_bn(192, 192, (7, 1), padding=(3, 0)),
            conv_bn(192, 192, 3, stride=2),
        ),
        nn.MaxPool2d(3, stride=2),
    )


def split_3x3(cin: int) -> Branches:
    return Branches(conv_bn(cin, 384, (1, 3), padding=(0, 1)), conv_bn(cin, 384, (3, 1), padding=(1, 0)))


def inception_e(cin: int) -> Branches:
    return Branches(
        conv_bn(cin, 320, 1),
        nn.Sequential(conv_bn(cin, 384, 1), split_3x3(384)),
        nn.Sequential(conv_bn(cin, 448, 1), conv_bn(448, 384, 3, padding=1), split_3x3(384)),
        pool_branch(cin, 192),
    )


class Leaf(nn.Module):
    """Keeps a Sequential as one stage: sequential_stages opens nested nn.Sequentials, not other modules."""

    def __init__(self, body: nn.Module):
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def inception_v3(num_classes: int = 1000) -> nn.Sequential:
    """Inception-v3 (torchvision's shapes, no auxiliary classifier): each stem convolution and block a stage."""
    parts: OrderedDict[str, nn.Module] = OrderedDict(
        conv1a=Leaf(conv_bn(3, 32, 3, stride=2)),
        conv2a=Leaf(conv_bn(32, 32, 3)),
        conv2b=Leaf(conv_bn(32, 64, 3, padding=1)),
        pool1=nn.MaxPool2d(3, stride=2),
        conv3b=Leaf(conv_bn(64, 80, 1)),
        conv4a=Leaf(conv_bn(80, 192, 3)),
        pool2=nn.MaxPool2d(3, stride=2),
        mixed5b=inception_a(192, 32),
        mixed5c=inception_a(256, 64),
        mixed5d=inception_a(288, 64),
        mixed6a=inception_b(288),
        mixed6b=inception_c(768, 128),
        mixed6c=inception_c(768, 160),
        mixed6d=inception_c(768, 160),
        mixed6e=inception_c(768, 192),
        mixed7a=inception_d(768),
        mixed7b=inception_e(1280),
        mixed7c=inception_e(2048),
        head=nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Dropout(0.5), nn.Flatten(1), nn.Linear(2048, num_classes)),
    )
    return nn.Sequential(parts)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate(x: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding of (batch, heads, time, head_dim), rotate-half form."""
    t, d = x.shape[-2], x.shape[-1]
    inv = base ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    angles = torch.outer(torch.arange(t, device=x.device, dtype=torch.float32), inv)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    half = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + half * sin


class LlamaBlock(nn.Module):
    """x + attn(norm(x)), then x + swiglu(norm(x)); grouped-query attention with `kv_heads` key/value heads."""

    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.attn_norm, self.mlp_norm = RMSNorm(dim), RMSNorm(dim)
        self.q = nn.Linear(dim, dim, bias=False)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        h = self.attn_norm(x)
        q = self.q(h).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k, v = (z.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2) for z in self.kv(h).chunk(2, -1))
        y = F.scaled_dot_product_attention(rotate(q), rotate(k), v, is_causal=True, enable_gqa=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, c))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, -1)
        return x + self.down(F.silu(gate) * up)


def llama_like(
    *, vocab: int = 32000, dim: int = 2048, heads: int = 32, kv_heads: int = 4, hidden: int = 5632, layers: int = 22
) -> nn.Sequential:
    """A Llama-style decoder; the defaults are TinyLlama-1.1B's shape."""
    blocks = nn.Sequential(*(LlamaBlock(dim, heads, kv_heads, hidden) for _ in range(layers)))
    return nn.Sequential(
        OrderedDict(
            embed=nn.Embedding(vocab, dim), blocks=blocks, norm=RMSNorm(dim), lm_head=nn.Linear(dim, vocab, bias=False)
        )
    )


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def image_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, targets)
