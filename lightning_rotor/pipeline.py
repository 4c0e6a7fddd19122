"""The step pipeline: stages + sample + budget -> profile -> Chain -> plan -> Plan -> runner.

Plain functions, in the order a first training call runs them. Each takes the previous
one's output and knows nothing of the ones after it: `profile` measures the stages on the
sample and returns numbers (a `Profile` holding the `Chain`); `plan_chain` sees only the
`Chain` and a byte budget; `runner` sees only the stages and the `Plan`. `prepare` runs the
three in a row and returns an `Entry`, what `PlanCache` keeps per call signature.

A chain found inside a module's forward (module-level discovery) leaves part of the forward
outside the chain; `measure_outside` measures what that part holds and `charge_outside`
charges it to the chain, so the budget bounds the whole step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_rotor._torch_compat import tree_flatten, tree_map
from lightning_rotor.chain import Chain
from lightning_rotor.execute import PlanRunner
from lightning_rotor.memory import MemoryProbe, storage_bytes
from lightning_rotor.ops import forward_counts
from lightning_rotor.planner import Plan, plan
from lightning_rotor.profile import Profile, profile_chain

if TYPE_CHECKING:
    from lightning_rotor.discovery.modules import ModuleRun

__all__ = ["Entry", "charge_outside", "measure_outside", "plan_chain", "prepare", "profile", "run_stages", "runner"]

LossFn = Callable[[Any], torch.Tensor]
Outside = tuple[int, int]  # (bytes kept from before the chain, peak of the rest of the forward above the chain's end)


@dataclass
class Entry:
    """The profile, plan and runner of one call signature."""

    profile: Profile
    plan: Plan
    runner: PlanRunner

    @property
    def chain(self) -> Chain:
        return self.profile.chain

    @property
    def runs(self) -> list[int]:
        """How many times each stage runs forward in one step (more than 1: recomputed)."""
        return forward_counts(self.plan.ops, self.chain.length)


def profile(
    stages: Sequence[nn.Module],
    sample: Any,
    *,
    names: Sequence[str] | None = None,
    repeats: int = 5,
    warmup: int = 0,
    loss_fn: LossFn | None = None,
    loss_tmp: int | None = None,
    outside: Outside | None = None,
    progress: Callable[[int, int, float], None] | None = None,
    timed: bool = True,
    options: bool = False,
) -> Profile:
    """Measure `stages` on `sample` (the chain input `a_0`): times, sizes, transients.

    `loss_fn` is measured on the chain output (default: a cross-entropy stand-in); `loss_tmp`
    bytes are charged instead when given. `outside`: see `charge_outside`. `timed=False`:
    sizes only, times 0 (a new shape's times are derived, lightning_rotor/shapes.py).
    `options`: measure each stage's option "sac" too (`profile_chain`).
    """
    loss: int | LossFn | None = loss_tmp if loss_tmp is not None else loss_fn
    measured = profile_chain(
        stages,
        sample,
        names=names,
        repeats=repeats,
        warmup=warmup,
        loss_tmp=loss,
        progress=progress,
        timed=timed,
        options=options,
    )
    if outside is not None:
        measured.chain = charge_outside(measured.chain, outside)
    return measured


def charge_outside(chain: Chain, outside: Outside) -> Chain:
    """A module-level chain charged with the rest of the forward: the bytes kept from before the chain
    with its input, the forward after the chain, the loss and their backward as the chain's loss."""
    before, tail = outside
    tail_tmp = tail - chain.out_size[-1]
    kept = chain.loss_tmp if chain.loss_tmp_kept is None else chain.loss_tmp_kept  # set by Chain's checks
    return dataclasses.replace(
        chain,
        input_size=chain.input_size + before,
        loss_tmp=max(chain.loss_tmp, tail_tmp),
        loss_tmp_kept=max(kept, tail_tmp),
    )


def plan_chain(chain: Chain, budget: int, slots: int | None = None) -> Plan:
    """The fastest schedule of `chain` within `budget` bytes (raises `InfeasibleBudget` below its minimum)."""
    return plan(chain, budget, slots=slots)


def runner(stages: Sequence[nn.Module], chain: Chain, chosen: Plan, names: Sequence[str] | None = None) -> PlanRunner:
    """What runs `chosen` on the stages: an autograd Function per call."""
    return PlanRunner(stages, chosen.ops, names, in_free=chain.in_free)


def prepare(
    stages: Sequence[nn.Module],
    sample: Any,
    budget: int | Callable[[Chain], int],
    *,
    names: Sequence[str] | None = None,
    slots: int | None = None,
    **settings: Any,
) -> Entry:
    """The whole pipeline on one call signature: profile, plan within `budget`, runner.

    `budget`: bytes, or a function of the profiled chain giving bytes (a fraction of its
    no-recomputation peak, a share of a budget over several chains). `settings` go to `profile`.
    """
    measured = profile(stages, sample, names=names, **settings)
    nbytes = budget(measured.chain) if callable(budget) else budget
    chosen = plan_chain(measured.chain, nbytes, slots)
    return Entry(measured, chosen, runner(stages, measured.chain, chosen, names))


def run_stages(stages: Iterable[nn.Module], value: Any) -> Any:
    """The chain's forward as written: each stage on the previous one's output."""
    for stage in stages:
        value = stage(value)
    return value


def measure_outside(
    module: nn.Module, run: ModuleRun, stages: Iterable[nn.Module], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Outside:
    """What a module-level chain's budget must also hold: (bytes the forward keeps from before the run,
    peak bytes of the rest of the forward, a loss and their backward above what is alive after the run).

    One forward with the blocks run without grad and the rest recorded, a cross-entropy
    stand-in for the caller's loss (`profile.proxy_loss`) and its backward down to the run's
    output and the call's inputs, taken as leaves of their own; parameters' `.grad` are set
    aside meanwhile and put back untouched, buffers and the RNG stream too (`profile.Untouched`).
    """
    from lightning_rotor.profile import Untouched, proxy_loss

    probe = MemoryProbe(module)
    seen: dict[str, int] = {}

    def blocks_without_grad(value: Any) -> Any:
        seen["before"] = probe.current - storage_bytes(value)
        with torch.no_grad():
            out = run_stages(stages, value)
        probe.reset_peak()
        seen["after"] = probe.current
        return out

    # the caller's tensors as leaves of their own: the backward stops at them, not in the caller's graph
    args, kwargs = tree_map(_own_leaf, (args, kwargs))
    devices = [t.device for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    run.install(blocks_without_grad)
    try:
        with Untouched([module], devices), probe:
            output = module(*args, **kwargs)
            loss = proxy_loss(output)
            if loss.requires_grad:
                loss.backward()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
            del output, loss
    finally:
        run.uninstall()
    return max(0, seen.get("before", 0)), max(0, probe.peak - seen.get("after", probe.peak))


def _own_leaf(value: Any) -> Any:
    """A tensor cut from the caller's graph, requiring grad as it did (anything else as it is)."""
    if not isinstance(value, torch.Tensor):
        return value
    return value.detach().requires_grad_(value.requires_grad)
