"""Uniform checkpointing schedules written as plan ops, so the simulator can referee them too.

`checkpoint_sequential(functions, segments, x)` cuts a chain of `L` stages into
`segments - 1` checkpointed segments of `L // segments` stages and runs the rest
normally; checkpointing every stage (`checkpoint(stage, x)` around each) keeps every
stage input and recomputes each stage right before its backward. Written as ops
(docs/memory-model.md), the simulator predicts their peaks, which the tests compare
with what torch's own implementations measure under the same tensor accounting.
"""

from __future__ import annotations

from lightning_rotor.ops import Op, OpKind


def segment_bounds(length: int, segments: int) -> list[tuple[int, int]]:
    """(start, end) of each checkpointed segment, exactly as torch's `checkpoint_sequential` cuts them."""
    if not 1 <= segments <= length:
        raise ValueError(f"segments must be between 1 and the chain length {length}, got {segments}")
    size = length // segments
    return [(start, start + size) for start in range(0, size * (segments - 1), size)]


def checkpoint_sequential_ops(length: int, segments: int) -> list[Op]:
    """The ops of `checkpoint_sequential(stages, segments, x)`: segments run without graph, the rest recorded."""
    bounds = segment_bounds(length, segments)
    ops: list[Op] = []
    for start, end in bounds:
        ops.append(Op(OpKind.FC, start))
        ops += [Op(OpKind.FN, j) for j in range(start + 1, end)]
    last = bounds[-1][1] if bounds else 0
    ops += [Op(OpKind.FE, j) for j in range(last, length)]
    ops.append(Op(OpKind.LOSS))
    ops += [Op(OpKind.B, j) for j in reversed(range(last, length))]
    for start, end in reversed(bounds):
        ops += [Op(OpKind.FE, j) for j in range(start, end)]
        ops += [Op(OpKind.B, j) for j in reversed(range(start, end))]
    return ops


def checkpoint_every_stage_ops(length: int) -> list[Op]:
    """The ops of `checkpoint(stage, x)` around every stage: all inputs kept, each stage recomputed once."""
    ops = [Op(OpKind.FC, k) for k in range(length)] + [Op(OpKind.LOSS)]
    for k in reversed(range(length)):
        ops += [Op(OpKind.FE, k), Op(OpKind.B, k)]
    return ops
