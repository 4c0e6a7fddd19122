"""Dump the plans of the planner corpus and of the model zoo, to compare a refactor's before and after byte for byte.

    python benchmarks/plan_dump.py --out /tmp/before.json      # on main
    python benchmarks/plan_dump.py --out /tmp/after.json       # on the branch
    cmp /tmp/before.json /tmp/after.json

The corpus is what the planner tests draw (random chains of every version: transients, released outputs,
options, frozen prefixes, offloading), generated deterministically by hypothesis, plus the GPU-like chains of
`benchmarks/results/gpu_chains`. Each chain is planned at several budgets (and bandwidths for version 6)
and each plan replayed by the simulator. The zoo models are profiled on a fixed input with sizes only
(`timed=False`: sizes are exact and deterministic, times are not) and their chains planned with times
derived from the sizes, so that the dump depends on the code alone.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from lightning_rotor.chain import Chain  # noqa: E402
from lightning_rotor.planner import InfeasibleBudget, min_feasible_budget, plan  # noqa: E402
from lightning_rotor.simulate import no_recompute_peak, simulate  # noqa: E402

FRACTIONS = (0.0, 0.3, 0.5, 0.8, 1.0)  # of the way from the smallest feasible budget to the no-recompute peak
ZOO = {"mlp": 8, "hetero": 8, "gpt": 2, "mobilenet": 2, "resnet18": 2}


def corpus(examples: int) -> list[Chain]:
    """Chains drawn by the planner tests' strategies, the same ones on every run (derandomized)."""
    from test_frozen import frozen_chains
    from test_offload_planner import offload_chains, saved_chains
    from test_options import chains_with_options
    from test_planner import chains

    drawn: list[Chain] = []
    strategies = [
        chains(),
        chains_with_options(),
        frozen_chains().map(lambda pair: pair[0]),
        offload_chains(),
        saved_chains(),
    ]

    @settings(max_examples=examples, derandomize=True, database=None, deadline=None)
    @given(st.one_of(*strategies))
    def collect(chain: Any) -> None:
        drawn.append(chain)

    collect()
    return drawn


def gpu_chains() -> list[tuple[str, Chain]]:
    folder = ROOT / "benchmarks" / "results" / "gpu_chains"
    return [(path.stem, Chain.from_dict(json.loads(path.read_text()))) for path in sorted(folder.glob("*.json"))]


def plans_of(chain: Chain, bandwidths: tuple[float | None, ...] = (None,)) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for bandwidth in bandwidths:
        try:
            low = min_feasible_budget(chain, bandwidth=bandwidth)
        except Exception as error:  # a chain nothing fits: its message is the dump
            rows.append({"bandwidth": bandwidth, "error": f"{type(error).__name__}: {error}"})
            continue
        high = max(low, no_recompute_peak(chain))
        for fraction in FRACTIONS:
            budget = int(low + fraction * (high - low))
            row: dict[str, Any] = {"bandwidth": bandwidth, "budget": budget}
            try:
                found = plan(chain, budget, bandwidth=bandwidth)
            except InfeasibleBudget as error:
                row["error"] = str(error)
            else:
                replayed = chain if bandwidth is None else chain.with_transfer(bandwidth)
                sim = simulate(replayed, found.ops)
                row["plan"] = found.to_dict()
                row["simulated"] = {"peak": sim.peak, "time": round(sim.time, 9)}
            rows.append(row)
    return rows


def zoo_chains() -> list[tuple[str, Chain]]:
    """The zoo models profiled for sizes only; times derived from sizes so the dump is deterministic."""
    from lightning_rotor.bench.workload import load_workload
    from lightning_rotor.profile import profile_chain

    found = []
    for name, batch in ZOO.items():
        torch.manual_seed(0)
        w = load_workload(name, batch_size=batch, size="tiny", device=torch.device("cpu"))
        profile = profile_chain(
            w.stages, w.x, names=w.stage_names, loss_tmp=lambda out, w=w: w.loss(out, w.y), timed=False
        )
        data = profile.chain.to_dict()
        length = len(data["out_size"])
        data["fwd_time"] = [1.0 + (data["out_size"][k] % 997) / 997 for k in range(length)]
        data["bwd_time"] = [2.0 * t for t in data["fwd_time"]]
        found.append((name, Chain.from_dict(data)))
        found.append((name + ":sizes", profile.chain))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--examples", type=int, default=150, help="corpus chains drawn")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dump: dict[str, Any] = {"corpus": [], "gpu": {}, "zoo": {}}
    for chain in corpus(args.examples):
        dump["corpus"].append({"chain": chain.to_dict(), "plans": plans_of(chain, (None, 0.0))})
    for name, chain in gpu_chains():
        dump["gpu"][name] = plans_of(chain, (0.0, 12e9, 25e9))
    for name, chain in zoo_chains():
        dump["zoo"][name] = {"chain": chain.to_dict()}
        if not name.endswith(":sizes"):
            dump["zoo"][name]["plans"] = plans_of(chain)
    Path(args.out).write_text(json.dumps(dump, indent=1, sort_keys=True) + "\n")
    print(f"plan_dump: {len(dump['corpus'])} corpus chains, {len(dump['gpu'])} GPU-like, {len(dump['zoo'])} zoo")


if __name__ == "__main__":
    main()
