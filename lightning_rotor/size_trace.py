"""Sizes traced through a profile: every size of a measured chain as a sum of the storages' own sizes.

The memory probe's figures (lightning_rotor/memory.py) are sums and differences of storage sizes, and the
profile's (lightning_rotor/profile.py) are sums, differences, maxima and minima of the probe's. While a profile
is traced (`traced`), each storage's bytes are a `Sym`: an int (the profile computes with it as with any) that
also carries its terms, storage index -> coefficient. Sums and differences keep their terms; each comparison
(the probe's `max(peak, current)` after every op, the profile's `max` and `min` of its figures) is recorded as
a guard, the comparison and its outcome. So a chain measured at one shape is, exactly, a linear function of its
storages' sizes wherever every guard has the same outcome (the same op is the largest, the same run the
smaller): run at another shape where they do, the same Python code takes the same branches and adds the same
storages. lightning_rotor/symbolic_sizes.py finds each storage's size at another shape and checks the guards.

Storages are numbered in the order the profile first counts them: two runs of the same ops at two shapes number
them alike. Where a figure leaves the sums (a product of two sizes, a division), it becomes a plain int, a
constant to the trace; lightning_rotor/symbolic_sizes.py refuses a constant that differs between shapes. A profile
may number its storages without tracing them (`StorageNumbers`): its figures plain ints, its storages numbered as
a trace would number them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from lightning_rotor._torch_compat import StorageWeakRef, storage_id
from lightning_rotor.memory import storages_sized_by

__all__ = ["CONST", "Peak", "SizeTrace", "StorageNumbers", "Sym", "Terms", "terms_of", "traced"]

CONST = -1  # the key of a figure's constant term
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


class Sym(int):
    """An int that is a sum of storage sizes (`terms`): arithmetic keeps the terms, comparisons are recorded."""

    terms: Terms

    def __new__(cls, value: int, terms: Terms) -> Sym:
        obj = int.__new__(cls, value)
        obj.terms = terms
        return obj

    def __add__(self, other: Any) -> Any:
        t = terms_of(other)
        value = int.__add__(self, other)
        return value if t is None or value is NotImplemented else _sym(value, _combined(self.terms, t, 1))

    __radd__ = __add__

    def __sub__(self, other: Any) -> Any:
        t = terms_of(other)
        value = int.__sub__(self, other)
        return value if t is None or value is NotImplemented else _sym(value, _combined(self.terms, t, -1))

    def __rsub__(self, other: Any) -> Any:
        t = terms_of(other)
        value = int.__rsub__(self, other)
        return value if t is None or value is NotImplemented else _sym(value, _combined(t, self.terms, -1))

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


class Peak(Sym):
    """A probe's peak: the largest of the levels it rose through since it started (`levels`, shared by the peaks
    of one run). Its terms are the largest level's; once they are used, the guards recorded are that every level
    is at most it (not the order in which the levels came: which of two lower levels was higher does not change
    the peak)."""

    levels: list[Terms]
    _top: Terms

    def __new__(cls, value: int, top: Terms, levels: list[Terms]) -> Peak:
        obj = int.__new__(cls, value)
        obj._top = top
        obj.levels = levels
        return obj

    @property
    def terms(self) -> Terms:  # type: ignore[override]
        if _TRACES:
            _TRACES[-1].dominated(self.levels, self._top)
        return self._top


def _raw(value: int) -> Terms:
    """The terms of a probe's level or peak without settling a peak's guards."""
    if isinstance(value, Peak):
        return value._top
    return terms_of(value) or {}


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
    the sizer is asked at the same points. A later shape numbered so gets its trace from a traced shape's
    (symbolic_sizes.py `numbered_shape`), at a fifth to a third less than tracing it."""

    def __init__(self) -> None:
        self.storages: list[Storage] = []
        self._seen: dict[int, tuple[StorageWeakRef, int]] = {}

    def size(self, storage: torch.UntypedStorage, tensor: torch.Tensor) -> int:
        """The bytes of `storage` (numbered when first counted, while it lives)."""
        key = storage_id(storage)
        seen = self._seen.get(key)
        if seen is not None and not seen[0].expired():
            return seen[1]
        nbytes = storage.nbytes()
        itemsize = tensor.element_size()
        whole = tensor.storage_offset() == 0 and nbytes == math.prod(tensor.shape) * itemsize and nbytes > 0
        self.storages.append(Storage(itemsize, tuple(tensor.shape)) if whole else Storage(1, (nbytes,)))
        size = self._sized(nbytes, len(self.storages) - 1)
        self._seen[key] = (StorageWeakRef(storage), size)
        return size

    def _sized(self, nbytes: int, index: int) -> int:
        return nbytes

    def higher(self, peak: int, current: int) -> int:
        return current if current > peak else peak

    def close(self) -> None:
        self._seen = {}  # storage handles must not outlive the block (MemoryProbe.close)


class SizeTrace(StorageNumbers):
    """One traced profile: the storages it counted (in order) and the guards its figures rest on, each as
    (terms of `a - b` without the constant, the constant, the comparison, its outcome)."""

    def __init__(self) -> None:
        super().__init__()
        self.guards: list[tuple[Terms, int, str, bool]] = []
        self.terms = 0  # in all guards
        self.abandoned = False  # too many guards to keep: no sizes are derived from this trace
        self._dominated: dict[tuple[int, int], int] = {}
        self._kept: list[tuple[list[Terms], Terms]] = []
        self._recorded: set[tuple[frozenset[tuple[int, int]], int, str, bool]] = set()  # the guards, once each

    def _sized(self, nbytes: int, index: int) -> int:
        """The bytes of a storage as a `Sym` of its own index."""
        return Sym(nbytes, {index: 1})

    def higher(self, peak: int, current: int) -> int:
        """`max(peak, current)` as a `Peak` that remembers `current` among its levels."""
        levels = peak.levels if isinstance(peak, Peak) else [_raw(peak)]
        level = _raw(current)
        if levels[-1] is not level:  # an op that allocated nothing leaves the level as it was
            levels.append(level)
        elif isinstance(peak, Peak) and not int.__gt__(current, peak):
            return peak  # nothing new: the same peak (its value, top and levels), not a copy of it per op
        if int.__gt__(current, peak):
            return Peak(int(current), level, levels)
        return Peak(int(peak), _raw(peak), levels)

    def dominated(self, levels: list[Terms], top: Terms) -> None:
        """Guards that every level in `levels` is at most `top` (each recorded once per peak)."""
        key = (id(levels), id(top))
        done = self._dominated.get(key, 0)
        for level in levels[done:]:
            if level is not top:
                self.guard(_combined(level, top, -1), "<=", True)
        self._dominated[key] = len(levels)
        self._kept.append((levels, top))  # alive while recorded: ids are not reused

    def guard(self, terms: Terms, op: str, result: bool) -> None:
        """Record that `sum(terms) op 0` came out `result`, unless it comes out so at every shape (a comparison of
        constants, or one whose sign no size changes: `holds_everywhere`) or is recorded already."""
        constant = terms.pop(CONST, 0)
        if not terms or self.abandoned or holds_everywhere(terms, constant, op, result):
            return
        key = (frozenset(terms.items()), constant, op, result)
        if key in self._recorded:
            return
        self._recorded.add(key)
        self.guards.append((terms, constant, op, result))
        self.terms += len(terms)
        if self.terms > MAX_TERMS:
            self.abandoned, self.guards, self._recorded = True, [], set()

    def close(self) -> None:
        super().close()
        self._dominated, self._kept, self._recorded = {}, [], set()


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
