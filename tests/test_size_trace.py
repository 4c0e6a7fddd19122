"""The size trace records each guard a figure rests on once, and none that holds at every shape."""

import torch

from lightning_rotor.memory import MemoryProbe
from lightning_rotor.size_trace import CONST, PEAKS, Sym, holds_everywhere, traced


def test_a_comparison_whose_sign_no_size_changes_is_no_guard():
    # sizes are never negative: -a - 2b + 0 <= 0 holds at every shape, a + b - 1 <= 0 does not
    assert holds_everywhere({0: -1, 1: -2}, 0, "<=", True)
    assert holds_everywhere({0: 1, 1: 2}, 3, "<", False)
    assert not holds_everywhere({0: 1, 1: 2}, -1, "<=", True)
    assert not holds_everywhere({0: -1, 1: 1}, 0, "<=", True)  # a - b: either sign
    assert not holds_everywhere({0: -1}, 0, "==", False)
    with traced() as trace:
        a, b = Sym(8, {0: 1}), Sym(4, {1: 1})
        assert b <= a + b  # -a <= 0: everywhere
        assert a + b > b  # a > 0: not at a shape where storage 0 is empty
        assert a > b and a > b  # a - b > 0, recorded once
    assert [(g[0], g[1], g[2], g[3]) for g in trace.guards] == [({0: 1}, 0, ">", True), ({0: 1, 1: -1}, 0, ">", True)]


def test_a_probe_peak_is_a_variable_of_the_levels_that_can_exceed_its_top():
    """A peak's terms, once used, are its variable (NOTE: [peak variables]): no guard; its top is the largest level
    here, and of the other levels it keeps those that can exceed the top at some shape, each once (levels below it
    by storages alone cannot)."""
    with traced() as trace:
        with MemoryProbe() as probe:
            x = torch.zeros(100)
            y = x * 2  # the top: x and y
            del y
            z = x + 1
            del x, z
        used = probe.peak + 0  # its terms used: its variable
    ((top, rises),) = trace.peaks
    assert used == 800 and used.terms == {PEAKS: 1} and not trace.guards
    assert sorted(top.values()) == [1, 1]  # x and y
    keys = [frozenset(r.items()) for r in rises]
    assert len(keys) == len(set(keys))
    assert all(
        not holds_everywhere({k: c for k, c in r.items() if k != CONST}, r.get(CONST, 0), "<=", True) for r in rises
    )


def test_an_op_that_changes_nothing_leaves_the_peak_as_it_was():
    """Views and in-place ops allocate nothing: the traced peak after them is the very peak before (no copy per op),
    with the same levels; an op that allocates adds one level and a higher peak."""
    with traced():
        with MemoryProbe() as probe:
            x = torch.zeros(100)
            before = probe.peak
            levels = len(before.levels)
            v = x.view(10, 10)
            x.add_(1)
            assert probe.peak is before and len(before.levels) == levels
            y = x * 2
            assert probe.peak is not before and probe.peak == 800 and len(probe.peak.levels) == levels + 1
            del v, x, y
