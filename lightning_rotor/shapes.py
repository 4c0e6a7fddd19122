"""Changing input shapes: what a budget means at a shape other than the first one planned.

A training run meets several input shapes (dynamic padding, a last partial batch, variable
image sizes); each gets its own profile and plan (`PlanCache`, one per signature). Per kind of
budget (docs/checkpointable.md, "Changing shapes"):

- a fraction (`0.5`, `"50%"`) is a fraction of *each* shape's own no-recomputation peak;
- bytes (`8_000_000`, `"6GiB"`) hold at every shape: a shape that cannot fit raises
  `InfeasibleShape`, naming the shape and its smallest feasible budget;
- the automatic budget (`None`) is device memory on CUDA (the same bytes at every shape) and
  no recomputation off CUDA (each shape's own no-recomputation peak).

A fraction or the automatic budget never stops training at a later shape: where the rule gives
less than that shape's smallest feasible budget, the shape is planned at its smallest and one
warning says so.
"""

from __future__ import annotations

import warnings

from lightning_rotor.budget import format_bytes
from lightning_rotor.planner import InfeasibleBudget

__all__ = ["InfeasibleShape", "feasible_for_shape"]


class InfeasibleShape(InfeasibleBudget):
    """A byte budget that a later input shape cannot meet; `.shape` names the input."""

    def __init__(self, budget: int, min_feasible: int, shape: str) -> None:
        super().__init__(budget, min_feasible)
        self.shape = shape
        ValueError.__init__(
            self,
            f"budget {format_bytes(budget)} ({budget} bytes) is below the smallest feasible budget "
            f"{format_bytes(min_feasible)} ({min_feasible} bytes) for input shape {shape}; use mem_limit >= "
            f"{min_feasible} (bytes hold at every shape; a fraction such as '50%' scales with each shape)",
        )


def feasible_for_shape(nbytes: int, smallest: int, shape: str, holds: bool) -> int:
    """`nbytes` for a later input `shape`, or what to do when it is below the shape's `smallest` budget:
    raise `InfeasibleShape` for a byte budget (`holds`), else plan at `smallest` with one warning."""
    if nbytes >= smallest:
        return nbytes
    if holds:
        raise InfeasibleShape(nbytes, smallest, shape)
    warnings.warn(
        f"rotor: input shape {shape} needs at least {format_bytes(smallest)} ({smallest} bytes); its budget "
        f"{format_bytes(nbytes)} ({nbytes} bytes) is raised to that (more than the fraction asks)",
        stacklevel=4,
    )
    return smallest
