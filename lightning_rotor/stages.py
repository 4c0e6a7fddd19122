"""`Stages`: the chain a discovery step found, before anything is measured.

A discovery step (today `sequential_stages`; graph and module-level discovery
are further producers) turns a user's module into stages `F_0 … F_{L-1}` with
`a_{k+1} = F_k(a_k)`. `Checkpointable`, the strategy and the benchmark consume
only this value, so a new way of finding stages plugs in without touching them.
Every stage is an `nn.Module` that calls the user's own submodules: parameters
are the same objects and `state_dict` keys are unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn


class SideInputs(Protocol):
    """Tensors that require grad and that every stage reads besides its chain input, the same objects for all
    (a decoder block's encoder output, a U-Net block's time embedding): docs/discovery.md, "Side inputs".

    The profiler and the executor give the stages other tensors in their place (`bind`), so that each stage's
    backward stops at them and their gradient is summed across stages as plain autograd sums it.
    """

    def tensors(self) -> list[torch.Tensor]:
        """This call's side tensors that require grad, in a fixed order."""
        ...

    def bind(self, values: Sequence[torch.Tensor] | None) -> None:
        """From now on the stages read `values` (one per `tensors()`) in their place; None: the call's own."""
        ...


@dataclass(frozen=True)
class Stages:
    """Stage names and modules, in order, and how they were found (`kind`)."""

    names: tuple[str, ...]
    modules: tuple[nn.Module, ...]
    kind: str = "sequential"
    notes: tuple[str, ...] = field(default=())  # cut points and guards, for the start-of-run summary
    sides: SideInputs | None = None  # tensors every stage reads besides its input (None: none)

    def __post_init__(self) -> None:
        object.__setattr__(self, "names", tuple(self.names))
        object.__setattr__(self, "modules", tuple(self.modules))
        if len(self.names) != len(self.modules):
            raise ValueError(f"{len(self.names)} stage names for {len(self.modules)} stage modules")
        if not self.modules:
            raise ValueError("a chain needs at least one stage")

    def __len__(self) -> int:
        return len(self.modules)

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self.modules)

    def __getitem__(self, k: int) -> nn.Module:
        return self.modules[k]


def side_inputs(stages: Any) -> SideInputs | None:
    """The side inputs of `stages` (a `Stages`; any other sequence of stages has none)."""
    return stages.sides if isinstance(stages, Stages) else None


def sequential_stages(module: nn.Sequential) -> Stages:
    """Leaves of nested Sequentials, in order; modules with `inplace=True` join the stage before.

    An in-place module (ReLU(inplace=True) after BatchNorm) overwrites its input; as a stage
    of its own, that input would be a checkpoint it corrupts. Fused, the overwrite stays
    inside one stage, as in the unwrapped model. A module used twice stays twice.
    """
    if not isinstance(module, nn.Sequential):
        raise TypeError(f"expected an nn.Sequential, got {type(module).__name__}")
    leaves: list[tuple[str, nn.Module]] = []

    def walk(seq: nn.Sequential, prefix: str) -> None:
        for name, child in seq._modules.items():  # named_children() would drop a module used twice
            if child is None:
                continue
            full = f"{prefix}{name}"
            if isinstance(child, nn.Sequential) and type(child).forward is nn.Sequential.forward and len(child) > 0:
                walk(child, full + ".")
            else:
                leaves.append((full, child))

    walk(module, "")
    names: list[str] = []
    groups: list[list[nn.Module]] = []
    for name, child in leaves:
        if groups and getattr(child, "inplace", False) is True:
            groups[-1].append(child)
            names[-1] = f"{names[-1]}+{name}"
        else:
            groups.append([child])
            names.append(name)
    if not groups:
        raise ValueError("cannot checkpoint an empty nn.Sequential: it has no stages")
    return Stages(tuple(names), tuple(g[0] if len(g) == 1 else nn.Sequential(*g) for g in groups), kind="sequential")
