"""Sizes traced through a profile: every size of a measured chain as a sum of the storages' own sizes.

The memory probe's figures (lightning_rotor/memory.py) are sums and differences of storage sizes, and the profile's
(lightning_rotor/profile.py) are sums, differences, maxima and minima of the probe's. While a profile is traced
(`traced`), each storage's bytes are a `Sym`: an int (the profile computes with it as with any) that also carries
its terms, storage index -> coefficient. Sums and differences keep their terms; a probe's peak (its `max(peak,
current)` after every op) is a variable of its own, the largest of its levels (NOTE: [peak variables]); each other
comparison (the profile's `max` and `min` of its figures) is recorded as a guard, the comparison and its outcome. So
a chain measured at one shape is, exactly, a linear function of its storages' sizes and its peaks wherever every
guard has the same outcome (the same run the smaller): run at another shape where they do, the same Python code
takes the same branches and adds the same storages. lightning_rotor/symbolic_sizes.py finds each storage's size at
another shape and checks the guards.

Storages are numbered in the order the profile first counts them: two runs of the same ops at two shapes number
them alike. Where a figure leaves the sums (a product of two sizes, a division), it becomes a plain int, a
constant to the trace; lightning_rotor/symbolic_sizes.py refuses a constant that differs between shapes. A profile
may number its storages without tracing them (`StorageNumbers`): its figures plain ints, its storages numbered as
a trace would number them.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from lightning_rotor._torch_compat import free_weak_storage, storage_id, weak_storage, weak_storage_expired
from lightning_rotor.memory import storages_sized_by, storages_sized_plainly

__all__ = ["CONST", "PEAKS", "Peak", "SizeTrace", "StorageNumbers", "Sym", "Terms", "terms_of", "traced", "untraced"]

CONST = -1  # the key of a figure's constant term
PEAKS = 1 << 40  # the key of the trace's j-th peak variable is `PEAKS + j` (NOTE: [peak variables])
Terms = dict[int, int]  # storage index (CONST: the constant) -> coefficient

OPS = ("<", "<=", ">", ">=", "==", "!=")

MAX_TERMS = 1_000_000  # guards' terms a trace keeps at most (memory); beyond, it is abandoned: the shape measured
_TRACES: list[SizeTrace] = []  # the traces being recorded (the innermost records)


def terms_of(value: Any) -> Terms | None:
    """The terms of an int (a `Sym`'s, or a plain int's constant); None for anything else."""
    if isinstance(value, Sym):  # a `Peak` settles its guards here
        return value.terms
    if isinstance(value, int) and not isinstance(value, bool):
        return {CONST: int(value)} if value else {}
    return None


def _combined(a: Terms, b: Terms, sign: int) -> Terms:
    """`a + sign * b`, zero terms dropped."""
    out = dict(a)
    for k, c in b.items():
        v = out.get(k, 0) + sign * c
        if v:
            out[k] = v
        else:
            out.pop(k, None)
    return out


def _sym(value: int, terms: Terms) -> int:
    """`value` with its terms; a plain int where it has no storage term."""
    if not any(k != CONST for k in terms):
        return value
    return Sym(value, terms)


# NOTE: [running sums] a probe adds and subtracts a storage's size at every op (its `current`), and the sums a
# profile derives are sums of a few such. Copying the terms at each step (`_combined`) cost the trace O(live
# storages) an op. A sum is instead a position in a `_Run` (`_running`), whose terms now (`head`) are changed in
# place and whose changes are logged; a sum plus or minus a `Sym` that is no running sum itself (a storage's size,
# as in the probe's steps) extends its run in place where it is the run's latest (the probe's `current` is, op
# after op), else (or plus any other figure) it begins a run from its own terms: a profile's figures taken from a
# probe's count leave the probe its run. Its terms, when asked (a comparison, a product, a peak's guards), are its
# run's start with the changes up to its position applied in order: the very dict, in the very order, that
# `_combined` step by step would have made. As `_sym`, a sum without a storage term is a plain int. A copy of the
# head is kept every `SNAPSHOT` changes: terms asked in any order (a chain's sizes, a peak's levels) are made from
# the copy before them, not from the run's start.
SNAPSHOT = 64
WALKED = 16  # a peak's levels compared with its top along their run (`_Walk`) from this many on


class _Run:
    """Terms changed in place, each change logged: every position's terms can be made again (NOTE: [running
    sums]). `storages`: the head's storage terms (not the constant)."""

    __slots__ = ("_cursor", "_cursor_at", "head", "log", "snapshot_at", "snapshots", "start", "storages")

    def __init__(self, start: Terms):
        self.start = start  # never changed
        self.head = dict(start)
        self.log: list[tuple[int, int]] = []  # (key, coefficient added), in order
        self.storages = len(start) - (CONST in start)
        self.snapshot_at = [0]  # positions of the copies of the head kept (`SNAPSHOT`), in order
        self.snapshots = [start]
        self._cursor: Terms = {}  # the terms at position `_cursor_at` (-1: none yet), moved on as asked
        self._cursor_at = -1

    def keep(self) -> None:
        """Keep a copy of the head where `SNAPSHOT` changes came since the last."""
        if len(self.log) - self.snapshot_at[-1] >= SNAPSHOT:
            self.snapshot_at.append(len(self.log))
            self.snapshots.append(dict(self.head))

    def before(self, at: int) -> tuple[int, Terms]:
        """The latest copy kept at or before position `at`: (its position, its terms, not to be changed)."""
        i = bisect.bisect_right(self.snapshot_at, at) - 1
        return self.snapshot_at[i], self.snapshots[i]

    def extend(self, terms: Terms, sign: int) -> None:
        """Add `sign * terms` to the head, as `_combined` would."""
        head, log = self.head, self.log
        for k, c in terms.items():
            c = sign * c
            had = k in head
            v = head.get(k, 0) + c
            if v:
                head[k] = v
            elif had:
                del head[k]
            if k != CONST:
                self.storages += (k in head) - had
            log.append((k, c))
        self.keep()

    def terms_at(self, at: int) -> Terms:
        """The terms at position `at` (a new dict)."""
        if at == len(self.log):
            return dict(self.head)
        kept_at, kept = self.before(at)
        if not kept_at <= self._cursor_at <= at:
            self._cursor, self._cursor_at = dict(kept), kept_at
        _replay(self._cursor, self.log, self._cursor_at, at)
        self._cursor_at = at
        return dict(self._cursor)


def _replay(terms: Terms, log: list[tuple[int, int]], begin: int, end: int) -> None:
    """Apply the changes `log[begin:end]` to `terms` in place."""
    for k, c in log[begin:end]:
        v = terms.get(k, 0) + c
        if v:
            terms[k] = v
        else:
            terms.pop(k, None)


def _sum(value: int, first: Sym, terms: Terms, sign: int) -> int:
    """`first + sign * terms` (its bytes `value`) where `terms` are another figure's or a constant's: a new run from
    `first`'s terms. Only a `Sym` that is no running sum (a storage's size) extends a run in place (`_stepped`): a
    probe's count keeps its run while a profile derives figures from it (NOTE: [running sums])."""
    return _extended(value, _Run(first.terms), terms, sign)


def _extended(value: int, run: _Run, terms: Terms, sign: int) -> int:
    """The sum `value` at the end of `run` extended by `sign * terms`; a plain int without a storage term."""
    run.extend(terms, sign)
    if not run.storages:
        return value
    return _running(value, run, len(run.log))


def _stepped(value: int, run: _Run, terms: Terms | None, sign: int) -> int:
    """`_extended`, for a probe's step: a running sum plus or minus a storage's size (`terms` never None)."""
    assert terms is not None
    return _extended(value, run, terms, sign)


def _running(value: int, run: _Run, at: int) -> Sym:
    """The sum `value` at position `at` of `run`: a `Sym` whose terms are made when first asked. (A `Sym`, not a
    subclass: a comparison of two `Sym`s is the left one's, as Python tries a right operand's reflected comparison
    first where its type is a subclass of the left one's.)"""
    obj = int.__new__(Sym, value)
    obj._run = run
    obj._at = at
    return obj


class Sym(int):
    """An int that is a sum of storage sizes (`terms`): arithmetic keeps the terms, comparisons are recorded."""

    _terms: Terms | None = None  # made when first asked of a running sum
    _run: _Run | None = None  # a running sum's run and position (NOTE: [running sums])
    _at: int

    def __new__(cls, value: int, terms: Terms) -> Sym:
        obj = int.__new__(cls, value)
        obj._terms = terms
        return obj

    @property
    def terms(self) -> Terms:
        terms = self._terms
        if terms is None:
            assert self._run is not None
            terms = self._terms = self._run.terms_at(self._at)
        return terms

    def __add__(self, other: Any) -> Any:
        run = self._run
        if run is not None and type(other) is Sym and other._run is None and self._at == len(run.log):
            return _stepped(int.__add__(self, other), run, other._terms, 1)  # a probe's step (NOTE: [running sums])
        t = terms_of(other)
        value = int.__add__(self, other)
        return value if t is None or value is NotImplemented else _sum(value, self, t, 1)

    __radd__ = __add__

    def __sub__(self, other: Any) -> Any:
        run = self._run
        if run is not None and type(other) is Sym and other._run is None and self._at == len(run.log):
            return _stepped(int.__sub__(self, other), run, other._terms, -1)
        t = terms_of(other)
        value = int.__sub__(self, other)
        return value if t is None or value is NotImplemented else _sum(value, self, t, -1)

    def __rsub__(self, other: Any) -> Any:
        t = terms_of(other)
        value = int.__rsub__(self, other)
        return value if t is None or value is NotImplemented else _extended(value, _Run(t), self.terms, -1)

    def __neg__(self) -> Any:
        return _sym(-int(self), {k: -c for k, c in self.terms.items()})

    def __pos__(self) -> Any:
        return self

    def __mul__(self, other: Any) -> Any:
        value = int.__mul__(self, other)
        if isinstance(other, Sym) or terms_of(other) is None or value is NotImplemented:
            return value  # a product of two sizes leaves the sums: a constant to the trace
        return _sym(value, {k: c * other for k, c in self.terms.items()} if other else {})

    __rmul__ = __mul__

    def _compare(self, other: Any, op: str) -> Any:
        result = getattr(int, _DUNDER[op])(self, other)
        t = terms_of(other)
        if t is not None and result is not NotImplemented and _TRACES:
            _TRACES[-1].guard(_combined(self.terms, t, -1), op, bool(result))
        return result

    def __lt__(self, other: Any) -> Any:
        return self._compare(other, "<")

    def __le__(self, other: Any) -> Any:
        return self._compare(other, "<=")

    def __gt__(self, other: Any) -> Any:
        return self._compare(other, ">")

    def __ge__(self, other: Any) -> Any:
        return self._compare(other, ">=")

    def __eq__(self, other: Any) -> Any:
        return self._compare(other, "==")

    def __ne__(self, other: Any) -> Any:
        return self._compare(other, "!=")

    __hash__ = int.__hash__

    def __reduce__(self) -> Any:  # pickled or copied: the number alone
        return (int, (int(self),))


# a level of a probe's peak: the sum the probe counted (its terms made when a guard needs them), or a plain int's
# terms (a new dict each time, as each op's level of a plain count is its own)
Level = Sym | Terms


# NOTE: [peak variables] A probe's peak is the largest of the levels it rose through. Its terms, once used, are
# not the largest level's with a guard that every other level stays below it (a guard fails wherever another op
# becomes a stage's largest: a short sequence, where attention's `L*L` no longer dominates) but a variable of its
# own, `PEAKS + j`, which lightning_rotor/symbolic_sizes.py evaluates at a new shape as the largest of the same
# levels there: the top's sum plus the largest excess of a level over it, 0 at least (`SizeTrace.peaks`, the levels
# that can exceed the top somewhere). That is what the probe computes there, running the same ops; only the other
# comparisons (the profile's own `max`, `min` and branches) stay guards. A level may hold another peak's variable
# (a peak folded into a count): variables are evaluated in the order they were made. Beyond the measured sizes
# along an axis, a derivation also asks every peak's top to stay its largest, as the guards it replaces did: there
# a wrong law of the dimensions (three sizes in one step of a padding, docs/checkpointable.md) was sometimes refused
# by that alone (`benchmarks/shapes_monomial.py`: 13 wrong chains of 456 with it, 61 without). Between measured
# sizes the dimensions' laws hold (`MonomialLaw.spans`), and a regime no measured shape had is derived: the small
# GPT measured at lengths 8 and 81 derives 25 to 42, where neither trace's tops are the largest. So that a regime
# beyond them gets a trace of its own, a later shape is measured numbered only where the nearest trace's tops likely
# stay its largest too (`ShapeLaws._numbers`), as before.
class Peak(Sym):
    """A probe's peak: the largest of the levels it rose through since it started (`levels`, shared by the peaks
    of one run). Its terms, once used in a trace, are a peak variable (NOTE: [peak variables])."""

    levels: list[Level]
    _top: Level

    def __new__(cls, value: int, top: Level, levels: list[Level]) -> Peak:
        obj = int.__new__(cls, value)
        obj._top = top
        obj.levels = levels
        return obj

    @property
    def terms(self) -> Terms:
        if _TRACES:
            return _TRACES[-1].variable(self.levels, self._top)
        return _level_terms(self._top)


def _level(value: int) -> Level:
    """A probe's level or peak as a level of a peak (a peak: its variable, in a trace)."""
    if type(value) is Sym and value._run is not None:  # a running sum: never without a storage term
        return value
    if isinstance(value, Peak):
        return value.terms if _TRACES else value._top
    if isinstance(value, Sym) and value.terms:
        return value
    return terms_of(value) or {}


def _level_terms(level: Level) -> Terms:
    return level if isinstance(level, dict) else level.terms


def holds_everywhere(terms: Terms, constant: int, op: str, result: bool) -> bool:
    """Whether `sum(terms) + constant op 0` comes out `result` at every shape: a storage's size is never negative
    (lightning_rotor/symbolic_sizes.py refuses a shape where one would be), so a sum whose coefficients and
    constant are all at most 0 stays at most 0 (`<=` holds, `>` fails), and one whose are all at least 0 stays at
    least 0 (`>=` holds, `<` fails). A peak's guards (every level at most the top) are often of the first kind."""
    if op in ("<=", ">") and constant <= 0 and max(terms.values()) <= 0:
        return result == (op == "<=")
    if op in (">=", "<") and constant >= 0 and min(terms.values()) >= 0:
        return result == (op == ">=")
    return False


_DUNDER = {"<": "__lt__", "<=": "__le__", ">": "__gt__", ">=": "__ge__", "==": "__eq__", "!=": "__ne__"}


@dataclasses.dataclass
class Storage:
    """A storage the traced profile counted: its element size and the factors its bytes are the product of
    (the shape of the tensor that made it, or its bytes alone where the storage is not that tensor's size)."""

    itemsize: int
    factors: tuple[int, ...]


class StorageNumbers:
    """The storages a profile counts, numbered in the order it first counts them, with their dimensions; the bytes
    as they are (plain ints, `higher` a plain `max`). A profile run so (`traced(StorageNumbers())`) computes every
    figure as an untraced one does, and numbers its storages as a traced one (`SizeTrace`) of the same ops does:
    the sizer is asked at the same points. A shape numbered so gets its trace from a traced shape's
    (symbolic_sizes.py `numbered_shape`), at a fifth to a third less than tracing it."""

    def __init__(self) -> None:
        self.storages: list[Storage] = []
        # per storage counted: a weak reference to it as a bare handle (`weak_storage`, freed here once: when the
        # storage at its address is another, or at `close`) and its size
        self._seen: dict[int, tuple[int, int]] = {}

    def size(self, storage: torch.UntypedStorage, tensor: torch.Tensor) -> int:
        """The bytes of `storage` (numbered when first counted, while it lives)."""
        key = storage_id(storage)
        seen = self._seen.get(key)
        if seen is not None:
            if not weak_storage_expired(seen[0]):
                return seen[1]
            free_weak_storage(seen[0])
        nbytes = storage.nbytes()
        itemsize = tensor.element_size()
        whole = tensor.storage_offset() == 0 and nbytes == math.prod(tensor.shape) * itemsize and nbytes > 0
        self.storages.append(Storage(itemsize, tuple(tensor.shape)) if whole else Storage(1, (nbytes,)))
        size = self._sized(nbytes, len(self.storages) - 1)
        self._seen[key] = (weak_storage(storage), size)
        return size

    def _sized(self, nbytes: int, index: int) -> int:
        return nbytes

    def higher(self, peak: int, current: int) -> int:
        return current if current > peak else peak

    def close(self) -> None:
        """Free the storage handles: they must not outlive the block (MemoryProbe.close)."""
        seen, self._seen = self._seen, {}
        for handle, _ in seen.values():
            free_weak_storage(handle)


class SizeTrace(StorageNumbers):
    """One traced profile: the storages it counted (in order) and the guards its figures rest on, each as
    (terms of `a - b` without the constant, the constant, the comparison, its outcome)."""

    def __init__(self) -> None:
        super().__init__()
        self.guards: list[tuple[Terms, int, str, bool]] = []
        # per peak variable (NOTE: [peak variables]): its top's terms, and the levels' excesses over it
        self.peaks: list[tuple[Terms, list[Terms]]] = []
        self.terms = 0  # in all guards and peaks
        self.abandoned = False  # too many guards to keep: no sizes are derived from this trace
        self._variables: dict[tuple[int, int, int], int] = {}
        self._kept: list[tuple[list[Level], Level]] = []
        # the guards recorded, by a key that is cheap to make (most guards differ in it), each its guards' terms
        self._recorded: dict[tuple[int, int, int, int, str, bool], list[Terms]] = {}

    def _sized(self, nbytes: int, index: int) -> int:
        """The bytes of a storage as a `Sym` of its own index."""
        size = int.__new__(Sym, nbytes)
        size._terms = {index: 1}
        return size

    def higher(self, peak: int, current: int) -> int:
        """`max(peak, current)` as a `Peak` that remembers `current` among its levels; a peak not passed is the same
        peak (its value, top and levels, which it shares), not a copy of it per op."""
        if type(peak) is Peak and peak.levels[-1] is current and not int.__gt__(current, peak):
            return peak  # an op that allocated nothing: the level as it was (a sum is its own level, `_level`)
        level = _level(current)
        if type(peak) is Peak:
            levels = peak.levels
            if levels[-1] is not level:  # an op that allocated nothing leaves the level as it was
                levels.append(level)
            return Peak(current, level, levels) if int.__gt__(current, peak) else peak
        levels = [_level(peak)]
        if levels[-1] is not level:
            levels.append(level)
        if int.__gt__(current, peak):
            return Peak(current, level, levels)
        return Peak(peak, _level(peak), levels)

    def variable(self, levels: list[Level], top: Level) -> Terms:
        """The terms of a peak of `levels` whose largest is `top` here: its variable (NOTE: [peak variables]), made
        once per peak and number of levels; the top's terms where the trace is abandoned."""
        if self.abandoned:
            return dict(_level_terms(top))
        key = (id(levels), id(top), len(levels))
        found = self._variables.get(key)
        if found is None:
            top_terms = _level_terms(top)
            rises = _rises(levels, top, top_terms)
            self.peaks.append((dict(top_terms), rises))
            self.terms += len(top_terms) + sum(len(r) for r in rises)
            found = self._variables[key] = PEAKS + len(self.peaks) - 1
            self._kept.append((levels, top))  # alive while recorded: ids are not reused
            if self.terms > MAX_TERMS:
                self._abandon()
        return {found: 1}

    def guard(self, terms: Terms, op: str, result: bool) -> None:
        """Record that `sum(terms) op 0` came out `result`, unless it comes out so at every shape (a comparison of
        constants, or one whose sign no size changes: `holds_everywhere`) or is recorded already."""
        constant = terms.pop(CONST, 0)
        if not terms or self.abandoned or holds_everywhere(terms, constant, op, result):
            return
        key = (len(terms), sum(terms), sum(terms.values()), constant, op, result)
        alike = self._recorded.setdefault(key, [])
        if terms in alike:  # equal terms, in any order
            return
        alike.append(terms)
        self.guards.append((terms, constant, op, result))
        self.terms += len(terms)
        if self.terms > MAX_TERMS:
            self._abandon()

    def _abandon(self) -> None:
        self.abandoned, self.guards, self._recorded, self.peaks = True, [], {}, []

    def close(self) -> None:
        super().close()
        self._variables, self._kept, self._recorded = {}, [], {}


def _rises(levels: list[Level], top: Level, top_terms: Terms) -> list[Terms]:
    """Each level's excess over the top (`level - top`, its constant in it), where it may be positive at some shape;
    each once, in the levels' order."""
    rises: list[Terms] = []
    seen: set[tuple[tuple[int, int], ...]] = set()
    walk = _Walk(top_terms) if len(levels) >= WALKED else None
    for level in levels:
        if level is top:
            continue
        excess = walk.excess(level) if walk is not None else _combined(_level_terms(level), top_terms, -1)
        if excess is None:
            continue
        rest = {k: c for k, c in excess.items() if k != CONST}
        if not rest or holds_everywhere(rest, excess.get(CONST, 0), "<=", True):
            continue
        key = tuple(sorted(excess.items()))
        if key not in seen:
            seen.add(key)
            rises.append(dict(excess))
    return rises


class _Walk:
    """A peak's levels compared with its top, one after another: each level's excess over the top (`level - top`,
    as `_combined` makes it), made only where its guard `excess <= 0` may fail at some shape.

    Levels of one run are walked along it (NOTE: [running sums]), the excess kept as it changes rather than made
    again per level: `_combined(level, top, -1)` is the level's terms that differ from the top's, in the level's
    order (`differ`), then the top's terms the level lacks, in the top's order, negated (`lacking`, made again
    when one of them came or went). How many storages' coefficients differ from the top's, and how many are above
    it, tell a level whose guard holds everywhere (`holds_everywhere`: equal to the top, or nowhere above it)."""

    def __init__(self, top: Terms):
        self.top = top
        self.run: _Run | None = None
        self.at = 0
        self.level: Terms = {}  # the level's terms, in its order
        self.differ: Terms = {}  # its terms that differ from the top's (coefficient minus the top's), in its order
        self.lacking: Terms | None = None  # the top's terms it lacks, negated (None: to make again)
        self.ordered = True  # False where a term of `differ` would have to go between others: made again
        self.unequal = 0  # storages whose coefficient differs from the top's
        self.above = 0  # storages whose coefficient is above the top's

    def excess(self, level: Level) -> Terms | None:
        if isinstance(level, dict) or level._run is None:
            return _combined(_level_terms(level), self.top, -1)
        run = level._run
        if run is not self.run or level._at < self.at:
            self._restart(level, run)
        self._advance(level._at)
        if not self.unequal:
            return None
        if not self.above and self.level.get(CONST, 0) <= self.top.get(CONST, 0):
            return None
        if not self.ordered:
            top = self.top
            self.differ = {k: c - top.get(k, 0) for k, c in self.level.items() if c != top.get(k, 0)}
            self.ordered = True
        if self.lacking is None:
            level_terms = self.level
            self.lacking = {k: -c for k, c in self.top.items() if k not in level_terms}
        return self.differ | self.lacking

    def _restart(self, level: Sym, run: _Run) -> None:
        """Walk `run` (`level`'s) from `level` where its terms are made already, else from the copy kept before it."""
        self.run = run
        if level._terms is not None:
            self.level, self.at = dict(level._terms), level._at
        else:
            kept_at, kept = run.before(level._at)
            self.level, self.at = dict(kept), kept_at
        top, terms = self.top, self.level
        self.differ, self.lacking, self.ordered = {}, None, False
        unequal = above = 0
        for k, c in terms.items():
            t = top.get(k, 0)
            if k != CONST and c != t:
                unequal, above = unequal + 1, above + (c > t)
        for k, t in top.items():
            if k != CONST and k not in terms:
                unequal, above = unequal + 1, above + (t < 0)
        self.unequal, self.above = unequal, above

    def _advance(self, at: int) -> None:
        assert self.run is not None
        terms, top, differ = self.level, self.top, self.differ
        for k, c in self.run.log[self.at : at]:
            old = terms.get(k, 0)
            v = old + c
            t = top.get(k, 0)
            if v:
                terms[k] = v
                if v != t:
                    if k in differ or not old:  # in place, or a new term: last in the level's order
                        differ[k] = v - t
                    else:
                        self.ordered = False
                else:
                    differ.pop(k, None)
            else:
                terms.pop(k, None)
                differ.pop(k, None)
            if t and (not old) != (not v):
                self.lacking = None  # a term of the top came or went
            if k != CONST:
                self.unequal += (v != t) - (old != t)
                self.above += (v > t) - (old > t)
        self.at = at


@contextmanager
def traced(trace: StorageNumbers | None = None, close: bool = True) -> Iterator[StorageNumbers]:
    """Trace the profiles run inside: every storage size the probes and the profile count is a `Sym`. `trace`: go
    on with one begun before (its storages keep their numbers), a `SizeTrace` or, numbering only, `StorageNumbers`;
    `close=False`: leave it open to go on with."""
    trace = trace if trace is not None else SizeTrace()
    if isinstance(trace, SizeTrace):  # comparisons are recorded in a trace, not while numbering only
        _TRACES.append(trace)
    try:
        with storages_sized_by(trace):
            yield trace
    finally:
        if isinstance(trace, SizeTrace):
            _TRACES.remove(trace)
        if close:
            trace.close()


@contextmanager
def untraced() -> Iterator[None]:
    """Inside, nothing is traced or numbered, whatever trace was entered around: a profile run between a traced
    profile and its planning (NOTE: [sizes on CUDA], lightning_rotor/allocator.py)."""
    traces = _TRACES[:]
    _TRACES.clear()
    try:
        with storages_sized_plainly():
            yield
    finally:
        _TRACES[:] = traces
