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


def partly_movable_chain() -> Chain:
    """Six stages (found by hypothesis): moving freely the floor is 258 B, recomputing only 267 B; within 133 B
    of host memory the exact-byte schedule fits from 261 B."""
    return Chain(
        input_size=45,
        out_size=[7, 31, 7, 33, 58, 18],
        saved_size=[47, 48, 12, 33, 98, 18],
        fwd_time=[1.5, 3.0, 0.0, 1.0, 3.0, 3.0],
        bwd_time=[0.0, 0.1, 7.0, 0.0, 1.5, 0.25],
        fwd_tmp=[0, 0, 0, 20, 0, 20],
        bwd_tmp=[25, 0, 4, 25, 0, 0],
        loss_tmp=6,
        bandwidth=6.0,
        offloadable=[23, 43, 10, 16, 98, 0],
    )


def test_a_host_limit_between_gives_a_floor_between():
    chain = partly_movable_chain()
    assert (min_feasible_budget(chain), min_feasible_budget(chain, bandwidth=0)) == (258, 267)
    limited = chain.with_transfer(None, 133)
    assert min_feasible_budget(limited) == 261
    result = plan(limited, 261)
    assert simulate(limited, result.ops).peak <= 261 and 0 < result.host_peak <= 133
    assert refused_floor(limited, 260) == 261


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
@given(chain=saved_chains(max_length=6), share=st.floats(0, 1), slots=st.sampled_from([8, 500]))
def test_plan_succeeds_at_the_stated_floor_and_refuses_below_naming_it(chain, share, slots):
    """Whatever the host limit: at the floor `min_feasible_budget` states, `plan()` finds a schedule within the
    budget and the host limit; one byte below, its refusal names that floor."""
    limited = chain.with_transfer(None, int(share * (sum(chain.offloadable) + sum(chain.sizes))))
    floor = min_feasible_budget(limited)
    result = plan(limited, floor, slots=slots)
    sim = simulate(limited, result.ops)  # raises past the host limit
    assert sim.peak <= floor and sim.host_peak == result.host_peak
    if floor > 1:
        assert refused_floor(limited, floor - 1, slots=slots) == floor
