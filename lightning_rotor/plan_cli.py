"""`lightning-rotor plan CHAIN.json --mem-limit SIZE [--bandwidth RATE [--host-limit SIZE]] [--json] [--slots N]`.

Plans a saved chain offline: a readable summary by default, the plan JSON of
docs/memory-model.md with `--json`. With a transfer bandwidth (`--bandwidth 12GB/s`, or
the chain's own, version 6) the planner may offload stage inputs to host memory; the
summary then puts the recompute-only plan's time at the same budget beside the plan's (or says that
none fits, below recompute-only's floor), and
the JSON carries both. Exit codes: 0 planned, 1 bad input (file, JSON, chain, budget,
bandwidth, host limit), 2 infeasible budget or bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from lightning_rotor.budget import BudgetError, format_bandwidth, format_bytes, parse_bandwidth, parse_host_limit
from lightning_rotor.chain import Chain, ChainError
from lightning_rotor.discretize import DEFAULT_SLOTS
from lightning_rotor.planner import InfeasibleBudget, Plan, PlannerTooLarge, min_feasible_budget, plan

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


def offload_saving(result: Plan) -> dict[str, float] | None:
    """What offloading bought at this budget: seconds saved against the recompute-only plan, and the
    share of that plan's recomputation overhead (its time above the no-recomputation time) removed.

    None when the plan was made without offloading (no recompute-only time to compare with).
    """
    before = result.recompute_only_time
    if before is None:
        return None
    saved = before - result.time
    overhead = before - result.no_recompute_time
    return {
        "recompute_only_time": before,
        "saved": saved,
        "overhead_removed": saved / overhead if overhead > 0 else 0.0,
    }


def _offload_lines(chain: Chain, result: Plan) -> list[str]:
    """Two lines on offloading whenever the plan was made with a bandwidth: what moved, and the recompute-only
    plan beside it (or that none fits this budget: offloading is what made it plannable)."""
    if not result.bandwidth:
        return []
    moved = sum(1 for op in result.ops if op[0] == "Offload")
    parts = sum(1 for op in result.ops if op[0] == "OffloadSaved")
    what = f"{moved} value(s)" + (f" and {parts} saved part(s)" if parts else "")
    host_limit = "" if chain.host_limit is None else f" of {format_bytes(chain.host_limit)} allowed"
    head = (
        f"offload: {what} to host memory at {format_bandwidth(result.bandwidth)}; "
        f"host peak {format_bytes(result.host_peak)}{host_limit}"
    )
    saving = offload_saving(result)
    if saving is None:
        floor = min_feasible_budget(chain, bandwidth=0)
        return [head, f"recompute-only: no plan fits this budget (its floor is {format_bytes(floor)}, {floor} bytes)"]
    share = (
        f", {100 * saving['overhead_removed']:.1f}% of its recomputation overhead"
        if saving["recompute_only_time"] > result.no_recompute_time
        else ""
    )
    return [
        head,
        f"recompute-only: {saving['recompute_only_time']:.6g} s at the same budget; offloading saves "
        f"{saving['saved']:.6g} s{share}",
    ]


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
            *_offload_lines(chain, result),
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
    parser.add_argument(
        "--bandwidth",
        default=None,
        help="host<->device transfer rate for offloading stage inputs ('12GB/s', '500MiB/s', bytes/s; 0: no "
        "offloading); default: the chain's own (version 6), else none",
    )
    parser.add_argument(
        "--host-limit",
        default=None,
        help="most host memory offloaded values may take ('2GiB', bytes); needs a bandwidth",
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
    """`--mem-limit -50%` as `--mem-limit=-50%`: argparse would take `-50%` for an option and never show our error.

    The same for `--bandwidth` and `--host-limit`.
    """
    out: list[str] = []
    it = iter(argv)
    for arg in it:
        if arg in ("--mem-limit", "--bandwidth", "--host-limit"):
            value = next(it, None)
            out.append(arg if value is None else f"{arg}={value}")
        else:
            out.append(arg)
    return out


class ArgumentError(ValueError):
    """Options that do not go together (exit code 2)."""


def _bandwidth(text: str) -> float:
    """`--bandwidth`: a rate, or 0 to plan a chain that carries its own bandwidth without offloading."""
    try:
        if float(text) == 0:
            return 0.0
    except ValueError:
        pass
    return parse_bandwidth(text)


def offloadable_values(chain: Chain) -> list[int]:
    """The stage inputs `a_k` an Offload op may move: 1 <= k <= L-1, past a frozen prefix, not empty."""
    return [k for k in range(chain.frozen + 1, chain.length) if chain.sizes[k] > 0]


def _transfer_options(chain: Chain, bandwidth: str | None, host_limit: str | None) -> dict[str, Any]:
    """The `plan()` keywords for `--bandwidth` / `--host-limit`; none when neither is given (today's call)."""
    rate = None if bandwidth is None else _bandwidth(bandwidth)
    limit = None if host_limit is None else parse_host_limit(host_limit)
    offloading = chain.offloads if rate is None else rate > 0
    if limit is not None and not offloading:
        raise ArgumentError(
            "--host-limit needs offloading: give --bandwidth (a positive rate) or a chain that carries its own"
        )
    if rate is not None and rate > 0 and not offloadable_values(chain):
        raise ArgumentError(
            f"--bandwidth given, but the chain has no value to offload (offloading moves the stage inputs a_1 … "
            f"a_{{L-1}} after any frozen prefix; this chain has {chain.length} stage(s)"
            + (f", {chain.frozen} frozen" if chain.frozen else "")
            + ")"
        )
    options: dict[str, Any] = {}
    if rate is not None:
        options["bandwidth"] = rate
    if limit is not None:
        options["host_limit"] = limit
    return options


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(_join_mem_limit(list(sys.argv[1:] if argv is None else argv)))
    if args.slots is not None and args.slots < 1:
        print(f"{PROG}: --slots must be a positive integer, got {args.slots}", file=sys.stderr)
        return 2
    try:
        chain = Chain.load(args.chain)
        transfer = _transfer_options(chain, args.bandwidth, args.host_limit)
        result = plan(chain, args.mem_limit, slots=args.slots, **transfer)
        if "host_limit" in transfer:  # the summary reports it beside the host peak
            chain = chain.with_transfer(None, transfer["host_limit"])
    except InfeasibleBudget as err:
        print(f"{PROG}: infeasible: {err}", file=sys.stderr)
        print(f"smallest feasible budget: {err.min_feasible} bytes ({format_bytes(err.min_feasible)})")
        return 2
    except ArgumentError as err:
        print(f"{PROG}: {err}", file=sys.stderr)
        return 2
    except (ChainError, BudgetError, PlannerTooLarge) as err:
        print(f"{PROG}: {err}", file=sys.stderr)
        return 1
    if args.json:
        data = result.to_dict()
        saving = offload_saving(result)
        if saving is not None:
            data.update(recompute_only_time=saving["recompute_only_time"], offload_saving=saving["saved"])
        print(json.dumps(data))
    else:
        print(summary(chain, result, args.chain))
    return 0


if __name__ == "__main__":
    sys.exit(main())
