"""Wide debt runs (issue 28): every recorded stage of a run may move its saved part, the copies queued on the one
channel, each prefetch issued ahead of its backward (docs/planner.md, "Wide runs")."""

import random

import pytest
import reference_planner
from reference_planner import solve
from test_offload_planner import small_offload_chain

from lightning_rotor.chain import Chain
from lightning_rotor.discretize import discretize
from lightning_rotor.planner import min_feasible_budget, plan, solve_discretized
from lightning_rotor.simulate import no_recompute_peak, simulate


def two_big_parts() -> Chain:
    """Stages 1 and 2 save 20 B each (19 may move), B 5 needs 40 B of transients; forwards and backwards 1 s; a
    part's copy takes 1.4 s: longer than one forward, so stage 1's copy is still running when stage 2's is issued."""
    return Chain(
        input_size=1,
        out_size=[1] * 6,
        saved_size=[1, 20, 20, 1, 1, 1],
        fwd_time=[1.0] * 6,
        bwd_time=[1.0] * 6,
        fwd_tmp=[0] * 6,
        bwd_tmp=[0, 0, 0, 0, 0, 40],
        bandwidth=19 / 1.4,
        offloadable=[0, 19, 19, 0, 0, 0],
    )


def test_a_run_moves_two_parts_queued_and_brings_them_back_ahead_of_their_backwards():
    """By hand at 51 B: B 5 fits only with both parts away. Stage 1's copy runs over Fe 2 and Fe 3 (to 1.4 s after
    Fe 1), stage 2's queues behind it (to 2.8 s, before Fe 5 starts at 3 s); back, stage 2's part is issued before
    B 4 and stage 1's before B 3, each arriving before its backward: nothing waits, 12 s, the no-recompute time.
    A run moving one part keeps stage 2's on the device (recomputing only, or moving one part: 13-14 s)."""
    chain = two_big_parts()
    result = plan(chain, 51)
    assert [op.label for op in result.ops] == [
        *["Fe 0", "Fe 1", "OffloadSaved 1", "Fe 2", "OffloadSaved 2", "Fe 3", "Fe 4", "Fe 5", "Loss", "B 5"],
        *["PrefetchSaved 2", "B 4", "PrefetchSaved 1", "B 3", "B 2", "B 1", "B 0"],
    ]
    sim = simulate(chain, result.ops)
    assert result.time == 12.0 and sim.wait == 0.0 and result.recompute_only_time == 14.0
    assert result.peak == sim.peak <= 51 and sim.host_peak == 38
    assert solve_discretized(chain, 51, 51) == solve(discretize(chain, 51, slots=51))


def wide_chain(rng: random.Random) -> Chain:
    """`small_offload_chain` whose stages save much beyond their output, most of it movable."""
    chain = small_offload_chain(rng)
    saved = [o + rng.choice([5, 20, 40]) for o in chain.out_size]
    offloadable = [max(0, s - o - rng.choice([0, 2])) for s, o in zip(saved, chain.out_size, strict=True)]
    return Chain(**{**chain.__dict__, "saved_size": saved, "offloadable": offloadable})


@pytest.mark.slow
def test_cpp_equals_reference_where_wide_runs_pay(monkeypatch):
    """At every third budget from the floor to the no-recompute peak, in exact bytes: the same cost and ops, within
    budget at the program's time; and the wide runs are exercised (the cost falls below runs moving one part)."""
    rng = random.Random(5)
    wider = 0
    for _ in range(40):
        chain = wide_chain(rng)
        for budget in range(min_feasible_budget(chain), no_recompute_peak(chain) + 1, 3):
            d = discretize(chain, budget, slots=budget)
            got = solve_discretized(chain, budget, budget)
            assert got is not None and got == solve(d)
            sim = simulate(chain, got[1])
            assert sim.peak <= budget
            assert abs(sim.time - d.cost_to_time(got[0])) <= 2 * (len(got[1]) + 1) * d.tick + 1e-12 * sim.time
            with monkeypatch.context() as m:
                m.setattr(reference_planner, "WIDE_RUN", 1)  # runs moving stage s's part only
                narrow = solve(d)
            assert narrow is not None and got[0] <= narrow[0]
            wider += got[0] < narrow[0]
    assert wider >= 40
