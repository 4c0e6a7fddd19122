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

A later shape costs no full profile. Its sizes are measured exactly, as on the first shape (the
memory runs of `profile_chain`, `timed=False`): the budget promise rests on them, and a size
predicted from another shape could be wrong by the one tensor that breaks it. Only the timing
rounds are skipped: each stage's times are the timed shape's, scaled by the ratio of the stage's
forward FLOPs at the two shapes (`torch.utils.flop_counter.FlopCounterMode`, one forward without
grad), or, for a stage without matmuls or convolutions, by the ratio of its output sizes.
A wrong time only makes a plan slower, never above its budget.

Fewer plans (`Checkpointable(shape_buckets={1: [64, 128, 256]})`): a chain input whose size along
a bucketed dimension is `n` runs the plan of the smallest bucket `>= n`, profiled on a zero-padded
copy of it (sizes above the largest bucket get their own plan). The input itself is not padded:
gradients are those of plain training. The plan's peak bounds the smaller input's when every
tensor of the step grows with that dimension (true of sequence models: embeddings, attention,
MLPs); the memory probe's samples (`RotorCallback`, `measure_step`) check it.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_rotor._torch_compat import tensor_version, tree_flatten, tree_unflatten
from lightning_rotor.budget import format_bytes
from lightning_rotor.chain import Chain
from lightning_rotor.planner import InfeasibleBudget

__all__ = [
    "Buckets",
    "InfeasibleShape",
    "bucketed",
    "check_buckets",
    "derived_times",
    "feasible_for_shape",
    "stage_flops",
]

Buckets = dict[int, tuple[int, ...]]  # a dimension of the chain input's tensors -> its sizes planned for


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
        f"{format_bytes(nbytes)} ({nbytes} bytes) is raised to that (above what the budget asks)",
        stacklevel=4,
    )
    return smallest


def stage_flops(stages: Sequence[nn.Module], sample: Any) -> list[int] | None:
    """Per stage, the FLOPs of its forward on `sample`: one forward without grad in eval mode (no
    statistics updated; matmuls and convolutions count the same), the RNG left as it was.

    On real tensors: torch's fake tensors would compute nothing, but their dispatch costs as
    much as the sizes-only profile itself on small models (measured: 0.24 s against 0.05 s).
    None when the forward fails.
    """
    tensors = [t for t in tree_flatten(sample)[0] if isinstance(t, torch.Tensor)]
    devices = [t.device for t in tensors if t.device.type == "cuda"]
    modes = [(m, m.training) for stage in stages for m in stage.modules()]
    buffers = [b for stage in stages for b in stage.buffers()]
    versions = [tensor_version(b) for b in buffers]
    counts = []
    try:
        for m, _ in modes:
            m.training = False
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            value = sample
            for stage in stages:
                with FlopCounterMode(display=False) as counter:
                    value = stage(value)
                counts.append(int(counter.get_total_flops()))
            del value
    except Exception:  # the shape is timed instead; the training step will raise what is wrong, if anything
        return None
    finally:
        for m, training in modes:
            m.training = training
    if [tensor_version(b) for b in buffers] != versions:  # a stage wrote a buffer: cannot count without effects
        raise RuntimeError("rotor: counting a stage's FLOPs wrote one of its buffers; use derive_shapes=False")
    return counts


def derived_times(timed: Chain, timed_flops: Sequence[int], sized: Chain, flops: Sequence[int]) -> Chain:
    """`sized` (a shape's chain, sizes measured, times 0) with each stage's times derived from `timed`
    (another shape of the same stages, timed): scaled by forward FLOPs, or output sizes where a stage has none."""
    scale = [
        f / t if t > 0 and f > 0 else (out / ref if ref > 0 else 1.0)
        for f, t, out, ref in zip(flops, timed_flops, sized.out_size, timed.out_size, strict=True)
    ]
    # an option's times scale with its stage's; an option the timed shape did not keep has no times: dropped
    options = [
        [
            dataclasses.replace(o, fwd_time=t.fwd_time * r, bwd_time=t.bwd_time * r)
            for o, t in zip(mine, theirs, strict=False)
        ]
        for mine, theirs, r in zip(sized.options, timed.options, scale, strict=True)
    ]
    return dataclasses.replace(
        sized,
        fwd_time=[t * r for t, r in zip(timed.fwd_time, scale, strict=True)],
        bwd_time=[t * r for t, r in zip(timed.bwd_time, scale, strict=True)],
        options=options,
    )


def check_buckets(buckets: Any) -> Buckets | None:
    """`shape_buckets` as {dimension: sorted sizes}, or one clear error."""
    if buckets is None:
        return None
    accepted = "shape_buckets takes {dimension: [sizes]}, e.g. {1: [64, 128, 256]} for sequence lengths"
    if not isinstance(buckets, dict) or not buckets:
        raise ValueError(f"{accepted}; got {buckets!r}")
    checked: Buckets = {}
    for dim, sizes in buckets.items():
        ok = isinstance(dim, int) and not isinstance(dim, bool) and isinstance(sizes, (list, tuple)) and sizes
        if not ok or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in sizes):
            raise ValueError(f"{accepted}; got {dim!r}: {sizes!r}")
        checked[dim] = tuple(sorted(set(sizes)))
    return checked


def bucketed(value: Any, buckets: Buckets) -> Any:
    """The chain input with each tensor zero-padded along each bucketed dimension to its bucket
    (the smallest size `>= n`; none above the largest); `value` itself when nothing grows."""

    def pad(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        shape = list(t.shape)
        for dim, sizes in buckets.items():
            if -t.dim() <= dim < t.dim():
                shape[dim] = next((n for n in sizes if n >= shape[dim]), shape[dim])
        if shape == list(t.shape):
            return t
        padded = t.new_zeros(shape)
        padded[tuple(slice(0, n) for n in t.shape)] = t.detach()
        return padded.requires_grad_(t.requires_grad)

    flat, spec = tree_flatten(value)
    padded = [pad(t) for t in flat]
    if all(p is t for p, t in zip(padded, flat, strict=True)):
        return value
    return tree_unflatten(padded, spec)
