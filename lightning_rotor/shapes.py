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

A later shape costs no full profile. Where measured shapes' traced profiles give it a law (each
storage's dimensions a monomial of the input's sizes over one or more axes: batch, length, side;
else affine along one axis of three), its sizes are derived exactly, with no run (`fit_shapes`, on by
default: lightning_rotor/symbolic_sizes.py); otherwise they are measured exactly, as on the first shape (the
memory runs of `profile_chain`, `timed=False`): the budget promise rests on them, and a size bounded
or guessed from another shape could be wrong by the one tensor that breaks it. The timing
rounds are skipped either way: each stage's times are the timed shape's, scaled by the ratio of the stage's
forward FLOPs at the two shapes (as `torch.utils.flop_counter.FlopCounterMode` counts them, one forward
without grad), or, for a stage without matmuls or convolutions, by the ratio of its output sizes.
A wrong time only makes a plan slower, never above its budget; where training steps prove it wrong, the
shape is timed (`ShapeTimes`).

Fewer profiles (`Checkpointable(predict_shapes=True)`): a later shape of the same family (its
input differs from measured ones only in one size, along one or more dimensions) gets no run at
all. Its chain bounds the real one from above, from the measured shapes (`predicted_chain`):

- between two measured sizes: the chord of their chains (each field on the straight line between
  theirs);
- above the largest: the largest's chain scaled by `(x / x_max) ** (2 * dims)` (`dims`: how many
  input dimensions vary: tokens `(B, L)` varying in `L` give a square);
- below the smallest: the smallest's chain as it is.

Sizes are rounded up, sizes freed rounded down. Every memory level the simulator charges is a sum
of chain fields standing for a sum of real tensor sizes; when each tensor's size is a polynomial of
the varying size with non-negative coefficients, of degree at most 2 per varying dimension (`B*L*d`,
`B*H*L*L`: products of dimensions), each real level is convex, grows with the size and grows no
faster than that power, so each bound is at or above it, and the plan of the bounding chain keeps
its budget at the real shape. A fraction budget is taken of a lower bound of the shape's own
no-recomputation peak (`peak_floor`: the measured peak below it, or the line through two measured
peaks on one side, below a convex curve), so a predicted shape never gets more than its fraction.
Where the bound cannot be planned within that budget the shape is measured, as above. What this
rests on: no tensor shrinks, jumps or grows faster as the size grows (no size-dependent kernel
choice); the memory probe's samples (`RotorCallback`, `measure_step`) check it, as they check buckets.

Fewer plans (`Checkpointable(shape_buckets={1: [64, 128, 256]})`): a chain input whose size along
a bucketed dimension is `n` runs the plan of the smallest bucket `>= n`, profiled on a zero-padded
copy of it (sizes above the largest bucket get their own plan). The input itself is not padded:
gradients are those of plain training. The plan's peak bounds the smaller input's when every
tensor of the step grows with that dimension (true of sequence models: embeddings, attention,
MLPs); the memory probe's samples (`RotorCallback`, `measure_step`) check it.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import warnings
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

import torch
from torch import nn

from lightning_rotor._torch_compat import GlobalFlops, tree_flatten, tree_unflatten
from lightning_rotor.budget import format_bytes
from lightning_rotor.chain import TIME_FIELDS, Chain, StageOption
from lightning_rotor.engine import no_cast_cache
from lightning_rotor.planner import InfeasibleBudget
from lightning_rotor.profile import Untouched
from lightning_rotor.twins import stage_key

__all__ = [
    "Buckets",
    "SizeAxis",
    "InfeasibleShape",
    "ShapeTimes",
    "bucketed",
    "check_buckets",
    "derived_times",
    "feasible_for_shape",
    "input_dims",
    "predicted_chain",
    "size_axis",
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
    """Per stage, the FLOPs of its forward on `sample`, for a shape no profile counted them at: counted as a
    profile's walk counts them (NOTE: [FLOPs counted in the walk], lightning_rotor/profile.py), so that every count
    of a chain compares with every other: one forward without grad, each module in its own mode, as training runs
    it (eval mode may take another kernel: CPU attention without dropout, which torch counts no FLOPs of), the
    buffers (running statistics), `.grad` and the RNG left as they were (`Untouched`).

    On real tensors: torch's fake tensors would compute nothing, but their dispatch costs as
    much as the sizes-only profile itself on small models (measured: 0.24 s against 0.05 s).
    Counted as `FlopCounterMode` counts, without its per-module counts (`GlobalFlops`, a third of the cost).
    A stage of an earlier one's structure on an input of the same (lightning_rotor/twins.py: a repeated block)
    runs uncounted and takes its count: FLOPs only scale times. None when the forward fails.
    """
    tensors = [t for t in tree_flatten(sample)[0] if isinstance(t, torch.Tensor)]
    devices = [t.device for t in tensors if t.device.type == "cuda"]
    counts, counter = [], GlobalFlops()
    try:
        with Untouched(stages, devices), torch.no_grad(), no_cast_cache():
            value, seen = sample, {}
            for stage in stages:
                key = stage_key(stage, value)
                if key in seen:
                    value = stage(value)
                else:
                    with counter:
                        value = stage(value)
                    seen[key] = int(counter.get_total_flops())
                counts.append(seen[key])
            del value
    except Exception:  # the caller does without (chain_state.py); the training step raises what is wrong, if anything
        return None
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


RETIME_FACTOR = 2.0  # a shape's step this many times slower or faster than its plan predicts is off
RETIME_STEPS = 2  # steps of a shape off in a row before it is timed (one slow step proves nothing)
PACES_KEPT = 8  # the latest: the pace follows the machine's load


class ShapeTimes:
    """Times of shapes derived by FLOPs from timed shapes' (`derived_times`), checked on training steps.

    Rule (`step`): the wall time of a whole training step over its plan's predicted time is the step's pace; the
    timed shapes' steps give the expected pace (the median of their latest `PACES_KEPT`). A shape whose times
    were derived and whose pace is more than `RETIME_FACTOR` times the expected one, or less than its inverse,
    on `RETIME_STEPS` steps in a row is timed when next met (the chain state profiles it with timing rounds);
    a step within the factor starts the count again. Per-op overhead the FLOPs do not see (a small batch, a
    short sequence on CPU) is what usually makes the prediction wrong. Later shapes take their times from
    the timed shape nearest in FLOPs (`nearest`), so that one shape timed corrects its neighbours too.
    """

    def __init__(self) -> None:
        self.timed: list[tuple[Chain, list[int]]] = []  # timed shapes' chains and stage FLOPs, the first first
        self.paces: list[float] = []  # timed shapes' steps: wall seconds per predicted second
        self.off: dict[str, int] = {}  # plan key -> its steps off the expected pace in a row
        self.retime: dict[str, float] = {}  # plan keys to time when next met -> how far off their steps were
        self.retimed: dict[str, float] = {}  # every plan key found off, with its pace over the expected one

    def nearest(self, flops: Sequence[int], first: tuple[Chain, list[int]]) -> tuple[Chain, list[int]]:
        """The timed shape (chain, FLOPs) whose total FLOPs are nearest `flops`' in ratio (`first` if none)."""
        total = max(1, sum(flops))
        return min(self.timed or [first], key=lambda timed: abs(math.log(total / max(1, sum(timed[1])))))

    def step(self, key: str, derived: bool, seconds: float, predicted: float) -> float | None:
        """A training step of shape `key` alone took `seconds`, its plan predicting `predicted` seconds, its times
        `derived` or timed (the plan cache's word: `PlanCache.times_derived`): the shape's pace over the expected
        one where this step proves its derived times wrong (then timed when next met, `retime`; the caller
        forgets its entry), else None."""
        if seconds <= 0 or predicted <= 0:
            return None
        pace = seconds / predicted
        if not derived:
            self.paces = [*self.paces[-PACES_KEPT + 1 :], pace]
            return None
        if not self.paces:
            return None
        off = pace / statistics.median(self.paces)
        if 1 / RETIME_FACTOR <= off <= RETIME_FACTOR:
            self.off.pop(key, None)
            return None
        self.off[key] = self.off.get(key, 0) + 1
        if self.off[key] < RETIME_STEPS:
            return None
        del self.off[key]
        self.retime[key] = self.retimed[key] = off
        return off


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


# -- predicted shapes ---------------------------------------------------------------------------
Dims = tuple[tuple[int, ...], ...]  # the chain input's tensors' shapes, in order
FREED = ("out_free", "in_free", "offloadable")  # sizes subtracted from what is held: rounded down
FIXED = ("names", "frozen", "bandwidth", "host_limit")  # what two chains of one family share
Weights = tuple[Fraction, Fraction]  # (a, b): a field bounded by `a * one chain's + b * another's`


@dataclasses.dataclass(frozen=True)
class SizeAxis:
    """Where two chain inputs of one family differ: the coordinates (tensor, dimension) that vary, all
    of one size in each input (a sequence length in the tokens and their mask, say)."""

    coords: tuple[tuple[int, int], ...]
    size: int  # in the second input


def input_dims(value: Any) -> Dims:
    """The shapes of the chain input's tensors, in `tree_flatten` order."""
    return tuple(tuple(t.shape) for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))


def size_axis(measured: Dims, new: Dims) -> tuple[SizeAxis, int] | None:
    """(the axis along which `new` differs from `measured`, the size there in `measured`); None when they
    are equal, differ in rank, or the differing coordinates do not share one size in each."""
    if len(measured) != len(new) or any(len(a) != len(b) for a, b in zip(measured, new, strict=True)):
        return None
    coords = tuple(
        (i, d) for i, (a, b) in enumerate(zip(measured, new, strict=True)) for d in range(len(a)) if a[d] != b[d]
    )
    if not coords:
        return None
    theirs = {measured[i][d] for i, d in coords}
    ours = {new[i][d] for i, d in coords}
    if len(theirs) != 1 or len(ours) != 1:
        return None
    return SizeAxis(coords, ours.pop()), theirs.pop()


def _figures(lo: Chain, hi: Chain, weights: Weights) -> Chain:
    """A chain of `lo`'s structure whose every field is `a * lo's + b * hi's`, `weights = (a, b)`: sizes in
    whole bytes (`_combined`), times in seconds."""
    a, b = weights

    def combined(field: str, u: Any, v: Any) -> Any:
        if field in TIME_FIELDS:
            return float(a) * u + float(b) * v
        return _combined(a, b, u, v, field)

    figures: dict[str, Any] = {}
    for f in dataclasses.fields(Chain):
        if f.name in FIXED or f.name == "options":
            continue
        u, v = getattr(lo, f.name), getattr(hi, f.name)
        if isinstance(u, list):
            figures[f.name] = [combined(f.name, p, q) for p, q in zip(u, v, strict=True)]
        else:
            figures[f.name] = combined(f.name, u, v)
    options = [
        [
            dataclasses.replace(
                o,
                **{
                    g.name: combined(g.name, getattr(o, g.name), getattr(p, g.name))
                    for g in dataclasses.fields(StageOption)
                    if g.name != "name"
                },
            )
            for o, p in zip(mine, theirs, strict=True)
        ]
        for mine, theirs in zip(lo.options, hi.options, strict=True)
    ]
    return dataclasses.replace(lo, **figures, options=options)


def _combined(a: Fraction, b: Fraction, u: int, v: int, field: str) -> int:
    """`a u + b v` in whole bytes: rounded up, or down for a size freed (the levels it stands in are then
    rounded up); in integers, as this runs for every field of every predicted chain."""
    den = a.denominator * b.denominator
    num = a.numerator * b.denominator * u + b.numerator * a.denominator * v
    return num // den if field in FREED else -(-num // den)


def same_family(a: Chain, b: Chain) -> bool:
    """Two chains of the same stages whose fields can be bounded together: equal in all but their figures."""
    return (
        a.length == b.length
        and all(getattr(a, f) == getattr(b, f) for f in FIXED)
        and [[o.name for o in opts] for opts in a.options] == [[o.name for o in opts] for opts in b.options]
    )


def _weights(x1: int, x2: int, x: int, degree: int, peaks: tuple[int, int], upper: bool) -> Weights | None:
    """The weights `(a, b)` that bound `q(x)` by `a q(x1) + b q(x2)` for every polynomial `q` of degree at most
    `degree` with non-negative coefficients, from above (`upper`: `a, b >= 0`, so that a chain measured above
    its real figures still bounds them) or below, tightest for the no-recomputation peaks `peaks`.

    A linear program in two variables (one constraint per power of `x`, `a x1**j + b x2**j >= x**j`, or `<=`),
    solved exactly by its vertices: intersections of two constraint lines. None when it has no optimum."""
    lines = [(Fraction(x1) ** j, Fraction(x2) ** j, Fraction(x) ** j) for j in range(degree + 1)]
    sign = 1 if upper else -1
    bounds = [(Fraction(1), Fraction(0), Fraction(0)), (Fraction(0), Fraction(1), Fraction(0))] if upper else []

    def feasible(a: Fraction, b: Fraction) -> bool:
        return all(sign * (a * u + b * v - c) >= 0 for u, v, c in lines) and all(
            a * u + b * v >= c for u, v, c in bounds
        )

    best: tuple[Fraction, Weights] | None = None
    every = lines + bounds
    for i, (u1, v1, c1) in enumerate(every):
        for u2, v2, c2 in every[i + 1 :]:
            det = u1 * v2 - u2 * v1
            if det == 0:
                continue
            a, b = (c1 * v2 - c2 * v1) / det, (u1 * c2 - u2 * c1) / det
            if feasible(a, b):
                value = sign * (a * peaks[0] + b * peaks[1])
                if best is None or value < best[0]:
                    best = (value, (a, b))
    if best is None or not upper and not _bounded(lines, peaks):
        return None
    return best[1]


def _bounded(lines: list[tuple[Fraction, Fraction, Fraction]], peaks: tuple[int, int]) -> bool:
    """Whether `max a p1 + b p2` subject to `a u + b v <= c` has an optimum: `(p1, p2)` is a non-negative
    combination of two constraint normals `(u, v)` (Farkas), else it grows without end."""
    normals = [(u, v) for u, v, _ in lines]
    for i, (u1, v1) in enumerate(normals):
        for u2, v2 in normals[i:]:
            det = u1 * v2 - u2 * v1
            if det == 0:
                if u1 * peaks[1] == v1 * peaks[0] and (u1 * peaks[0] + v1 * peaks[1]) >= 0:
                    return True
                continue
            y1, y2 = (peaks[0] * v2 - peaks[1] * u2) / det, (u1 * peaks[1] - v1 * peaks[0]) / det
            if y1 >= 0 and y2 >= 0:
                return True
    return False


def _pairs(points: Sequence[tuple[int, Any]], x: int) -> list[tuple[tuple[int, Any], tuple[int, Any]]]:
    """Pairs of measured points to bound `x` from: the nearest on each side, the two nearest below, the two
    nearest above (a pair further out bounds less tightly)."""
    below, above = [p for p in points if p[0] < x][-2:], [p for p in points if p[0] > x][:2]
    pairs = [(below[-1], above[0])] if below and above else []
    return pairs + [(p[0], p[1]) for p in (below, above) if len(p) == 2]


def predicted_chain(measured: Sequence[tuple[int, Chain, int]], x: int, dims: int) -> tuple[Chain, int] | None:
    """A chain bounding the chain at size `x` from above, and a lower estimate of its no-recomputation peak,
    from chains `measured` at other sizes along one axis, as `(size, chain, its no-recomputation peak)`
    (`dims` input dimensions varying: polynomials of
    degree `2 * dims`). Each field of the bound is the same non-negative combination of two measured chains'
    (`_weights`, the tightest for their peaks); the estimate, the largest lower bound of the peak from any
    pair. None when the chains differ in structure or no pair bounds `x`."""
    points = sorted(((s, c) for s, c, _ in measured), key=lambda p: p[0])
    if not points or any(not same_family(points[0][1], c) for _, c in points) or any(s == x for s, _ in points):
        return None
    peaks = {s: peak for s, _, peak in measured}
    degree = 2 * dims
    pairs = _pairs(points, x) or [(points[0], points[0])]
    best: tuple[Fraction, Chain] | None = None
    floor = max([p for s, p in peaks.items() if s < x], default=0)  # the peak grows with the size
    for (x1, c1), (x2, c2) in pairs:
        if x1 == x2:  # one point: scaled up (above it) or as it is (below it)
            up: Weights | None = (max(Fraction(1), Fraction(x, x1) ** degree), Fraction(0))
            down: Weights | None = (min(Fraction(1), Fraction(x, x1) ** degree), Fraction(0))
        else:
            up = _weights(x1, x2, x, degree, (peaks[x1], peaks[x2]), upper=True)
            down = _weights(x1, x2, x, degree, (peaks[x1], peaks[x2]), upper=False)
        if down is not None:
            floor = max(floor, math.floor(down[0] * peaks[x1] + down[1] * peaks[x2]))
        if up is not None:
            a, b = up
            value = a * peaks[x1] + b * peaks[x2]
            if best is None or value < best[0]:
                best = (value, _figures(c1, c2, up))
    if best is None:
        return None
    return best[1], floor
