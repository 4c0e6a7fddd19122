"""Offloading on a GPU: measured against predicted step time, and allocator peak against the budget, with
offloading on and off, for a few zoo models and budgets.

    python benchmarks/offload_gpu.py                              # CUDA: bench-size gpt and resnet18
    python benchmarks/offload_gpu.py --models gpt --budgets 0.3 0.5 --repeats 11
    python benchmarks/offload_gpu.py --cpu --size tiny --repeats 3  # exercises the script without a GPU

Per model the chain is profiled once on the device and the transfer bandwidth measured
(`offload.measure_bandwidth`, or `--bandwidth 12GB/s`). Per budget (a fraction of the
no-recomputation peak) three schedules run, interleaved, `--repeats` steps each after a warm-up:

- `off`: the planner's plan without offloading (chain bandwidth 0);
- `on`: the planner's plan on the chain with the bandwidth (offloads once the planner makes them;
  until then the same ops as `off`, which the `offloads` column shows);
- `inserted`: `off`'s plan with an offload inserted at each split `Fc s, Fn s+1 …` whose `a_s` is
  plain (after `Fc s`, prefetched before the right part's `B s2`), kept where the simulator accepts
  it: the executor's transfers measured even before the planner plans them;
- `saved`: `off`'s plan with what a recorded stage saved offloaded: `OffloadSaved s` after each
  `Fe s` whose `B s+1` is followed by `B s`, `PrefetchSaved s` before that `B s+1` (the planner
  family's placement), where the simulator accepts it; the chain is profiled with offloading on,
  so it carries each stage's `offloadable` bytes;
- `both`: `inserted`'s plan with the saved parts offloaded as in `saved`.

Columns: offloads (stage inputs and saved parts moved per step), predicted step (simulator, ms),
measured step (median, ms) and their ratio; predicted peak and measured peak (CUDA:
`torch.cuda.max_memory_allocated` above the step's start, plus the input, as `CudaMemoryProbe`;
`--cpu`: `MemoryProbe`'s exact tensor accounting), the measured peak over the budget; host memory
predicted and measured. On CPU the copies are
synchronous: the times there say nothing about overlap.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_rotor.bench.workload import Workload, load_workload
from lightning_rotor.budget import format_bandwidth, format_bytes, parse_bandwidth
from lightning_rotor.chain import Chain
from lightning_rotor.execute import PlanRunner
from lightning_rotor.memory import CudaMemoryProbe, MemoryProbe
from lightning_rotor.offload import measure_bandwidth
from lightning_rotor.ops import Op, OpKind
from lightning_rotor.planner import InfeasibleBudget, min_feasible_budget, plan
from lightning_rotor.profile import profile_chain
from lightning_rotor.simulate import no_recompute_peak, simulate


def insert_offloads(chain: Chain, ops: list[Op]) -> list[Op]:
    """`ops` with `Offload s` after each `Fc s, Fn s+1 …` split (the sweep may be empty) whose `a_s` (s >= 1, not
    empty) the simulator accepts offloading, and `Prefetch s` before the split's `B s2` (the planner family's
    placement, without its rule that the copy ends within the sweep)."""
    ops = list(ops)
    points = []
    for i, op in enumerate(ops):
        s = op.stage
        if op.kind is not OpKind.FC or s is None or s < 1 or chain.sizes[s] == 0:
            continue
        j = i + 1
        while j < len(ops) and ops[j] == Op(OpKind.FN, s + j - i):
            j += 1
        if Op(OpKind.B, s + j - i) in ops[j:]:  # without a sweep to hide it, the copy overlaps the right part
            points.append((i, s, ops.index(Op(OpKind.B, s + j - i), j)))
    for i, s, b in reversed(points):
        tried = [*ops[: i + 1], Op(OpKind.OFFLOAD, s), *ops[i + 1 : b], Op(OpKind.PREFETCH, s), *ops[b:]]
        try:
            simulate(chain, tried)
        except ValueError:
            continue
        ops = tried
    return ops


def insert_saved_offloads(chain: Chain, ops: list[Op]) -> list[Op]:
    """`ops` with `OffloadSaved s` after an `Fe s` and `PrefetchSaved s` before a `B s+1` that `B s` follows, for
    each stage with `offloadable` bytes, where the simulator accepts it (the planner family's placement)."""
    ops = list(ops)
    for s in range(chain.length - 1):
        if not chain.offloadable[s]:
            continue
        for i, op in enumerate(ops):
            if op != Op(OpKind.FE, s) or Op(OpKind.B, s + 1) not in ops[i:]:
                continue
            b = ops.index(Op(OpKind.B, s + 1), i)
            if b + 1 == len(ops) or ops[b + 1] != Op(OpKind.B, s):
                continue
            offload, prefetch = Op(OpKind.OFFLOAD_SAVED, s), Op(OpKind.PREFETCH_SAVED, s)
            tried = [*ops[: i + 1], offload, *ops[i + 1 : b], prefetch, *ops[b:]]
            try:
                simulate(chain, tried)
            except ValueError:
                continue
            ops = tried
            break
    return ops


@dataclass
class Run:
    """One schedule at one budget, and what its steps measured."""

    label: str
    ops: list[Op]
    predicted_time: float
    predicted_peak: int
    predicted_host: int
    runner: PlanRunner
    times: list[float] = field(default_factory=list)
    peaks: list[int] = field(default_factory=list)
    hosts: list[int] = field(default_factory=list)
    left: list[int] = field(default_factory=list)  # host bytes still held after each step (0: all came back)


def step(w: Workload, run: Run, seed: int, cuda: bool) -> None:
    """One forward and backward through the plan, timed and measured; parameter gradients exist beforehand
    (zeros, not set to None) so that the allocator's peak holds activations only."""
    for p in w.model.parameters():
        if p.requires_grad:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            else:
                p.grad.zero_()
    torch.manual_seed(seed)
    probe: Any = CudaMemoryProbe(w.device) if cuda else MemoryProbe(w.model)
    if cuda:
        torch.cuda.synchronize(w.device)
    start = time.perf_counter()
    with probe:
        probe.track(w.x)
        loss = w.loss(run.runner(w.x), w.y)
        loss.backward()
        del loss
    if cuda:
        torch.cuda.synchronize(w.device)
    run.times.append(time.perf_counter() - start)
    run.peaks.append(probe.peak)
    run.hosts.append(probe.host_peak)
    run.left.append(probe.host_current)


def runs_for(w: Workload, chain: Chain, bandwidth: float, budget: int) -> list[Run]:
    """The three schedules at `budget` bytes (see the module docstring)."""
    on_chain = chain.with_transfer(bandwidth)
    off = plan(chain, budget)
    on = plan(on_chain, budget)
    inserted = insert_offloads(on_chain, off.ops)
    schedules = {
        "off": off.ops,
        "on": on.ops,
        "inserted": inserted,
        "saved": insert_saved_offloads(on_chain, off.ops),
        "both": insert_saved_offloads(on_chain, inserted),
    }
    out = []
    for label, ops in schedules.items():
        sim = simulate(on_chain if label != "off" else chain, ops)
        runner = PlanRunner(
            w.stages, ops, w.stage_names, in_free=chain.in_free, sizes=chain.sizes, offloadable=chain.offloadable
        )
        out.append(Run(label, ops, sim.time, sim.peak, sim.host_peak, runner))
    return out


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(wd) for c, wd in zip(r, widths, strict=True)) for r in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt", "resnet18"])
    parser.add_argument("--budgets", nargs="+", type=float, default=[0.3, 0.5], help="fractions of the plain peak")
    parser.add_argument("--batch-size", type=int, default=None, help="default: 32 on CUDA, 4 with --cpu")
    parser.add_argument("--size", default=None, choices=["tiny", "bench", "full"], help="default: bench (tiny: --cpu)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--bandwidth", default=None, help="bytes/s or a rate ('12GB/s'); default: measured")
    parser.add_argument("--cpu", action="store_true", help="run on CPU, copies synchronous (exercises the script)")
    args = parser.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        print("offload_gpu.py needs CUDA, which is not available here; run it on a GPU machine, or with --cpu to "
              "exercise it on CPU (synchronous copies: no overlap to measure)", file=sys.stderr)  # fmt: skip
        return 2
    cuda = not args.cpu
    device = torch.device("cuda" if cuda else "cpu")
    size = args.size or ("bench" if cuda else "tiny")
    batch = args.batch_size or (32 if cuda else 4)
    given = parse_bandwidth(args.bandwidth) if args.bandwidth is not None else None
    header = ["model", "budget", "schedule", "offloads", "pred ms", "meas ms", "meas/pred", "pred peak",
              "meas peak", "peak/budget", "pred host", "meas host"]  # fmt: skip
    rows = [header]
    print(f"device {torch.cuda.get_device_name(device) if cuda else 'cpu'}, size {size}, batch {batch}")
    for name in args.models:
        w = load_workload(name, batch_size=batch, size=size, device=device)
        if not w.stages:
            print(f"{name}: not a plain nn.Sequential; skipped", file=sys.stderr)
            continue
        chain = profile_chain(w.stages, w.x, names=w.stage_names, offload=True).chain  # offloadable too
        largest = max(chain.sizes[1 : chain.length], default=0)
        bandwidth = given or measure_bandwidth(device, min(max(largest, 2**20), 2**28))
        print(f"{name}: {chain.length} stages, largest stage input {format_bytes(largest)}, "
              f"bandwidth {format_bandwidth(bandwidth)}")  # fmt: skip
        low, high = min_feasible_budget(chain), no_recompute_peak(chain)
        for fraction in args.budgets:
            budget = int(fraction * high)
            if budget < low:
                print(f"{name} at {fraction:.0%}: below the smallest feasible budget {format_bytes(low)}; skipped")
                continue
            try:
                runs = runs_for(w, chain, bandwidth, budget)
            except InfeasibleBudget as err:
                print(f"{name} at {fraction:.0%}: {err}")
                continue
            for run in runs:  # warm-up: kernels, the allocator, the pinned buffers
                step(w, run, 0, cuda)
                run.times.clear(), run.peaks.clear(), run.hosts.clear(), run.left.clear()
            for r in range(args.repeats):  # interleaved, so that drift hits every schedule alike
                for run in runs:
                    step(w, run, r, cuda)
            for run in runs:
                measured = statistics.median(run.times)
                peak, host = max(run.peaks), max(run.hosts)
                rows.append([
                    name, f"{fraction:.0%} {format_bytes(budget)}", run.label,
                    str(sum(op.kind is OpKind.OFFLOAD or op.kind is OpKind.OFFLOAD_SAVED for op in run.ops)),
                    f"{run.predicted_time * 1e3:.2f}", f"{measured * 1e3:.2f}",
                    f"{measured / run.predicted_time:.2f}" if run.predicted_time > 0 else "-",
                    format_bytes(run.predicted_peak), format_bytes(peak), f"{peak / budget:.3f}",
                    format_bytes(run.predicted_host), format_bytes(host),
                ])  # fmt: skip
        del w
        if cuda:
            torch.cuda.empty_cache()
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
