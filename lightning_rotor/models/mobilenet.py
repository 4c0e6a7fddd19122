"""A MobileNet-style network as one nn.Sequential: depthwise blocks, BatchNorm, in-place ReLU6.

It is the in-place-heavy member of the model zoo. The stem and the MobileNet-v1
depthwise-separable layers sit at the top level, so the chain cuts between every
convolution and its BatchNorm; each BatchNorm is fused with the `ReLU6(inplace=True)`
after it into one stage by `sequential_stages`. Inverted residual blocks
(MobileNet-v2: 1x1 expansion, depthwise 3x3, 1x1 projection, residual add) are one
stage each. `width` scales every channel count (32 is the standard stem).
"""

from __future__ import annotations

import torch
from torch import nn


def conv_bn(cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1) -> list[nn.Module]:
    """Conv (no bias), BatchNorm, in-place ReLU6: three top-level modules, two stages once fused."""
    return [
        nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2, groups=groups, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU6(inplace=True),
    ]


class InvertedResidual(nn.Module):
    """MobileNet-v2 block: expand (1x1), depthwise (3x3), project (1x1, linear); residual when shapes allow."""

    def __init__(self, cin: int, cout: int, stride: int, expansion: int = 6):
        super().__init__()
        hidden = cin * expansion
        self.residual = stride == 1 and cin == cout
        self.body = nn.Sequential(
            *conv_bn(cin, hidden, 1),
            *conv_bn(hidden, hidden, 3, stride=stride, groups=hidden),
            nn.Conv2d(hidden, cout, 1, bias=False),
            nn.BatchNorm2d(cout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.body(x)
        return x + out if self.residual else out


# (output channels as multiples of width, stride) of the depthwise-separable (v1) layers
V1_LAYERS = ((2, 1), (4, 2), (4, 1))
# (output channels as multiples of width, stride, repeats) of the inverted residual (v2) stages
V2_STAGES = ((4, 1, 2), (8, 2, 2), (12, 1, 2), (20, 2, 2))


def mobilenet(*, width: int = 32, num_classes: int = 1000, head: int = 40) -> nn.Sequential:
    """Stem, v1 depthwise-separable layers (flat), v2 inverted residual blocks, 1x1 head, pool, linear."""
    layers: list[nn.Module] = [*conv_bn(3, width, 3, stride=2)]
    cin = width
    for mult, stride in V1_LAYERS:
        layers += conv_bn(cin, cin, 3, stride=stride, groups=cin)  # depthwise
        layers += conv_bn(cin, mult * width, 1)  # pointwise
        cin = mult * width
    for mult, stride, repeats in V2_STAGES:
        for r in range(repeats):
            layers.append(InvertedResidual(cin, mult * width, stride if r == 0 else 1))
            cin = mult * width
    layers += conv_bn(cin, head * width, 1)
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(1), nn.Linear(head * width, num_classes)]
    return nn.Sequential(*layers)
