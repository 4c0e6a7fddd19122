"""Planner time and memory on one long chain: `python benchmarks/planner_scale.py L [SLOTS]`.

Random heterogeneous chain (`random.Random(0)`), budget 30% of the no-recompute peak, the
whole `plan()` call on the default threads; prints seconds and the process's peak RSS.
Run one size per process, so the RSS is that size's. Figures: docs/planner.md.
"""

import random
import resource
import sys
import time

from lightning_rotor.chain import Chain
from lightning_rotor.planner import plan


def long_chain(length: int) -> Chain:
    rng = random.Random(0)
    out = [rng.randint(1000, 100000) for _ in range(length)]
    return Chain(
        input_size=5000,
        out_size=out,
        saved_size=[o + rng.randint(0, 100000) for o in out],
        fwd_time=[rng.uniform(1e-3, 5e-3) for _ in range(length)],
        bwd_time=[rng.uniform(2e-3, 1e-2) for _ in range(length)],
        fwd_tmp=[rng.randint(0, 1000) for _ in range(length)],
        bwd_tmp=[rng.randint(0, 1000) for _ in range(length)],
    )


def main() -> None:
    length = int(sys.argv[1])
    slots = int(sys.argv[2]) if len(sys.argv) > 2 else 500
    chain = long_chain(length)
    start = time.perf_counter()
    result = plan(chain, 0.3, slots=slots)
    seconds = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"L={length} slots={slots} plan={seconds:.2f}s peak_rss={rss:.0f}MiB recomputed={result.recomputed_stages}")


if __name__ == "__main__":
    main()
