"""The memory model against torch's own checkpointing, on the benchmark zoo at tiny sizes.

For each zoo model, with the same exact tensor accounting (`MemoryProbe`) everywhere:
the simulator's peak for `checkpoint_sequential`'s schedule matches what
`checkpoint_sequential` measures (within 5%); rotor's smallest feasible budget is below
the lowest peak of every uniform scheme; at the measured plain peak rotor recomputes
nothing; and rotor's measured peak is 95-100% of its prediction, never above its budget.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_rotor.bench.measure import measure_peak
from lightning_rotor.bench.methods import _each_checkpointed, _segments
from lightning_rotor.bench.uniform import checkpoint_every_stage_ops, checkpoint_sequential_ops, segment_bounds
from lightning_rotor.bench.workload import load_workload
from lightning_rotor.execute import PlanRunner
from lightning_rotor.planner import min_feasible_budget, plan
from lightning_rotor.profile import profile_chain
from lightning_rotor.simulate import no_recompute_peak, simulate

ZOO = ("mobilenet", "gpt", "hetero", "resnet50")
# the first use of a model measures it under every uniform scheme, whichever test comes first: 2-11 s for each
# but gpt (under 1 s), so the others are slow in all three tests
ZOO_CASES = [name if name == "gpt" else pytest.param(name, marks=pytest.mark.slow) for name in ZOO]
_cache: dict = {}


def zoo(name: str):
    """(workload, chain, measured peaks of plain and of every uniform scheme), computed once per model."""
    if name not in _cache:
        w = load_workload(name, batch_size=8, size="tiny", device=torch.device("cpu"))
        chain = profile_chain(
            w.stages, w.x, names=w.stage_names, repeats=1, warmup=0, loss_tmp=lambda out: w.loss(out, w.y)
        ).chain
        seq = nn.Sequential(*w.stages)
        length = len(w.stages)
        uniform = {
            f"cs{s}": (measure_peak(w, _segments(seq, s), 0), checkpoint_sequential_ops(length, s))
            for s in range(2, length + 1)
        }
        uniform["every"] = (measure_peak(w, _each_checkpointed(w.stages), 0), checkpoint_every_stage_ops(length))
        _cache[name] = (w, chain, measure_peak(w, w.model, 0), uniform)
    return _cache[name]


def test_segments_are_cut_as_torch_cuts_them():
    assert segment_bounds(10, 3) == [(0, 3), (3, 6)]  # the last segment, 6..9, runs recorded
    assert segment_bounds(5, 5) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    ops = checkpoint_sequential_ops(4, 2)
    assert [op.label for op in ops] == [
        "Fc 0",
        "Fn 1",
        "Fe 2",
        "Fe 3",
        "Loss",
        "B 3",
        "B 2",
        "Fe 0",
        "Fe 1",
        "B 1",
        "B 0",
    ]
    with pytest.raises(ValueError, match="segments"):
        segment_bounds(3, 4)


@pytest.mark.parametrize("name", ZOO_CASES)
def test_simulator_predicts_what_torch_checkpointing_measures(name):
    _, chain, plain, uniform = zoo(name)
    assert no_recompute_peak(chain) == pytest.approx(plain, rel=0.05)
    for label, (measured, ops) in uniform.items():
        assert simulate(chain, ops).peak == pytest.approx(measured, rel=0.05), label


@pytest.mark.parametrize("name", ZOO_CASES)
def test_rotor_goes_below_every_uniform_scheme_and_runs_as_predicted(name):
    w, chain, plain, uniform = zoo(name)
    lowest = min(measured for measured, _ in uniform.values())
    smallest = min_feasible_budget(chain)
    assert smallest < lowest
    for budget in (smallest, lowest, plain):
        chosen = plan(chain, budget)
        measured = measure_peak(w, PlanRunner(w.stages, chosen.ops, w.stage_names, in_free=chain.in_free), 0)
        assert measured <= budget
        assert 0.95 * chosen.peak <= measured <= chosen.peak, (budget, measured, chosen.peak)


@pytest.mark.parametrize("name", ZOO_CASES)
def test_at_the_plain_peak_nothing_is_recomputed(name):
    _, chain, plain, _ = zoo(name)
    assert plan(chain, plain).recomputed_stages == 0
