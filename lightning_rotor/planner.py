"""Plan the fastest checkpointing schedule of a chain within a byte budget.

The dynamic program runs in C++ (`lightning_rotor._planner`, cpp/planner.cpp) on
the integer problem of `discretize`: memory in `slots` units of
`budget // slots` bytes, every size rounded up, so every plan fits the budget in
exact bytes. Rounding can make a budget just above the exact minimum look
infeasible; then the planner falls back to an exact-byte schedule, so planning
at `min_feasible_budget(chain)` always succeeds. With a transfer bandwidth (chain version 6) the
program may also offload kept stage inputs to host memory; `plan()` then scores that plan beside
the recompute-only one and keeps the faster. docs/planner.md derives it all.
"""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import importlib.util
import math
import os
import sys
import warnings
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from lightning_rotor.budget import BudgetSpec, format_bytes, parse_budget, resolve_budget
from lightning_rotor.chain import Chain
from lightning_rotor.discretize import DEFAULT_SLOTS, discretize, resolve_slots
from lightning_rotor.ops import Op, frozen_prefix_ops, parse_ops, recomputed_stages, shift_ops
from lightning_rotor.simulate import Simulation, no_recompute_peak, simulate


def _load_planner() -> ModuleType:
    """The C++ planner: the package's own build, else the installed distribution's.

    A Python started in a source checkout imports the checkout's `lightning_rotor/`, which
    has no built extension after a non-editable `pip install .`; the installed copy's build
    is then loaded (with a warning naming both), and where there is none, one line says what to do.
    """
    try:
        from lightning_rotor import _planner

        return _planner
    except ImportError as err:
        here = Path(__file__).resolve().parent
        suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
        if any(f.name.startswith("_planner.") and f.name.endswith(suffixes) for f in here.iterdir()):
            raise  # built here but failed to load: the error itself says why
        for dist in importlib.metadata.distributions():
            if (dist.metadata["Name"] or "").lower().replace("_", "-") != "lightning-rotor":
                continue
            for file in dist.files or []:
                path = Path(str(dist.locate_file(file))).resolve()
                if (
                    path.name.startswith("_planner.")
                    and path.name.endswith(suffixes)
                    and path.parent != here
                    and path.is_file()
                ):
                    spec = importlib.util.spec_from_file_location("lightning_rotor._planner", path)
                    if spec is None or spec.loader is None:
                        continue
                    module = importlib.util.module_from_spec(spec)
                    spec.loader.exec_module(module)
                    sys.modules["lightning_rotor._planner"] = module
                    warnings.warn(
                        f"lightning_rotor: {here} (imported, a source checkout?) has no built C++ planner; "
                        f"using the installed one, {path}. Build in place (pip install -e .) to use the "
                        "checkout's",
                        stacklevel=2,
                    )
                    return module
        raise ImportError(
            f"lightning_rotor's C++ planner is not built in {here} (a source checkout shadows any installed copy "
            "when Python starts in it): build it in place with `pip install -e .` or "
            "`python setup.py build_ext --inplace`, or run from outside the checkout"
        ) from err


if TYPE_CHECKING:  # the type checker reads the extension's types from lightning_rotor/_planner.pyi
    from lightning_rotor import _planner
else:
    _planner = _load_planner()

__all__ = ["InfeasibleBudget", "Plan", "PlannerTooLarge", "min_feasible_budget", "plan", "planner_memory_estimate"]


class PlannerTooLarge(MemoryError):
    """The planner's tables for this chain would not fit in the memory available."""


TABLE_ENTRY_BYTES = 8  # one double per (subproblem, memory slot)


def planner_memory_estimate(length: int, slots: int, offload: bool = False) -> int:
    """Upper bound on the planner's table bytes: one entry per subproblem (s, t) and memory slot.

    There are L(L+1)/2 "given" subproblems and L with the loss pending, each tabulated over at most
    `slots + 1` memory values; pruning usually stores fewer (docs/planner.md has measured figures).
    With offloading each subproblem has a second table (its input held plain), so twice as many.
    """
    subproblems = length * (length + 1) // 2 + length
    return (2 if offload else 1) * subproblems * (slots + 1) * TABLE_ENTRY_BYTES


def available_ram() -> int | None:
    """Bytes of RAM available now (Linux `MemAvailable`, else free pages), or None when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_planner_memory(length: int, slots: int, offload: bool = False) -> None:
    """Refuse, in one line, a chain whose tables could exceed the memory available (before allocating)."""
    need, have = planner_memory_estimate(length, slots, offload), available_ram()
    if have is not None and need > have:
        raise PlannerTooLarge(
            f"planning {length} stages at slots={slots} may need up to {format_bytes(need)} of tables, more than the "
            f"{format_bytes(have)} available; lower slots (memory grows as L^2 x slots) or merge stages into fewer"
        )


class InfeasibleBudget(ValueError):
    """No persistent schedule fits the budget; `.min_feasible` is the smallest budget that does."""

    def __init__(self, budget: int, min_feasible: int) -> None:
        self.budget = budget
        self.min_feasible = min_feasible
        super().__init__(
            f"budget {format_bytes(budget)} ({budget} bytes) is below the smallest feasible budget "
            f"{format_bytes(min_feasible)} ({min_feasible} bytes) for this chain; use mem_limit >= {min_feasible}"
        )

    @property
    def mem_limit(self) -> int:
        """The budget in bytes under its old name (callers move to `budget`; subclasses may still set it)."""
        return self.budget

    @mem_limit.setter
    def mem_limit(self, budget: int) -> None:
        self.budget = budget


@dataclass
class Plan:
    """A schedule and what it costs: `time` in seconds and `peak` in bytes, as the simulator replays it.

    `budget` is the resolved budget in bytes the plan was made for (the user's `mem_limit`, resolved).
    With offloading (chain version 6): `bandwidth` is the transfer bandwidth it was planned with (bytes/s,
    0: none), `host_peak` the host bytes its offloaded values hold at most, and `recompute_only_time` the
    time of the best plan without offloading at the same budget (None when offloading was off).
    """

    ops: list[Op]
    time: float
    peak: int
    budget: int
    slots: int = DEFAULT_SLOTS
    recomputed_stages: int = 0
    no_recompute_time: float = 0.0
    bandwidth: float = 0.0
    host_peak: int = 0
    recompute_only_time: float | None = None

    @property
    def mem_limit(self) -> int:
        """The budget in bytes under its old name (callers move to `budget`)."""
        return self.budget

    def to_dict(self) -> dict[str, Any]:
        """The plan JSON of docs/memory-model.md (plus planner details; the offloading ones when it was on)."""
        data: dict[str, Any] = {
            "budget": self.budget,
            "time": self.time,
            "peak": self.peak,
            "slots": self.slots,
            "recomputed_stages": self.recomputed_stages,
            "no_recompute_time": self.no_recompute_time,
        }
        if self.bandwidth or self.host_peak or self.recompute_only_time is not None:
            data.update(
                bandwidth=self.bandwidth, host_peak=self.host_peak, recompute_only_time=self.recompute_only_time
            )
        data["ops"] = [op.to_json() for op in self.ops]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        """A plan from `to_dict`'s JSON; plans saved before `budget` was named so say `mem_limit`."""
        if not isinstance(data, dict):
            raise ValueError(f"a plan must be a JSON object, got {type(data).__name__}")
        budget = "budget" if "budget" in data else "mem_limit"
        missing = [k for k in ("time", "peak", "ops") if k not in data] + ([] if budget in data else ["budget"])
        if missing:
            raise ValueError(f"plan is missing field(s) {', '.join(missing)}")
        ops = parse_ops(data["ops"])
        return cls(
            ops=ops,
            time=float(data["time"]),
            peak=int(data["peak"]),
            budget=int(data[budget]),
            slots=int(data.get("slots", DEFAULT_SLOTS)),
            recomputed_stages=int(data.get("recomputed_stages", recomputed_stages(ops))),
            no_recompute_time=float(data.get("no_recompute_time", 0.0)),
            bandwidth=float(data.get("bandwidth", 0.0)),
            host_peak=int(data.get("host_peak", 0)),
            recompute_only_time=None if data.get("recompute_only_time") is None else float(data["recompute_only_time"]),
        )


def _memory_args(chain: Chain) -> tuple[list[int], list[int], list[int], list[int], list[int], int]:
    return chain.sizes, chain.saved_size, chain.fwd_tmp, chain.fwd_tmp_nograd, chain.bwd_net, chain.loss_tmp


def _memory_options(chain: Chain) -> list[list[list[int]]] | None:
    """The stage options' memory figures in exact bytes for `_planner` (chain version 5), None when there are none."""
    if not chain.has_options:
        return None
    return [
        [[o.saved_size, o.fwd_tmp, o.bwd_net, chain.option_loss_tmp_graph(o)] for o in opts] for opts in chain.options
    ]


def check_bandwidth(bandwidth: object) -> float | None:
    """`bandwidth` checked (bytes/s, 0: no offloading), or None (the chain's own)."""
    if bandwidth is None:
        return None
    if isinstance(bandwidth, bool) or not isinstance(bandwidth, (int, float)) or not 0 <= bandwidth < math.inf:
        raise ValueError(
            "bandwidth must be a finite number of bytes per second >= 0 (0: no offloading) or None (the chain's "
            f"own), got {bandwidth!r}"
        )
    return float(bandwidth)


def min_feasible_budget(chain: Chain, *, bandwidth: float | None = None) -> int:
    """Smallest budget in bytes (chain input included) for which some persistent schedule exists.

    At least 1: budgets are positive, even for a chain of empty values. A frozen prefix
    (chain version 4) needs its own forward peak; the rest is an ordinary chain, `chain.suffix()`.
    With a channel (`bandwidth` > 0, or the chain's own when None), kept inputs and the `offloadable`
    parts of recorded stages may move to host memory, waited for where the memory needs it, so the
    floor may be below recompute-only's (docs/planner.md, "Debts"); `bandwidth=0` gives recompute-only's.
    With a `host_limit` on the chain as well, it is the least budget found with a schedule within the host
    limit (`_host_bound_floor`): `plan()` succeeds there, and refuses a budget only below it, naming it.
    """
    checked = check_bandwidth(bandwidth)
    suffix = chain.suffix()
    offload = suffix.bandwidth > 0 if checked is None else checked > 0
    floor = _free_floor(chain, offload)
    if offload and suffix.host_limit is not None:
        moving = suffix if checked is None else suffix.with_transfer(checked)
        floor = max(floor, _host_bound_floor(moving, floor))
    return floor


def _free_floor(chain: Chain, offload: bool) -> int:
    """The floor with offloaded values moving freely (no host limit): the C++ tables' least need."""
    suffix = chain.suffix()
    return max(1, chain.prefix_peak, _planner.min_budget(*_memory_args(suffix), **_exact_extras(suffix, offload)))


def _within_host(chain: Chain, budget: int, found: list[Any] | None) -> list[Op] | None:
    """`found`'s ops where they replay within `budget` and the chain's host limit (the simulator refuses more)."""
    if found is None:
        return None
    ops = parse_ops(found)
    try:
        sim = simulate(chain, ops)
    except ValueError:
        return None
    return ops if sim.peak <= budget else None


def _host_witness(chain: Chain, budget: int) -> list[Op] | None:
    """A schedule of `chain` (no frozen prefix) within `budget` and its host limit: the exact-byte one that moves
    what it must, else the offloading DP's at automatic slots; None when neither keeps within both."""
    exact = _planner.feasible_schedule(*_memory_args(chain), budget, **_exact_extras(chain, True))
    ops = _within_host(chain, budget, exact)
    if ops is None:
        found = solve_discretized(chain, budget, resolve_slots(None, chain.length))
        ops = _within_host(chain, budget, None if found is None else found[1])
    return ops


def _host_bound_floor(chain: Chain, low: int) -> int:
    """The least budget from `low` (the floor moving freely) with a `_host_witness`, by bisection up to
    recompute-only's floor, which needs no host memory, to 1/1024 of the gap (each step plans and replays: ~10
    steps, not ~30 on a chain of gigabytes), after two probes that settle most chains: the free floor itself, and
    1/1024 below recompute-only's. The budget returned has a witness, so planning there succeeds; one below it
    may too, where the search skipped it (the exact least under a host limit is not searched)."""
    high = _free_floor(chain, False)
    if low >= high or _host_witness(chain, low) is not None:
        return min(low, high)
    close = max(1, (high - low) >> 10)
    if high - close <= low or _host_witness(chain, high - close) is None:  # none just below: recomputing only
        return high
    below, high = low, high - close  # `below` has no witness; `high` has one
    while high - below > close:
        middle = (below + high) // 2
        if _host_witness(chain, middle) is not None:
            high = middle
        else:
            below = middle
    return high


def _exact_extras(chain: Chain, offload: bool) -> dict[str, Any]:
    """The keyword arguments of `_planner.min_budget` / `feasible_schedule` beyond the memory figures."""
    extras: dict[str, Any] = dict(
        loss_tmp_graph=chain.loss_tmp_graph,
        in_free=chain.in_free,
        loss_value=chain.loss_value,
        options=_memory_options(chain),
    )
    if offload:
        extras.update(offload=True, offloadable=list(chain.offloadable) if any(chain.offloadable) else None)
    return extras


SMALL_FILL = 10**8  # stages^3 x slots below which one thread fills the tables (about 0.2 ms of work)


def _threads_for(length: int, slots: int) -> int:
    """The threads of a solve left to the planner (0: its default), one for a small fill: starting a thread and
    handing rows over cost about what it saves there, and much more when the cores are shared (a thread waiting
    on another that is descheduled); a changing shape's chain is planned on every new shape."""
    return 1 if length**3 * slots < SMALL_FILL else 0


def solve_discretized(
    chain: Chain, budget: int, slots: int, threads: int | None = None
) -> tuple[int, list[Any]] | None:
    """The DP alone on `chain` discretized at `budget` bytes: (cost in time units, op tuples) or None.

    What `plan()` runs before the referee scores it; tests hold it against the reference planner.
    A chain with a bandwidth (version 6) is planned with offloading, the cost including the stalls.
    """
    d = discretize(chain, budget, slots=slots)
    return _planner.solve(
        d.size,
        d.saved,
        d.fwd_tmp,
        d.fwd_tmp_nograd,
        d.bwd_tmp,
        d.loss_tmp,
        d.fwd_cost,
        d.bwd_cost,
        d.slots,
        threads=threads or _threads_for(chain.length, slots),
        loss_tmp_graph=d.loss_tmp_graph,
        in_free=d.in_free,
        loss_value=d.loss_value,
        options=[[list(o) for o in opts] for opts in d.options] if d.options else None,
        transfer_cost=d.transfer_cost or None,
        count_bits=d.count_bits,
        offloadable=d.offloadable or None,
        saved_transfer_cost=d.saved_transfer_cost or None,
    )


def _planning_problem(
    chain: Chain,
    mem_limit: BudgetSpec,
    bandwidth: float | None,
    host_limit: int | None,
    slots: int | None,
    threads: int | None,
) -> tuple[Chain, Chain, int, int]:
    """(the whole chain, the part with choices, budget in bytes, slots) for `plan()`, its arguments checked; one
    line refuses a budget below the floor or tables larger than the memory available."""
    checked = check_bandwidth(bandwidth)
    if checked is not None or host_limit is not None:
        chain = chain.with_transfer(checked, host_limit)
    whole, chain = chain, chain.suffix()  # a frozen prefix runs first as Fn ops: only the rest has choices
    resolved = resolve_slots(slots, chain.length)
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be a positive integer or None, got {threads!r}")
    spec = parse_budget(mem_limit)  # bytes need no replay of the no-recomputation schedule
    budget = resolve_budget(spec, no_recompute_peak(whole)) if isinstance(spec, Fraction) else spec
    if budget < _free_floor(whole, whole.offloads):  # below it nothing fits; the floor named respects the host limit
        raise InfeasibleBudget(budget, min_feasible_budget(whole))
    check_planner_memory(chain.length, resolved, chain.offloads)
    return whole, chain, budget, resolved


def _recompute_only_candidates(
    chain: Chain, budget: int, slots: int, threads: int | None
) -> list[tuple[Simulation, list[Op]]]:
    """The plans without offloading, scored by the referee: the DP's (on the chain without transfers: exactly
    the plan without offloading), then the exact-byte fallback's; `simulate` also refuses an invalid plan.

    A fallback that is the DP's very schedule (as often where the budget leaves room) is not replayed again: the
    same ops on the same chain replay alike, and the DP's comes first, so it wins the tie either way (a changing
    shape's chain is planned at every new shape: each replay is about a tenth of a millisecond on a short chain).
    """
    found = solve_discretized(chain.with_transfer(0.0) if chain.offloads else chain, budget, slots, threads)
    scored: list[tuple[Simulation, list[Op]]] = []
    if found is not None:
        ops = parse_ops(found[1])
        scored.append((simulate(chain, ops), ops))
    fallback = _planner.feasible_schedule(*_memory_args(chain), budget, **_exact_extras(chain, False))
    if fallback is not None:
        ops = parse_ops(fallback)
        if not scored or ops != scored[0][1]:
            scored.append((simulate(chain, ops), ops))
    return scored


def plan(
    chain: Chain,
    mem_limit: BudgetSpec,
    *,
    bandwidth: float | None = None,
    host_limit: int | None = None,
    slots: int | None = None,
    threads: int | None = None,
) -> Plan:
    """The fastest persistent schedule of `chain` whose peak stays within `mem_limit`.

    `mem_limit`: bytes, a size string (`"6GiB"`), or a fraction of the no-recomputation
    peak (`0.5`, `"50%"`). `slots`: memory precision of the dynamic program (None: automatic,
    `discretize.auto_slots`: 500 for 150 stages or more, up to 20,000 for short chains).
    `threads`: threads filling its tables (None: min(2, hardware threads)); the plan
    does not depend on it. Raises `InfeasibleBudget` when no schedule fits. A chain with a
    frozen prefix gets `Fn 0 … Fn F-1` and then the plan of `chain.suffix()` at the same budget.
    Where the chain carries stage options (version 5), a stage may be recorded by one (`Fs k:o`).

    `bandwidth` (bytes/s; None: the chain's own, 0: no offloading) and `host_limit` (bytes; None:
    the chain's own) set the transfer channel (chain version 6). With a bandwidth, the offloading
    plan, the recompute-only plan and the fallback are all replayed by `simulate`; those within the
    budget and the host limit compete and the fastest wins, so offloading is never slower than
    recomputing only (by the simulator). Without one, the plan is exactly the recompute-only plan.
    """
    whole, chain, budget, slots = _planning_problem(chain, mem_limit, bandwidth, host_limit, slots, threads)
    scored = _recompute_only_candidates(chain, budget, slots, threads)
    recompute_only = min(scored, key=lambda item: item[0].time) if scored else None
    if chain.offloads:
        scored += _offloading_candidates(chain, budget, slots, threads, exact=not scored)
    if not scored:  # below the host-bound floor: what fits the budget passes the host limit
        raise InfeasibleBudget(budget, min_feasible_budget(whole))
    best, ops = min(scored, key=lambda item: item[0].time)
    peak, time, host_peak = best.peak, best.time, best.host_peak
    alone = recompute_only[0].time if chain.offloads and recompute_only is not None else None
    if whole.frozen:
        prefix = frozen_prefix_ops(whole.frozen)
        ops = prefix + shift_ops(ops, whole.frozen)
        peak, time = simulate(whole, ops)[:2]
        if alone is not None and recompute_only is not None:
            alone = simulate(whole, prefix + shift_ops(recompute_only[1], whole.frozen)).time
    return Plan(
        ops=ops,
        time=time,
        peak=peak,
        budget=budget,
        slots=slots,
        recomputed_stages=recomputed_stages(ops),
        no_recompute_time=whole.no_recompute_time(),
        bandwidth=whole.bandwidth,
        host_peak=host_peak,
        recompute_only_time=alone,
    )


def _offloading_candidates(
    chain: Chain, budget: int, slots: int, threads: int | None, exact: bool
) -> list[tuple[Any, list[Op]]]:
    """The offloading program's plan, scored, when it fits the budget and the host limit; with `exact` (no
    recompute-only schedule fits: the budget is below its floor), also the exact-byte schedule that moves what
    it must, so that planning at `min_feasible_budget(chain)` succeeds whatever the slots' rounding."""
    found = []
    offloading = solve_discretized(chain, budget, slots, threads)
    if offloading is not None:
        found.append(parse_ops(offloading[1]))
    if exact:  # at the budget, or else the witness of the host-bound floor below it (within the floor: fits)
        fallback = _within_host(
            chain, budget, _planner.feasible_schedule(*_memory_args(chain), budget, **_exact_extras(chain, True))
        )
        if fallback is None and chain.host_limit is not None and (floor := min_feasible_budget(chain)) <= budget:
            fallback = _host_witness(chain, floor)
        if fallback is not None:
            found.append(fallback)
    scored = []
    for ops in found:
        try:
            sim = simulate(chain, ops)
        except ValueError:  # its host bytes pass the host limit: not a candidate
            continue
        if sim.peak <= budget:
            scored.append((sim, ops))  # after the recompute-only ones: a tie goes to a plan without transfers
    return scored
