"""Plan a saved chain for several budgets, offline: no model, no tensors, just numbers.

    python examples/offline_planning.py                  # profiles a small ResNet first, saves chain.json
    python examples/offline_planning.py path/chain.json  # or plans a chain you saved

A chain (docs/memory-model.md) is what profiling measured: per-stage times
and sizes. Planning needs only that, so budgets can be explored on a laptop for a
model that trains elsewhere. Save a chain from a training run with
`Checkpointable.chain.save(path)`, or from a Lightning checkpoint's `["rotor"]` entry.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from lightning_rotor.budget import format_bytes
from lightning_rotor.chain import Chain
from lightning_rotor.planner import InfeasibleBudget, min_feasible_budget, plan
from lightning_rotor.simulate import no_recompute_peak, simulate


def profile_resnet(path: Path) -> Chain:
    """Measure a small ResNet-18 on one batch and save its chain to `path`."""
    from lightning_rotor.models import example_input, get_model
    from lightning_rotor.profile import profile_chain
    from lightning_rotor.stages import sequential_stages

    model = get_model("resnet18", width=8, num_classes=10)
    x, _ = example_input("resnet18", 16, image_size=32, num_classes=10)
    stages = sequential_stages(model)
    names = list(stages.names)
    chain = profile_chain(stages, x, names=names).chain
    chain.save(path)
    print(f"profiled {len(names)} stages, saved {path}")
    return chain


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("chain", nargs="?", type=Path, help="a chain JSON file (default: profile a small ResNet)")
    parser.add_argument("--budgets", nargs="+", default=["100%", "85%", "70%", "60%", "50%"])
    args = parser.parse_args()

    torch.manual_seed(0)
    chain = Chain.load(args.chain) if args.chain else profile_resnet(Path("chain.json"))
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
