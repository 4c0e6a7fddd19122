"""Debts (issue 28): a copy spanning several operations, a wait where the memory needs one, and the lower floor.

docs/planner.md, "Debts": a recorded stage's saved part moves during a run of recorded forwards after it and
comes back during the backwards of that run; a split's kept input moves during its right part; what the
operations do not hide, compute waits for (`Wait`, `WaitSaved`, or the op reading the value).
"""

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference_planner import reference_min_budget, solve
from test_offload_planner import saved_chains

from lightning_rotor.chain import Chain
from lightning_rotor.discretize import discretize
from lightning_rotor.planner import InfeasibleBudget, min_feasible_budget, plan, solve_discretized
from lightning_rotor.simulate import no_recompute_peak, simulate


def labels(ops):
    return [op.label for op in ops]


def five_stages(**changes) -> Chain:
    """Stage 1 saves 20 B (19 may move), B 4 needs 20 B of transients; forwards and backwards 1 s; the part's copy
    takes 1.5 s: longer than one forward or backward, shorter than two."""
    data = dict(
        input_size=1,
        out_size=[1] * 5,
        saved_size=[1, 20, 1, 1, 1],
        fwd_time=[1.0] * 5,
        bwd_time=[1.0] * 5,
        fwd_tmp=[0] * 5,
        bwd_tmp=[0, 0, 0, 0, 20],
        bandwidth=19 / 1.5,
        offloadable=[0, 19, 0, 0, 0],
    )
    data.update(changes)
    return Chain(**data)


def test_a_copy_spans_two_forwards_and_its_prefetch_two_backwards():
    """By hand at 28 B: with stage 1's part held, B 4 needs 48 B; away, 28 B. The offload runs over Fe 2 and Fe 3
    (2 s), the prefetch over B 3 and B 2 (2 s): nothing waits, 10 s, the no-recompute time (recomputing only:
    11 s). Before debts, a copy had to end within Fe 2 and come back within B 2."""
    chain = five_stages()
    result = plan(chain, 28)
    assert labels(result.ops) == [
        *["Fe 0", "Fe 1", "OffloadSaved 1", "Fe 2", "Fe 3", "Fe 4", "Loss"],
        *["B 4", "PrefetchSaved 1", "B 3", "B 2", "B 1", "B 0"],
    ]
    sim = simulate(chain, result.ops)
    assert result.time == 10.0 and sim.wait == 0.0 and result.recompute_only_time == 11.0
    assert result.peak == 28 and sim.host_peak == 19
    cost, ops = solve_discretized(chain, 28, 28)
    assert solve(discretize(chain, 28, slots=28)) == (cost, ops)


def test_memory_forces_a_wait_when_it_costs_less_than_recomputing():
    """Forwards of stages 2 and 3 take 0.25 s each and the copy 1 s: the loss (B 3's 20 B of transients after it)
    only fits once the part has left, so compute waits 0.5 s there: 11 s against 11.5 s recomputing stage 1."""
    chain = five_stages(
        out_size=[1] * 4,
        saved_size=[1, 20, 1, 1],
        fwd_time=[1.0, 1.0, 0.25, 0.25],
        bwd_time=[2.0] * 4,
        fwd_tmp=[0] * 4,
        bwd_tmp=[0, 0, 0, 20],
        bandwidth=19.0,
        offloadable=[0, 19, 0, 0],
    )
    result = plan(chain, 27)
    assert labels(result.ops) == [
        *["Fe 0", "Fe 1", "OffloadSaved 1", "Fe 2", "Fe 3", "WaitSaved 1", "Loss"],
        *["B 3", "PrefetchSaved 1", "B 2", "B 1", "B 0"],
    ]
    sim = simulate(chain, result.ops)
    assert sim.wait == 0.5 and result.time == 11.0 and result.recompute_only_time == 11.5 and result.peak == 27


def loss_bound_chain() -> Chain:
    """One stage saving 12 B (8 may move), a_1 of 4 B, a loss of 6 B of transients on a recorded a_1. Recomputing
    only, the floor is 22 B: either the loss runs beside the graph (12 + 4 + 6) or the graph is recorded beside
    δ_1 (4 + 12 + 6). With the part away during the loss it is 18 B (Fe 0: 12 + 6; B 0: 12 + 4 + 2)."""
    return Chain(
        input_size=0,
        out_size=[4],
        saved_size=[12],
        fwd_time=[1.0],
        bwd_time=[2.0],
        fwd_tmp=[6],
        bwd_tmp=[2],
        loss_tmp=6,
        bandwidth=8.0,
        offloadable=[8],
    )


def test_the_floor_is_lower_where_a_held_part_is_idle_long_enough_to_move():
    chain = loss_bound_chain()
    assert min_feasible_budget(chain, bandwidth=0) == 22 and min_feasible_budget(chain) == 18
    assert min_feasible_budget(chain, bandwidth=8.0) == 18 and reference_min_budget(chain, offload=True) == 18
    result = plan(chain, 18)
    assert labels(result.ops) == ["Fe 0", "OffloadSaved 0", "WaitSaved 0", "Loss", "PrefetchSaved 0", "B 0"]
    sim = simulate(chain, result.ops)
    assert result.peak == sim.peak == 18 and sim.wait == 2.0  # 1 s to move 8 B away, 1 s to bring them back
    assert result.recompute_only_time is None  # nothing fits without moving
    with pytest.raises(InfeasibleBudget, match="use mem_limit >= 18"):
        plan(chain, 17)
    with pytest.raises(InfeasibleBudget, match="use mem_limit >= 22"):
        plan(chain, 18, bandwidth=0)


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chain=saved_chains(), slots=st.sampled_from([8, 40, 500]), above=st.sampled_from([0, 1, 3]))
def test_planning_at_the_floor_with_offloading_succeeds_within_budget(chain, slots, above):
    """The C++ floor equals the reference's, and plan() at it (or just above: the slots' rounding may fail there,
    the exact-byte schedule then moves what it must) replays within the budget."""
    floor = min_feasible_budget(chain)
    assert floor == max(1, reference_min_budget(chain, offload=True))
    assert floor <= min_feasible_budget(chain, bandwidth=0)
    result = plan(chain, floor + above, slots=slots)
    assert simulate(chain, result.ops).peak <= floor + above


def tiny_chains():
    """Every chain of two stages on a small grid: sizes, saved bytes, which part moves, forward and loss times."""
    for a1, a2, extra0, extra1, moves, fwd, lt in itertools.product(
        [1, 4], [1, 4], [0, 8], [0, 8], [(0, 0), (1, 0), (0, 1), (1, 1)], [(1.0, 0.25), (0.25, 1.0)], [0, 6]
    ):
        saved = [a1 + extra0, a2 + extra1]
        yield Chain(
            input_size=1,
            out_size=[a1, a2],
            saved_size=saved,
            fwd_time=list(fwd),
            bwd_time=[1.0, 2.0],
            fwd_tmp=[0, 2],
            bwd_tmp=[2, 0],
            loss_tmp=lt,
            bandwidth=4.0,
            offloadable=[extra0 * moves[0], extra1 * moves[1]],
        )


@pytest.mark.slow
def test_cpp_equals_reference_on_every_tiny_chain_at_every_budget():
    """Exhaustive on a grid of two-stage chains (256), every budget from below the floor to the no-recompute peak,
    in exact bytes: the same cost and ops, and each plan replays within its budget."""
    planned = 0
    for chain in tiny_chains():
        for budget in range(max(1, reference_min_budget(chain, offload=True) - 1), no_recompute_peak(chain) + 1):
            d = discretize(chain, budget, slots=budget)
            expected = solve(d)
            assert solve_discretized(chain, budget, budget) == expected
            if expected is not None:
                planned += 1
                assert simulate(chain, expected[1]).peak <= budget
    assert planned > 1000
