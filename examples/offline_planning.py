"""Plan a saved chain for several budgets, offline: no model, no tensors, just numbers.

    python examples/offline_planning.py                  # profiles a small ResNet first, saves chain.json
    python examples/offline_planning.py path/chain.json  # or plans a chain you saved
    python examples/offline_planning.py examples/resnet50_b32.json --budgets 50% 30%

A chain (docs/memory-model.md) is what profiling measured: per-stage times
and sizes. Planning needs only that, so budgets can be explored on a laptop for a
model that trains elsewhere. Save a chain from a training run with
`Checkpointable.chain.save(path)`, or from a Lightning checkpoint's `["rotor"]` entry.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

from lightning_rotor import (
    Chain,
    Checkpointable,
    InfeasibleBudget,
    format_bytes,
    min_feasible_budget,
    no_recompute_peak,
    plan,
    simulate,
)
from lightning_rotor.models import example_input, get_model


def profile_resnet(path: Path, width: int, batch_size: int, image_size: int) -> Chain:
    """Measure a small ResNet-18 on one training batch and save its chain to `path`."""
    model = Checkpointable(get_model("resnet18", width=width, num_classes=10), "100%")
    x, y = example_input("resnet18", batch_size, image_size=image_size, num_classes=10)
    F.cross_entropy(model(x), y).backward()  # the first training call profiles the stages
    model.chain.save(path)
    print(f"profiled {model.chain.length} stages, saved {path}")
    return model.chain


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("chain", nargs="?", type=Path, help="a chain JSON file (default: profile a small ResNet)")
    parser.add_argument("--budgets", nargs="+", default=["100%", "85%", "70%", "60%", "50%"])
    parser.add_argument("--save", type=Path, default=Path("chain.json"), help="where the profiled chain goes")
    parser.add_argument("--width", type=int, default=8, help="the profiled ResNet-18's first width")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=32)
    args = parser.parse_args()

    torch.manual_seed(0)
    if args.chain:
        chain = Chain.load(args.chain)
    else:
        chain = profile_resnet(args.save, args.width, args.batch_size, args.image_size)
    peak = no_recompute_peak(chain)
    print(
        f"{chain.length} stages; no recomputation: peak {format_bytes(peak)}, "
        f"step {chain.no_recompute_time() * 1e3:.2f} ms; smallest feasible budget "
        f"{format_bytes(min_feasible_budget(chain))}"
    )
    print(f"{'budget':>10}  {'peak':>11}  {'time':>9}  {'overhead':>8}  recomputed")
    for budget in args.budgets:
        try:
            chosen = plan(chain, budget)
        except InfeasibleBudget as err:
            print(f"{budget:>10}  infeasible: {err}")
            continue
        replay = simulate(chain, chosen.ops)  # the simulator is the referee
        assert replay.peak == chosen.peak and replay.peak <= chosen.budget
        overhead = chosen.time / chain.no_recompute_time() - 1
        print(
            f"{budget:>10}  {format_bytes(chosen.peak):>11}  {chosen.time * 1e3:7.2f}ms  {overhead:8.1%}  "
            f"{chosen.recomputed_stages}"
        )


if __name__ == "__main__":
    main()
