"""The floor under a host limit: `min_feasible_budget` of a chain that offloads with a `host_limit` names a budget
`plan()` succeeds at, and `plan()` refuses a budget below it naming the same floor (docs/planner.md, "Debts")."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_offload_debts import loss_bound_chain
from test_offload_planner import saved_chains

from lightning_rotor.chain import Chain
from lightning_rotor.planner import InfeasibleBudget, min_feasible_budget, plan
from lightning_rotor.simulate import simulate


def refused_floor(chain: Chain, budget: int, **kwargs) -> int | None:
    """The floor `plan()`'s refusal names at `budget`, None when it plans."""
    try:
        plan(chain, budget, **kwargs)
    except InfeasibleBudget as refusal:
        return refusal.min_feasible
    return None


def test_a_host_limit_too_small_for_the_moved_part_gives_recompute_only_floor():
    """Moving stage 0's 8 B lowers the floor from 22 B to 18 B; with 4 B of host memory it cannot move."""
    chain = loss_bound_chain()
    assert min_feasible_budget(chain.with_transfer(None, 8)) == 18
    small = chain.with_transfer(None, 4)
    assert min_feasible_budget(small) == 22
    assert refused_floor(chain, 18, host_limit=4) == 22
    result = plan(chain, 22, host_limit=4)
    assert result.host_peak == 0 and result.peak <= 22


def two_parts_chain() -> Chain:
    """Two stages saving 7 B (6 may move) and 29 B (all may move), a loss of 30 B: moving freely the floor is
    116 B (both parts away during the loss), 120 B with stage 1's part alone, recomputing only 127 B."""
    return Chain(
        input_size=49,
        out_size=[7, 24],
        saved_size=[7, 29],
        fwd_time=[0.0, 3.0],
        bwd_time=[1.0, 0.25],
        fwd_tmp=[0, 0],
        bwd_tmp=[4, 4],
        loss_tmp=30,
        bandwidth=60.0,
        offloadable=[6, 29],
    )


def test_the_floor_is_that_of_the_parts_the_host_limit_holds():
    chain = two_parts_chain()
    assert (min_feasible_budget(chain), min_feasible_budget(chain, bandwidth=0)) == (116, 127)
    floors = [min_feasible_budget(chain.with_transfer(None, limit)) for limit in (28, 29, 34, 35)]
    assert floors == [127, 120, 120, 116]
    result = plan(chain, 120, host_limit=29)
    assert [op.label for op in result.ops if op.label.startswith("Offload")] == ["OffloadSaved 1"]
    assert result.host_peak == 29 and result.peak <= 120
    assert refused_floor(chain, 119, host_limit=29) == 120


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
@given(chain=saved_chains(max_length=6), share=st.floats(0, 1), slots=st.sampled_from([8, 500]))
def test_plan_succeeds_at_the_stated_floor_and_refuses_below_naming_it(chain, share, slots):
    """Whatever the host limit: at the floor `min_feasible_budget` states, `plan()` finds a schedule within the
    budget and the host limit; one byte below, it plans (a schedule the bisection skipped) or its refusal names
    that floor."""
    limited = chain.with_transfer(None, int(share * (sum(chain.offloadable) + sum(chain.sizes))))
    floor = min_feasible_budget(limited)
    result = plan(limited, floor, slots=slots)
    sim = simulate(limited, result.ops)  # raises past the host limit
    assert sim.peak <= floor and sim.host_peak == result.host_peak
    if floor > 1:
        assert refused_floor(limited, floor - 1, slots=slots) in (None, floor)
