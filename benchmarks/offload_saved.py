"""How much of recompute-only's overhead offloading removes on the example chains (predicted times).

For each chain in examples/*.json, `offloadable[k]` is set to `max(0, saved_size[k] - out_size[k])`: everything
a stage saves beyond its output (a realistic figure: the profiler's measure excludes a_k's and a_{k+1}'s storages
and parameters, so this is about what it finds on these models). At 30% and 50% of the no-recompute peak (the
floor where it is higher) and 12 and 25 GB/s, it prints the share of the overhead of recomputing only
(`recompute_only_time - no_recompute_time`) that planning with offloading removes, once with stage inputs only
(`offloadable` 0, the value family) and once with saved parts too.

Predictions of `plan()` scored by the simulator, not measured steps. The chains' times come from the files
(docs/planner.md, "Offloading", says what is known of how they were measured).

    python benchmarks/offload_saved.py
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from lightning_rotor.chain import Chain
from lightning_rotor.planner import min_feasible_budget, plan
from lightning_rotor.simulate import no_recompute_peak

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
FRACTIONS = (0.3, 0.5)
BANDWIDTHS = (12e9, 25e9)


def with_saved_parts(chain: Chain) -> Chain:
    """`chain` whose stages may move everything they save beyond their output."""
    offloadable = [max(0, s - o) for s, o in zip(chain.saved_size, chain.out_size, strict=True)]
    return dataclasses.replace(chain, offloadable=offloadable)


def removed(chain: Chain, budget: int, bandwidth: float) -> tuple[float, float, float]:
    """(share of the overhead removed, time with offloading, recompute-only time); the share is 0 without overhead."""
    result = plan(chain, budget, bandwidth=bandwidth)
    assert result.recompute_only_time is not None
    overhead = result.recompute_only_time - chain.no_recompute_time()
    share = (result.recompute_only_time - result.time) / overhead if overhead > 0 else 0.0
    return share, result.time, result.recompute_only_time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bandwidth", type=float, nargs="*", default=list(BANDWIDTHS), help="bytes/s")
    bandwidths = parser.parse_args().bandwidth
    print("| chain | budget | GB/s | recompute-only overhead | removed, inputs only | removed, with saved parts |")
    print("|---|---:|---:|---:|---:|---:|")
    for path in sorted(EXAMPLES.glob("*.json")):
        chain = Chain.load(path)
        saved = with_saved_parts(chain)
        peak, low = no_recompute_peak(chain), min_feasible_budget(chain)
        for fraction in FRACTIONS:
            budget = max(low, int(fraction * peak))
            label = f"{fraction:.0%}" + (f" (floor {budget / peak:.0%})" if budget == low > fraction * peak else "")
            for bandwidth in bandwidths:
                inputs, _, alone = removed(chain, budget, bandwidth)
                both, _, _ = removed(saved, budget, bandwidth)
                overhead = alone / chain.no_recompute_time() - 1
                print(f"| {path.name} | {label} | {bandwidth / 1e9:g} | {overhead:.1%} | {inputs:.1%} | {both:.1%} |")


if __name__ == "__main__":
    main()
