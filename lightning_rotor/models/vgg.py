"""A VGG-style network (VGG-11 layout by default) as one nn.Sequential.

`features` (3x3 convolutions with in-place ReLU, max-pools), then `classifier`
(adaptive pool, flatten, two hidden linear layers with dropout, output layer).
`width` scales the channels (64 is standard), `hidden` the classifier,
`pool` the spatial size fed to it (7 is standard).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from torch import nn

# each layout: output channels of a 3x3 convolution (at width 64), or "M" for a 2x2 max-pool
CONFIGS: dict[int, tuple[int | str, ...]] = {
    11: (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"),
    13: (64, 64, "M", 128, 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"),
    16: (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"),
}


def vgg(
    depth: int = 11,
    *,
    num_classes: int = 1000,
    width: int = 64,
    hidden: int = 4096,
    pool: int = 7,
    in_channels: int = 3,
    batch_norm: bool = False,
    dropout: float = 0.5,
) -> nn.Sequential:
    """A VGG of `depth` (11, 13, 16) as an nn.Sequential of `features` and `classifier`."""
    if depth not in CONFIGS:
        raise ValueError(f"vgg depth must be one of {sorted(CONFIGS)}, got {depth!r}")
    layers: list[nn.Module] = []
    cin = in_channels
    for item in CONFIGS[depth]:
        if isinstance(item, str):  # "M"
            layers.append(nn.MaxPool2d(2, 2))
            continue
        cout = item * width // 64
        layers.append(nn.Conv2d(cin, cout, 3, padding=1))
        if batch_norm:
            layers.append(nn.BatchNorm2d(cout))
        layers.append(nn.ReLU(inplace=True))
        cin = cout
    classifier = nn.Sequential(
        nn.AdaptiveAvgPool2d(pool),
        nn.Flatten(1),
        nn.Linear(cin * pool * pool, hidden),
        nn.ReLU(inplace=True),
        nn.Dropout(dropout),
        nn.Linear(hidden, hidden),
        nn.ReLU(inplace=True),
        nn.Dropout(dropout),
        nn.Linear(hidden, num_classes),
    )
    return nn.Sequential(OrderedDict(features=nn.Sequential(*layers), classifier=classifier))


def vgg11(**kwargs: Any) -> nn.Sequential:
    return vgg(11, **kwargs)
