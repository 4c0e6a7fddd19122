"""benchmarks/offload_sim.py on small chains: both plans replayed, offloading never slower, the report's figures.

Needs the offloading planner of issue 19 (`plan(bandwidth=)`, `min_feasible_budget(bandwidth=)`).
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest

from lightning_rotor.chain import Chain
from lightning_rotor.planner import min_feasible_budget, plan
from lightning_rotor.simulate import no_recompute_peak

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import offload_sim  # noqa: E402


def uniform(stages: int = 12) -> Chain:
    """Equal stages whose checkpoints are as big as what they record: offloading has room to pay."""
    return Chain(
        input_size=100,
        out_size=[100] * stages,
        saved_size=[150] * stages,
        fwd_time=[1.0] * stages,
        bwd_time=[2.0] * stages,
        fwd_tmp=[0] * stages,
        bwd_tmp=[0] * stages,
    )


def test_study_replays_both_plans_and_offloading_is_never_slower():
    chain = uniform()
    budgets = offload_sim.budgets_of(chain, 8)
    assert budgets[0] == min_feasible_budget(chain) and budgets[-1] == no_recompute_peak(chain)
    points = offload_sim.study("uniform", chain, 1e6, budgets, None)
    assert [p.budget for p in points] == budgets  # every budget from the floor up is feasible
    for p in points:
        assert p.peak_offload <= p.budget and p.peak_recompute <= p.budget
        assert p.offload <= p.recompute_only + 1e-9
        assert p.recompute_only == pytest.approx(plan(chain, p.budget).time)
        assert p.removed is None or 0 <= p.removed <= 1
    assert points[-1].removed is None  # at the plain peak nothing is recomputed: no overhead to remove
    assert any(p.offloaded and p.removed and p.removed > 0 for p in points), "offloading never paid on uniform"


def test_report_csv_and_chart(tmp_path):
    chain = uniform()
    chains = {"uniform": (chain, "hand-written")}
    budgets = offload_sim.budgets_of(chain, 6)
    results = {("uniform", bw): offload_sim.study("uniform", chain, bw, budgets, None) for bw in offload_sim.BANDWIDTHS}
    text = offload_sim.report(results, chains, "python benchmarks/offload_sim.py")
    assert "| uniform (12) | hand-written |" in text and "Mean share of recompute-only's overhead removed" in text
    offload_sim.write_csv(results, tmp_path / "points.csv")
    rows = list(csv.DictReader(open(tmp_path / "points.csv")))
    assert len(rows) == len(offload_sim.BANDWIDTHS) * len(budgets)
    assert all(float(r["offload_s"]) <= float(r["recompute_only_s"]) + 1e-9 for r in rows)
    offload_sim.chart(results, ["uniform"], tmp_path / "chart.png")
    assert (tmp_path / "chart.png").stat().st_size > 0
