"""The benchmark's C yardstick (benchmarks/rotor_yardstick.c) solves the same problem: equal optimal costs."""

import shutil
import sys
from pathlib import Path

import pytest

from lightning_rotor.simulate import no_recompute_peak

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def yardstick(tmp_path_factory):
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        pytest.skip("no C compiler")
    sys.path.insert(0, str(BENCH))
    try:
        import planner_speed
    finally:
        sys.path.remove(str(BENCH))
    return planner_speed, planner_speed.compile_yardstick(tmp_path_factory.mktemp("yardstick"))


@pytest.mark.parametrize(("length", "fraction"), [(3, 0.5), (3, 0.8), (12, 0.4), (20, 0.3), (20, 0.9)])
def test_yardstick_cost_equals_planner(yardstick, length, fraction):
    bench, exe = yardstick
    chain = bench.bench_chain(length, seed=length)
    budget = int(fraction * no_recompute_peak(chain))
    cost, _ = bench.run_yardstick(exe, bench.yardstick_input(chain, budget))
    assert cost == bench.planner_cost(chain, budget)


def test_yardstick_finds_plans(yardstick):
    bench, exe = yardstick
    chain = bench.bench_chain(20, seed=20)
    cost, _ = bench.run_yardstick(exe, bench.yardstick_input(chain, int(0.3 * no_recompute_peak(chain))))
    assert cost is not None and cost > 0
