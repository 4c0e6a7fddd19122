"""What rotor's executor costs per op: torch's own `checkpoint_sequential` against the very same schedule
run through `PlanRunner`, on a chain of short stages (1-3 ms each on one CPU thread), or on a zoo model.

    python benchmarks/executor_overhead.py --stages 20 --segments 4 --repeats 21
    python benchmarks/executor_overhead.py --model hetero --batch 32 --segments 4 7 --repeats 101

Both run one training step per round, interleaved; the ratio of medians is the executor's
overhead on that schedule (docs/benchmarks.md). With `--model`, the step without
recomputation is compared too (torch's plain step against the executor's no-recompute plan),
which prices the executor where nothing is recomputed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential

from lightning_rotor.bench.measure import train_step
from lightning_rotor.bench.uniform import checkpoint_sequential_ops
from lightning_rotor.bench.workload import Workload, load_workload
from lightning_rotor.execute import PlanRunner
from lightning_rotor.models.mlp import Dense  # tanh(Linear(x)): a short stage
from lightning_rotor.ops import no_recompute_ops
from lightning_rotor.stages import sequential_stages


def dense_workload(stages: int, width: int, batch: int) -> Workload:
    model = nn.Sequential(*[Dense(width) for _ in range(stages)])
    found = sequential_stages(model)
    x = torch.randn(batch, width)
    return Workload(
        name="dense",
        model=model,
        x=x,
        y=None,
        loss=lambda out, _y: out.sum(),
        device=x.device,
        stage_names=list(found.names),
        stages=list(found.modules),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a zoo model (lightning-rotor bench --model) instead of Dense")
    parser.add_argument("--stages", type=int, default=20)
    parser.add_argument("--segments", type=int, nargs="+", default=[4])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.model:
        w = load_workload(args.model, batch_size=args.batch, size="bench", device=torch.device("cpu"))
    else:
        w = dense_workload(args.stages, args.width, args.batch)
    length = len(w.stages)
    seq = nn.Sequential(*w.stages)
    runs = {}
    if args.model:
        runs["plain"] = w.model
        runs["exec:plain"] = PlanRunner(w.stages, no_recompute_ops(length), w.stage_names)
    for s in args.segments:
        runs[f"cs{s}"] = lambda v, s=s: checkpoint_sequential(seq, s, v, use_reentrant=False)
        runs[f"exec:cs{s}"] = PlanRunner(w.stages, checkpoint_sequential_ops(length, s), w.stage_names)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for forward in runs.values():
        train_step(w, forward, 0)
    for _ in range(args.repeats):
        for name, forward in runs.items():
            start = time.perf_counter()
            train_step(w, forward, 0)
            times[name].append(time.perf_counter() - start)
    print(
        f"{args.model or 'Dense'}: {length} stages, {args.repeats} interleaved rounds, "
        f"{torch.get_num_threads()} thread(s)"
    )
    medians = {}
    for name, ts in times.items():
        medians[name] = statistics.median(ts)
        spread = (max(ts) - min(ts)) / medians[name]
        print(f"{name:12s} median {medians[name] * 1e3:8.2f} ms  min {min(ts) * 1e3:8.2f} ms  spread {spread:.0%}")
    for name in runs:
        if name.startswith("exec:"):
            print(f"ratio {name} / {name[5:]} (medians): {medians[name] / medians[name[5:]]:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
