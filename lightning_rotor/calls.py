"""Several calls of one chain in one training step (a GAN discriminator's `D(real) + D(fake)`).

A call whose forward has run and whose backward has not started is *pending*: its graph,
its input and its loss hold bytes while the step's other calls run. `StepCalls` keeps the
pending calls of one chain; a new call is planned against the budget less what they hold,
so one budget covers the whole step however many calls it makes.

# NOTE: [Several calls per step]
# - What a pending call holds is the simulator's peak during its plan's `Loss` op: every byte
#   held after the forward (checkpoints, graphs, `a_0`), the output or its gradient, and the
#   loss's own transient. Between its forward and its backward a call is somewhere inside
#   that op (its loss may have run forward, even backward, but the chain's backward has not).
# - Autograd runs the backward of the latest call first (the engine takes ready nodes in
#   reverse creation order), so when call k's backward runs, the calls after it are done and
#   the calls before it still hold what they held when call k was planned: planning call k
#   against `budget - sum(held of calls before k)` bounds the whole step.
# - A backward that starts while a later call of the step is still pending (two losses
#   backpropagated one by one, the first first) breaks that order; `StepCalls` checks it
#   fits and otherwise raises before the chain's backward writes any gradient.
# - A call stops being pending when its backward starts (a pre-hook on its output's graph
#   node) or when its graph is dropped without backward (the hook's closure lives in the
#   node, a weak reference sees it go).
# - A step ends when no call is pending; its calls' signatures (the step's *structure*) are
#   learned, and later steps of that structure are planned together (`step_budgets`). Every
#   call of the first step, and a call more than any step seen made, runs the plan of its
#   smallest budget, which holds the least while pending: such a step fits whenever the
#   budget is at least `step_minimum`, however many calls it makes. (The first call of a
#   new input signature after the first step gets the whole budget, as a lone call does.)
# - A call after another pending call runs its plan even when nothing is recomputed: in plain
#   autograd a parameter's accumulator waits for every call's gradient, so the later call's
#   parameter gradients would be held through the earlier call's backward (measured: the
#   chain's parameter bytes over the plan). The plan runs each stage's backward as its own
#   engine call, which stores them in `.grad` at once.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from lightning_rotor._torch_compat import tree_flatten
from lightning_rotor.budget import format_bytes
from lightning_rotor.chain import Chain
from lightning_rotor.ops import Op, OpKind
from lightning_rotor.planner import InfeasibleBudget
from lightning_rotor.simulate import simulate

if TYPE_CHECKING:
    from lightning_rotor.cache import PlanCache
    from lightning_rotor.pipeline import Entry

__all__ = [
    "Call",
    "InfeasibleStep",
    "StepBudget",
    "StepCalls",
    "StepChain",
    "call_figures",
    "step_budgets",
    "step_minimum",
]

GRID = 16  # budgets tried per call when planning a step's calls together (planning takes milliseconds)

# (signature, budget) -> (bytes held while pending, plan peak, plan seconds)
PlanAt = Callable[[str, int], tuple[int, int, float]]


def call_figures(chain: Chain, ops: Sequence[Op]) -> tuple[int, int]:
    """(bytes a call of this plan holds while pending, peak of its backward part): the simulator's figures."""
    sim = simulate(chain, ops)
    loss = list(ops).index(Op(OpKind.LOSS))
    return sim.op_peaks[loss], max(sim.op_peaks[loss:])


@dataclass(eq=False)
class Call:
    """One call of a chain in a step, pending from the end of its forward to the start of its backward."""

    signature: str
    index: int  # its place in the step, 0 first
    budget: int  # what it was planned against
    held: int  # bytes its graph holds while pending (`call_figures`)
    backward_peak: int
    limit: int  # the chain's budget for the whole step
    what: str  # how errors name it


class InfeasibleStep(InfeasibleBudget):
    """A call of a step does not fit in what the step's pending calls leave of the budget."""

    def __init__(self, what: str, mem_limit: int, held: int, smallest: int, min_feasible: int, shared: str = ""):
        self.mem_limit, self.min_feasible, self.held = mem_limit, min_feasible, held
        if min_feasible > mem_limit and shared:
            fix = (
                f"the step's calls need at least {format_bytes(min_feasible)} ({min_feasible} bytes), more than "
                f"chain {shared!r}'s share of the shared budget; give the chains their own budgets "
                f"(mem_limit={{{shared!r}: {min_feasible}, ...}}) or a larger total"
            )
        elif min_feasible > mem_limit:
            fix = (
                f"the step's calls need a budget of at least {format_bytes(min_feasible)}; "
                f"use mem_limit >= {min_feasible}"
            )
        else:
            fix = (
                f"the budget fits this step's calls planned together ({format_bytes(min_feasible)}), but the "
                "earlier calls were planned for steps of fewer calls; steps like this one are planned "
                "together from now on: run the step again"
            )
        ValueError.__init__(
            self,
            f"{what} needs at least {format_bytes(smallest)}, but the step's pending calls (forward run, backward "
            f"not started) hold {format_bytes(held)} of the budget {format_bytes(mem_limit)} ({mem_limit} bytes); "
            f"{fix}",
        )


def step_budgets(
    signatures: Sequence[str], total: int, smallest: dict[str, int], plan_at: PlanAt, tried: Sequence[int] = ()
) -> list[int] | None:
    """The budget of each call of a step, fastest in sum, such that the whole step fits `total` bytes.

    Call k gets at most `total` less what calls 0..k-1 hold. Tried: every call capped at one
    of `GRID` budgets from the largest smallest budget to `total`; every call at its own
    smallest budget (the step fits whenever `total >= step_minimum`); and `tried`, the
    budgets a step of this structure already ran with. None when nothing fits.
    """
    if len(signatures) == 1:  # one call: the whole budget is its fastest (the plan at a budget is its fastest within)
        return [total] if total >= smallest[signatures[0]] else None
    low = max(smallest[s] for s in signatures)
    caps = sorted({total, *(low + (total - low) * i // GRID for i in range(GRID))} - {0}, reverse=True)
    candidates = [[c] * len(signatures) for c in caps if c >= low]
    candidates += [[smallest[s] for s in signatures], list(tried)]
    best: tuple[float, list[int]] | None = None
    for wanted in candidates:
        if len(wanted) != len(signatures):
            continue
        budgets, held, seconds = [], 0, 0.0
        for sig, want in zip(signatures, wanted, strict=True):
            budget = min(want, total - held)
            if budget < smallest[sig]:
                break
            h, _, t = plan_at(sig, budget)
            budgets.append(budget)
            held += h
            seconds += t
        else:
            if best is None or seconds < best[0]:
                best = (seconds, budgets)
    return None if best is None else best[1]


def step_minimum(signatures: Sequence[str], smallest: dict[str, int], plan_at: PlanAt) -> int:
    """The smallest total at which `step_budgets` fits the step: each call at its own smallest budget."""
    need, held = 0, 0
    for sig in signatures:
        need = max(need, held + smallest[sig])
        held += plan_at(sig, smallest[sig])[0]
    return need


def describe(value: Any) -> str:
    """A call's input, briefly: its tensors' shapes."""
    shapes = [tuple(t.shape) for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
    return ", ".join(str(s) for s in shapes[:4]) + (", …" if len(shapes) > 4 else "")


@dataclass
class StepCalls:
    """The calls of one chain in the current training step, and the step structures seen so far."""

    pending: list[weakref.ref[Call]] = field(default_factory=list)
    step: list[tuple[str, int]] = field(default_factory=list)  # (signature, budget) of this step's calls
    finished: list[tuple[tuple[str, int], ...]] = field(default_factory=list)  # ended steps not learned yet
    step_peak: int = 0  # predicted peak of the current step: max over its calls of held before + plan peak
    last_step_peak: int = 0  # the same for the last ended step

    def alive(self) -> list[Call]:
        calls = [ref() for ref in self.pending]
        return [c for c in calls if c is not None]

    def held(self) -> int:
        """Bytes the pending calls hold."""
        return sum(c.held for c in self.alive())

    def begin(self) -> tuple[str, ...]:
        """A call arrives: end the last step when nothing is pending. Returns the signatures of
        this step's calls so far."""
        if not self.alive():
            self.pending.clear()
            if self.step:
                self.finished.append(tuple(self.step))
                self.last_step_peak = self.step_peak
            self.step, self.step_peak = [], 0
        return tuple(sig for sig, _ in self.step)

    def add(self, call: Call, peak: int, output: Any) -> None:
        """Count `call` as pending until its backward starts or its graph goes (`output`: what it returned)."""
        self.step_peak = max(self.step_peak, self.held() + peak)
        self.step.append((call.signature, call.budget))
        nodes = {
            id(t.grad_fn): t.grad_fn
            for t in tree_flatten(output)[0]
            if isinstance(t, torch.Tensor) and t.grad_fn is not None
        }
        if not nodes:
            return  # no graph: nothing is held for a backward
        self.pending.append(weakref.ref(call))
        for node in nodes.values():
            node.register_prehook(_Started(self, call))  # the node owns the call: it lives as long as the graph

    def refused(self, signature: str) -> None:
        """A call of this step did not fit: still part of the step's structure, so that the next such
        step is planned for it."""
        self.step.append((signature, 0))

    def take_finished(self) -> Iterable[tuple[tuple[str, int], ...]]:
        done, self.finished = self.finished, []
        return done

    def started(self, call: Call) -> None:
        """`call`'s backward starts: it is no longer pending. A later call of the step still
        pending means the backwards run out of order; refuse it when the step no longer fits."""
        alive = self.alive()
        if call not in alive:
            return
        others = [c for c in alive if c is not call]
        later = [c for c in others if c.index > call.index]
        held = sum(c.held for c in others)
        self.pending = [weakref.ref(c) for c in others]
        if later and held + call.backward_peak > call.limit:
            raise RuntimeError(
                f"rotor: the backward of {call.what} started while {later[0].what} still holds its graph; "
                f"that needs {format_bytes(held + call.backward_peak)}, over the budget "
                f"{format_bytes(call.limit)}; backpropagate the sum of the step's losses once, or each "
                "call's loss before the next call"
            )

    def __getstate__(self) -> dict[str, Any]:
        """Copies learn the step structures, not another module's pending graphs."""
        state = dict(self.__dict__)
        state["pending"], state["step"], state["step_peak"] = [], [], 0
        return state


class _Started:
    """A graph-node pre-hook: the call's backward starts."""

    def __init__(self, calls: StepCalls, call: Call):
        self.calls, self.call = calls, call

    def __call__(self, grads: Any) -> None:
        self.calls.started(self.call)


class StepChain(Protocol):
    """What a step's budget reads of its chain, and asks of it (implemented by `chain_state.ChainState`)."""

    budget: int | None  # the step's bytes: its first call's shape's

    @property
    def plans(self) -> PlanCache: ...

    def no_recompute(self) -> bool:
        """Nothing is recomputed, however many calls (an automatic budget off CUDA)."""
        ...

    def grow_share(self, structure: tuple[str, ...]) -> bool:
        """A share of a budget shared with other chains that fits a step of `structure`'s calls; asked or not."""
        ...

    def share_name(self) -> str:
        """The chain's name where it shares a budget with others ("" alone), for errors."""
        ...


class StepBudget:
    """The budgets of one chain's calls in a training step (NOTE: [Several calls per step]): the step's pending
    calls, the step structures seen so far and the budgets each of their calls first ran with."""

    def __init__(self) -> None:
        self.calls = StepCalls()  # this step's pending calls
        self.structures: dict[tuple[str, ...], list[int]] = {}  # steps seen: signatures -> budgets first run
        self.to_grow: list[tuple[str, ...]] = []  # steps of several calls a shared budget is not split for yet

    def call_entry(self, chain: StepChain, key: str, primary: Entry, value: Any) -> tuple[Entry, Call, int]:
        """The entry this call runs (`primary`: its signature's whole-budget entry), planned against the budget
        less what pending calls hold; with the call to count as pending and its plan's peak.

        Raises `InfeasibleStep` when the call cannot fit in what is left, before it runs.
        """
        plans = chain.plans
        prefix = self.calls.begin()
        for step in self.calls.take_finished():
            structure = tuple(sig for sig, _ in step)
            if structure not in self.structures and len(structure) > 1:
                self.to_grow.append(structure)
            self.structures.setdefault(structure, [b for _, b in step])
        if self.to_grow and chain.grow_share(self.to_grow[-1]):
            self.to_grow.clear()
        budget, held = chain.budget or 0, self.calls.held()
        what = f"call {len(prefix) + 1} of this step (input {describe(value)})"
        if chain.no_recompute():  # an automatic CPU budget: nothing is recomputed, however many calls
            chosen = budget
        else:
            chosen = self.budget_for_call(plans, prefix, key, budget - held, budget)
            if chosen < plans.smallest(key) and chain.grow_share((*prefix, key)):
                budget = chain.budget or 0
                chosen = self.budget_for_call(plans, prefix, key, budget - held, budget)
            if chosen < plans.smallest(key):
                need = step_minimum((*prefix, key), plans.smallest_of((*prefix, key)), plans.figures)
                self.calls.refused(key)
                raise InfeasibleStep(what, budget, held, plans.smallest(key), need, chain.share_name())
        entry = primary if chosen == budget else plans.entry_at(key, chosen)
        pending, backward_peak = plans.call_figures(key, chosen)
        call = Call(key, len(prefix), chosen, pending, backward_peak, budget, what)
        return entry, call, entry.plan.peak

    def budget_for_call(
        self, plans: PlanCache, prefix: tuple[str, ...], key: str, available: int, budget: int | None
    ) -> int:
        """The budget of the next call after `prefix` (signatures of the step's calls so far), at most
        `available`; `budget`: the step's."""
        position = len(prefix)
        wanted = []
        for structure, tried in self.structures.items():
            if len(structure) > position and structure[: position + 1] == (*prefix, key):
                budgets = plans.learned_budgets(structure, budget, tried)
                if budgets is not None:
                    wanted.append(budgets[position])
        if wanted:
            return min(min(wanted), available)
        if position == 0 and self.structures:
            return available  # a new input signature: steps so far tell nothing, plan for the whole budget
        return min(plans.smallest(key), available)  # the first step, or a call more: hold the least

    def step_limit(self, budget: int | None, no_recompute: bool) -> int:
        """The bytes a training step may hold, all its calls together: `budget`, or with nothing recomputed
        (an automatic budget off CUDA) the step's predicted peak when larger."""
        return max(budget or 0, self.calls.step_peak) if no_recompute else budget or 0
