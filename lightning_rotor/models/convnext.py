"""A ConvNeXt written as timm writes it (nested stages of blocks, a hand-written forward), no timm needed.

Layout (Liu et al. 2022, "A ConvNet for the 2020s"; timm's module names): `stem` (4x4 stride-4
convolution, LayerNorm over channels), `stages.0..3` (each a `ConvNeXtStage`: a downsampling
LayerNorm + 2x2 stride-2 convolution except the first, then `blocks`, a Sequential of
`ConvNeXtBlock`), `head` (global average pool, LayerNorm, linear). A block is a depthwise 7x7
convolution, LayerNorm over channels, an MLP of 1x1 convolutions with GELU (4x wider), a learned
per-channel layer scale, drop path, and the residual addition.

`set_grad_checkpointing()` is the model's own checkpointing, as timm has it: each block runs
under `torch.utils.checkpoint` (its input kept, its inside recomputed in the backward). The
benchmarks and tests compare rotor's default discovery with it. `convnext_atto()` is timm's
`convnext_atto` sizes: depths (2, 2, 6, 2), dims (40, 80, 160, 320).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class LayerNorm2d(nn.LayerNorm):
    """LayerNorm over the channels of an NCHW map."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class DropPath(nn.Module):
    """Drop the residual branch per sample (stochastic depth), scaled to keep its expectation."""

    def __init__(self, p: float = 0.0):
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.p == 0.0 or not self.training:
            return x
        keep = 1.0 - self.p
        mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
        return x * mask.div_(keep)


class ConvMlp(nn.Module):
    """Two 1x1 convolutions with a GELU between them."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Conv2d(dim, hidden, 1)
        self.act = nn.GELU()
        self.fc2 = nn.Conv2d(hidden, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class ConvNeXtBlock(nn.Module):
    """Depthwise 7x7 conv, channel LayerNorm, MLP, layer scale, drop path, residual."""

    def __init__(self, dim: int, mlp_ratio: int = 4, ls_init: float = 1e-6, drop_path: float = 0.0):
        super().__init__()
        self.conv_dw = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = LayerNorm2d(dim, eps=1e-6)
        self.mlp = ConvMlp(dim, mlp_ratio * dim)
        self.gamma = nn.Parameter(torch.full((dim,), ls_init))
        self.drop_path = DropPath(drop_path)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x
        x = self.mlp(self.norm(self.conv_dw(x)))
        x = x.mul(self.gamma.reshape(1, -1, 1, 1))
        return self.drop_path(x) + shortcut


class ConvNeXtStage(nn.Module):
    """Optional downsampling (LayerNorm, 2x2 stride-2 conv), then a Sequential of blocks."""

    def __init__(self, cin: int, cout: int, depth: int, drop_paths: Sequence[float], ls_init: float = 1e-6):
        super().__init__()
        if cin == cout:
            self.downsample: nn.Module = nn.Identity()
        else:
            self.downsample = nn.Sequential(LayerNorm2d(cin, eps=1e-6), nn.Conv2d(cin, cout, 2, stride=2))
        self.blocks = nn.Sequential(*(ConvNeXtBlock(cout, ls_init=ls_init, drop_path=p) for p in drop_paths[:depth]))
        self.grad_checkpointing = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.downsample(x)
        if self.grad_checkpointing and torch.is_grad_enabled():
            for block in self.blocks:  # the model's own checkpointing: keep each block's input only
                x = checkpoint(block, x, use_reentrant=False)
            return x
        return self.blocks(x)


class Head(nn.Module):
    """Global average pool, LayerNorm, dropout, linear classifier."""

    def __init__(self, dim: int, num_classes: int, drop: float = 0.0):
        super().__init__()
        self.norm = LayerNorm2d(dim, eps=1e-6)
        self.drop = nn.Dropout(drop)
        self.fc = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.mean((2, 3), keepdim=True)).flatten(1)
        return self.fc(self.drop(x))


class ConvNeXt(nn.Module):
    """ConvNeXt: stem, four stages of blocks, classifier head (timm's layout and names)."""

    def __init__(
        self,
        depths: Sequence[int] = (3, 3, 9, 3),
        dims: Sequence[int] = (96, 192, 384, 768),
        num_classes: int = 1000,
        in_channels: int = 3,
        drop_path_rate: float = 0.0,
        ls_init: float = 1e-6,
    ):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, dims[0], 4, stride=4), LayerNorm2d(dims[0], eps=1e-6))
        rates = torch.linspace(0, drop_path_rate, sum(depths)).tolist()
        stages, cin, start = [], dims[0], 0
        for depth, dim in zip(depths, dims, strict=True):
            stages.append(ConvNeXtStage(cin, dim, depth, rates[start : start + depth], ls_init))
            cin, start = dim, start + depth
        self.stages = nn.Sequential(*stages)
        self.head = Head(dims[-1], num_classes)

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Checkpoint every block with `torch.utils.checkpoint` (timm's per-block checkpointing)."""
        for stage in self.stages.modules():
            if isinstance(stage, ConvNeXtStage):
                stage.grad_checkpointing = enable

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(self.stem(x)))


def convnext_atto(num_classes: int = 1000, **kwargs: Any) -> ConvNeXt:
    """timm's `convnext_atto` sizes (3.7 M parameters at 1000 classes)."""
    return ConvNeXt(depths=(2, 2, 6, 2), dims=(40, 80, 160, 320), num_classes=num_classes, **kwargs)
