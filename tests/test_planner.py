"""Planner: optimal (same cost as the reference at the same precision), valid, within budget, exact minimum budget."""

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference_planner import reference_min_budget, reference_plan, solve

from lightning_rotor import _planner
from lightning_rotor.chain import Chain
from lightning_rotor.discretize import discretize
from lightning_rotor.ops import FORWARD_KINDS
from lightning_rotor.planner import InfeasibleBudget, Plan, min_feasible_budget, plan, solve_discretized
from lightning_rotor.simulate import no_recompute_ops, no_recompute_peak, simulate


@st.composite
def chains(draw, max_length=7):
    length = draw(st.integers(1, max_length))
    size = st.integers(0, 60)
    out = draw(st.lists(size, min_size=length, max_size=length))
    extra = draw(st.lists(st.sampled_from([0, 0, 5, 17, 40]), min_size=length, max_size=length))
    time = st.sampled_from([0.0, 0.0, 0.25, 1.0, 1.5, 3.0, 0.1, 7.0])
    input_size = draw(size)
    sizes = [input_size, *out]
    bwd_tmp = draw(st.lists(st.sampled_from([0, 0, 4, 25]), min_size=length, max_size=length))
    loss_tmp = draw(st.sampled_from([0, 6, 30]))
    version2 = {}
    if draw(st.booleans()):  # version 2: signed transients, released outputs, a loss that keeps a_L
        fraction = st.sampled_from([0.0, 0.5, 1.0])
        bwd_tmp = [b - int(draw(fraction) * sizes[k]) for k, b in enumerate(bwd_tmp)]
        loss_tmp -= int(draw(fraction) * sizes[-1])
        version2 = dict(out_free=[int(draw(fraction) * o) for o in out], loss_tmp_kept=loss_tmp + draw(size))
        if draw(st.booleans()):  # version 3: stage inputs neither graph keeps, let go after their last forward
            free = version2["out_free"]
            version2["in_free"] = [0] + [draw(st.integers(0, free[k - 1])) for k in range(1, length)]
        if draw(st.booleans()):  # version 3: the loss value, held from the end of the loss on
            version2["loss_value"] = draw(st.sampled_from([1, 8, 35]))
    saved = [o + e for o, e in zip(out, extra, strict=True)]
    if draw(st.integers(0, 3)) == 0:  # outputs partly views of their inputs: recorded outputs smaller than values
        saved = [
            max(s - draw(st.sampled_from([0, 10, 60])), version2.get("out_free", [0] * length)[k])
            for k, s in enumerate(saved)
        ]
    return Chain(
        input_size=input_size,
        out_size=out,
        saved_size=saved,
        fwd_time=draw(st.lists(time, min_size=length, max_size=length)),
        bwd_time=draw(st.lists(time, min_size=length, max_size=length)),
        fwd_tmp=draw(st.lists(st.sampled_from([0, 0, 3, 20]), min_size=length, max_size=length)),
        fwd_tmp_nograd=draw(
            st.one_of(st.none(), st.lists(st.sampled_from([0, 2, 9, 30]), min_size=length, max_size=length))
        ),
        bwd_tmp=bwd_tmp,
        loss_tmp=loss_tmp,
        **version2,
    )


def cpp_solve(chain, budget, slots):
    return solve_discretized(chain, budget, slots)


def without_in_free(chain):
    """The same chain with nothing of a stage input released (version 2's meaning)."""
    return Chain(**{**chain.__dict__, "in_free": None})


def forward_ops(ops):
    return sum(1 for op in ops if op[0] in FORWARD_KINDS)


@pytest.mark.slow
@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chain=chains(), where=st.floats(0, 1.2), slots=st.sampled_from([3, 8, 40, 500]))
def test_cpp_equals_reference(chain, where, slots):
    """Same integer problem in, same optimal cost and the same ops out; the plan replays within budget."""
    low, high = reference_min_budget(chain), no_recompute_peak(chain)
    budget = max(1, int(low - 3 + where * (high - low + 6)))
    expected = solve(discretize(chain, budget, slots=slots))
    got = cpp_solve(chain, budget, slots)
    if expected is None:
        assert got is None
        return
    assert got is not None and got[0] == expected[0]
    assert got[1] == expected[1]
    assert simulate(chain, got[1]).peak <= budget


@pytest.mark.slow
@settings(max_examples=400, deadline=None)
@given(chain=chains(), where=st.floats(-0.2, 1.2))
def test_plan_within_budget_and_reports_simulated_figures(chain, where):
    low, high = min_feasible_budget(chain), no_recompute_peak(chain)
    assert low == max(1, reference_min_budget(chain))
    budget = max(1, int(low + where * (high - low)))
    if budget < low:
        with pytest.raises(InfeasibleBudget):
            plan(chain, budget)
        return
    result = plan(chain, budget)
    sim = simulate(chain, result.ops)
    assert sim.peak == result.peak <= budget == result.budget
    assert sim.time == result.time
    reference = reference_plan(chain, budget, slots=500)
    if reference is not None:  # never slower than the 500-slot dynamic program
        assert result.time <= simulate(chain, reference[1]).time * (1 + 1e-9) + 1e-12


@settings(max_examples=200, deadline=None)
@given(chain=chains())
def test_min_feasible_budget_plans_and_one_byte_less_does_not(chain):
    smallest = min_feasible_budget(chain)
    result = plan(chain, smallest)
    assert simulate(chain, result.ops).peak <= smallest
    if smallest > 1:
        with pytest.raises(InfeasibleBudget) as err:
            plan(chain, smallest - 1)
        assert err.value.min_feasible == smallest and err.value.budget == smallest - 1
        assert f"({smallest} bytes)" in str(err.value)


@pytest.mark.slow
@settings(max_examples=500, deadline=None)
@given(chain=chains(), where=st.floats(0, 1.2), slots=st.sampled_from([3, 8, 40, 500]))
def test_releasing_stage_inputs_never_hurts(chain, where, slots):
    """in_free only lowers what is held: a schedule peaks no higher, the minimum budget and the optimum fall or stay."""
    old = without_in_free(chain)
    assert reference_min_budget(chain) <= reference_min_budget(old)
    assert min_feasible_budget(chain) <= min_feasible_budget(old)
    low, high = reference_min_budget(old), no_recompute_peak(old)
    assert no_recompute_peak(chain) <= high
    budget = max(1, int(low - 3 + where * (high - low + 6)))
    before, after = cpp_solve(old, budget, slots), cpp_solve(chain, budget, slots)
    if before is not None:
        assert after is not None and after[0] <= before[0]
        assert simulate(chain, before[1]).peak <= simulate(old, before[1]).peak


def persistent_schedules(length):
    """Every schedule of the planners' family (Fe s, or a checkpoint s -> s2, at every subproblem), in op lists."""
    from functools import cache

    @cache
    def family(s, t, given):
        found = []
        inner = family(s + 1, t, given) if s + 1 < t else ([()] if given else [(("Loss",),)])
        found += [(("Fe", s), *middle, ("B", s)) for middle in inner]
        for s2 in range(s + 1, (t - 1 if given else t) + 1):
            run = (("Fc", s), *(("Fn", j) for j in range(s + 1, s2)))
            rights = [(("Loss",),)] if not given and s2 == length else family(s2, t, given)
            found += [run + right + left for right in rights for left in family(s, s2, True)]
        return tuple(found)

    return family(0, length, False)


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(chain=chains(max_length=4), where=st.floats(0, 1))
def test_planners_account_like_the_simulator(chain, where):
    """Replayed by the simulator, the best schedule of the whole family fits exactly the minimum budget, and at a
    budget in exact bytes the reference's plan is as fast as the fastest schedule of the family that fits."""
    chain = Chain(
        **{
            **chain.__dict__,
            "fwd_time": [float(round(t)) for t in chain.fwd_time],
            "bwd_time": [float(round(t)) for t in chain.bwd_time],
        }
    )  # integer times: sums are exact
    replayed = [simulate(chain, ops) for ops in persistent_schedules(chain.length)]
    assert min(r.peak for r in replayed) == reference_min_budget(chain)
    assert min_feasible_budget(chain) == max(1, reference_min_budget(chain))
    low, high = reference_min_budget(chain), no_recompute_peak(chain)
    budget = max(1, low + int(where * (high - low)))
    fastest = min(r.time for r in replayed if r.peak <= budget)
    cost, ops = reference_plan(chain, budget, slots=None)
    assert simulate(chain, ops).time == fastest and simulate(chain, ops).peak <= budget


def test_in_free_all_zero_is_version_2():
    """An explicit all-zero in_free, and none at all, give the C++ planner exactly the same problem."""
    chain = medium_chain()
    zeros = [0] * chain.length
    budget = int(0.5 * no_recompute_peak(chain))
    d = discretize(chain, budget)
    args = (d.size, d.saved, d.fwd_tmp, d.fwd_tmp_nograd, d.bwd_tmp, d.loss_tmp, d.fwd_cost, d.bwd_cost, d.slots)
    assert d.in_free == zeros
    assert _planner.solve(*args, in_free=zeros) == _planner.solve(*args) == cpp_solve(chain, budget, 500)
    memory = (chain.sizes, chain.saved_size, chain.fwd_tmp, chain.fwd_tmp_nograd, chain.bwd_net, chain.loss_tmp)
    assert _planner.min_budget(*memory, in_free=zeros) == _planner.min_budget(*memory) == min_feasible_budget(chain)
    with pytest.raises(ValueError, match="inconsistent chain lengths"):
        _planner.solve(*args, in_free=zeros[:-1])
    with pytest.raises(ValueError, match=r"in_free\[0\] must be within 0..size\[0\]"):
        _planner.min_budget(*memory, in_free=[chain.input_size + 1] + zeros[1:])


def test_release_bigger_than_the_recorded_output():
    """A stage whose input is let go but whose output is small (a pooling head): the subproblem after Fe s has more
    memory than before it. The planners agree and the plan fits, at every budget from the minimum up."""
    chain = Chain(
        input_size=8,
        out_size=[40, 40, 2, 30],
        saved_size=[40, 40, 2, 30],
        fwd_time=[1.0, 1.0, 1.0, 1.0],
        bwd_time=[2.0, 2.0, 2.0, 2.0],
        fwd_tmp=[0, 5, 0, 3],
        bwd_tmp=[0, 0, 0, 0],
        loss_tmp=0,
        out_free=[40, 40, 2, 0],
        in_free=[0, 40, 40, 2],
    )
    old = without_in_free(chain)
    low = min_feasible_budget(chain)
    assert low == reference_min_budget(chain) < min_feasible_budget(old)
    for budget in range(low, no_recompute_peak(chain) + 2):
        for slots in (7, 40, 500):
            expected = solve(discretize(chain, budget, slots=slots))
            got = cpp_solve(chain, budget, slots)
            assert got == (None if expected is None else (expected[0], expected[1]))
        result = plan(chain, budget)
        sim = simulate(chain, result.ops)
        assert sim.peak == result.peak <= budget and sim.time == result.time
        exact = reference_plan(chain, budget, slots=None)
        assert exact is not None and result.time <= simulate(chain, exact[1]).time * (1 + 1e-12)


def medium_chain(length=14, seed=3):
    import random

    rng = random.Random(seed)
    out = [rng.randint(1, 40) * 1000 for _ in range(length)]
    return Chain(
        input_size=5000,
        out_size=out,
        saved_size=[o + rng.choice([0, o, 2 * o]) for o in out],
        fwd_time=[rng.uniform(0.001, 0.004) for _ in range(length)],
        bwd_time=[rng.uniform(0.002, 0.008) for _ in range(length)],
        fwd_tmp=[rng.choice([0, 3000]) for _ in range(length)],
        bwd_tmp=[rng.choice([0, 8000]) for _ in range(length)],
        loss_tmp=2000,
    )


@pytest.mark.parametrize("fraction", [0.35, 0.5, 0.7, 0.9])
def test_cost_equals_reference_at_500_slots(fraction):
    chain = medium_chain()
    budget = int(fraction * no_recompute_peak(chain))
    expected = reference_plan(chain, budget, slots=500)
    got = cpp_solve(chain, budget, 500)
    assert expected is not None and got[0] == expected[0] and got[1] == expected[1]
    result = plan(chain, budget)
    assert result.time <= simulate(chain, expected[1]).time
    assert result.time > result.no_recompute_time  # this budget does force recomputation
    assert result.recomputed_stages > 0


@pytest.mark.parametrize("budget", [1.0, "100%", 10**12])
def test_unlimited_memory_gives_no_recompute_plan(budget):
    chain = medium_chain()
    result = plan(chain, budget)
    assert result.ops == no_recompute_ops(chain.length)
    assert result.recomputed_stages == 0
    assert result.time == result.no_recompute_time == math.fsum([*chain.fwd_time, *chain.bwd_time])


def test_zero_cost_stages_not_recomputed_needlessly():
    chain = medium_chain()
    free = Chain.from_dict({**chain.to_dict(), "fwd_time": [0.0] * chain.length, "bwd_time": [0.0] * chain.length})
    assert plan(free, 10**12).ops == no_recompute_ops(free.length)
    # Under a tight budget the free stages are recomputed only as much as memory forces.
    budget = int(0.5 * no_recompute_peak(free))
    result = plan(free, budget)
    expected = reference_plan(free, budget)
    assert forward_ops(result.ops) == forward_ops(expected[1])
    assert forward_ops(result.ops) == discretize(free, budget).cost_to_forward_ops(cpp_solve(free, budget, 500)[0])
    # A free reshape stage in a costly chain: recording it costs nothing, so the plan is unchanged by it.
    times = [0.0 if k == 5 else t for k, t in enumerate(chain.fwd_time)]
    mixed = Chain.from_dict({**chain.to_dict(), "fwd_time": times})
    assert plan(mixed, 10**12).ops == no_recompute_ops(mixed.length)


def test_fractions_resolve_against_no_recompute_peak():
    chain = medium_chain()
    peak = no_recompute_peak(chain)
    assert plan(chain, 0.5).mem_limit == peak // 2
    assert plan(chain, "50%").mem_limit == peak // 2
    assert plan(chain, "0.5").mem_limit == peak // 2


def test_more_slots_never_slower():
    chain = medium_chain()
    budget = int(0.45 * no_recompute_peak(chain))
    assert plan(chain, budget, slots=2000).time <= plan(chain, budget, slots=500).time * (1 + 1e-12)


def test_infeasible_message():
    chain = Chain(
        input_size=2**20,
        out_size=[2**20] * 3,
        saved_size=[2**21] * 3,
        fwd_time=[1.0] * 3,
        bwd_time=[1.0] * 3,
        fwd_tmp=[0] * 3,
        bwd_tmp=[0] * 3,
    )
    smallest = min_feasible_budget(chain)
    with pytest.raises(InfeasibleBudget) as err:
        plan(chain, "1MiB")
    assert isinstance(err.value, ValueError)
    assert err.value.budget == 2**20 and err.value.min_feasible == smallest
    text = str(err.value)
    assert "1.00 MiB (1048576 bytes)" in text and f"{smallest} bytes" in text and "\n" not in text


def test_plan_dict_round_trip():
    chain = medium_chain()
    result = plan(chain, 0.5)
    data = json.loads(json.dumps(result.to_dict()))
    assert {"budget", "time", "peak", "ops"} <= set(data)
    assert data["ops"][0] == list(result.ops[0])
    assert Plan.from_dict(data) == result
    with pytest.raises(ValueError, match="missing"):
        Plan.from_dict({"ops": []})


def test_plan_budget_is_bytes_and_mem_limit_its_old_name():
    """`Plan.budget` holds the resolved bytes (`mem_limit` is the user's spec elsewhere); the old name still reads it,
    and plans saved under the old key load."""
    chain = medium_chain()
    result = plan(chain, "50%")
    assert result.budget == result.mem_limit == int(0.5 * no_recompute_peak(chain))
    with pytest.raises(AttributeError):
        result.mem_limit = 1  # an alias, not a second field
    old = {**result.to_dict(), "mem_limit": result.budget}
    del old["budget"]
    assert Plan.from_dict(old) == result
    with pytest.raises(InfeasibleBudget) as err:
        plan(chain, 1)
    assert err.value.budget == err.value.mem_limit == 1
    err.value.mem_limit = 2  # subclasses (InfeasibleTotal, InfeasibleStep) still set the old name
    assert err.value.budget == 2


@pytest.mark.parametrize("slots", [0, -1, 2.5, True])
def test_bad_slots(slots):
    with pytest.raises(ValueError, match="slots"):
        plan(medium_chain(), 0.5, slots=slots)


def test_the_simulator_is_the_only_replay():
    """The C++ module plans; scoring a plan (peak, time) is simulate's job alone (docs/planner.md)."""
    assert not hasattr(_planner, "replay")
    assert {"solve", "min_budget", "feasible_schedule", "default_threads"} <= set(dir(_planner))


def test_exact_fallback_when_slot_rounding_finds_nothing():
    """At coarse precision the rounded DP finds no plan at the exact minimum; the exact-byte schedule does."""
    chain = medium_chain()
    smallest = min_feasible_budget(chain)
    assert cpp_solve(chain, smallest, 7) is None  # rounding every size up to 1/7 of the budget
    result = plan(chain, smallest, slots=7)
    sim = simulate(chain, result.ops)
    assert sim.peak == result.peak <= smallest and sim.time == result.time


@settings(max_examples=300, deadline=None)
@given(chain=chains(), where=st.floats(0, 1.2))
def test_exact_fallback_replays_within_its_budget(chain, where):
    """The fallback is the DP's minimum-budget recursion walked in exact bytes: the referee finds every schedule it
    gives within the budget, from the exact minimum up, and it gives none one byte below."""
    memory = dict(
        size=chain.sizes,
        saved=chain.saved_size,
        fwd_tmp=chain.fwd_tmp,
        fwd_tmp_nograd=chain.fwd_tmp_nograd,
        bwd_tmp=chain.bwd_net,
        loss_tmp=chain.loss_tmp,
        loss_tmp_graph=chain.loss_tmp_graph,
        in_free=chain.in_free,
        loss_value=chain.loss_value,
    )
    low = _planner.min_budget(**memory)
    assert low == reference_min_budget(chain)
    budget = low + int(where * (no_recompute_peak(chain) - low))
    ops = _planner.feasible_schedule(**memory, budget=budget)
    assert simulate(chain, ops).peak <= budget
    assert _planner.feasible_schedule(**memory, budget=low - 1) is None


def test_chain_too_large_for_memory_is_refused_before_planning():
    from lightning_rotor.planner import PlannerTooLarge, available_ram, planner_memory_estimate

    have = available_ram()
    length = 50
    slots = 8 * have // planner_memory_estimate(length, 1) + 10  # tables of about 4x the bytes available
    chain = Chain(
        input_size=1,
        out_size=[1] * length,
        saved_size=[1] * length,
        fwd_time=[1.0] * length,
        bwd_time=[1.0] * length,
        fwd_tmp=[0] * length,
        bwd_tmp=[0] * length,
    )
    with pytest.raises(PlannerTooLarge) as err:
        plan(chain, 10**9, slots=slots)
    assert "may need up to" in str(err.value) and "\n" not in str(err.value)


def test_memory_estimate_bounds_the_tables():
    from lightning_rotor.planner import planner_memory_estimate

    assert planner_memory_estimate(400, 500) == (400 * 401 // 2 + 400) * 501 * 8


def test_automatic_precision_is_finer_for_short_chains_and_never_plans_slower():
    from pathlib import Path

    from lightning_rotor.discretize import auto_slots

    assert auto_slots(150) == auto_slots(1000) == 500  # rotor's discretisation for long chains
    assert auto_slots(9) == 20_000 and auto_slots(39) == 150 * 150 * 500 // 39**2
    chain = Chain.load(Path(__file__).resolve().parent.parent / "examples" / "resnet50_b32.json")
    automatic = plan(chain, "50%")
    assert automatic.slots == auto_slots(chain.length) > 500
    assert automatic.time < plan(chain, "50%", slots=500).time


@pytest.mark.parametrize(("length", "seed", "fraction", "same"), [(6, 2, 0.6, True), (14, 3, 0.5, False)])
def test_a_fallback_equal_to_the_dp_plan_is_replayed_once(length, seed, fraction, same, monkeypatch):
    """`plan` replays each distinct candidate once: where the exact-byte fallback is the DP's very schedule (room
    to spare), one replay scores both (a changing shape's chain is planned at every new shape); the plan is the
    fastest, the DP's on a tie, as before."""
    import lightning_rotor.planner as planner_module

    chain = medium_chain(length, seed)
    budget = int(fraction * no_recompute_peak(chain))
    dp = [tuple(op) for op in cpp_solve(chain, budget, 500)[1]]
    fallback = _planner.feasible_schedule(*planner_module._memory_args(chain), budget)
    replayed = []
    monkeypatch.setattr(planner_module, "simulate", lambda c, ops: replayed.append(list(ops)) or simulate(c, ops))
    result = plan(chain, budget, slots=500)
    assert ([tuple(op) for op in fallback] == dp) is same
    distinct = [dp] if same else [dp, [tuple(op) for op in fallback]]
    assert [[tuple(op) for op in ops] for ops in replayed] == distinct
    fastest = min(distinct, key=lambda ops: simulate(chain, ops).time)  # the first of equals
    assert [tuple(op) for op in result.ops] == fastest and result.time == simulate(chain, fastest).time
