"""`lightning-rotor plan CHAIN.json --mem-limit SIZE [--json] [--slots N]`.

Plans a saved chain offline: a readable summary by default, the plan JSON of
docs/memory-model.md with `--json`. Exit codes: 0 planned, 1 bad
input (file, JSON, chain, budget), 2 infeasible budget or bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from lightning_rotor.budget import BudgetError, format_bytes
from lightning_rotor.chain import Chain, ChainError
from lightning_rotor.discretize import DEFAULT_SLOTS
from lightning_rotor.planner import InfeasibleBudget, Plan, PlannerTooLarge, plan

PROG = "lightning-rotor plan"


def compact_ops(ops: Sequence[tuple[Any, ...]]) -> str:
    """`Fe0-3 Fs4:1 Fc5 Fn6-7 Loss B7..0`: runs of one op kind (and stage option) over consecutive stages.

    `Fs k:o` records option `o` of stage `k` (chain version 5); a run of them on one option is `Fs2-4:1`.
    """
    parts: list[str] = []
    i = 0
    while i < len(ops):
        kind = ops[i][0]
        if kind == "Loss":
            parts.append("Loss")
            i += 1
            continue
        first, option = ops[i][1], ops[i][2:]
        step = -1 if kind == "B" else 1
        j = i
        while (
            j + 1 < len(ops)
            and ops[j + 1][0] == kind
            and ops[j + 1][2:] == option
            and ops[j + 1][1] == ops[j][1] + step
        ):
            j += 1
        last = ops[j][1]
        suffix = f":{option[0]}" if option else ""
        if last == first:
            parts.append(f"{kind}{first}{suffix}")
        else:
            parts.append(f"{kind}{first}{'-' if step == 1 else '..'}{last}{suffix}")
        i = j + 1
    return " ".join(parts)


def summary(chain: Chain, result: Plan, source: str) -> str:
    slower = result.time / result.no_recompute_time - 1 if result.no_recompute_time > 0 else 0.0
    return "\n".join(
        [
            f"chain:   {source} ({chain.length} stages)",
            f"budget:  {format_bytes(result.budget)} ({result.budget} bytes)",
            f"peak:    {format_bytes(result.peak)} ({result.peak} bytes, {100 * result.peak / result.budget:.1f}% "
            "of the budget)",
            f"time:    {result.time:.6g} s predicted vs {result.no_recompute_time:.6g} s without recomputation "
            f"({100 * slower:+.1f}%)",
            f"recomputed stages: {result.recomputed_stages} of {chain.length}",
            f"ops ({len(result.ops)}): {compact_ops(result.ops)}",
        ]
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Plan the fastest checkpointing schedule of a chain.")
    parser.add_argument("chain", help="chain JSON file (docs/memory-model.md)")
    parser.add_argument(
        "--mem-limit",
        required=True,
        help="activation budget: bytes, '6GiB', '512MB', or a fraction of the no-recomputation peak ('0.5', '50%%')",
    )
    parser.add_argument("--json", action="store_true", help="print the plan JSON instead of a summary")
    parser.add_argument(
        "--slots",
        type=int,
        default=None,
        help=f"memory precision of the planner (default: automatic, from {DEFAULT_SLOTS} for "
        "150 stages or more up to 20000 for short chains)",
    )
    return parser


def _join_mem_limit(argv: list[str]) -> list[str]:
    """`--mem-limit -50%` as `--mem-limit=-50%`: argparse would take `-50%` for an option and never show our error."""
    out: list[str] = []
    it = iter(argv)
    for arg in it:
        if arg == "--mem-limit":
            value = next(it, None)
            out.append(arg if value is None else f"{arg}={value}")
        else:
            out.append(arg)
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(_join_mem_limit(list(sys.argv[1:] if argv is None else argv)))
    if args.slots is not None and args.slots < 1:
        print(f"{PROG}: --slots must be a positive integer, got {args.slots}", file=sys.stderr)
        return 2
    try:
        chain = Chain.load(args.chain)
        result = plan(chain, args.mem_limit, slots=args.slots)
    except InfeasibleBudget as err:
        print(f"{PROG}: infeasible: {err}", file=sys.stderr)
        print(f"smallest feasible budget: {err.min_feasible} bytes ({format_bytes(err.min_feasible)})")
        return 2
    except (ChainError, BudgetError, PlannerTooLarge) as err:
        print(f"{PROG}: {err}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print(summary(chain, result, args.chain))
    return 0


if __name__ == "__main__":
    sys.exit(main())
