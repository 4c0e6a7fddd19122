"""Planner with offloading (chain version 6): the C++ program equals the reference on the offload family, its plans
replay within budget at the time it predicts, and plan() is never slower than recomputing only."""

import json
import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference_planner import reference_min_budget, reference_plan, solve
from test_options import chains_with_options
from test_planner import chains, medium_chain

from lightning_rotor.chain import Chain, StageOption
from lightning_rotor.discretize import discretize
from lightning_rotor.ops import OpKind
from lightning_rotor.planner import Plan, min_feasible_budget, plan, solve_discretized
from lightning_rotor.simulate import no_recompute_peak, simulate

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def transfers(ops):
    return [op for op in ops if OpKind(op[0]).is_transfer]


@st.composite
def offload_chains(draw, max_length=7):
    """Small random chains (sizes 0-60 B) whose forwards mostly take time (a copy hides only behind forwards),
    with a bandwidth at which copies take from a fraction of a stage to several stages."""
    chain = draw(chains(max_length=max_length))
    length = chain.length
    fwd = draw(st.lists(st.sampled_from([0.0, 0.25, 1.0, 1.5, 3.0]), min_size=length, max_size=length))
    chain = Chain(**{**chain.__dict__, "fwd_time": fwd})
    return chain.with_transfer(draw(st.sampled_from([6.0, 20.0, 60.0, 500.0])))


def assert_cpp_is_reference(chain: Chain, budget: int, got, expected) -> None:
    """The C++ planner's cost and ops are the reference planner's at every budget, below the floor included (both
    plan nothing there: the floors agree, `test_the_floor_is_the_least_budget_the_reference_plans`)."""
    assert got == (None if expected is None else (expected[0], expected[1]))


@pytest.mark.slow
@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chain=offload_chains(), where=st.floats(0, 1.2), slots=st.sampled_from([3, 8, 40, 500]))
def test_cpp_equals_reference_with_offloading(chain, where, slots):
    """Same integer problem in, same optimal cost and the same ops out, transfers included."""
    low, high = reference_min_budget(chain), no_recompute_peak(chain)
    budget = max(1, int(low - 3 + where * (high - low + 6)))
    d = discretize(chain, budget, slots=slots)
    assert d.transfer_cost and len(d.transfer_cost) == chain.length + 1
    expected = solve(d)
    got = solve_discretized(chain, budget, slots)
    assert_cpp_is_reference(chain, budget, got, expected)


@pytest.mark.slow
@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chain=offload_chains(), where=st.floats(0, 1.2), slots=st.sampled_from([8, 40, 500]))
def test_offload_plans_replay_within_budget_at_the_predicted_time(chain, where, slots):
    """Every plan of the offload program replays in the simulator: within its budget, and its time is the
    program's cost within the ticks' rounding (each op's time rounded to the nearest tick, a copy up)."""
    low, high = min_feasible_budget(chain), no_recompute_peak(chain)
    budget = max(1, int(low + where * (high - low)))
    got = solve_discretized(chain, budget, slots)
    if got is None:
        return
    d = discretize(chain, budget, slots=slots)
    sim = simulate(chain, got[1])
    assert sim.peak <= budget
    predicted = d.cost_to_time(got[0])
    assert abs(sim.time - predicted) <= 2 * (len(got[1]) + 1) * d.tick + 1e-12 * max(1.0, sim.time)
    # without offloading the same budget costs as much or more (or is below recompute-only's floor)
    alone = solve_discretized(chain.with_transfer(0.0), budget, slots)
    assert alone is not None or budget < min_feasible_budget(chain, bandwidth=0) + 3 * d.unit
    if alone is not None:
        assert sim.time <= simulate(chain, alone[1]).time + 2 * (len(got[1]) + len(alone[1])) * d.tick


def offloading_chain() -> Chain:
    """Five stages of 1 s forward, 2 s backward; a_5 and the last two graphs are large, the checkpoints tiny."""
    return Chain(
        input_size=1,
        out_size=[1, 1, 1, 1, 10],
        saved_size=[11, 11, 1, 1, 10],
        fwd_time=[1.0] * 5,
        bwd_time=[2.0] * 5,
        fwd_tmp=[0] * 5,
        bwd_tmp=[0] * 5,
        bandwidth=40.0,
    )


BUDGET = 24  # B 4 peaks at a_0 + a_3 + ā_4 + ā_5 + δ_5 + δ_4 = 1 + 1 + 1 + 10 + 10 + 1: no room for a_1 too


def test_offloading_a_checkpoint_saves_a_recomputation():
    """By hand: with a_1 kept, B 4 would peak at 25 > 24, so without offloading a_1 is recomputed from a_0 (19 s).
    Offloaded during Fn 2 (its copy takes 0.025 s of that 1 s forward), it is prefetched during B 3 (2 s): 18 s."""
    chain = offloading_chain()
    result = plan(chain, BUDGET)
    expected = "Fc 0, Fc 1, Offload 1, Fn 2, Fe 3, Fe 4, Loss, B 4, Prefetch 1, B 3, Fe 1, Fe 2, B 2, B 1, Fe 0, B 0"
    assert [op.label for op in result.ops] == expected.split(", ")
    assert result.time == 18.0 and result.recompute_only_time == 19.0 and result.peak == BUDGET
    assert result.host_peak == 1 and simulate(chain, result.ops).wait == 0.0
    assert plan(chain, BUDGET, bandwidth=0).time == 19.0
    assert plan(chain, BUDGET, host_limit=0).time == 19.0  # no host memory: the offloading plan is refused
    # a channel too slow to hide the copy behind Fn 2 (2 s for one byte): no offloading
    assert not transfers(plan(chain, BUDGET, bandwidth=0.5).ops)


def test_a_prefetch_longer_than_its_backward_stalls_the_left_part():
    """With B 3 taking 0.25 s and the copy 0.5 s (2 B/s), Fe 1 waits 0.25 s for a_1: 16.5 s against 17.25 s
    recomputing a_1; the program counts the stall as the simulator does."""
    chain = Chain(**{**offloading_chain().__dict__, "bwd_time": [2.0, 2.0, 2.0, 0.25, 2.0], "bandwidth": 2.0})
    result = plan(chain, BUDGET)
    assert transfers(result.ops) == [("Offload", 1), ("Prefetch", 1)]
    assert simulate(chain, result.ops).wait == 0.25
    assert result.time == 16.5 and result.recompute_only_time == 17.25
    d = discretize(chain, BUDGET, slots=BUDGET)
    cost, ops = solve_discretized(chain, BUDGET, BUDGET)
    assert ops == result.ops and solve(d) == (cost, ops)
    assert abs(d.cost_to_time(cost) - 16.5) <= 20 * d.tick


def example_chains():
    """The project's example chains, and a chain built like the planner tests build theirs.

    Their times: gpt_tiny_sac_options.json is a one-thread CPU profile (benchmarks/options_profile.py); the
    other three record no device or profiling run (docs/planner.md, "Saved parts of recorded stages")."""
    found = {path.stem: Chain.load(path) for path in sorted(EXAMPLES.glob("*.json"))}
    found["medium"] = medium_chain()
    found["medium_frozen"] = Chain(**{**medium_chain().__dict__, "frozen": 3})  # plans start Fn 0, Fn 1, Fn 2
    return found


EXAMPLE_CHAINS = example_chains()


def zoo_gpt_chain() -> Chain:
    """The benchmark zoo's GPT at tiny size on the CPU, profiled as tests/test_zoo.py profiles it."""
    import torch

    from lightning_rotor.bench.workload import load_workload
    from lightning_rotor.profile import profile_chain

    w = load_workload("gpt", batch_size=8, size="tiny", device=torch.device("cpu"))
    return profile_chain(
        w.stages, w.x, names=w.stage_names, repeats=1, warmup=0, loss_tmp=lambda out: w.loss(out, w.y)
    ).chain


@pytest.mark.slow
@pytest.mark.parametrize("name", [*sorted(EXAMPLE_CHAINS), "zoo_gpt"])
def test_offloading_is_never_slower_than_recomputing_only(name):
    """At 12 and 25 GB/s and budgets from 30% to 90% of the no-recompute peak: the plan is valid and within its
    budget by the simulator, never slower than the plan without offloading, which is exactly today's plan."""
    chain = zoo_gpt_chain() if name == "zoo_gpt" else EXAMPLE_CHAINS[name]
    peak, low = no_recompute_peak(chain), min_feasible_budget(chain)
    budgets = sorted({max(low, int(f / 100 * peak)) for f in range(30, 91, 10)})
    for budget in budgets:
        today = plan(chain, budget)
        assert today.recompute_only_time is None and today.bandwidth == 0.0 and today.host_peak == 0
        for bandwidth in (12e9, 25e9):
            result = plan(chain, budget, bandwidth=bandwidth)
            sim = simulate(chain.with_transfer(bandwidth), result.ops)
            assert sim.peak == result.peak <= budget == result.budget
            assert sim.time == result.time and sim.host_peak == result.host_peak
            assert result.bandwidth == bandwidth
            assert result.recompute_only_time == today.time
            assert result.time <= today.time
            if not transfers(result.ops):
                assert result.ops == today.ops


def offload_wins(chain, bandwidths=(12e9, 25e9)):
    """(budget fraction, bandwidth, time with offloading / time without) wherever offloading is strictly faster."""
    peak, low = no_recompute_peak(chain), min_feasible_budget(chain)
    wins = []
    for f in range(30, 91, 5):
        budget = max(low, int(f / 100 * peak))
        for bandwidth in bandwidths:
            result = plan(chain, budget, bandwidth=bandwidth)
            if result.time < result.recompute_only_time:
                wins.append((f, bandwidth, result.time / result.recompute_only_time))
    return wins


@pytest.mark.slow
def test_offloading_wins_on_resnet50():
    """On a realistic chain offloading is strictly faster at some budget (it must pay for itself somewhere)."""
    wins = offload_wins(EXAMPLE_CHAINS["resnet50_b32"])
    assert wins and all(ratio < 1 for _, _, ratio in wins)


def test_bandwidth_zero_is_no_offloading():
    """bandwidth 0 (or None on a chain without one) plans exactly as without offloading: the same Plan."""
    chain = medium_chain()
    for fraction in (0.3, 0.5, 0.8):
        today = plan(chain, fraction)
        assert plan(chain, fraction, bandwidth=0) == today == plan(chain, fraction, bandwidth=None)
        assert plan(chain.with_transfer(12e9), fraction, bandwidth=0.0) == today
        assert "bandwidth" not in today.to_dict()
    assert min_feasible_budget(chain, bandwidth=12e9) == min_feasible_budget(chain)


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf, True, "12GB/s"])
def test_bad_bandwidth_is_one_line(bad):
    chain = medium_chain()
    for call in (lambda: plan(chain, 0.5, bandwidth=bad), lambda: min_feasible_budget(chain, bandwidth=bad)):
        with pytest.raises(ValueError, match=r"bandwidth must be a finite number of bytes per second >= 0") as err:
            call()
        assert "\n" not in str(err.value)


def test_plan_json_round_trip_with_offloading():
    chain = offloading_chain()
    result = plan(chain, BUDGET)
    assert transfers(result.ops) and result.host_peak > 0 and result.recompute_only_time > result.time
    data = json.loads(json.dumps(result.to_dict()))
    assert data["bandwidth"] == chain.bandwidth and data["host_peak"] == result.host_peak
    assert Plan.from_dict(data) == result
    old = {k: v for k, v in data.items() if k not in ("bandwidth", "host_peak", "recompute_only_time")}
    assert Plan.from_dict(old).bandwidth == 0.0 and Plan.from_dict(old).recompute_only_time is None


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chain=offload_chains(max_length=12), where=st.floats(0, 1), threads=st.sampled_from([2, 3, 8]))
def test_threads_change_nothing_with_offloading(chain, where, threads):
    """Both table flavours of a subproblem are filled at the same visit, so threads give bit-identical results."""
    low, high = min_feasible_budget(chain), no_recompute_peak(chain)
    budget = max(1, int(low + where * (high - low)))
    assert solve_discretized(chain, budget, 40, threads) == solve_discretized(chain, budget, 40, 1)


def small_offload_chain(rng) -> Chain:
    """4-6 stages whose checkpoints weigh about what recorded stages do, with B often shorter than a copy."""
    length = rng.randint(4, 6)
    out = [rng.choice([1, 3, 10, 10, 40]) for _ in range(length)]
    return Chain(
        input_size=rng.choice([1, 10]),
        out_size=out,
        saved_size=[max(0, o + rng.choice([-5, 0, 5, 10])) for o in out],  # some outputs partly views
        fwd_time=[rng.choice([0.5, 1.0, 2.0]) for _ in range(length)],
        bwd_time=[rng.choice([0.25, 0.5, 2.0]) for _ in range(length)],
        fwd_tmp=[rng.choice([0, 2]) for _ in range(length)],
        bwd_tmp=[rng.choice([0, 3, 20, 40]) for _ in range(length)],
        loss_value=rng.choice([0, 2]),
        bandwidth=rng.choice([8.0, 20.0, 100.0]),
    )


@pytest.mark.slow
def test_cpp_equals_reference_where_offloading_pays():
    """Chains where offloading often wins (random chains rarely offload): at every other budget from the floor to
    the no-recompute peak, in exact bytes, the same cost and ops, and the plan replays within budget."""
    import random

    rng = random.Random(7)
    offloading = 0
    for _ in range(250):
        chain = small_offload_chain(rng)
        for budget in range(min_feasible_budget(chain), no_recompute_peak(chain) + 1, 2):
            got = solve_discretized(chain, budget, budget)
            assert got is not None and got == solve(discretize(chain, budget, slots=budget))
            assert simulate(chain, got[1]).peak <= budget
            offloading += bool(transfers(got[1]))
    assert offloading >= 20  # the family is exercised, not just today's choices


@pytest.mark.slow
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    chain=chains_with_options(),
    bandwidth=st.sampled_from([6.0, 20.0, 500.0]),
    where=st.floats(0, 1.2),
    slots=st.sampled_from([8, 40, 500]),
)
def test_cpp_equals_reference_with_options_and_offloading(chain, bandwidth, where, slots):
    """Stage options (Fs) and offloading together: the same cost and ops; no offload ends before a B of a stage
    with options (its time would depend on the option that recorded it); the plan replays within budget."""
    chain = chain.with_transfer(bandwidth)
    low, high = reference_min_budget(chain), no_recompute_peak(chain)
    budget = max(1, int(low - 3 + where * (high - low + 6)))
    expected = solve(discretize(chain, budget, slots=slots))
    got = solve_discretized(chain, budget, slots)
    assert_cpp_is_reference(chain, budget, got, expected)
    if got is not None:
        ops = list(got[1])
        for i, op in enumerate(ops):
            if op[0] == "Prefetch":
                assert ops[i + 1][0] == "B" and not chain.options[ops[i + 1][1]]
        assert simulate(chain, ops).peak <= budget


# --- saved parts (chain version 6, `offloadable`): a recorded stage's saved bytes move to host memory ---


def saved_part_chain(**changes) -> Chain:
    """Four stages; stage 1 saves 20 B (19 offloadable), B 3 needs 20 B of transients: with stage 1's graph held
    through B 3 the step peaks at 46 B, with it on the host at 27 B."""
    data = dict(
        input_size=1,
        out_size=[1, 1, 1, 1],
        saved_size=[1, 20, 1, 1],
        fwd_time=[1.0] * 4,
        bwd_time=[2.0] * 4,
        fwd_tmp=[0] * 4,
        bwd_tmp=[0, 0, 0, 20],
        bandwidth=38.0,  # 19 B in 0.5 s, within Fe 2's 1 s
        offloadable=[0, 19, 0, 0],
    )
    data.update(changes)
    return Chain(**data)


SAVED_OPS = "Fe 0, Fe 1, OffloadSaved 1, Fe 2, Fe 3, Loss, B 3, PrefetchSaved 1, B 2, B 1, B 0".split(", ")


def test_offloading_a_saved_part_saves_a_recomputation():
    """By hand: at 27 B, recomputing only costs 13 s (stage 0 or 1 forward twice); with stage 1's saved part on the
    host from Fe 2 to B 2, nothing is recomputed: 12 s. Fe 2, the first op of (2, 4), runs with the part still on the
    device (1 + 1 + 20 + 1 = 23 B): only it and B 2 must fit without the part's bytes, so 27 B suffice."""
    chain = saved_part_chain()
    result = plan(chain, 27)
    assert [op.label for op in result.ops] == SAVED_OPS
    assert result.time == 12.0 and result.recompute_only_time == 13.0 and result.peak == 27
    sim = simulate(chain, result.ops)
    assert sim.op_peaks[3] == 23 and sim.op_peaks[6] == 27 and sim.wait == 0.0 and sim.host_peak == 19
    assert not transfers(plan(chain, 26).ops)  # B 3 then needs 1 + 5 + 21 = 27 B
    cost, ops = solve_discretized(chain, 27, 27)
    assert [tuple(op) for op in ops] == [tuple(op) for op in result.ops]
    assert solve(discretize(chain, 27, slots=27)) == (cost, ops)


def test_a_saved_prefetch_longer_than_b_next_stalls_b():
    """The copy takes 1 s (19 B/s), hidden by Fe 2 (1.5 s) but not by B 2 (0.5 s): B 1 waits 0.5 s. 11.5 s against
    12 s recomputing; the program counts the stall as the simulator does."""
    chain = saved_part_chain(fwd_time=[1.0, 1.0, 1.5, 1.0], bwd_time=[2.0, 2.0, 0.5, 2.0], bandwidth=19.0)
    result = plan(chain, 27)
    assert [op.label for op in result.ops] == SAVED_OPS
    assert simulate(chain, result.ops).wait == 0.5
    assert result.time == 11.5 and result.recompute_only_time == 12.0
    d = discretize(chain, 27, slots=27)
    cost, ops = solve_discretized(chain, 27, 27)
    assert solve(d) == (cost, ops) and abs(d.cost_to_time(cost) - 11.5) <= 20 * d.tick


def test_saved_parts_move_only_when_allowed():
    chain = saved_part_chain()
    assert plan(chain, 27, bandwidth=0).time == 13.0  # no channel
    assert plan(chain, 27, host_limit=18).time == 13.0  # 19 B do not fit on the host
    # a 1 s copy does not surely end within Fe 2; Fe 2 and Fe 3 hide it (a debt run, docs/planner.md "Debts")
    slow = plan(saved_part_chain(bandwidth=19.0), 27)
    assert slow.time == 12.0 and [op.label for op in slow.ops if op.kind is not OpKind.WAIT_SAVED] == SAVED_OPS
    staged = saved_part_chain(
        options=[[], [], [StageOption(saved_size=1, fwd_time=1.0, bwd_time=9.0, fwd_tmp=0, bwd_tmp=0)], []]
    )
    # the variant ending within Fe 2 needs B 2's time, which depends on the option; a debt run records stage 2 by Fe
    assert [op.label for op in plan(staged, 27).ops if op.kind is not OpKind.WAIT_SAVED] == SAVED_OPS
    # every offloadable 0: exactly the plans and costs of value offloading alone
    zero = saved_part_chain(offloadable=[0] * 4)
    assert discretize(zero, 27).saved_transfer_cost == [] and discretize(zero, 27).offloadable == []
    # without a channel, offloadable changes nothing
    for budget in range(25, 47):
        alone = saved_part_chain(bandwidth=0.0)
        assert solve_discretized(alone, budget, 40) == solve_discretized(zero.with_transfer(0.0), budget, 40)
        assert discretize(alone, budget).tick == discretize(zero.with_transfer(0.0), budget).tick


@st.composite
def saved_chains(draw, max_length=7):
    """`offload_chains` whose stages may move part of what they save: none, some or all of it."""
    chain = draw(offload_chains(max_length=max_length))
    shares = draw(st.lists(st.sampled_from([0, 0, 0.5, 0.9, 1]), min_size=chain.length, max_size=chain.length))
    offloadable = [int(f * s) for f, s in zip(shares, chain.saved_size, strict=True)]
    return Chain(**{**chain.__dict__, "offloadable": offloadable})


@pytest.mark.slow
@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chain=saved_chains(), where=st.floats(0, 1.2), slots=st.sampled_from([3, 8, 40, 500]))
def test_cpp_equals_reference_with_saved_parts(chain, where, slots):
    """Saved parts and values offloaded, in both table flavours: the same optimal cost and the same ops."""
    low, high = reference_min_budget(chain), no_recompute_peak(chain)
    budget = max(1, int(low - 3 + where * (high - low + 6)))
    d = discretize(chain, budget, slots=slots)
    assert bool(d.saved_transfer_cost) == any(chain.offloadable)
    expected = solve(d)
    got = solve_discretized(chain, budget, slots)
    assert_cpp_is_reference(chain, budget, got, expected)


@pytest.mark.slow
@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chain=saved_chains(), where=st.floats(0, 1.2), slots=st.sampled_from([8, 40, 500]))
def test_saved_part_plans_replay_within_budget_at_the_predicted_time(chain, where, slots):
    """Every plan replays within its budget at the program's time (within the ticks' rounding); each saved part
    moves in the planner's shape; plan() is never slower than recomputing only."""
    low, high = min_feasible_budget(chain), no_recompute_peak(chain)
    budget = max(1, int(low + where * (high - low)))
    got = solve_discretized(chain, budget, slots)
    if got is None:
        return
    d = discretize(chain, budget, slots=slots)
    ops = list(got[1])
    sim = simulate(chain, ops)
    assert sim.peak <= budget
    assert abs(sim.time - d.cost_to_time(got[0])) <= 2 * (len(ops) + 1) * d.tick + 1e-12 * max(1.0, sim.time)
    for i, op in enumerate(ops):
        if op[0] == "OffloadSaved":  # Fe s, OffloadSaved s, … PrefetchSaved s, B …, B s (docs/planner.md, "Debts")
            assert ops[i - 1] == ("Fe", op[1])
            j = ops.index(("PrefetchSaved", op[1]))
            end = ops.index(("B", op[1]))
            # only backwards of later stages between them, and the prefetches of enclosing records or splits
            assert j < end and all(o[0] in ("B", "Prefetch", "PrefetchSaved") for o in ops[j + 1 : end])
    result = plan(chain, budget, slots=slots)
    assert result.peak <= budget
    assert result.recompute_only_time is None or result.time <= result.recompute_only_time
    assert result.recompute_only_time is not None or budget < min_feasible_budget(chain, bandwidth=0)


@pytest.mark.slow
def test_cpp_equals_reference_where_saved_parts_pay():
    """Chains whose stages save much beyond their output (saved parts often move): at every third budget from the
    floor to the no-recompute peak, in exact bytes, the same cost and ops, within budget, never slower."""
    import random

    rng = random.Random(3)
    moved = 0
    for _ in range(150):
        chain = small_offload_chain(rng)
        saved = [o + rng.choice([0, 5, 20, 40]) for o in chain.out_size]
        chain = Chain(
            **{
                **chain.__dict__,
                "saved_size": saved,
                "offloadable": [max(0, s - o - rng.choice([0, 2])) for s, o in zip(saved, chain.out_size, strict=True)],
            }
        )
        for budget in range(min_feasible_budget(chain), no_recompute_peak(chain) + 1, 3):
            got = solve_discretized(chain, budget, budget)
            assert got is not None and got == solve(discretize(chain, budget, slots=budget))
            assert simulate(chain, got[1]).peak <= budget
            moved += any(op[0] == "OffloadSaved" for op in got[1])
    assert moved >= 100  # the variant is exercised, not just today's choices


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chain=saved_chains(max_length=12), where=st.floats(0, 1), threads=st.sampled_from([2, 3, 8]))
def test_threads_change_nothing_with_saved_parts(chain, where, threads):
    low, high = min_feasible_budget(chain), no_recompute_peak(chain)
    budget = max(1, int(low + where * (high - low)))
    assert solve_discretized(chain, budget, 40, threads) == solve_discretized(chain, budget, 40, 1)


def test_the_program_refuses_inconsistent_saved_parts():
    """The C++ entry point checks what discretize hands it: a saved part within what the stage saves, and saved
    transfer costs only beside value transfer costs (both mean the channel exists)."""
    from lightning_rotor import _planner

    d = discretize(saved_part_chain(), 27, slots=27)
    args = (d.size, d.saved, d.fwd_tmp, d.fwd_tmp_nograd, d.bwd_tmp, d.loss_tmp, d.fwd_cost, d.bwd_cost, d.slots)
    common = dict(count_bits=d.count_bits, loss_tmp_graph=d.loss_tmp_graph, in_free=d.in_free)
    ok = _planner.solve(
        *args,
        **common,
        transfer_cost=d.transfer_cost,
        offloadable=d.offloadable,
        saved_transfer_cost=d.saved_transfer_cost,
    )
    assert ok is not None and ("OffloadSaved", 1) in ok[1]
    with pytest.raises(ValueError, match="saved transfer costs must be empty or one per stage"):
        _planner.solve(*args, **common, offloadable=d.offloadable, saved_transfer_cost=d.saved_transfer_cost)
    with pytest.raises(ValueError, match=r"offloadable\[1\] must be within 0..saved\[1\]"):
        _planner.solve(
            *args,
            **common,
            transfer_cost=d.transfer_cost,
            offloadable=[0, d.saved[1] + 1, 0, 0],
            saved_transfer_cost=d.saved_transfer_cost,
        )


def test_saved_parts_after_a_frozen_prefix():
    """The same chain behind one frozen stage: the suffix keeps its offloadable figures, the plan moves stage 2's
    saved part (stage 1 of the suffix) and replays within budget in the whole chain's indices."""
    base = saved_part_chain()
    chain = Chain(
        input_size=1,
        out_size=[1, *base.out_size],
        saved_size=[1, *base.saved_size],
        fwd_time=[1.0, *base.fwd_time],
        bwd_time=[2.0, *base.bwd_time],
        fwd_tmp=[0] * 5,
        bwd_tmp=[0, *base.bwd_tmp],
        bandwidth=38.0,
        offloadable=[0, *base.offloadable],
        frozen=1,
    )
    result = plan(chain, 28)  # one byte more than without the prefix: a_1 stays beside a_0
    shifted = [op if op == "Loss" else f"{op.split()[0]} {int(op.split()[1]) + 1}" for op in SAVED_OPS]
    assert [op.label for op in result.ops] == ["Fn 0", *shifted]
    assert result.time == 13.0 and result.recompute_only_time == 14.0
    assert simulate(chain, result.ops).peak == result.peak == 28


def part_back_before_the_next_backward_chain() -> Chain:
    """Hypothesis's chain (shrunk) where moving stage 1's part pays only if it comes back before `B 2`: `B 2` ends
    2 B above its own peak (`bwd_tmp[2] = -2`, nothing saved), so the state just before `B 1` (ā_2 whole, δ_2 and the
    35 B loss value: 43 B) is held between two ops and is no op's peak; a `PrefetchSaved 1` there peaks at it."""
    return Chain(
        input_size=0,
        out_size=[0, 4, 0, 0],
        saved_size=[0, 4, 0, 5],
        fwd_time=[0.0, 0.0, 0.25, 0.0],
        bwd_time=[0.0] * 4,
        fwd_tmp=[0, 0, 20, 0],
        bwd_tmp=[0, 0, -2, 0],
        fwd_tmp_nograd=[0, 0, 20, 0],
        out_free=[0, 2, 0, 0],
        loss_value=35,
        bandwidth=20.0,
        offloadable=[0, 2, 0, 0],
    )


PART_BACK_EARLY = "Fe 0, Fe 1, OffloadSaved 1, Fe 2, Fe 3, Loss, B 3, PrefetchSaved 1, B 2, B 1, B 0".split(", ")


def test_the_floor_counts_a_part_back_before_the_next_backward():
    """The floor's moved part was charged `PrefetchSaved 1` just before `B 1` (43 B); brought back before `B 2` it
    is not (42 B: `B 3` with the 35 B loss value). Both planners and the exact-byte walk now plan at 42 B, within it
    by the simulator, and nothing below."""
    from lightning_rotor import _planner
    from lightning_rotor.planner import _exact_extras, _memory_args, parse_ops

    chain = part_back_before_the_next_backward_chain()
    assert min_feasible_budget(chain) == reference_min_budget(chain, offload=True) == 42
    assert min_feasible_budget(chain, bandwidth=0) == 44
    result = plan(chain, 42)
    assert [op.label for op in result.ops] == PART_BACK_EARLY and simulate(chain, result.ops).peak == 42
    assert solve_discretized(chain, 42, 42) == solve(discretize(chain, 42, slots=42))
    assert solve_discretized(chain, 41, 41) is None and solve(discretize(chain, 41, slots=41)) is None
    walk = parse_ops(_planner.feasible_schedule(*_memory_args(chain), 42, **_exact_extras(chain, True)))
    assert [op.label for op in walk] == [*PART_BACK_EARLY[:3], "WaitSaved 1", *PART_BACK_EARLY[3:]]
    assert simulate(chain, walk).peak == 42


def test_the_floor_counts_a_part_back_two_backwards_later():
    """Hypothesis's chain where the part of stage 0 comes back before `B 2` (a run with d = 2): `B 1` ends 16 B above
    its own peak, so neither the state before `B 0` nor the one before `B 1` is an op's peak. 55 B, not 56."""
    from lightning_rotor import _planner
    from lightning_rotor.planner import _exact_extras, _memory_args, parse_ops

    chain = Chain(
        input_size=0,
        out_size=[31, 20, 5, 6, 0],
        saved_size=[31, 20, 5, 6, 0],
        fwd_time=[0.0] * 5,
        bwd_time=[0.0] * 5,
        fwd_tmp=[0] * 5,
        bwd_tmp=[0, -31, -10, 0, 0],
        out_free=[15, 10, 0, 0, 0],
        in_free=[0, 6, 10, 0, 0],
        bandwidth=6.0,
        offloadable=[15, 0, 0, 0, 0],
    )
    assert min_feasible_budget(chain) == reference_min_budget(chain, offload=True) == 55
    ops = "Fe 0, OffloadSaved 0, Fe 1, WaitSaved 0, Fe 2, Fe 3, Fe 4, Loss, B 4, B 3, PrefetchSaved 0, B 2, B 1, B 0"
    walk = parse_ops(_planner.feasible_schedule(*_memory_args(chain), 55, **_exact_extras(chain, True)))
    assert ", ".join(op.label for op in walk) == ops and simulate(chain, walk).peak == 55
    got = solve_discretized(chain, 55, 55)
    assert got == solve(discretize(chain, 55, slots=55)) and simulate(chain, got[1]).peak <= 55
    assert solve_discretized(chain, 54, 54) is None and solve(discretize(chain, 54, slots=54)) is None


def test_the_floor_counts_a_part_back_before_a_stage_with_options():
    """Stage 3 has an option, so the run records it with `Fe 3` before waiting, and stage 2's part comes back before
    `B 3` (the run j = 4, d = 1): `B 3` ends 1 B above its peak. Both planners plan at 6 B, recomputing only at 7."""
    option = StageOption(saved_size=0, fwd_time=0.0, bwd_time=0.0, fwd_tmp=0, bwd_tmp=0)
    chain = Chain(
        input_size=0,
        out_size=[0, 0, 3, 0, 2],
        saved_size=[0, 0, 3, 0, 2],
        fwd_time=[0.0] * 5,
        bwd_time=[0.0] * 5,
        fwd_tmp=[0, 0, 0, 3, 0],
        bwd_tmp=[0, 0, 0, -1, 0],
        fwd_tmp_nograd=[0, 0, 0, 3, 0],
        out_free=[0, 0, 1, 0, 0],
        loss_value=1,
        options=[[], [], [], [option], []],
        bandwidth=6.0,
        offloadable=[0, 0, 3, 0, 0],
    )
    assert min_feasible_budget(chain) == reference_min_budget(chain, offload=True) == 6
    assert min_feasible_budget(chain, bandwidth=0) == 7
    got = solve_discretized(chain, 6, 6)
    assert got == solve(discretize(chain, 6, slots=6)) and simulate(chain, got[1]).peak <= 6
    assert ("PrefetchSaved", 2) in got[1] and solve_discretized(chain, 5, 5) is None


def least_planned_budget(chain: Chain) -> int:
    """The least budget at which the reference DP plans (exact bytes), by bisection up to the no-recompute peak."""
    low, high = 1, max(1, no_recompute_peak(chain))
    while low < high:
        mid = (low + high) // 2
        if reference_plan(chain, mid, slots=None) is None:
            low = mid + 1
        else:
            high = mid
    return low


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chain=saved_chains(max_length=6))
def test_the_floor_is_the_least_budget_the_reference_plans(chain):
    """With values and saved parts moving: the floor of both planners is the least budget the reference DP plans, and
    the plans there (the reference's, the C++ program's, the exact-byte walk's) replay within it."""
    from lightning_rotor import _planner
    from lightning_rotor.planner import _exact_extras, _memory_args, parse_ops

    floor = min_feasible_budget(chain)
    assert floor == max(1, reference_min_budget(chain, offload=True)) == least_planned_budget(chain)
    expected = reference_plan(chain, floor, slots=None)
    assert expected is not None and solve_discretized(chain, floor, floor) == expected
    walk = parse_ops(_planner.feasible_schedule(*_memory_args(chain), floor, **_exact_extras(chain, True)))
    for ops in (expected[1], walk):
        assert simulate(chain, list(ops)).peak <= floor
