"""Profile a GPT chain with its per-block option "sac" (chain version 5) and compare plans with and without options.

The profiler measures the options itself (`profile_chain(..., options=True)`, what
`Checkpointable(options=True)` runs): option 1 of each block records only the outputs of matmuls and
attention (torch's selective activation checkpointing, `lightning_rotor.selective`'s policy) and
recomputes the rest in its backward. Its figures are measured as the block's own `Fe` figures are
(`MemoryProbe`, the executor's backward), its times in the same timing rounds as the stages'.

Printed: per block the bytes each way saves, then at a few budgets (fractions of the no-recompute
peak, and the smallest feasible one) the planned step time with and without options, relative to
the no-recompute time. Predictions from one profile on this machine, not measured steps.

    python benchmarks/options_profile.py examples/gpt_tiny_sac_options.json
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import time

import torch

from lightning_rotor import Checkpointable
from lightning_rotor.models.gpt import gpt, lm_loss
from lightning_rotor.ops import OpKind
from lightning_rotor.planner import InfeasibleBudget, min_feasible_budget, plan
from lightning_rotor.profile import profile_chain
from lightning_rotor.simulate import no_recompute_peak

FRACTIONS = (0.5, 0.6, 0.7, 0.8, 0.9)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--embd", type=int, default=128)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--measure", type=int, default=0, help="also time this many real steps per budget and way")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = gpt(vocab_size=512, block_size=args.seq, n_layer=args.layers, n_head=4, n_embd=args.embd, dropout=0.0)
    stages = [model.embed, *model.blocks, model.ln_f, model.lm_head]
    names = ["embed", *(f"blocks.{i}" for i in range(args.layers)), "ln_f", "lm_head"]
    idx = torch.randint(0, 512, (args.batch, args.seq))
    chain = profile_chain(stages, idx, names=names, repeats=args.repeats, options=True).chain
    for k, opts in enumerate(chain.options):
        for o in opts:
            fwd, bwd = o.fwd_time / chain.fwd_time[k], o.bwd_time / chain.bwd_time[k]
            print(
                f"{names[k]}: all saves {chain.saved_size[k]} B, {o.name} saves {o.saved_size} B; "
                f"{o.name} forward x{fwd:.2f}, backward x{bwd:.2f}"
            )
    chain.save(args.out)
    without = dataclasses.replace(chain, options=None)
    peak = no_recompute_peak(without)
    base = plan(without, peak).time
    budgets = [("min", min_feasible_budget(chain))] + [(f"{f:.0%}", int(f * peak)) for f in FRACTIONS]
    print(f"\nbudget        with options (Fs ops)   without   (time / no-recompute time {base:.4f} s)")
    for label, nbytes in budgets:
        mine = plan(chain, nbytes)
        fs = sum(op.kind is OpKind.FS for op in mine.ops)
        try:
            theirs = f"{plan(without, nbytes).time / base:.3f}"
        except InfeasibleBudget:  # below the floor without options
            theirs = "infeasible"
        print(f"{label:>4} {nbytes / 2**20:7.2f} MiB   {mine.time / base:.3f} ({fs})        {theirs}")
    if args.measure:
        measure(model, idx, args.measure)


def measure(model: torch.nn.Module, idx: torch.Tensor, steps: int) -> None:
    """Real steps of `Checkpointable` with and without options at each fraction, interleaved, medians."""
    targets = torch.randint(0, 512, idx.shape)
    print("\nmeasured (median step seconds, [min-max]), with options / without, each profiled on its own")
    for fraction in FRACTIONS:
        ways = {on: Checkpointable(copy.deepcopy(model), fraction, options=on) for on in (True, False)}
        times: dict[bool, list[float]] = {True: [], False: []}
        for step in range(steps + 1):  # the first step profiles and plans: not timed
            for on, rotor in ways.items():
                start = time.perf_counter()
                lm_loss(rotor(idx), targets).backward()
                if step:
                    times[on].append(time.perf_counter() - start)
                rotor.zero_grad(set_to_none=True)
        fs = sum(op.kind is OpKind.FS for op in ways[True].plan.ops)
        med = {on: statistics.median(t) for on, t in times.items()}
        print(
            f"{fraction:.0%}: {med[True]:.3f} [{min(times[True]):.3f}-{max(times[True]):.3f}] ({fs} Fs) / "
            f"{med[False]:.3f} [{min(times[False]):.3f}-{max(times[False]):.3f}] = {med[True] / med[False]:.3f}"
        )


if __name__ == "__main__":
    main()
