"""The size trace's own cost per probed op, without torch: a block's probe count replayed through the trace.

    PYTHONPATH=. python benchmarks/trace_replay.py --models litgpt gpt
    cd /other/checkout && PYTHONPATH=. python /this/checkout/benchmarks/trace_replay.py   # another checkout's trace

One `Fe`+`B` of stage `--stage` of the chain `benchmarks/profile_cost.py`'s model profiles (as
`benchmarks/probe_op_cost.py` runs it) is probed once, and the storages alive after each op recorded (their order
and sizes). Then, `--repeats` times, a fresh `SizeTrace` is given the same count op after op, as `MemoryProbe` gives
it (a freed storage's size subtracted, a new one's added, the peak raised through `higher`), and the peak's terms
used once at the end (its guards settled, as a profile's figures do). Printed: microseconds an op for the count and
for the settling, fastest of the repeats (pure Python: steadier than a probed run on a shared machine), and the
guards recorded (the same on any checkout whose traces are the same).
"""

from __future__ import annotations

import gc
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_op_cost import profiled_stages, stage_arguments, variants  # noqa: E402

from lightning_rotor import size_trace  # noqa: E402
from lightning_rotor.memory import MemoryProbe  # noqa: E402

Op = tuple[list[int], list[tuple[int, int]]]  # storages freed, storages made (index, bytes)


def recorded_ops(name: str, stage: int) -> list[Op]:
    """Per op of a probed `Fe`+`B` of `stage`: the storages the probe stopped counting and those it began to."""
    stages, value = profiled_stages(name)
    with torch.no_grad():
        for s in stages[:stage]:
            value = s(value)
    alive: list[list[tuple[int, int]]] = []
    add = MemoryProbe._add

    def recording(probe: MemoryProbe, *args: Any, **kwargs: Any) -> None:
        add(probe, *args, **kwargs)
        alive.append([(next(iter(size_trace.terms_of(v) or {0: 0})), int(v)) for v in probe._live.values()])

    MemoryProbe._add = recording  # type: ignore[method-assign]
    try:
        variants(stages[stage], value)["probe traced"]()
    finally:
        MemoryProbe._add = add  # type: ignore[method-assign]
    ops, before = [], {}
    for live in alive:
        now = dict(live)
        ops.append(([i for i in before if i not in now], [(i, n) for i, n in live if i not in before]))
        before = now
    return ops


def replayed(ops: list[Op]) -> tuple[float, float, int]:
    """(seconds counting, seconds settling the peak, guards) of one replay."""
    trace = size_trace.SizeTrace()
    with size_trace.traced(trace):
        sizes: dict[int, int] = {}
        start = time.perf_counter()
        current, peak = 0, 0
        for freed, made in ops:
            for i in freed:
                current -= sizes[i]
            for i, n in made:
                sizes[i] = trace._sized(n, i)
                current += sizes[i]
            peak = trace.higher(peak, current)
        counted = time.perf_counter()
        _ = peak - current
        settled = time.perf_counter()
    return counted - start, settled - counted, len(trace.guards)


def main() -> None:
    args = stage_arguments(__doc__.splitlines()[0], repeats=300)
    for name in args.models:
        ops = recorded_ops(name, args.stage)
        gc.disable()
        runs = [replayed(ops) for _ in range(args.repeats)]
        gc.enable()
        count, settle = (min(r[i] for r in runs) / len(ops) * 1e6 for i in (0, 1))
        print(f"{name} stage {args.stage}: {len(ops)} ops, count {count:.2f} us an op, settling {settle:.2f}, "
              f"{runs[0][2]} guards")  # fmt: skip


if __name__ == "__main__":
    main()
