"""Per-stage options (chain version 5): a stage recorded by option o (`Fs k:o`), chosen by the planners.

The reference planner (tests/reference_planner.py) and an exhaustive replay of the planners' whole
family of schedules, options included, are the oracles; `simulate` is the one referee.
"""

import json
import threading
from functools import cache
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference_planner import reference_min_budget, reference_plan, solve
from test_planner import chains
from torch import nn

from lightning_rotor.chain import Chain, ChainError, StageOption
from lightning_rotor.discretize import discretize
from lightning_rotor.execute import PlanRunner
from lightning_rotor.memory import MemoryProbe
from lightning_rotor.models.gpt import Block, gpt, lm_loss
from lightning_rotor.ops import Op, OpKind, parse_ops, recomputed_stages
from lightning_rotor.plan_cli import compact_ops, main
from lightning_rotor.planner import InfeasibleBudget, min_feasible_budget, plan, solve_discretized
from lightning_rotor.profile import profile_chain
from lightning_rotor.selective import measure_sac_memory
from lightning_rotor.simulate import no_recompute_peak, simulate
from lightning_rotor.stages import sequential_stages

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@st.composite
def chains_with_options(draw, max_length=6, integer_times=False):
    """A random chain (test_planner's), and for some stages one or two options: mostly saving less, slower."""
    chain = draw(chains(max_length=max_length))
    if integer_times:  # sums of integers are exact: the exhaustive replay compares times with ==
        chain = Chain(
            **{
                **chain.__dict__,
                "fwd_time": [float(round(t)) for t in chain.fwd_time],
                "bwd_time": [float(round(t)) for t in chain.bwd_time],
            }
        )
    sizes, in_free_next = chain.sizes, [*chain.in_free[1:], 0]
    time = st.sampled_from([0.0, 1.0, 2.0, 3.0] if integer_times else [0.0, 0.25, 1.0, 1.5, 3.0, 0.1])
    options = []
    for k in range(chain.length):
        opts = []
        for _ in range(draw(st.sampled_from([0, 0, 1, 1, 2]))):
            saved = draw(st.integers(0, chain.saved_size[k] + 10))
            low_free = in_free_next[k]
            if saved < low_free:
                saved = low_free
            out_free = draw(st.integers(low_free, min(chain.out_size[k], saved)))
            opts.append(
                StageOption(
                    saved_size=saved,
                    fwd_time=draw(time),
                    bwd_time=draw(time),
                    fwd_tmp=draw(st.sampled_from([0, 3, 20])),
                    bwd_tmp=draw(st.integers(-sizes[k], 40)),
                    out_free=out_free,
                )
            )
        options.append(opts)
    return Chain(**{**chain.__dict__, "options": options})


def without_options(chain):
    return Chain(**{**chain.__dict__, "options": None})


@pytest.mark.slow
@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chain=chains_with_options(), where=st.floats(0, 1.2), slots=st.sampled_from([3, 8, 40, 500]))
def test_cpp_equals_reference_with_options(chain, where, slots):
    """Same integer problem, same optimal cost and the same ops (options included); the plan replays within budget."""
    low, high = reference_min_budget(chain), no_recompute_peak(chain)
    budget = max(1, int(low - 3 + where * (high - low + 6)))
    expected = solve(discretize(chain, budget, slots=slots))
    got = cpp_solve_options(chain, budget, slots)
    if expected is None:
        assert got is None
        return
    assert got is not None and got[0] == expected[0]
    assert got[1] == expected[1]
    assert simulate(chain, got[1]).peak <= budget


def cpp_solve_options(chain, budget, slots):
    return solve_discretized(chain, budget, slots)


def family_with_options(chain):
    """Every schedule of the planners' family: at each subproblem Fe s, each Fs s:o, or a checkpoint s -> s2."""
    length = chain.length

    @cache
    def family(s, t, given):
        found = []
        inner = family(s + 1, t, given) if s + 1 < t else ([()] if given else [(("Loss",),)])
        records = [("Fe", s)] + [("Fs", s, o) for o in range(1, len(chain.options[s]) + 1)]
        found += [(record, *middle, ("B", s)) for record in records for middle in inner]
        for s2 in range(s + 1, (t - 1 if given else t) + 1):
            run = (("Fc", s), *(("Fn", j) for j in range(s + 1, s2)))
            rights = [(("Loss",),)] if not given and s2 == length else family(s2, t, given)
            found += [run + right + left for right in rights for left in family(s, s2, True)]
        return tuple(found)

    return family(0, length, False)


@pytest.mark.slow
@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chain=chains_with_options(max_length=4, integer_times=True), where=st.floats(0, 1))
def test_planners_equal_an_exhaustive_search_with_options(chain, where):
    """Replayed by the simulator, the family's lowest peak is the minimum budget (reference and C++), and at a budget
    in exact bytes the reference's plan is as fast as the fastest schedule of the family that fits."""
    replayed = [simulate(chain, ops) for ops in family_with_options(chain)]
    assert min(r.peak for r in replayed) == reference_min_budget(chain)
    assert min_feasible_budget(chain) == max(1, reference_min_budget(chain))
    low, high = reference_min_budget(chain), max(r.peak for r in replayed)
    budget = max(1, low + int(where * (high - low)))
    fastest = min(r.time for r in replayed if r.peak <= budget)
    _, ops = reference_plan(chain, budget, slots=None)
    assert simulate(chain, ops).time == fastest and simulate(chain, ops).peak <= budget


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chain=chains_with_options(), where=st.floats(-0.2, 1.2))
def test_plan_with_options_reports_simulated_figures_and_never_loses(chain, where):
    """plan() reports the simulator's peak and time; options never raise the minimum budget nor slow a plan down."""
    plain = without_options(chain)
    low, high = min_feasible_budget(chain), no_recompute_peak(chain)
    assert low == max(1, reference_min_budget(chain)) <= min_feasible_budget(plain)
    budget = max(1, int(low + where * (high - low)))
    if budget < low:
        with pytest.raises(InfeasibleBudget):
            plan(chain, budget)
        return
    result = plan(chain, budget)
    sim = simulate(chain, result.ops)
    assert sim.peak == result.peak <= budget and sim.time == result.time
    if budget >= min_feasible_budget(plain):
        # the same slots: the chain's own schedules are among those with options (slot rounding aside, equal units)
        without = plan(plain, budget, slots=result.slots)
        assert result.time <= without.time * (1 + 1e-9) + 1e-12


def test_no_options_is_version_4_exactly():
    """Empty option lists are the chain without options: the same file, the same problem, the same plans."""
    chain = Chain.load(EXAMPLES / "gpt2_small_b8.json")
    empty = Chain(**{**chain.__dict__, "options": [[] for _ in range(chain.length)]})
    assert empty.to_dict() == chain.to_dict() and chain.to_dict()["version"] == 4 and "options" not in chain.to_dict()
    budget = (min_feasible_budget(chain) + no_recompute_peak(chain)) // 2
    assert plan(empty, budget) == plan(chain, budget)
    assert discretize(empty, budget).options == []


def sac_chain():
    """Three stages; stage 1 can save a third of its recording (option 1) at the price of recomputing in B 1."""
    return Chain(
        input_size=10,
        out_size=[10, 10, 10],
        saved_size=[40, 60, 40],
        fwd_time=[1.0, 1.0, 1.0],
        bwd_time=[2.0, 2.0, 2.0],
        fwd_tmp=[0, 0, 0],
        bwd_tmp=[0, 0, 0],
        options=[[], [StageOption(saved_size=20, fwd_time=1.0, bwd_time=2.5, fwd_tmp=0, bwd_tmp=25, name="sac")], []],
    )


def test_simulator_rules_for_an_option_op_by_hand():
    chain = sac_chain()
    ops = [("Fe", 0), ("Fs", 1, 1), ("Fe", 2), ("Loss",), ("B", 2), ("B", 1), ("B", 0)]
    sim = simulate(chain, ops)
    # a_0 10 | Fe 0 +40 | Fs 1:1 +20 | Fe 2 +40 | Loss +δ_3 | B 2: -40 -10 +10 | B 1: -20 -10 +10 | B 0: -40 -10 +10
    assert sim.curve == [50, 70, 110, 120, 80, 60, 20]
    assert sim.op_peaks[5] == 80 + 10 + 25  # B 1 after the option: cur + s_1 + the option's bwd_tmp (its recompute)
    assert sim.time == 1 + 1 + 1 + 2 + 2.5 + 2
    with pytest.raises(ValueError, match=r"op 1 \(Fs 1:2\): stage 1 has 1 option"):
        simulate(chain, [("Fe", 0), ("Fs", 1, 2), ("Fe", 2), ("Loss",), ("B", 2), ("B", 1), ("B", 0)])
    with pytest.raises(ValueError, match=r"op 0 \(Fs 0:1\): stage 0 has 0 option"):
        simulate(chain, [("Fs", 0, 1)])


def test_an_option_lowers_the_floor_and_the_planner_takes_it():
    chain = sac_chain()
    assert min_feasible_budget(chain) < min_feasible_budget(without_options(chain))
    floor = min_feasible_budget(chain)
    result = plan(chain, floor)
    assert Op(OpKind.FS, 1, 1) in result.ops and result.peak <= floor
    with pytest.raises(InfeasibleBudget):
        plan(without_options(chain), floor)
    # with memory to spare the option is not taken: it is slower
    assert plan(chain, 10**6).ops == plan(without_options(chain), 10**6).ops


def test_a_faster_option_is_taken_at_unlimited_memory():
    chain = sac_chain()
    faster = StageOption(saved_size=50, fwd_time=1.0, bwd_time=1.5, fwd_tmp=0, bwd_tmp=0)
    chain = Chain(**{**chain.__dict__, "options": [[], [faster], []]})
    result = plan(chain, 10**6)
    assert result.ops[1] == Op("Fs", 1, 1) and result.time == 1 + 1 + 1 + 2 + 1.5 + 2
    assert recomputed_stages(result.ops) == 0


def test_frozen_prefix_with_options_plans_as_its_suffix():
    chain = Chain(**{**sac_chain().__dict__, "frozen": 1})
    suffix = chain.suffix()
    assert suffix.options[0][0].bwd_tmp == chain.options[1][0].bwd_tmp - chain.input_size
    budget = min_feasible_budget(chain)
    assert budget == max(chain.prefix_peak, min_feasible_budget(suffix))
    result = plan(chain, budget)
    assert result.ops[0] == Op("Fn", 0) and Op("Fs", 1, 1) in result.ops
    assert simulate(chain, result.ops).peak <= budget


def test_ops_parse_and_print_options():
    op = Op("Fs", 3, 1)
    assert op == ("Fs", 3, 1) and op.kind is OpKind.FS and op.stage == 3 and op.option == 1
    assert op.label == "Fs 3:1" and op.to_json() == ["Fs", 3, 1] and op.kind.is_forward
    assert Op("Fe", 3).option == 0
    assert parse_ops([["Fs", 2, 1], ["Fe", 1], ["Loss"]]) == [("Fs", 2, 1), ("Fe", 1), ("Loss",)]
    for bad in (["Fs", 2], ["Fs", 2, 0], ["Fs", 2, True], ["Fe", 2, 1]):
        with pytest.raises(ValueError, match="op 0"):
            parse_ops([bad])
    assert compact_ops(parse_ops([("Fe", 0), ("Fs", 1, 1), ("Fs", 2, 1), ("Fs", 3, 2), ("Fe", 4), ("Loss",)])) == (
        "Fe0 Fs1-2:1 Fs3:2 Fe4 Loss"
    )


def test_chain_json_round_trip_and_one_line_errors(tmp_path):
    chain = sac_chain()
    data = chain.to_dict()
    assert data["version"] == 5 and data["options"][1] == [
        {"name": "sac", "saved_size": 20, "fwd_time": 1.0, "bwd_time": 2.5, "fwd_tmp": 0, "bwd_tmp": 25}
    ]
    path = tmp_path / "c.json"
    chain.save(path)
    assert Chain.load(path) == chain
    with pytest.raises(ChainError, match="need chain version 5; this file says version 4"):
        Chain.from_dict({**data, "version": 4})
    bad = json.loads(json.dumps(data))
    del bad["options"][1][0]["bwd_time"]
    with pytest.raises(ChainError, match=r"options\[1\]\[0\] is missing field\(s\) bwd_time"):
        Chain.from_dict(bad)
    bad = json.loads(json.dumps(data))
    bad["options"][1][0]["out_free"] = 11
    with pytest.raises(ChainError, match=r"options\[1\]\[0\]\.out_free=11 is larger than the stage's out_size=10"):
        Chain.from_dict(bad)
    bad = json.loads(json.dumps(data))
    bad["options"] = [[]]
    with pytest.raises(ChainError, match="one list of options per stage"):
        Chain.from_dict(bad)
    with pytest.raises(ChainError, match=r"options\[1\]\[0\]\.out_free=0 is below in_free=5 of the next stage"):
        Chain.from_dict({**data, "out_free": [10, 10, 0], "in_free": [0, 0, 5]})


def test_cli_prints_option_ops(tmp_path, capsys):
    path = tmp_path / "sac.json"
    sac_chain().save(path)
    floor = min_feasible_budget(sac_chain())
    assert main([str(path), "--mem-limit", str(floor)]) == 0
    assert "Fs1:1" in capsys.readouterr().out
    assert main([str(path), "--mem-limit", str(floor), "--json"]) == 0
    assert ["Fs", 1, 1] in json.loads(capsys.readouterr().out)["ops"]


def tiny_gpt(dropout=0.0):
    torch.manual_seed(0)
    m = gpt(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32, dropout=dropout)
    return nn.Sequential(m.embed, *m.blocks, m.ln_f, m.lm_head)


def profiled_with_options(model, x, y):
    """The model's profiled chain plus option "sac" of every block, measured on the values plain training makes."""
    stages = sequential_stages(model)
    chain = profile_chain(stages, x, names=list(stages.names), repeats=1, loss_tmp=lambda out: lm_loss(out, y)).chain
    values = [x]
    with torch.no_grad():
        for stage in model:
            values.append(stage(values[-1]))
    options = []
    for k, stage in enumerate(model):
        if not isinstance(stage, Block):
            options.append([])
            continue
        saved, fwd_tmp, bwd_tmp = measure_sac_memory(stage, values[k], chain.sizes[k])
        time = chain.fwd_time[k], chain.bwd_time[k] * 1.5  # times do not matter here: the ops are chosen below
        options.append([StageOption(saved, time[0], time[1], fwd_tmp, bwd_tmp, name="sac")])
    return stages, Chain(**{**chain.__dict__, "options": options})


SAC_PLANS = [  # every block by its option; an option recomputed after Fc; an option on a recomputed stage
    [("Fe", 0), ("Fs", 1, 1), ("Fs", 2, 1), ("Fs", 3, 1), ("Fe", 4), ("Fe", 5), ("Loss",)]
    + [("B", k) for k in (5, 4, 3, 2, 1, 0)],
    [("Fe", 0), ("Fc", 1), ("Fn", 2), ("Fs", 3, 1), ("Fe", 4), ("Fe", 5), ("Loss",), ("B", 5), ("B", 4), ("B", 3)]
    + [("Fe", 1), ("Fs", 2, 1), ("B", 2), ("B", 1), ("B", 0)],
    [("Fc", 0), ("Fn", 1), ("Fc", 2), ("Fs", 3, 1), ("Fe", 4), ("Fe", 5), ("Loss",), ("B", 5), ("B", 4), ("B", 3)]
    + [("Fe", 0), ("Fs", 1, 1), ("Fs", 2, 1), ("B", 2), ("B", 1), ("B", 0)],
]


@pytest.fixture(params=["alone", "another thread"])
def threads(request):
    """Alone, the executor replays a recomputed stage's draws from generator states; with another (non-daemon)
    thread alive, op by op (lightning_rotor/rng.py): an `Fs` rerun follows either."""
    if request.param == "alone":
        yield
        return
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    yield
    stop.set()
    thread.join()


@pytest.mark.parametrize("ops", SAC_PLANS, ids=["all", "after-Fc", "recomputed"])
def test_option_ops_train_bitwise_like_plain_within_the_simulated_peak(ops, threads):
    """`Fs k:1` runs block k (with dropout) under torch's selective checkpoint contexts: gradients bitwise equal to
    plain training, the same random stream after the step, and the measured activation bytes after every op
    never above what the simulator predicts."""
    x, y = torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16))
    plain = tiny_gpt(dropout=0.1)
    torch.manual_seed(7)
    expected = lm_loss(plain(x), y)
    expected.backward()
    stream = torch.get_rng_state()
    rotor = tiny_gpt(dropout=0.1)
    stages, chain = profiled_with_options(rotor, x, y)
    rotor.zero_grad(set_to_none=True)
    runner = PlanRunner(stages, ops, list(stages.names))
    runner.probe = probe = MemoryProbe(rotor)
    torch.manual_seed(7)
    with probe:
        got = lm_loss(runner(x), y)
        got.backward()
        detached = got.detach()
        del got
    assert torch.equal(torch.get_rng_state(), stream)
    assert torch.equal(expected, detached)
    for a, b in zip(plain.parameters(), rotor.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    sim = simulate(chain, ops)
    assert [label for label, _, _ in probe.marks] == [Op(*op).label for op in ops]
    measured = [nbytes for _, _, nbytes in probe.marks]
    assert all(m <= p for m, p in zip(measured, sim.curve, strict=True)), (measured, sim.curve)
    assert 0.85 * sim.peak <= probe.peak <= sim.peak  # safe, and close (docs/memory-model.md, "Chain version 5")


def test_the_executor_refuses_options_it_has_no_rule_for():
    stages = sequential_stages(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
    runner = PlanRunner(stages, [("Fe", 0), ("Fs", 1, 2), ("Loss",), ("B", 1), ("B", 0)], list(stages.names))
    with pytest.raises(RuntimeError, match=r"executor has no rule for op Fs 1:2: option 1 \(sac\) is the only one"):
        runner(torch.randn(2, 4, requires_grad=True)).sum().backward()


def test_example_chain_with_options_plans_options_somewhere():
    """examples/gpt_tiny_sac_options.json (a CPU profile, benchmarks/options_profile.py): some budget takes an option,
    never slower than without options, and the same floor or lower."""
    chain = Chain.load(EXAMPLES / "gpt_tiny_sac_options.json")
    plain = without_options(chain)
    assert chain.has_options and min_feasible_budget(chain) <= min_feasible_budget(plain)
    low, high = min_feasible_budget(plain), no_recompute_peak(plain)
    took_option = False
    for step in range(11):
        budget = low + step * (high - low) // 10
        with_options, without = plan(chain, budget), plan(plain, budget)
        assert with_options.time <= without.time and with_options.peak <= budget
        took_option |= any(op.kind is OpKind.FS for op in with_options.ops)
    assert took_option
