"""What rotor's executor costs per op: torch's own `checkpoint_sequential` against the very same schedule
run through `PlanRunner`, on a chain of short stages (1-3 ms each on one CPU thread).

    python benchmarks/executor_overhead.py --stages 20 --segments 4 --repeats 21

Both run one training step per round, interleaved; the ratio of medians is the executor's
overhead on that schedule (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential

from lightning_rotor.bench.uniform import checkpoint_sequential_ops
from lightning_rotor.execute import PlanRunner
from lightning_rotor.models.mlp import Dense  # tanh(Linear(x)): a short stage
from lightning_rotor.stages import sequential_stages


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=20)
    parser.add_argument("--segments", type=int, default=4)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = nn.Sequential(*[Dense(args.width) for _ in range(args.stages)])
    x = torch.randn(args.batch, args.width)
    stages = sequential_stages(model)
    runner = PlanRunner(stages, checkpoint_sequential_ops(args.stages, args.segments), list(stages.names))
    seq = nn.Sequential(*stages.modules)
    runs = {
        "torch checkpoint_sequential": lambda v: checkpoint_sequential(seq, args.segments, v, use_reentrant=False),
        "rotor executor, same schedule": runner,
    }
    times: dict[str, list[float]] = {name: [] for name in runs}

    def step(forward) -> None:
        model.zero_grad(set_to_none=True)
        forward(x).sum().backward()

    for forward in runs.values():
        step(forward)
    for _ in range(args.repeats):
        for name, forward in runs.items():
            start = time.perf_counter()
            step(forward)
            times[name].append(time.perf_counter() - start)
    with torch.no_grad():
        stage_ms = []
        for stage in stages.modules:
            start = time.perf_counter()
            stage(x)
            stage_ms.append((time.perf_counter() - start) * 1e3)
    print(f"{args.stages} stages, forward {min(stage_ms):.2f}-{max(stage_ms):.2f} ms each, "
          f"{args.segments} segments, {args.repeats} interleaved rounds, {torch.get_num_threads()} thread(s)")
    medians = {}
    for name, ts in times.items():
        medians[name] = statistics.median(ts)
        spread = (max(ts) - min(ts)) / medians[name]
        print(f"{name:32s} median {medians[name] * 1e3:7.2f} ms  min {min(ts) * 1e3:7.2f} ms  spread {spread:.0%}")
    torch_ms, rotor_ms = medians.values()
    print(f"ratio (rotor / torch, medians): {rotor_ms / torch_ms:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
