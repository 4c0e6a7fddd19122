"""benchmarks/offload_sim.py's chart: every link drawn, each in its own style (the 64 GB/s link was drawn in the
ideal link's grey dots, and the ideal link not at all)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import offload_sim  # noqa: E402
from test_offload_sim import uniform  # noqa: E402


def test_each_link_is_drawn_in_its_own_style(tmp_path):
    chain = uniform(6)
    budgets = offload_sim.budgets_of(chain, 3)
    links = [*offload_sim.BANDWIDTHS, offload_sim.IDEAL]
    results = {("uniform", bw): offload_sim.study("uniform", chain, bw, budgets, None) for bw in links}
    fig = offload_sim.chart(results, ["uniform"], tmp_path / "chart.png")
    lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
    drawn = [lines[f"offload + recompute, {offload_sim.link_name(bw)}"] for bw in links]
    looks = {(line.get_color(), line.get_linestyle(), line.get_marker()) for line in drawn}
    assert len(looks) == len(links)
    ideal = lines["offload + recompute, ideal (1 PB/s)"]
    assert ideal.get_linestyle() == ":" and all(line.get_linestyle() == "-" for line in drawn[:-1])
