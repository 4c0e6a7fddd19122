"""Small chains are planned on the calling thread: a second thread's start and row hand-offs cost more than the
whole fill of a chain under 16 stages (cpp/planner.cpp, `kParallelMinStages`), so the default of two threads must
not make them slower than one."""

import random
import statistics
import time

from test_planner_threads import random_chain

from lightning_rotor.discretize import resolve_slots
from lightning_rotor.planner import min_feasible_budget, solve_discretized
from lightning_rotor.simulate import no_recompute_peak


def test_a_six_stage_chain_solves_as_fast_on_two_threads_as_on_one():
    """Calls alternate between one and two threads, so the load of the machine hits both alike. With a thread
    started per solve, two threads took 1.9x one's median (37 us against 19 us)."""
    chain = random_chain(random.Random(3), 6)
    budget = (min_feasible_budget(chain) + no_recompute_peak(chain)) // 2
    slots = resolve_slots(None, chain.length)
    seconds: dict[int, list[float]] = {1: [], 2: []}
    for _ in range(300):
        for threads in (1, 2):
            start = time.perf_counter()
            solve_discretized(chain, budget, slots, threads)
            seconds[threads].append(time.perf_counter() - start)
    assert statistics.median(seconds[2]) < 1.3 * statistics.median(seconds[1])
