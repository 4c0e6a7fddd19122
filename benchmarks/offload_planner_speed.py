"""Planning time with offloading (issue 28: 50 stages under 1 s, L=150 under 10 s).

    python benchmarks/offload_planner_speed.py 50 150

`planner_speed.bench_chain(L)` with every stage's saved part beyond its output movable, at 12 GB/s,
automatic slots, 30% and 50% of the no-recompute peak: the offloading DP alone, the recompute-only DP
alone, and `plan()` (which runs both and scores them with the simulator). One run each.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]

from planner_speed import bench_chain  # noqa: E402

from lightning_rotor.discretize import resolve_slots  # noqa: E402
from lightning_rotor.planner import plan, solve_discretized  # noqa: E402
from lightning_rotor.simulate import no_recompute_peak  # noqa: E402


def main(lengths: list[int]) -> None:
    for length in lengths:
        chain = bench_chain(length)
        movable = [s - o for s, o in zip(chain.saved_size, chain.out_size, strict=True)]
        chain = dataclasses.replace(chain, offloadable=movable).with_transfer(12e9)
        peak, slots = no_recompute_peak(chain), resolve_slots(None, length)
        for fraction in (0.3, 0.5):
            budget = int(fraction * peak)
            start = time.perf_counter()
            solve_discretized(chain, budget, slots)
            offloading = time.perf_counter() - start
            start = time.perf_counter()
            solve_discretized(chain.with_transfer(0.0), budget, slots)
            alone = time.perf_counter() - start
            start = time.perf_counter()
            plan(chain, budget)
            whole = time.perf_counter() - start
            print(
                f"L={length} {fraction:.0%} slots={slots}: offloading DP {offloading:.3f} s, "
                f"recompute-only DP {alone:.3f} s, plan() {whole:.3f} s",
                flush=True,
            )


if __name__ == "__main__":
    main([int(x) for x in sys.argv[1:]] or [50, 150])
