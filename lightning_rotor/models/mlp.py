"""Two plain chains: an MLP, and a deliberately heterogeneous chain for benchmarks."""

from __future__ import annotations

import torch
from torch import nn

# (expansion factor, number of narrow stages after it): stages of very unequal cost and size
HETERO_PATTERN = ((4, 2), (1, 1), (8, 1), (2, 3), (4, 1), (8, 2), (1, 1), (4, 2))


class Dense(nn.Module):
    """tanh(Linear(x)): one narrow stage."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


def mlp(
    *, in_features: int = 784, hidden: int = 1024, depth: int = 4, num_classes: int = 10, dropout: float = 0.0
) -> nn.Sequential:
    """`depth` hidden layers of Linear, ReLU (and Dropout when `dropout` > 0), then a linear output."""
    layers: list[nn.Module] = [nn.Flatten(1)]
    width = in_features
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        if dropout > 0:
            layers.append(nn.Dropout(dropout))
        width = hidden
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


def hetero(
    *, in_features: int = 256, dim: int = 256, num_classes: int = 10, pattern: tuple = HETERO_PATTERN
) -> nn.Sequential:
    """A chain whose stages differ wildly in output size and cost.

    Each pattern entry `(e, n)` adds an expansion Linear(dim, e*dim), a GELU on the
    wide value and a contraction back to `dim` (three stages whose values are e times
    the narrow one), then `n` narrow `Dense` stages. Uniform segments, as
    `checkpoint_sequential` cuts them, land their boundaries on wide values; an
    optimal schedule keeps only narrow ones.
    """
    layers: list[nn.Module] = [nn.Linear(in_features, dim)]
    for expand, narrow in pattern:
        layers += [nn.Linear(dim, expand * dim), nn.GELU(), nn.Linear(expand * dim, dim)]
        layers += [Dense(dim) for _ in range(narrow)]
    layers.append(nn.Linear(dim, num_classes))
    return nn.Sequential(*layers)
