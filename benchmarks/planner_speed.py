"""Planner speed and memory against a plain C implementation of the rotor dynamic program.

    python benchmarks/planner_speed.py [--repeats 5] [--yardstick-repeats 3]

- L = 150 at 40% of the no-recomputation peak, 500 slots: `plan()` (whole Python call)
  against benchmarks/rotor_yardstick.c (-O2, memory-major O(M·L³), its DP time only),
  compiled here with gcc and fed the same DiscreteChain; their optimal costs must be equal.
  The DP alone is timed on the default threads (min(2, hardware threads)) and on one thread.
- L = 400 at 40%: `plan()` wall time.
- L = 150 and 400: one `simulate()` of the plan (part of `plan()`, which scores up to two candidates with it).
- L = 400: peak resident memory of a fresh process running the C++ DP (VmHWM from /proc/self/status).
Figures are medians with min..max over the repeats. docs/planner.md records a run.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lightning_rotor import _planner
from lightning_rotor.chain import Chain
from lightning_rotor.discretize import discretize
from lightning_rotor.planner import plan
from lightning_rotor.simulate import no_recompute_peak, simulate

HERE = Path(__file__).resolve().parent
MiB = 2**20


def bench_chain(length: int, seed: int = 0) -> Chain:
    """A heterogeneous chain: activations 1–16 MiB, saved graphs up to 3x, times 0.5–8 ms."""
    rng = random.Random(seed)
    out = [rng.randint(1, 16) * MiB for _ in range(length)]
    return Chain(
        input_size=4 * MiB,
        out_size=out,
        saved_size=[o + rng.choice([0, o, 2 * o]) for o in out],
        fwd_time=[rng.uniform(0.5e-3, 4e-3) for _ in range(length)],
        bwd_time=[rng.uniform(1e-3, 8e-3) for _ in range(length)],
        fwd_tmp=[rng.choice([0, 0, rng.randint(1, 8) * MiB]) for _ in range(length)],
        fwd_tmp_nograd=[rng.choice([0, 0, rng.randint(1, 8) * MiB]) for _ in range(length)],
        bwd_tmp=[rng.choice([0, rng.randint(1, 8) * MiB]) for _ in range(length)],
        loss_tmp=MiB,
    )


def spread(values: list[float]) -> str:
    return f"median {statistics.median(values):.4f} s (min {min(values):.4f}, max {max(values):.4f}, n={len(values)})"


def timed_plan(chain: Chain, budget: int, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        plan(chain, budget)
        times.append(time.perf_counter() - start)
    return times


def timed_simulate(chain: Chain, budget: int, repeats: int) -> list[float]:
    """One replay of the plan by the simulator, the referee `plan()` scores its candidates with."""
    ops = plan(chain, budget).ops
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        simulate(chain, ops)
        times.append(time.perf_counter() - start)
    return times


def timed_solve(chain: Chain, budget: int, repeats: int, threads: int = 0) -> list[float]:
    """The C++ dynamic program alone (plus its pybind11 call), like the yardstick's timing.

    `threads`: 0 for the default (min(2, hardware threads)), 1 for a single thread."""
    d = discretize(chain, budget)
    args = (d.size, d.saved, d.fwd_tmp, d.fwd_tmp_nograd, d.bwd_tmp, d.loss_tmp, d.fwd_cost, d.bwd_cost, d.slots)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        _planner.solve(*args, threads=threads)
        times.append(time.perf_counter() - start)
    return times


def compile_yardstick(workdir: Path) -> Path:
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        raise SystemExit("planner_speed: gcc not found; the yardstick is compiled at benchmark time")
    exe = workdir / "rotor_yardstick"
    subprocess.run([gcc, "-O2", "-o", str(exe), str(HERE / "rotor_yardstick.c")], check=True)
    return exe


def yardstick_input(chain: Chain, budget: int, slots: int = 500) -> str:
    d = discretize(chain, budget, slots=slots)
    rows = [
        [d.length, d.slots, d.loss_tmp],
        d.size,
        d.saved,
        d.fwd_tmp,
        d.fwd_tmp_nograd,
        d.bwd_tmp,
        d.fwd_cost,
        d.bwd_cost,
    ]
    return "\n".join(" ".join(str(x) for x in row) for row in rows) + "\n"


def run_yardstick(exe: Path, text: str) -> tuple[int | None, float]:
    """(optimal cost or None, seconds in its dynamic program)."""
    out = subprocess.run([str(exe)], input=text, capture_output=True, text=True, check=True).stdout.split()
    return (None if out[0] == "infeasible" else int(out[0])), float(out[1])


def planner_cost(chain: Chain, budget: int, slots: int = 500) -> int | None:
    d = discretize(chain, budget, slots=slots)
    found = _planner.solve(
        d.size, d.saved, d.fwd_tmp, d.fwd_tmp_nograd, d.bwd_tmp, d.loss_tmp, d.fwd_cost, d.bwd_cost, d.slots
    )
    return None if found is None else found[0]


MEMORY_PROBE = """
import importlib.machinery, importlib.util, json, sys
loader = importlib.machinery.ExtensionFileLoader("_planner", {so!r})
planner = importlib.util.module_from_spec(importlib.util.spec_from_loader("_planner", loader))
loader.exec_module(planner)
args = json.loads(sys.stdin.read())
def high_water():  # VmHWM: peak resident set of this process image (ru_maxrss survives exec)
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
before = high_water()
planner.solve(*args)
print(before, high_water())
"""


def planner_memory(chain: Chain, budget: int) -> tuple[int, int]:
    """(peak RSS bytes before, after) the C++ dynamic program in a fresh process that loads only the extension."""
    d = discretize(chain, budget)
    args = [d.size, d.saved, d.fwd_tmp, d.fwd_tmp_nograd, d.bwd_tmp, d.loss_tmp, d.fwd_cost, d.bwd_cost, d.slots]
    code = MEMORY_PROBE.format(so=_planner.__file__)
    out = subprocess.run(
        [sys.executable, "-c", code], input=json.dumps(args), capture_output=True, text=True, check=True
    ).stdout.split()
    return int(out[0]), int(out[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--yardstick-repeats", type=int, default=3)
    parser.add_argument("--length", type=int, default=150, help="chain length of the yardstick comparison")
    parser.add_argument("--large", type=int, default=400, help="chain length of the large-chain timing")
    args = parser.parse_args(argv)
    results: dict = {}

    chain = bench_chain(args.length)
    budget = int(0.4 * no_recompute_peak(chain))
    with tempfile.TemporaryDirectory() as tmp:
        exe = compile_yardstick(Path(tmp))
        text = yardstick_input(chain, budget)
        ours = planner_cost(chain, budget)
        yard_times, yard_cost = [], None
        for _ in range(args.yardstick_repeats):
            yard_cost, seconds = run_yardstick(exe, text)
            yard_times.append(seconds)
    if yard_cost != ours:
        print(f"MISMATCH: yardstick cost {yard_cost} != planner cost {ours}", file=sys.stderr)
        return 1
    plan_times = timed_plan(chain, budget, args.repeats)
    solve_times = timed_solve(chain, budget, args.repeats)
    single_times = timed_solve(chain, budget, args.repeats, threads=1)
    simulate_times = timed_simulate(chain, budget, args.repeats)
    speedup = statistics.median(yard_times) / statistics.median(plan_times)
    dp_speedup = statistics.median(yard_times) / statistics.median(solve_times)
    single_speedup = statistics.median(yard_times) / statistics.median(single_times)
    threads = _planner.default_threads()
    print(f"L={args.length}, budget {budget} bytes (40% of no-recompute peak), 500 slots; equal optimal cost {ours}")
    print(f"  yardstick (gcc -O2, DP only): {spread(yard_times)}")
    print(f"  lightning_rotor plan():       {spread(plan_times)}")
    print(f"  lightning_rotor DP only, {threads} thread(s): {spread(solve_times)}")
    print(f"  lightning_rotor DP only, 1 thread:    {spread(single_times)}")
    print(f"  simulate() of the plan:       {spread(simulate_times)}")
    print(
        f"  speedup (median/median): whole plan() {speedup:.1f}x, DP against DP {dp_speedup:.1f}x "
        f"({threads} thread(s)), {single_speedup:.1f}x (1 thread)"
    )
    results["compare"] = {
        "length": args.length,
        "budget": budget,
        "cost": ours,
        "yardstick_s": yard_times,
        "plan_s": plan_times,
        "solve_s": solve_times,
        "solve_1thread_s": single_times,
        "simulate_s": simulate_times,
        "threads": threads,
        "speedup": speedup,
        "dp_speedup": dp_speedup,
        "dp_speedup_1thread": single_speedup,
    }

    large = bench_chain(args.large)
    large_budget = int(0.4 * no_recompute_peak(large))
    large_times = timed_plan(large, large_budget, max(1, args.repeats // 2 + 1))
    print(f"L={args.large} at 40%: plan() {spread(large_times)}")
    large_simulate = timed_simulate(large, large_budget, args.repeats)
    print(f"L={args.large} at 40%: simulate() of the plan {spread(large_simulate)}")
    before, after = planner_memory(large, large_budget)
    print(f"L={args.large}: planner process peak RSS {after / MiB:.0f} MiB (before the DP: {before / MiB:.0f} MiB)")
    results["large"] = {
        "length": args.large,
        "plan_s": large_times,
        "simulate_s": large_simulate,
        "rss_before": before,
        "rss_after": after,
    }
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
