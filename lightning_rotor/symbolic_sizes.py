"""Exact sizes of a new input shape without running it: each size of a chain as a polynomial of the varying size.

A chain's sizes (`out_size`, `saved_size`, transients, bytes freed, the loss's, each option's: every integer
field but the stage count and `frozen`) are sums of tensor sizes, and a tensor's size in a stage of standard
ops is a product of the input's dimensions: a polynomial of the varying size `x` (a sequence length, an image
side) with integer values, of degree at most 2 per varying input dimension (`B*L*d`, `B*H*L*L`; `dims`
dimensions varying together: degree `2 * dims`). A `SizeLaw` finds each field's polynomial exactly (rational
coefficients, Lagrange interpolation) from `2 * dims + 1` measured chains of one family along one axis and
checks it, to the byte, on every other measured chain of that axis (at least one): where any field disagrees
there is no law (a data-dependent stage, a size-dependent kernel choice, a stride's rounding), and each shape
is measured as before. A shape's chain is then the law's value at its size, provided every field there is a
whole number of bytes and the chain passes `Chain`'s own checks.

What this rests on, and what the check can and cannot prove: if every field is a polynomial of degree at most
`2 * dims`, the interpolated one is it, exactly, at every size (two such polynomials equal at `2 * dims + 1`
points are one). The check on a further measured shape cannot prove that premise: a field that follows another
law (`ceil(x / 8) * 8`, a stride-2 convolution's `floor((x - 1) / 2) + 1` at odd sides, tokens kept by their
values) can agree with a polynomial at every measured size and differ at the next. It catches the usual ways
the premise fails (padding, parity, data-dependent counts at random sizes); the memory probe's samples
(`RotorCallback`, `measure_step`) check the rest, as they check predicted shapes.

Compared with a symbolic trace (fake tensors with symbolic sizes, each tensor's size read as an expression):
a trace proves the premise op by op and refuses data-dependent ops itself, but the chain's fields are not
tensor sizes, they are the memory probe's accounting of them (storages shared by views, in-place writes,
tensors autograd saves or frees, what outlives a stage): to be exact it must replay the probe's accounting on
the symbolic tensors, where a law fitted from the probe's own figures inherits it as it is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from fractions import Fraction
from typing import Any

from lightning_rotor.chain import TIME_FIELDS, Chain, ChainError, StageOption

__all__ = ["SizeLaw", "chain_at", "size_law"]

NOT_SIZES = ("names", "frozen", "bandwidth", "host_limit", "options", *TIME_FIELDS)  # no polynomial of the size
OPTION_NOT_SIZES = ("name", *TIME_FIELDS)
Point = tuple[int, Chain, Sequence[int] | None]  # (size along the axis, its measured chain, its stages' FLOPs)


def chain_sizes(chain: Chain) -> list[int]:
    """Every size field of `chain` in one list, in a fixed order (`with_sizes` puts them back)."""
    return [v for _, v in _slots(chain)]


def _slots(chain: Chain) -> list[tuple[str, int]]:
    """Each size of `chain` with its field's name (`out_size[3]`, `options[2][0].saved_size`)."""
    slots: list[tuple[str, int]] = []
    for f in dataclasses.fields(Chain):
        value = getattr(chain, f.name)
        if f.name in NOT_SIZES or value is None:
            continue
        if isinstance(value, list):
            slots.extend((f"{f.name}[{k}]", v) for k, v in enumerate(value))
        else:
            slots.append((f.name, value))
    for k, options in enumerate(chain.options):
        for i, option in enumerate(options):
            slots.extend(
                (f"options[{k}][{i}].{g.name}", getattr(option, g.name))
                for g in dataclasses.fields(StageOption)
                if g.name not in OPTION_NOT_SIZES
            )
    return slots


def with_sizes(template: Chain, sizes: Sequence[int]) -> Chain:
    """`template` with its size fields (in `chain_sizes` order) replaced by `sizes`; its times as they are."""
    it: Iterator[int] = iter(sizes)
    figures: dict[str, Any] = {}
    for f in dataclasses.fields(Chain):
        value = getattr(template, f.name)
        if f.name in NOT_SIZES or value is None:
            continue
        figures[f.name] = [next(it) for _ in value] if isinstance(value, list) else next(it)
    options = [[dataclasses.replace(o, **_option_sizes(it)) for o in opts] for opts in template.options]
    return dataclasses.replace(template, **figures, options=options)


def _option_sizes(it: Iterator[int]) -> dict[str, Any]:
    """An option's size fields, taken in `chain_sizes` order from `it`."""
    return {g.name: next(it) for g in dataclasses.fields(StageOption) if g.name not in OPTION_NOT_SIZES}


def _structure(chain: Chain) -> tuple[Any, ...]:
    """What two chains of one family along an axis share: all but their figures."""
    optional = tuple(getattr(chain, f.name) is None for f in dataclasses.fields(Chain))
    names = tuple(tuple(o.name for o in opts) for opts in chain.options)
    return chain.length, chain.names, chain.frozen, chain.host_limit, optional, names, len(chain_sizes(chain))


def _lagrange(nodes: Sequence[int], x: int) -> list[Fraction]:
    """The weights `w` with `p(x) = sum(w_i p(nodes_i))` for every polynomial `p` of degree below `len(nodes)`."""
    weights = []
    for i, xi in enumerate(nodes):
        w = Fraction(1)
        for j, xj in enumerate(nodes):
            if j != i:
                w *= Fraction(x - xj, xi - xj)
        weights.append(w)
    return weights


def _evaluated(weights: Sequence[Fraction], values: Sequence[Sequence[int]]) -> list[int] | None:
    """Each component's interpolated value; None where one is not a whole number."""
    out = []
    for column in zip(*values, strict=True):
        v = sum((w * c for w, c in zip(weights, column, strict=True)), Fraction(0))
        if v.denominator != 1:
            return None
        out.append(int(v))
    return out


@dataclasses.dataclass(frozen=True)
class SizeLaw:
    """Each size field of one family's chains (and each stage's forward FLOPs, where counted) as a polynomial
    of the varying size, interpolated through `nodes` and checked to the byte at `checked`."""

    template: Chain
    nodes: tuple[int, ...]
    sizes: tuple[tuple[int, ...], ...]  # per node, `chain_sizes` of its chain
    flops: tuple[tuple[int, ...], ...] | None  # per node, its stages' FLOPs; None: not all counted, or no law
    checked: tuple[int, ...]

    def chain(self, x: int) -> tuple[Chain, list[int] | None] | None:
        """The chain at size `x` (times the template's: derive them from the FLOPs), with its stages' FLOPs;
        None where a field is not a whole number of bytes there or the chain breaks `Chain`'s rules."""
        weights = _lagrange(self.nodes, x)
        sizes = _evaluated(weights, self.sizes)
        if sizes is None:
            return None
        try:
            chain = with_sizes(self.template, sizes)
        except ChainError:
            return None
        flops = _evaluated(weights, self.flops) if self.flops is not None else None
        if flops is not None and any(f < 0 for f in flops):
            flops = None
        return chain, flops


def size_law(points: Sequence[Point], dims: int) -> SizeLaw | str:
    """The law of the chains `points` measured at distinct sizes along one axis (`dims` input dimensions
    varying with it), or why there is none: too few points (fewer than `2 * dims + 2`), chains of different
    structure, or a field that no polynomial of degree `2 * dims` through the first `2 * dims + 1` points fits
    at another (named, with its stage where it has one)."""
    count = 2 * dims + 1
    if len({x for x, _, _ in points}) != len(points):
        return "two chains measured at one size"
    if len(points) <= count:
        return f"{len(points)} shapes measured, a law needs {count + 1}"
    first = points[0][1]
    if any(_structure(c) != _structure(first) for _, c, _ in points):
        return "chains of different structure"
    nodes, rest = points[:count], points[count:]
    sizes = tuple(tuple(chain_sizes(c)) for _, c, _ in nodes)
    counted = all(f is not None for _, _, f in points)
    flops = tuple(tuple(f) for _, _, f in nodes if f is not None) if counted else None
    for x, chain, measured_flops in rest:
        weights = _lagrange([n for n, _, _ in nodes], x)
        fitted: Sequence[int | None] = _evaluated(weights, sizes) or [None] * len(sizes[0])
        wrong = [name for (name, v), f in zip(_slots(chain), fitted, strict=True) if v != f]
        if wrong:
            return f"{wrong[0]} at size {x} is off the polynomial through sizes {[n for n, _, _ in nodes]}"
        if flops is not None and _evaluated(weights, flops) != list(measured_flops or ()):
            flops = None  # FLOPs off the law: counted per shape, the sizes' law stands
    return SizeLaw(first, tuple(n for n, _, _ in nodes), sizes, flops, tuple(x for x, _, _ in rest))


def _windowed(xs: Sequence[int], rows: Sequence[Sequence[int]], x: int, degree: int) -> list[int | None]:
    """Per component of `rows` (one row per measured size `xs`, ascending), its value at `x` from the polynomial
    of degree `degree` through a window of `degree + 2` consecutive sizes around `x` that it fits (interpolated
    through the first `degree + 1`, checked on the last). None where no window around `x` fits, where two
    fitting windows disagree at `x` (two pieces of a peak: its largest op changes near `x`), or where the
    value is not whole."""
    width = degree + 2
    found: list[int | None] = [None] * len(rows[0])
    refused = [False] * len(rows[0])
    for s in range(len(xs) - width + 1):
        if not xs[s] <= x <= xs[s + width - 1]:
            continue
        nodes, check = xs[s : s + degree + 1], s + degree + 1
        at_check, at_x = _lagrange(nodes, xs[check]), _lagrange(nodes, x)
        for c, column in enumerate(zip(*rows[s : s + degree + 1], strict=True)):
            if sum((w * v for w, v in zip(at_check, column, strict=True)), Fraction(0)) != rows[check][c]:
                continue
            value = sum((w * v for w, v in zip(at_x, column, strict=True)), Fraction(0))
            if value.denominator != 1 or found[c] not in (None, value):
                refused[c] = True
            found[c] = int(value)
    return [None if r else f for f, r in zip(found, refused, strict=True)]


def chain_at(points: Sequence[Point], dims: int, x: int) -> tuple[Chain, list[int] | None] | str:
    """The chain at size `x` from chains `points` measured at other sizes along one axis (`dims` input dimensions
    varying with it), each size field from a window of measured sizes around `x` on which it follows one
    polynomial of degree `2 * dims` (`_windowed`), with the stages' FLOPs where they were counted at every point
    and follow one too (else None: count them); or why not (the first field without a law at `x`).

    Piecewise, as a transient is a peak: the largest of its ops' levels, each a polynomial, the largest changing
    with the size (an attention's square overtaking an MLP's line). What it rests on beyond `size_law`'s: no
    other op's level overtakes between the measured sizes of the window, unseen at all of them."""
    degree = 2 * dims
    ordered = sorted(points, key=lambda p: p[0])
    if len({p[0] for p in ordered}) != len(ordered) or any(p[0] == x for p in ordered):
        return "two chains measured at one size, or at this one"
    if len(ordered) < degree + 2 or not ordered[0][0] < x < ordered[-1][0]:
        return f"size {x} is not between {degree + 2} measured sizes"
    template = ordered[0][1]
    if any(_structure(c) != _structure(template) for _, c, _ in ordered):
        return "chains of different structure"
    xs = [p[0] for p in ordered]
    sizes = _windowed(xs, [chain_sizes(c) for _, c, _ in ordered], x, degree)
    missing = [name for (name, _), v in zip(_slots(template), sizes, strict=True) if v is None]
    if missing:
        return f"{missing[0]} follows no polynomial around size {x}"
    try:
        chain = with_sizes(template, [v for v in sizes if v is not None])
    except ChainError as error:
        return f"the chain at size {x} breaks a rule: {error}"
    counted = [list(f) for _, _, f in ordered if f is not None]
    flops = _windowed(xs, counted, x, degree) if len(counted) == len(ordered) else [None]
    whole = [f for f in flops if f is not None and f >= 0]
    return chain, whole if len(whole) == len(flops) else None
