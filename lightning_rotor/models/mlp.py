"""Plain chains: an MLP, and two deliberately heterogeneous chains for benchmarks."""

from __future__ import annotations

import torch
from torch import nn

# (expansion factor, number of narrow stages after it): stages of very unequal cost and size
HETERO_PATTERN = ((4, 2), (1, 1), (8, 1), (2, 3), (4, 1), (8, 2), (1, 1), (4, 2))
# hetero2: expansion factor of each group (cheap stages with large values between costly ones with small values)
HETERO2_EXPANSIONS = (8, 32, 4, 16, 32, 8)


class Dense(nn.Module):
    """tanh(Linear(x)): one narrow stage."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


class Heavy(nn.Module):
    """Costly, small: Linear, tanh, Linear on a (batch, dim) value."""

    def __init__(self, dim: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, dim)
        self.fc2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class Expand(nn.Module):
    """Cheap, large: (batch, dim) -> (batch, dim, factor), each feature scaled `factor` ways."""

    def __init__(self, factor: int):
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, factor))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.unsqueeze(-1) * self.scale


class Reduce(nn.Module):
    """Cheap, back to small: GELU on the large value, then the mean over its last dimension."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(x).mean(dim=-1)


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


def hetero2(
    *, in_features: int = 256, dim: int = 1024, num_classes: int = 10, expansions: tuple = HETERO2_EXPANSIONS
) -> nn.Sequential:
    """A second heterogeneous chain: stages differ wildly in cost and size, in opposite directions.

    After an input Linear, each group is `Heavy` (two dim x dim matmuls, small output),
    `Expand` (elementwise, output `e` times larger) and `Reduce` (elementwise, small
    output), with expansion factors `expansions`. The cheap stages hold the memory and the
    costly ones the time: a good schedule keeps the small values and recomputes only the
    cheap stages, while uniform segments (`checkpoint_sequential`) recompute whatever
    falls inside each segment, costly stages included.
    """
    layers: list[nn.Module] = [nn.Linear(in_features, dim)]
    for factor in expansions:
        layers += [Heavy(dim), Expand(factor), Reduce()]
    layers.append(nn.Linear(dim, num_classes))
    return nn.Sequential(*layers)
