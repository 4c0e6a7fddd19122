"""ResNet-18/50/101-style networks as one nn.Sequential (the torchvision layout, written anew).

Layout: `stem` (conv, BatchNorm, in-place ReLU, max-pool), `layer1..layer4`
(Sequentials of residual blocks), `head` (average pool, flatten, linear). Flattened
into stages this gives conv, bn+relu, pool, one stage per residual block, then the
head's three leaves. The in-place ReLU after the stem's BatchNorm is fused into the
BatchNorm's stage by `sequential_stages`; inside blocks it stays within the block.

`width` scales every channel count (64 is the standard network), so tests can
build tiny ones.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

DEPTHS = {
    18: ("basic", (2, 2, 2, 2)),
    34: ("basic", (3, 4, 6, 3)),
    50: ("bottleneck", (3, 4, 6, 3)),
    101: ("bottleneck", (3, 4, 23, 3)),
    152: ("bottleneck", (3, 8, 36, 3)),
}


def conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)


def shortcut(cin: int, cout: int, stride: int) -> nn.Module | None:
    """A 1x1 projection where the residual's shape changes, else the identity."""
    if stride == 1 and cin == cout:
        return None
    return nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))


class BasicBlock(nn.Module):
    """Two 3x3 convolutions and a residual connection (ResNet-18/34)."""

    expansion = 1

    def __init__(self, cin: int, planes: int, stride: int = 1):
        super().__init__()
        self.conv1 = conv3x3(cin, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = shortcut(cin, planes, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carrying the stride), 1x1 expand, residual (ResNet-50/101/152, "v1.5")."""

    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int = 1):
        super().__init__()
        cout = planes * self.expansion
        self.conv1 = nn.Conv2d(cin, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = conv3x3(planes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = shortcut(cin, cout, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


def resnet(depth: int = 50, *, num_classes: int = 1000, width: int = 64, in_channels: int = 3) -> nn.Sequential:
    """A ResNet of `depth` (18, 34, 50, 101, 152) as an nn.Sequential of stem, block stages and head."""
    if depth not in DEPTHS:
        raise ValueError(f"resnet depth must be one of {sorted(DEPTHS)}, got {depth!r}")
    kind, counts = DEPTHS[depth]
    block = BasicBlock if kind == "basic" else Bottleneck
    parts: OrderedDict[str, nn.Module] = OrderedDict()
    parts["stem"] = nn.Sequential(
        nn.Conv2d(in_channels, width, 7, stride=2, padding=3, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(3, stride=2, padding=1),
    )
    cin = width
    for i, count in enumerate(counts):
        planes = width * 2**i
        blocks = []
        for j in range(count):
            blocks.append(block(cin, planes, stride=2 if i > 0 and j == 0 else 1))
            cin = planes * block.expansion
        parts[f"layer{i + 1}"] = nn.Sequential(*blocks)
    parts["head"] = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(1), nn.Linear(cin, num_classes))
    return nn.Sequential(parts)


def resnet18(**kwargs) -> nn.Sequential:
    return resnet(18, **kwargs)


def resnet50(**kwargs) -> nn.Sequential:
    return resnet(50, **kwargs)


def resnet101(**kwargs) -> nn.Sequential:
    return resnet(101, **kwargs)
