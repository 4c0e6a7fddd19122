"""Running sums (NOTE: [running sums] in lightning_rotor/size_trace.py) give every sum the very terms, in the very
order, that copying the terms at each step (`_combined`, the arithmetic before running sums) gives; a peak's
variable holds every level's excess over its top (NOTE: [peak variables])."""

from contextlib import contextmanager

from hypothesis import example, given, settings
from hypothesis import strategies as st

from lightning_rotor import size_trace
from lightning_rotor.size_trace import CONST, SizeTrace, Sym, _combined, holds_everywhere, terms_of, traced


@contextmanager
def copies_every(changes: int):
    """Runs keep a copy of their terms every `changes` changes inside the block (`size_trace.SNAPSHOT`)."""
    kept, size_trace.SNAPSHOT = size_trace.SNAPSHOT, changes
    try:
        yield
    finally:
        size_trace.SNAPSHOT = kept


def reference_terms(value: int) -> dict[int, int]:
    return {CONST: int(value)} if value else {}


# a step: (which earlier value, add or subtract, a storage's index or a constant, ask its terms now)
steps = st.lists(
    st.tuples(
        st.integers(0, 1_000),
        st.sampled_from([1, -1]),
        st.one_of(st.integers(0, 7), st.integers(-3, 3).map(lambda c: ("c", c))),
        st.booleans(),
    ),
    max_size=40,
)


snapshots = st.sampled_from([1, 2, 5, size_trace.SNAPSHOT])  # changes between copies of a run's terms kept


@settings(max_examples=300, deadline=None)
@given(steps, snapshots)
def test_running_sums_have_the_terms_stepwise_arithmetic_gives(script, every):
    """Any sums of storage sizes and constants, each from any earlier one (the latest of a run extends it in place,
    an earlier one begins a run), their terms asked at any time, made from any kept copy: values, which are `Sym`s,
    and terms in order as step by step."""
    with copies_every(every):
        stepwise_sums(script)


def stepwise_sums(script):
    sizes = [Sym(8 * (i + 1), {i: 1}) for i in range(8)]
    values: list[tuple[int, dict[int, int] | None]] = [(0, None)]
    for pick, sign, operand, ask in script:
        base, base_ref = values[pick % len(values)]
        other = sizes[operand] if isinstance(operand, int) else operand[1]
        other_ref = {operand: 1} if isinstance(operand, int) else reference_terms(other)
        got = base + other if sign == 1 else base - other
        base_terms = base_ref if base_ref is not None else reference_terms(base)
        if base_ref is None and sign == 1 and isinstance(other, Sym):
            ref = _combined(other_ref, base_terms, 1)  # `int + Sym` is the Sym's `__radd__`: its terms first
        else:
            ref = _combined(base_terms, other_ref, sign)
        has_storage = any(k != CONST for k in ref)
        assert int(got) == int(base) + sign * int(other)
        assert isinstance(got, Sym) == has_storage
        values.append((got, ref if has_storage else None))
        if ask and isinstance(got, Sym):
            assert list(got.terms.items()) == list(ref.items())
    for value, ref in values:
        if ref is not None:
            assert list(terms_of(value).items()) == list(ref.items())


def reference_rises(levels: list, top) -> list[tuple[dict[int, int], int]]:
    """`level - top` (terms, constant) for every level but the top, unless it is at most 0 everywhere; each once."""
    found, seen = [], set()
    top_terms = top if isinstance(top, dict) else top.terms
    for level in levels:
        if level is top:
            continue
        terms = _combined(level if isinstance(level, dict) else level.terms, top_terms, -1)
        constant = terms.pop(CONST, 0)
        key = (frozenset(terms.items()), constant)
        if terms and not holds_everywhere(terms, constant, "<=", True) and key not in seen:
            seen.add(key)
            found.append((terms, constant))
    return found


# a probe's op: a new storage of some size counted, or the i-th live one freed; a sum of the current and a
# storage made outside the probe (as a profile's figure), which takes the run's end from the probe's count; a reset
# of the peak; a live storage counted again
ops = st.lists(
    st.one_of(
        st.integers(1, 50).map(lambda n: ("new", n)),
        st.integers(0, 20).map(lambda i: ("free", i)),
        st.just(("outside", 0)),
        st.just(("reset", 0)),
        st.integers(0, 20).map(lambda i: ("again", i)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops, snapshots)
@example([("new", 1), ("new", 50), ("free", 1), ("new", 1), ("again", 0)], 64)  # a term equal to the top's moves off
def test_a_peaks_variable_holds_every_level_against_its_top_as_stepwise_arithmetic_gives(script, every):
    """A probe's count, op after op, through the trace's `higher`: once the peak's terms are used, they are its
    variable alone, no guard is recorded, and the variable's top and excesses (terms in order) are those that
    comparing every level with the top step by step gives."""
    with copies_every(every):
        probe_rises(script)


def probe_rises(script):
    trace = SizeTrace()
    with traced(trace):
        live: list[Sym] = []
        current: int = 0
        peak: int = 0
        for made, (kind, n) in enumerate(script):
            if kind == "new":
                live.append(Sym(8 * n, {made: 1}))
                current = current + live[-1]
            elif kind == "free" and live:
                current = current - live.pop(n % len(live))
            elif kind == "outside" and live:
                _ = current + live[0]
            elif kind == "again" and live:
                current = current + live[n % len(live)]  # a coefficient of 2: not a probe's, any sum's
            elif kind == "reset":
                peak = current  # a new peak from what is alive now (`MemoryProbe.reset_peak`)
            peak = trace.higher(peak, current)
        if not hasattr(peak, "levels"):
            return
        assert terms_of(peak + 0) == {size_trace.PEAKS + len(trace.peaks) - 1: 1}  # its terms used: its variable
        top = peak._top if isinstance(peak._top, dict) else peak._top.terms
        expected = reference_rises(peak.levels, peak._top)
    assert not trace.guards and trace.peaks[-1][0] == top
    assert [([(k, c) for k, c in r.items() if k != CONST], r.get(CONST, 0)) for r in trace.peaks[-1][1]] == [
        (list(t.items()), c) for t, c in expected
    ]
