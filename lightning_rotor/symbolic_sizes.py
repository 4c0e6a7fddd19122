"""Exact sizes of a new input shape without running it, from traced profiles of measured shapes.

A traced profile (lightning_rotor/size_trace.py) gives every size of a measured chain as a sum of its storages'
sizes and its probes' peaks (each the largest of its levels, sums of storage sizes: NOTE: [peak variables]),
valid wherever its guards hold (each other comparison the profile made has the same outcome: the same run the
smaller). What is left is each storage's size at the new shape.

A storage's bytes are its element size times the dimensions of the tensor that made it. A family of input
shapes has axes: groups of input coordinates that share one size in every shape seen (the batch in the images
and the timesteps, a side in height and width, a sequence length in tokens and mask). Two laws give each
storage's dimensions at a new shape, tried in this order:

- the monomial law (`MonomialLaw`): every dimension is `c * prod_a s_a ** k_a` (`B`, `L`, `H/4`, `B*H*W/16`,
  `L*L`), `k_a` in 0..2, `c` rational. Each axis's exponents come from two measured shapes that differ in it
  only (`d2 * s1**k == d1 * s2**k` for exactly one `k`, per dimension; none: the law is refused); every other
  measured shape checks them to the byte. A new shape may differ from its base (the nearest measured shape the
  law holds at) in several axes: a partial batch at a new side;
- the affine law (`ShapeLaw`), where the monomial one is refused (`L + 1`: a class token, labels padded by
  one as transformers' causal-LM loss does): along one axis each dimension is `a x + b`, through two measured
  shapes and checked on a third.

Then the traced shapes are tried nearest first: the first whose every guard holds at the evaluated storage sizes
gives every size of the chain, exactly, as the profile run there would have computed it (beyond the measured sizes,
every peak's top must stay its largest too); none, or a dimension no whole number there (`H/32` at a side not a
multiple of 32): the shape is measured, and its trace covers the sizes around it from then on. Checked on the
measured shapes themselves: a trace whose guards hold at another measured shape must give its measured chain to the
byte (a size that left the sums, a constant to the trace, fails here). Shapes that ran other ops (another number of
storages: a 1x1 last stage, MoE routing) are kept apart, each group its own law.

What this rests on: the stages run the same ops at the new shape as at the measured ones (no size-dependent
branch, no data-dependent op), and each dimension follows its law beyond the measured sizes. Where it does
not, dimensions are *quasi-polynomial*: a stride's floor (`H // 32`) or a padding to a multiple (`8 *
ceil(L / 8)`) is a law per residue class, and a few sizes can fit a wrong law exactly:

- sizes that are all multiples of the period (16 and 24 padded to 8: `L` at both) fit `k = 1` and miss the
  padding at 20. So a law derives only at multiples of the gcd of the sizes it holds at along each axis it
  extrapolates (`divisors`; the affine law too): a size whose residues differ from theirs is measured;
- two sizes in one bucket of the period (a ConvNeXt at sides 48 and 56: its last stage's side is 1 at both)
  fit `k = 0`, a constant, wrong at 64 and beyond (checked: `benchmarks/shapes_monomial.py` derived 266 wrong
  chains from 33 such pairs). Between the two sizes a monotone floor is that constant, and a dimension
  `c * s` there is exact at multiples of their gcd; beyond them, not. So a law from two sizes of an axis
  derives between them only (`spans`), and a third measured size along the axis that it holds at lets it
  derive beyond: what the affine law's third point did. In that benchmark's sweep no derivation was wrong
  with these rules on the GPT, the ConvNeXt and a padding model from two sizes; from three sizes in one
  bucket of a padding (9, 10 and 11 padded to 16) the law is a wrong constant, as the affine law's was before.

A later shape whose regime is likely a traced shape's (that shape's guards hold at the storage sizes it likely
has: `likely_sizes`) is measured with its storages numbered only, untraced (`ShapeLaws._numbers`): its chain is
the untraced profile's, and its trace the traced shape's, checked to hold there and give its chain to the byte
(`numbered_shape`); where none holds it stays untraced, and its family's later shapes are traced.

NOTE: [the first shape numbered] A family's first shape is numbered only, not traced: a model that never changes
shape (most training) never pays for a trace (litgpt's first profile 12.0-12.6 plain steps before, 10.6-10.9
after: docs/benchmarks.md, "The first shape numbered only"). Its next measured shape is traced, and the first takes
that trace where its guards hold there and its rows give its chain (`numbered_shape`), else borrows it all the
same: a trace is exact wherever its guards hold, whichever shape it was taken at, and the first shape's storage
dimensions are a point of the law. What it costs: beyond the measured sizes a derivation asks the trace's peaks to
keep their tops (NOTE: [peak variables] in size_trace.py), and the first shape has the second's tops: a shape beyond
them in the first's regime is measured where the first's own trace would have derived it.

The memory probe's samples (`RotorCallback`, `measure_step`) check the rest, as for any plan; on CUDA a derived
shape is also charged the caching allocator's excess of the nearest measured shape (lightning_rotor/allocator.py).

A module-level chain (a run of blocks, the code around it measured apart and charged to the chain) is traced
with the code around it, and its shapes are keyed by the call's arguments (the tokens, the labels) rather than
the run's input, which only exists once the code before the run has run: so a call is known to be derived
before anything of it is measured (`ShapeLaws.call`), and the code around its run is not measured either.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from fractions import Fraction
from typing import Any

import numpy as np

from lightning_rotor.chain import TIME_FIELDS, Chain, ChainError, StageOption
from lightning_rotor.size_trace import CONST, PEAKS, SizeTrace, Storage, StorageNumbers, Terms, terms_of, traced

__all__ = [
    "ShapeLaw",
    "ShapeLaws",
    "TracedShape",
    "chain_sizes",
    "plain_sizes",
    "shape_law",
    "traced_shape",
]

Found = tuple[Chain, tuple[int, ...], "list[int] | None"]  # a derived chain, the sizes it came from, FLOPs
Call = tuple[str, "Dims"]  # a module-level chain's call: its arguments' family and shapes
NOT_SIZES = ("names", "frozen", "bandwidth", "host_limit", "options", *TIME_FIELDS)  # no size of the input's
OPTION_NOT_SIZES = ("name", *TIME_FIELDS)
Dims = tuple[tuple[int, ...], ...]  # the chain input's tensors' shapes, in order
NO_AXIS = "no measured shapes along one axis of this one"
TOO_FEW = "fewer than 3 traced shapes along this axis"
FEW_ALIKE = "fewer than 2 traced shapes that ran the same ops"


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


def plain_sizes(chain: Chain) -> Chain:
    """`chain` with every size a plain int (a traced profile's are `Sym`s)."""
    return with_sizes(chain, [int(v) for v in chain_sizes(chain)])


def _structure(chain: Chain) -> tuple[Any, ...]:
    """What two chains of one family share: all but their figures."""
    optional = tuple(getattr(chain, f.name) is None for f in dataclasses.fields(Chain))
    names = tuple(tuple(o.name for o in opts) for opts in chain.options)
    return chain.length, tuple(chain.names), chain.frozen, chain.host_limit, optional, names, len(chain_sizes(chain))


class Rows:
    """Linear functions of the storages' sizes (one `Terms` each), evaluated together (numpy, exact int64)."""

    def __init__(self, rows: Sequence[Terms], sentinel: int):
        # every row gets a term of the sentinel storage (size 0), so that no row is empty for `reduceat`
        cols: list[int] = []
        coefs: list[int] = []
        starts: list[int] = []
        consts: list[int] = []
        for terms in rows:
            starts.append(len(cols))
            consts.append(terms.get(CONST, 0))
            for k, c in terms.items():
                if k != CONST:
                    cols.append(k)
                    coefs.append(c)
            cols.append(sentinel)
            coefs.append(0)
        self.cols = np.asarray(cols, dtype=np.int64)
        self.coefs = np.asarray(coefs, dtype=np.int64)
        self.starts = np.asarray(starts, dtype=np.int64)
        self.consts = np.asarray(consts, dtype=np.int64)

    def at(self, sizes: np.ndarray) -> np.ndarray:
        if not len(self.starts):
            return self.consts
        return np.add.reduceat(self.coefs * sizes[self.cols], self.starts) + self.consts


@dataclasses.dataclass
class Peaks:
    """A trace's peak variables (NOTE: [peak variables] in lightning_rotor/size_trace.py) as rows: each peak's top,
    and its levels' excesses over it, the excesses of one peak contiguous (`counts` per peak). `depth`: how many
    rounds of evaluation a level holding another peak's variable needs (1: none does)."""

    tops: Rows
    rises: Rows
    counts: np.ndarray
    depth: int

    def extended(self, sizes: np.ndarray) -> tuple[np.ndarray, bool]:
        """`sizes` (the storages', the sentinel last) followed by each peak's value there: its top plus its largest
        excess, 0 at least; and whether a level rose above a top."""
        n = len(self.counts)
        values = np.concatenate([sizes, np.zeros(n, dtype=np.int64)])
        rise = np.zeros(n, dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(self.counts)[:-1]]) if n else rise
        some = self.counts > 0
        for _ in range(self.depth if n else 0):  # a later peak's levels may hold an earlier one's value
            if some.any():
                rise[some] = np.maximum.reduceat(self.rises.at(values), starts[some])
            values[len(sizes) :] = self.tops.at(values) + np.maximum(rise, 0)
        return values, bool((rise > 0).any())


@dataclasses.dataclass
class TracedShape:
    """A measured shape along an axis: its size there, its chain (plain ints), its stages' FLOPs, and its trace
    (its storages' dimensions, its guards and each size of its chain as rows of its storages' sizes and its peak
    variables)."""

    size: int
    chain: Chain
    flops: list[int] | None
    dims: np.ndarray  # (storages, widest) int64, padded with 1
    itemsizes: np.ndarray
    ranks: tuple[int, ...]
    guards: Rows
    allowed: np.ndarray  # per guard, whether its outcome holds where `a - b` is below, at or above zero
    sizes: Rows
    constant: np.ndarray  # per size of the chain: a constant to the trace (no storage's size in it)
    peaks: Peaks

    def held_sizes(self, sizes: np.ndarray, tops: bool = False) -> list[int] | None:
        """Each size of the chain at the storage sizes `sizes`, exact there; None where a comparison the profile made
        has another outcome there, or with `tops` where a peak's largest level is another (beyond the measured
        sizes: NOTE: [peak variables] in size_trace.py). The peaks are evaluated once for both."""
        values, risen = self.peaks.extended(sizes)
        signs = np.sign(self.guards.at(values)) + 1
        if (tops and risen) or not self.allowed[np.arange(len(signs)), signs].all():
            return None
        return [int(v) for v in self.sizes.at(values)]

    def guards_hold(self, sizes: np.ndarray, tops: bool = False) -> bool:
        return self.held_sizes(sizes, tops) is not None


def _allowed(op: str, outcome: bool) -> tuple[bool, bool, bool]:
    """Where a guard `a - b <op> 0` that came out `outcome` holds: at `a - b` below, at and above zero."""
    holds = (op in ("<", "<=", "!="), op in ("<=", ">=", "=="), op in (">", ">=", "!="))
    return holds if outcome else (not holds[0], not holds[1], not holds[2])


def _storage_dims(storages: Sequence[Storage]) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
    """(dims, itemsizes, ranks) of a profile's storages, as `TracedShape` holds them (a sentinel last)."""
    n = len(storages)
    widest = max((len(s.factors) for s in storages), default=0)
    dims = np.ones((n + 1, max(widest, 1)), dtype=np.int64)  # the last: the sentinel, size 0 (itemsize 0)
    for i, s in enumerate(storages):
        dims[i, : len(s.factors)] = s.factors
    itemsizes = np.asarray([s.itemsize for s in storages] + [0], dtype=np.int64)
    return dims, itemsizes, tuple(len(s.factors) for s in storages)


def traced_shape(size: int, trace: SizeTrace, chain: Chain, flops: list[int] | None) -> TracedShape:
    """The measured shape of `chain`, profiled under `trace`, at `size` along its axis."""
    n = len(trace.storages)
    dims, itemsizes, ranks = _storage_dims(trace.storages)
    sizes = [terms_of(v) for v in chain_sizes(chain)]

    def rows(terms: Sequence[Terms]) -> Rows:  # peak variable j's column after the storages' and the sentinel's
        return Rows([{k if k < PEAKS else n + 1 + k - PEAKS: c for k, c in t.items()} for t in terms], n)

    return TracedShape(
        size=size,
        chain=plain_sizes(chain),
        flops=flops,
        dims=dims,
        itemsizes=itemsizes,
        ranks=ranks,
        guards=rows([g[0] | {CONST: g[1]} for g in trace.guards]),
        allowed=np.asarray([_allowed(g[2], g[3]) for g in trace.guards], dtype=bool).reshape(-1, 3),
        sizes=rows([t if t is not None else {} for t in sizes]),
        constant=np.asarray([t is None or not any(k != CONST for k in t) for t in sizes], dtype=bool),
        peaks=Peaks(
            rows([top for top, _ in trace.peaks]),
            rows([r for _, rises in trace.peaks for r in rises]),
            np.asarray([len(rises) for _, rises in trace.peaks], dtype=np.int64),
            _depth(trace.peaks),
        ),
    )


def _depth(peaks: Sequence[tuple[Terms, list[Terms]]]) -> int:
    """Rounds of evaluation the peak variables need: 1 where no level holds another peak's variable."""
    depth: list[int] = []
    for top, rises in peaks:
        held = [k - PEAKS for terms in (top, *rises) for k in terms if k >= PEAKS]
        depth.append(1 + max((depth[j] for j in held), default=0))
    return max(depth, default=1)


def numbered_shape(
    numbers: StorageNumbers,
    chain: Chain,
    flops: list[int] | None,
    traced: Sequence[TracedShape],
    borrow: bool = False,
) -> TracedShape | None:
    """The measured shape of `chain`, profiled with its storages numbered only (`size_trace.StorageNumbers`): the
    trace of the first of `traced` (nearest first) that ran the same ops and holds here (its guards hold at the
    numbered storages' sizes, its rows give `chain` to the byte), with these storages' dimensions. That trace is
    exact wherever its guards hold, here as at its own shape; a trace taken here is the same but where two levels
    of a peak have equal bytes here (it keeps the first as the peak: same bytes, other terms). None where no trace
    holds (other ops here, or another outcome of a comparison of the profile's): the shape is untraced; with
    `borrow`, the first trace that ran the same ops, its guards not holding here: a trace holds wherever its guards
    do, and this shape's dimensions are a point of the law (NOTE: [the first shape numbered])."""
    dims, itemsizes, ranks = _storage_dims(numbers.storages)
    sizes = itemsizes * np.prod(dims, axis=1)
    measured = chain_sizes(chain)
    alike = [
        base
        for base in traced
        if base.ranks == ranks
        and np.array_equal(base.itemsizes, itemsizes)
        and _structure(base.chain) == _structure(chain)
    ]
    held = (b for b in alike if b.held_sizes(sizes) == measured)
    base = next(held, None) or (alike[0] if borrow and alike else None)
    if base is None:
        return None
    return dataclasses.replace(base, size=0, chain=chain, flops=flops, dims=dims, itemsizes=itemsizes)


@dataclasses.dataclass
class ShapeLaw:
    """Each storage's dimensions as `a x + b` along one axis (through two measured shapes, checked on the others),
    and the measured shapes whose traces give a chain where their guards hold."""

    x1: int
    x2: int
    d1: np.ndarray
    d2: np.ndarray
    itemsizes: np.ndarray
    shapes: list[TracedShape]
    divisor: int = 1  # the gcd of the sizes on the line: a size not its multiple is measured (`MonomialLaw._unseen`)

    def storage_sizes(self, x: int) -> np.ndarray | None:
        """Each storage's bytes at size `x`; None where a dimension is not a non-negative whole number there."""
        span = self.x2 - self.x1
        scaled = self.d1 * span + (self.d2 - self.d1) * (x - self.x1)
        if np.any(scaled % span) or np.any(scaled < 0):
            return None
        return self.itemsizes * np.prod(scaled // span, axis=1)

    def chain(self, x: int) -> tuple[TracedShape, Chain] | None:
        """The chain at size `x` (times the trace's own: derive them) and the measured shape whose trace gave it;
        None where no trace's guards hold at `x`."""
        sizes = self.storage_sizes(x)
        if sizes is None:
            return None
        beyond = not min(s.size for s in self.shapes) <= x <= max(s.size for s in self.shapes)
        for shape in sorted(self.shapes, key=lambda s: abs(s.size - x)):
            found = shape.held_sizes(sizes, tops=beyond)
            if found is not None:
                try:
                    return shape, with_sizes(shape.chain, found)
                except ChainError:
                    return None
        return None

    def flops(self, x: int) -> list[int] | None:
        """Each stage's forward FLOPs at size `x`, through the three measured shapes nearest `x` (a polynomial of
        degree 2: matmuls over `B*L` or a side squared, attention's `L*L`); None where not counted at three or
        negative. They only scale times (`shapes.derived_times`): a wrong one makes a plan slower, never larger."""
        counted = sorted((s for s in self.shapes if s.flops is not None), key=lambda s: abs(s.size - x))[:3]
        return _quadratic([(s.size, s.flops or []) for s in counted], x) if len(counted) == 3 else None


PAIRS_FROM = 8  # the lines tried: through two of the first shapes measured


def _line(shapes: Sequence[TracedShape]) -> tuple[TracedShape, TracedShape] | str:
    """The two measured shapes (ascending) whose line the most others confirm, every storage's dimensions on it to
    the byte, and none contradicts; or why none. A shape where the line gives a dimension that is not a whole
    number (a stride's halving at an odd side) is no claim of the line's: neither confirms nor contradicts it."""
    best: tuple[int, tuple[TracedShape, TracedShape]] | None = None
    contradicted = ""
    candidates = shapes[:PAIRS_FROM]
    for i, a in enumerate(candidates):
        for b in candidates[i + 1 :]:
            low, high = (a, b) if a.size < b.size else (b, a)
            span = high.size - low.size
            confirmed = 0
            for s in shapes:
                if s is low or s is high:
                    continue
                scaled = low.dims * span + (high.dims - low.dims) * (s.size - low.size)
                if np.any(scaled % span):
                    continue
                if not np.array_equal(scaled // span, s.dims):
                    contradicted = (
                        f"a tensor's size at size {s.size} is not on the line through sizes {low.size} and {high.size}"
                    )
                    confirmed = -1
                    break
                confirmed += 1
            if confirmed > 0 and (best is None or confirmed > best[0]):
                best = (confirmed, (low, high))
    if best is None:
        return contradicted or "no measured shape confirms a line through two others"
    return best[1]


def shape_law(shapes: Sequence[TracedShape]) -> ShapeLaw | str:
    """The law of traced shapes measured at distinct sizes along one axis, or why there is none."""
    if len({s.size for s in shapes}) != len(shapes):
        return "two shapes measured at one size"
    if len(shapes) < 3:
        return f"{len(shapes)} shapes measured, a law needs 3"
    first = shapes[0]
    for s in shapes[1:]:
        if _structure(s.chain) != _structure(first.chain) or s.ranks != first.ranks:
            return f"the stages ran other ops at size {s.size} than at size {first.size}"
        if not np.array_equal(s.itemsizes, first.itemsizes):
            return f"the stages made tensors of other types at size {s.size} than at size {first.size}"
    line = _line(shapes)
    if isinstance(line, str):
        return line
    law = ShapeLaw(line[0].size, line[1].size, line[0].dims, line[1].dims, first.itemsizes, list(shapes))
    law.divisor = math.gcd(*(s.size for s in shapes if _on_the_line(law, s)))
    moved = _moved_constants(shapes)
    if moved is not None:
        return f"{moved} is not a sum of storage sizes: its constant part differs between measured shapes"
    return _checked(law)


def _on_the_line(law: ShapeLaw, shape: TracedShape) -> bool:
    """Whether every storage's dimensions at `shape` are the law's there (whole numbers, to the byte)."""
    span = law.x2 - law.x1
    scaled = law.d1 * span + (law.d2 - law.d1) * (shape.size - law.x1)
    return not np.any(scaled % span) and np.array_equal(scaled // span, shape.dims)


def _moved_constants(shapes: Sequence[TracedShape]) -> str | None:
    """The first size of the chain whose constant part (what left the sums: a product, a figure not from the
    probe) differs between `shapes`, or None. Constants of a trace are the same at every shape (a parameter's
    bytes, the loss value's stand-in): one that moves stands for a size the trace lost."""
    constant = np.logical_or.reduce([s.constant for s in shapes])
    values = np.asarray([chain_sizes(s.chain) for s in shapes], dtype=object)
    consts = np.asarray([s.sizes.consts for s in shapes])
    moved = (constant & np.any(values != values[0], axis=0)) | np.any(consts != consts[0], axis=0)
    return _slots(shapes[0].chain)[int(np.argmax(moved))][0] if np.any(moved) else None


def _checked(law: ShapeLaw) -> ShapeLaw | str:
    """`law`, or why not: a trace whose guards hold at another measured shape must give its chain to the byte."""
    found = _disagreement(law.shapes, [law.storage_sizes(s.size) for s in law.shapes])
    if found is None:
        return law
    name, i, j = found
    return f"{name} at size {law.shapes[i].size} differs from the one traced at size {law.shapes[j].size}"


def _disagreement(shapes: Sequence[TracedShape], sizes: Sequence[np.ndarray | None]) -> tuple[str, int, int] | None:
    """The first size of a chain, measured shape `i` and traced shape `j` where `j`'s trace, its guards holding at
    `i`'s storage sizes (`sizes[i]`; None: no claim there), does not give `i`'s measured chain to the byte; None
    where every such trace agrees (a size that left a trace's sums, a branch its guards miss, fails here)."""
    for i, (shape, at) in enumerate(zip(shapes, sizes, strict=True)):
        if at is None:
            continue
        measured = chain_sizes(shape.chain)
        for j, other in enumerate(shapes):
            derived = other.held_sizes(at)
            if derived is not None and derived != measured:
                name = next(n for (n, m), v in zip(_slots(shape.chain), derived, strict=True) if m != v)
                return name, i, j
    return None


CONFIRMED = 3  # sizes along an axis (its exponents' two and one more) before its law derives beyond them
POWERS = (0, 1, 2)  # a dimension's exponent in one axis: a length, `L*L` in attention, a side's `H*W` flattened
Point = tuple[int, ...]  # a shape's size along each axis of its family
Axes = tuple[tuple[tuple[int, int], ...], ...]  # per axis, its coordinates (tensor, dimension) in the input


def family_axes(shapes: Sequence[Dims]) -> Axes | None:
    """The axes of `shapes` (one family): the coordinates whose size varies among them, grouped where they have one
    size in every shape (the batch in the images and the timesteps, a side in height and width); None where the
    shapes differ in structure (number of tensors, ranks)."""
    first = shapes[0]
    if any(len(s) != len(first) or any(len(a) != len(b) for a, b in zip(s, first, strict=True)) for s in shapes):
        return None
    groups: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for i, tensor in enumerate(first):
        for d in range(len(tensor)):
            column = tuple(s[i][d] for s in shapes)
            if len(set(column)) > 1:
                groups.setdefault(column, []).append((i, d))
    return tuple(tuple(coords) for coords in groups.values())


def point_of(dims: Dims, axes: Axes) -> Point:
    """The sizes of the shape `dims` along `axes`."""
    return tuple(dims[i][d] for (i, d), *_ in axes)


def _powers(d1: np.ndarray, s1: int, d2: np.ndarray, s2: int) -> np.ndarray | None:
    """Per dimension, the one `k` in `POWERS` with `d2 * s1**k == d1 * s2**k` (sizes `s1 != s2` along one axis),
    0 where the dimension is 0 at both (an empty tensor; zero at two sizes, a padding's amount at multiples of its
    step, is what the divisors leave out); None where a dimension has no such `k` (`x + 1`, a padded size)."""
    a, b = d1.astype(object), d2.astype(object)
    fits = np.stack([b * s1**k == a * s2**k for k in POWERS]).astype(bool)
    fits[1:] &= (d1 != 0) | (d2 != 0)
    if not np.all(fits.sum(axis=0) == 1):
        return None
    return np.asarray(POWERS, dtype=object)[np.argmax(fits, axis=0)]


def _distance(a: Point, b: Point) -> tuple[int, float]:
    """How far the shape at `b` is from `a`: the axes they differ in, then the sum of their size ratios' logs."""
    logs = sum(abs(math.log((x + 1) / (y + 1))) for x, y in zip(a, b, strict=True))
    return sum(x != y for x, y in zip(a, b, strict=True)), logs


@dataclasses.dataclass
class MonomialLaw:
    """Each storage's every dimension as `c * prod_a s_a ** k_a` over a family's axes: the exponents of an axis
    from two measured shapes that differ in it only, checked to the byte on every other measured shape; the
    measured shapes (`points`, `shapes`) whose traces give a chain where their guards hold; per axis, the gcd of
    the sizes that confirmed it (a size not its multiple is measured: padding or a stride there went unseen) and
    the span it derives in: between its two sizes until a third confirms it (`_confirmed`), then any size."""

    points: list[Point]
    shapes: list[TracedShape]
    powers: dict[int, np.ndarray]  # axis -> per (storage, dimension) its exponent (object: Python ints)
    divisors: dict[int, int]
    bases: list[int]  # the measured shapes the law holds at (derived from)
    spans: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)

    def dims_at(self, point: Point, base: int) -> np.ndarray | None:
        """Every storage's dimensions at `point` from the measured shape `base`; None where `point` differs from it
        in an axis without exponents, or a dimension is no whole number there."""
        at = self.points[base]
        differ = [a for a in range(len(point)) if point[a] != at[a]]
        if any(a not in self.powers for a in differ):
            return None
        dims = self.shapes[base].dims
        # int64 where no product can overflow it (every case but huge sizes): the same whole numbers, without
        # Python ints per element (a tenth of a millisecond a derived shape)
        scale = math.prod(max(point[a], at[a], 1) ** max(POWERS) for a in differ)
        fits = int(np.abs(dims).max(initial=0)) * scale < 2**62
        num: Any = dims if fits else dims.astype(object)
        den: Any = np.ones_like(num)
        for a in differ:
            powers = self.powers[a].astype(np.int64) if fits else self.powers[a]
            num, den = num * np.power(point[a], powers), den * np.power(at[a], powers)
        if np.any(num % den):
            return None
        return np.asarray(num // den, dtype=np.int64)

    def nearest(self, point: Point) -> list[int]:
        """The measured shapes, nearest `point` first."""
        return sorted(range(len(self.points)), key=lambda i: _distance(point, self.points[i]))

    def chain(self, point: Point) -> tuple[int, Chain] | str:
        """The chain at `point` (times the trace's own) and the measured shape it was evaluated from, or why not."""
        order = self.nearest(point)
        dims, unseen = None, ""
        for i in (i for i in order if i in self.bases):
            out_of_reach = self._unseen(point, [a for a in range(len(point)) if point[a] != self.points[i][a]])
            dims = self.dims_at(point, i) if not out_of_reach else None
            if dims is not None:
                break
            unseen = unseen or out_of_reach
        if dims is None:
            return unseen or f"no exponents for an axis that {point} differs in, or a size there no whole number"
        sizes = self.shapes[0].itemsizes * np.prod(dims, axis=1)
        beyond = any(
            not min(self.points[j][a] for j in self.bases) <= point[a] <= max(self.points[j][a] for j in self.bases)
            for a in range(len(point))
        )
        for i in order:
            found = self.shapes[i].held_sizes(sizes, tops=beyond)
            if found is not None:
                try:
                    return i, with_sizes(self.shapes[i].chain, found)
                except ChainError:
                    break
        return f"no traced shape's branches hold at {point}"

    def _unseen(self, point: Point, axes: Sequence[int]) -> str:
        """Why `point` is out of the law's reach along `axes`, or "": a size not a multiple of every confirming size
        along its axis (a padding to a multiple or a stride's floor there went unseen), or beyond the two sizes
        of an axis no third has confirmed (a floor equal at both, `k = 0`, may grow beyond them)."""
        for a in axes:
            if a in self.divisors and point[a] % self.divisors[a]:
                return (
                    f"size {point[a]} is not a multiple of {self.divisors[a]}, as every measured size along its axis is"
                )
            low, high = self.spans.get(a, (0, sys.maxsize))
            if not low <= point[a] <= high:
                return f"size {point[a]} is beyond {low} and {high}, and no third measured size confirms their law"
        return ""

    def flops(self, point: Point) -> list[int] | None:
        """Each stage's forward FLOPs at `point`: through the three measured shapes nearest it along its one differing
        axis (`_quadratic`), else a power law per axis through two (`f1 * (s / s1) ** p`), multiplied over the axes;
        None where not counted so. They only scale times: a wrong one makes a plan slower, never larger."""
        counted = [i for i in self.nearest(point) if self.shapes[i].flops is not None]
        for i in counted:
            differ = [a for a in range(len(point)) if point[a] != self.points[i][a]]
            line = [j for j in counted if _on_line(self.points[j], point, differ)]
            if len(differ) == 1 and len(line) >= 3:
                a = differ[0]
                return _quadratic([(self.points[j][a], self.shapes[j].flops or []) for j in line[:3]], point[a])
        for i in counted:
            flops = self._power_flops(point, i, counted)
            if flops is not None:
                return flops
        return None

    def _power_flops(self, point: Point, base: int, counted: list[int]) -> list[int] | None:
        """FLOPs at `point` from the counted shape `base`, a power law per differing axis through a counted pair."""
        at = self.points[base]
        flops = np.asarray(self.shapes[base].flops, dtype=float)
        for a in (a for a in range(len(point)) if point[a] != at[a]):
            pair = next(
                ((i, j) for i in counted for j in counted if i < j and _on_line(self.points[i], self.points[j], [a])),
                None,
            )
            if pair is None:
                return None
            (s1, f1), (s2, f2) = ((self.points[k][a], np.asarray(self.shapes[k].flops, dtype=float)) for k in pair)
            if np.any((f1 > 0) != (f2 > 0)):
                return None
            exponent = np.log(np.where(f1 > 0, f2, 1) / np.where(f1 > 0, f1, 1)) / math.log(s2 / s1)
            flops = flops * (point[a] / at[a]) ** exponent
        return [round(f) for f in flops]


def _on_line(a: Point, b: Point, axes: Sequence[int]) -> bool:
    """Whether the shapes at `a` and `b` differ in `axes` only (in each of them)."""
    return all((x != y) == (k in axes) for k, (x, y) in enumerate(zip(a, b, strict=True)))


def _quadratic(points: Sequence[tuple[int, list[int]]], x: int) -> list[int] | None:
    """Per column, the polynomial of degree 2 through three (size, values) at `x`; None where one is negative.
    Lagrange's weights over one common denominator: whole numbers until the one division per column, rounded as
    a `Fraction` rounds (half to even)."""
    tops, bottoms = [], []
    for i, (si, _) in enumerate(points):
        tops.append(math.prod(x - sj for j, (sj, _) in enumerate(points) if j != i))
        bottoms.append(math.prod(si - sj for j, (sj, _) in enumerate(points) if j != i))
    common = math.prod(bottoms)
    weights = [top * (common // bottom) for top, bottom in zip(tops, bottoms, strict=True)]
    values = [
        round(Fraction(sum(w * int(f) for w, f in zip(weights, column, strict=True)), common))
        for column in zip(*(f for _, f in points), strict=True)
    ]
    return values if all(v >= 0 for v in values) else None


def monomial_law(points: Sequence[Point], shapes: Sequence[TracedShape]) -> MonomialLaw | str:
    """The monomial law of traced shapes that ran the same ops, at distinct `points` of their axes, or why none."""
    if len(set(points)) != len(points):
        return "two shapes measured at one size"
    if len({_ops_of(s) for s in shapes}) != 1:
        return "the stages ran other ops at the measured shapes"
    powers: dict[int, np.ndarray] = {}
    seeds: list[int] = []  # the shapes the exponents came from
    for a in range(len(points[0])):
        pairs = [
            (i, j) for i in range(len(points)) for j in range(i + 1, len(points)) if _on_line(points[i], points[j], [a])
        ]
        found = ((i, j, _powers(shapes[i].dims, points[i][a], shapes[j].dims, points[j][a])) for i, j in pairs)
        i, j, k = next((f for f in found if f[2] is not None), (0, 0, None))  # the first pair that has exponents
        if pairs and k is None:
            return f"a tensor's size at {points[pairs[0][0]]} and {points[pairs[0][1]]} is no monomial of their sizes"
        if k is not None:
            powers[a], seeds = k, [*seeds, i, j]
    return _confirmed(MonomialLaw(list(points), list(shapes), powers, {}, []), seeds)


def _confirmed(law: MonomialLaw, seeds: Sequence[int]) -> MonomialLaw | str:
    """`law` with the shapes it holds at, or why not: each measured shape where it makes a claim (from the first
    shape the exponents came from, measured at its sizes along the axes without exponents) has every dimension it
    gives, to the byte; one where it makes none (a dimension no whole number there: a stride's floor at an odd
    size) is no base to derive from. A trace whose guards hold at another measured shape's sizes gives its chain."""
    free = [a for a in range(len(law.points[0])) if a not in law.powers]
    firsts: dict[Point, int] = {}
    for i in seeds:
        firsts.setdefault(tuple(law.points[i][a] for a in free), i)
    for i, point in enumerate(law.points):
        base = firsts.get(tuple(point[a] for a in free))
        dims = law.dims_at(point, base) if base is not None else None
        if dims is None:
            continue  # no claim of the law's here
        if not np.array_equal(dims, law.shapes[i].dims):
            return f"a tensor's size at {point} is not the monomial through {law.points[base or 0]}"
        law.bases.append(i)
    law.divisors = {a: math.gcd(*(law.points[i][a] for i in law.bases)) for a in law.powers}
    for a in law.powers:
        seen = {law.points[i][a] for i in law.bases}
        law.spans[a] = (min(seen), max(seen)) if len(seen) < CONFIRMED else (0, sys.maxsize)
    found = _disagreement(law.shapes, [s.itemsizes * np.prod(s.dims, axis=1) for s in law.shapes])
    if found is not None:
        name, i, j = found
        return f"{name} at {law.points[i]} differs from the one traced at {law.points[j]}"
    moved = _moved_constants(law.shapes)
    return f"{moved} is not a sum of storage sizes: its constant part differs between measured shapes" if moved else law


def size_axis(measured: Dims, new: Dims) -> tuple[tuple[tuple[int, int], ...], int, int] | None:
    """(the coordinates (tensor, dimension) where `new` differs from `measured`, the size there in `measured`, in
    `new`); None when they are equal, differ in rank, or the differing coordinates do not share one size in each."""
    if len(measured) != len(new) or any(len(a) != len(b) for a, b in zip(measured, new, strict=True)):
        return None
    coords = tuple(
        (i, d) for i, (a, b) in enumerate(zip(measured, new, strict=True)) for d in range(len(a)) if a[d] != b[d]
    )
    theirs, ours = {measured[i][d] for i, d in coords}, {new[i][d] for i, d in coords}
    if not coords or len(theirs) != 1 or len(ours) != 1:
        return None
    return coords, theirs.pop(), ours.pop()


class ShapeLaws:
    """The traced shapes of one chain, per family (plan key without shapes) and input shapes; a new shape's chain
    from those by the monomial law over the family's axes, else the affine law along one (`chain_for`). Says once
    why a law is refused."""

    def __init__(self) -> None:
        # a module-level chain (a run of blocks, the code around it measured apart): its shapes are keyed by the
        # call's arguments (family, shapes), whose sizes decide the run's input's; `call` says which call runs now
        self._outside: tuple[Any, StorageNumbers, Call | None] | None = None  # the code around it, measured in a trace
        self._call: Call | None = None
        self._call_derived: Found | None = None  # the chain of the call running now, derived from its arguments
        self._keyed: Call | None = None  # the key the next measured shape is recorded under (a call's)
        self.measured: list[tuple[str, Dims, TracedShape | None, Chain, list[int] | None]] = []
        self._laws: dict[tuple[Any, ...], list[Any]] = {}
        # per (family, shapes): what `_found` gave, until a shape is measured (every step of a module-level chain
        # asks at its call, its plan key not known yet: a shape seen before is not derived again)
        self._found_at: dict[tuple[str, Dims], Found | str] = {}
        self.refused: str | None = None  # the first reason a law was refused (warned once)
        # shapes measured with their storages numbered only, their traces a traced shape's (`numbered_shape`), and
        # those no traced shape's trace held at (untraced; their family's later shapes are traced: `_numbers`)
        self.numbered: list[Call] = []
        self.missed: list[Call] = []
        # a family's first shape, numbered only until a later shape of it is traced (NOTE: [the first shape
        # numbered]): its storages, matched then against that trace
        self._first: dict[Call, StorageNumbers] = {}

    def add(
        self, family: str, dims: Dims, trace: StorageNumbers | None, chain: Chain, flops: list[int] | None
    ) -> Chain:
        """A measured shape (`trace`: its traced profile, or its storages numbered only; None where it was neither);
        its chain in plain ints. A shape measured again (timed after its derived times proved wrong) replaces its
        earlier measurement."""
        family, dims = self._keyed or (family, dims)
        self._keyed = None
        self._first.pop((family, dims), None)  # measured again: this measurement stands
        traced = self._traced_shape(family, dims, trace, chain, flops)
        self.measured = [m for m in self.measured if (m[0], m[1]) != (family, dims)]
        self.measured.append((family, dims, traced, chain, flops))
        if isinstance(trace, SizeTrace) and traced is not None:
            self._match_first(family)
        self._laws.clear()
        self._found_at.clear()
        return traced.chain if traced is not None else plain_sizes(chain)

    def _traced_shape(
        self, family: str, dims: Dims, trace: StorageNumbers | None, chain: Chain, flops: list[int] | None
    ) -> TracedShape | None:
        """A measured shape's trace: its own, or for a shape numbered only a traced shape's (`numbered_shape`)."""
        if isinstance(trace, SizeTrace):
            return traced_shape(0, trace, chain, flops) if not trace.abandoned else None
        if trace is None:
            return None
        near = [t for _, t in self._traced_near(family, dims)]
        if not near and not any(m[0] == family for m in self.measured):
            self._first[(family, dims)] = trace  # no trace of its family yet: matched against the first one
            return None
        found = numbered_shape(trace, plain_sizes(chain), flops, near)
        (self.numbered if found is not None else self.missed).append((family, dims))
        return found

    def _match_first(self, family: str) -> None:
        """The first shape of `family`, numbered only, given its trace from the traced shapes now measured
        (`numbered_shape`, borrowing one whose guards do not hold there); untraced where none ran the same ops."""
        for (their_family, dims), numbers in list(self._first.items()):
            if their_family != family:
                continue
            del self._first[(family, dims)]
            i = next(i for i, m in enumerate(self.measured) if (m[0], m[1]) == (family, dims))
            _, _, _, chain, flops = self.measured[i]
            near = [t for _, t in self._traced_near(family, dims)]
            found = numbered_shape(numbers, plain_sizes(chain), flops, near, borrow=True)
            if found is not None:
                self.numbered.append((family, dims))
            self.measured[i] = (family, dims, found, chain, flops)

    def _traced_near(self, family: str, dims: Dims) -> list[tuple[Dims, TracedShape]]:
        """The traced shapes of `family` alike `dims` (input shapes, trace), nearest first."""
        near = [(d, t) for f, d, t, _, _ in self.measured if f == family and t is not None and _alike(d, dims)]
        return sorted(near, key=lambda m: _ratio(m[0], dims))

    def _numbers(self, key: Call | None) -> StorageNumbers | None:
        """Numbering only (no trace) for a family's first shape (NOTE: [the first shape numbered]), and for a later
        shape of `key` where the guards of the nearest traced shape of its family hold at the sizes its storages
        likely have there (`likely_sizes`): its trace is then that shape's
        (`numbered_shape`), and tracing costs a fifth to a third of a sizes-only profile. Else None: trace it. A
        wrong guess costs, never a wrong size: a shape no trace holds at keeps its measured chain, untraced, and
        its family is traced from then on (`missed`)."""
        if key is None or any(f == key[0] for f, _ in self.missed):
            return None
        family, dims = key
        near = self._traced_near(family, dims)
        if not near:  # the family's first shape is numbered only (NOTE: [the first shape numbered]); else trace
            return StorageNumbers() if not any(m[0] == family for m in self.measured) else None
        (at, base), others = near[0], near[1:]
        fixed = np.zeros(base.dims.shape, dtype=bool)  # dimensions another traced shape had along the same sizes
        for d, other in others:
            if other.dims.shape == base.dims.shape and _moved(at, d) == _moved(at, dims):
                fixed |= base.dims == other.dims
        guesses = (True, False) if any(0 < x <= SMALL for x in _moved_sizes(at, dims)) else (False,)
        # tops too: a shape where another op is a stage's largest is traced, its tops a regime for the shapes beyond
        # the measured sizes (NOTE: [peak variables] in size_trace.py)
        holds = any(base.guards_hold(likely_sizes(base, at, dims, fixed, strict), tops=True) for strict in guesses)
        return StorageNumbers() if holds else None

    @contextlib.contextmanager
    def tracing(self, on: bool, outside: Any = None, key: Call | None = None) -> Iterator[StorageNumbers | None]:
        """A trace of the profile run inside (None: not traced), or its storages numbered only where `key` (the new
        shape's family and input shapes) is near a traced shape (`_numbers`). With `outside` (what the code around a
        run of blocks costs), the profile goes on with the trace that measured it (`tracing_outside`), or is not
        traced."""
        pending, self._outside = self._outside, None
        if outside is not None and (pending is None or pending[0] is not outside):
            yield None
            return
        if not on:
            yield None
            return
        self._keyed = pending[2] if pending is not None else None
        with traced(pending[1] if pending is not None else self._numbers(key)) as trace:
            yield trace

    @contextlib.contextmanager
    def tracing_outside(self, on: bool) -> Iterator[Callable[[Any], Any]]:
        """Measure the code around a run of blocks in a trace that the profile of its shape goes on with: the
        block yields `note`, to be called with what was measured (returned as it is)."""
        if self._outside is not None:
            self._outside[1].close()
            self._outside = None
        if not on:
            yield lambda outside: outside
            return
        with traced(self._numbers(self._call), close=False) as trace:
            yield lambda outside: self._noted(outside, trace)

    def _noted(self, outside: Any, trace: StorageNumbers) -> Any:
        self._outside = (outside, trace, self._call)
        return outside

    def call(self, family: str, dims: Dims, derive: bool) -> bool:
        """A call of a module-level chain begins, its arguments of `family` and shapes `dims`: True where `derive`
        and its chain follows from measured calls' (`chain_for` gives it during the call, until `call_done`), so
        that the code around its run of blocks need not be measured."""
        self._call = (family, dims)
        found = self._found(family, dims) if derive else None
        self._call_derived = found if not isinstance(found, str) else None
        return self._call_derived is not None

    def call_done(self) -> None:
        """The call ended: a trace of the code around its run that no profile went on with is closed (its storage
        handles must not outlive the call: a copy of the module would free them twice)."""
        self._call = self._call_derived = None
        if self._outside is not None:
            self._outside[1].close()
            self._outside = None

    def chain_for(self, family: str, dims: Dims) -> Found | str:
        """The chain of a shape (times to derive), the measured sizes its law came from and its stages' FLOPs (None:
        count them), or why not; during a module-level chain's call derived from its arguments (`call`), that."""
        if self._call_derived is not None:
            found, self._call_derived = self._call_derived, None
            return found
        return self._found(family, dims)

    def _found(self, family: str, dims: Dims) -> Found | str:
        found = self._found_at.get((family, dims))
        if found is None:
            found = self._found_at[(family, dims)] = self._derived(family, dims)
        return found

    def _derived(self, family: str, dims: Dims) -> Found | str:
        """A new shape's chain: by the monomial law where it gives one, else by the affine law along one axis; a
        refused monomial law is warned of where no affine law can follow (another 3rd shape along one axis)."""
        monomial, refused = self._by_monomials(family, dims)
        if not isinstance(monomial, str):
            return monomial
        affine = self._by_line(family, dims, warn=refused is not None or monomial in (NO_AXIS, FEW_ALIKE))
        if affine == NO_AXIS and refused is not None:
            self._refuse(refused)
        return monomial if affine in (NO_AXIS, TOO_FEW) else affine

    def _by_monomials(self, family: str, dims: Dims) -> tuple[Found | str, str | None]:
        """The chain of `dims` by the monomial law of measured shapes of its family, or why not; and why a law was
        refused, if one was."""
        measured = [(d, t) for f, d, t, _, _ in self.measured if f == family and t is not None and _alike(d, dims)]
        axes = family_axes([d for d, _ in measured] + [dims]) if measured else None
        if axes is None:
            return NO_AXIS, None
        key = (family, axes, tuple(d for d, _ in measured))
        if key not in self._laws:
            groups: dict[Any, list[tuple[Point, TracedShape]]] = {}
            for d, traced in measured:
                groups.setdefault(_ops_of(traced), []).append((point_of(d, axes), traced))
            ordered = sorted(groups.values(), key=len, reverse=True)
            self._laws[key] = [monomial_law(*zip(*g, strict=True)) for g in ordered if len(g) >= 2]
        point, reason, refused = point_of(dims, axes), FEW_ALIKE, None
        for law in self._laws[key]:
            if isinstance(law, str):
                refused = refused or law
                continue
            found = law.chain(point)
            if isinstance(found, str):
                reason = found
                continue
            i, chain = found
            differ = [a for a in range(len(point)) if point[a] != law.points[i][a]]
            return (
                chain,
                tuple(sorted({law.points[j][a] for j in law.bases for a in differ})),
                law.flops(point),
            ), refused
        return refused or reason, refused

    def _refuse(self, reason: str) -> None:
        """Say once why sizes of new shapes are not derived."""
        if self.refused is None:
            self.refused = reason
            warnings.warn(
                f"rotor: the sizes of new input shapes cannot be derived from measured ones ({reason}); "
                "such shapes are measured (lightning_rotor/symbolic_sizes.py)",
                stacklevel=6,
            )

    def _by_line(self, family: str, dims: Dims, warn: bool) -> Found | str:
        """The chain of `dims` by the affine law along the one axis where it differs from measured shapes; `warn`:
        say once why a law is refused (not where a monomial law of these shapes stands)."""
        axes: dict[tuple[tuple[int, int], ...], list[tuple[int, int]]] = {}
        for i, (their_family, their_dims, trace, _, _) in enumerate(self.measured):
            found = size_axis(their_dims, dims) if their_family == family and trace is not None else None
            if found is not None:
                axes.setdefault(found[0], []).append((found[1], i))
        if len(axes) != 1:
            return NO_AXIS
        ((coords, points),) = axes.items()
        x = dims[coords[0][0]][coords[0][1]]
        reason = TOO_FEW
        for law in self._laws_along(coords, points, warn):
            if isinstance(law, str):
                reason = law
                continue
            if x % law.divisor:
                reason = f"size {x} is not a multiple of {law.divisor}, as every measured size along its axis is"
                continue
            found_chain = law.chain(x)
            if found_chain is not None:
                return found_chain[1], tuple(sorted(s.size for s in law.shapes)), law.flops(x)
            reason = f"no traced shape's branches hold at size {x}"
        return reason

    def _laws_along(self, coords: Any, points: list[tuple[int, int]], warn: bool) -> list[ShapeLaw | str]:
        """The laws of the traced shapes along one axis, one per group of shapes that ran the same ops (a small
        image whose last stage is 1x1 runs other ops than larger ones), largest group first."""
        key = (coords, tuple(i for _, i in points))
        if key not in self._laws:
            groups: dict[Any, list[TracedShape]] = {}
            for size, i in points:
                traced = self.measured[i][2]
                if traced is not None:
                    groups.setdefault(_ops_of(traced), []).append(dataclasses.replace(traced, size=size))
            self._laws[key] = [shape_law(g) for g in sorted(groups.values(), key=len, reverse=True) if len(g) >= 3]
        refused = next((law for law in self._laws[key] if isinstance(law, str)), None)
        if refused is not None and warn:
            self._refuse(refused)
        return self._laws[key]


SMALL = 4  # an input size up to this is taken for a batch by a guess (`likely_sizes`)


def likely_sizes(shape: TracedShape, at: Dims, dims: Dims, fixed: np.ndarray, strict: bool) -> np.ndarray:
    """The storage sizes a traced shape measured at input shapes `at` likely has at `dims`, a guess only (whether
    to trace a shape, `ShapeLaws._numbers`). For each input size `x` that becomes `y`, a dimension above 1 and not
    `fixed` (the same at another traced shape along these sizes) scales: for a length or a side, by `(y / x) ** 2`
    where a multiple of `x * x` (attention's `L * L`), else by `y / x` where that makes a whole number (`B * L`,
    `H / 4`); for a batch (`x` up to `SMALL`) so too, or with `strict` by `y / x` only where it is `x` times one
    or two of the input's other sizes (`B`, `B * L`: an even width is no multiple of a batch of 2, a batch times a
    group count is). Else it stays (a width, `L + 1`)."""
    now = shape.dims.astype(object)
    flat = [n for t in at for n in t]
    for x, y in {(x, y) for p, q in zip(at, dims, strict=True) for x, y in zip(p, q, strict=True) if x != y}:
        if x < 1:
            continue
        free = ~fixed & (now > 1)
        if x > SMALL or not strict:
            square = free & (now % (x * x) == 0) & (x > SMALL)
            linear = free & ~square & (now * y % x == 0)
        else:
            others = sorted({n for n in flat if n != x})
            products = [math.prod(c) for r in range(3) for c in itertools.combinations(others, r)]
            square = np.zeros(now.shape, dtype=bool)
            linear = free & (now % x == 0) & np.isin(now // x, products)
        now = np.where(square, now * y * y // (x * x), np.where(linear, now * y // x, now))
    return (shape.itemsizes * np.prod(now.astype(np.int64), axis=1)).astype(np.int64)


def _moved_sizes(a: Dims, b: Dims) -> set[int]:
    """The sizes of `a` that differ in `b`."""
    return {x for p, q in zip(a, b, strict=True) for x, y in zip(p, q, strict=True) if x != y}


def _moved(a: Dims, b: Dims) -> set[tuple[int, int]]:
    """The coordinates (tensor, dimension) where two alike input shapes differ."""
    return {(i, d) for i, (p, q) in enumerate(zip(a, b, strict=True)) for d in range(len(p)) if p[d] != q[d]}


def _ratio(a: Dims, b: Dims) -> float:
    """How far apart two alike input shapes are: the largest ratio of one's size to the other's."""
    ratios = [
        max(x, y) / min(x, y) if min(x, y) else (1.0 if x == y else math.inf)
        for p, q in zip(a, b, strict=True)
        for x, y in zip(p, q, strict=True)
    ]
    return max(ratios, default=1.0)


def _alike(a: Dims, b: Dims) -> bool:
    """Whether two input shapes have the same structure: as many tensors, each of one rank."""
    return len(a) == len(b) and all(len(x) == len(y) for x, y in zip(a, b, strict=True))


def _ops_of(shape: TracedShape) -> tuple[Any, ...]:
    """What two traced shapes share when their stages ran the same ops: the chain's structure, the storages made."""
    return _structure(shape.chain), shape.ranks, shape.itemsizes.tobytes()
