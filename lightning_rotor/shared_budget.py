"""The budget object: what `mem_limit=` resolves to, for one chain or shared by several.

A `Budget` owns every way a budget becomes bytes: a byte count or size as given, a fraction
(`"50%"`) of the chains' no-recomputation peaks, the automatic budget (`None`, below), a split
between chains and a chain's growth when it is called several times per step. It receives
`Chain`s (numbers) and hands back bytes; a chain that must plan again for a new share is told
through the `ShareHolder` it joined with (its `ChainState`, lightning_rotor/chain_state.py), never
through its module.

One chain alone (`Budget(mem_limit)`, `bytes_for` without other names): the bytes are resolved
once, on its first profiled chain; a fraction is taken of that chain's no-recomputation peak.

Several chains (`Budget(mem_limit, names)`): each chain learns its needs on its first training
call (its smallest feasible budget `min` and its no-recomputation peak `need`). The total is
split by need: every chain gets its `min` first, and what is left is shared in proportion to
`need - min` (a chain never gets more than its `need`: past it, bytes buy nothing). A fraction
means that fraction of the sum of the chains' no-recomputation peaks.

Chains run one after another in a forward, so the split is only complete once every
chain has run once; when a later chain joins, the earlier ones are planned again for
their new share (planning is cheap, profiles are kept). A total below the sum of the
minimums raises `InfeasibleTotal`, which names the chain and the smallest total.

A chain called several times per step (lightning_rotor/calls.py) needs more than one call's
figures: `grow` raises its minimum and need to those of its step and splits again (the total
stays what the chains' single calls made it).

Automatic budget (`None`): on CUDA, the device's free memory minus what the first
optimizer step will still allocate for parameters (a gradient and `OPTIMIZER_STATES`
states per trainable parameter without one yet), times `AUTO_MARGIN`; on any other
device the chains' no-recomputation peaks (no recomputation: a CPU has no device
memory to protect, and free RAM says nothing about what training may use).

(Parsing lives in `lightning_rotor.budget`, a leaf module the planner imports; this object
needs the planner, so it sits beside it rather than in it.)
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from fractions import Fraction
from typing import Any, Protocol

import torch
from torch import nn

from lightning_rotor.budget import MemLimit, format_bytes, parse_budget, resolve_budget
from lightning_rotor.chain import Chain
from lightning_rotor.planner import InfeasibleBudget, min_feasible_budget
from lightning_rotor.simulate import no_recompute_peak

__all__ = [
    "AUTO_MARGIN",
    "OPTIMIZER_STATES",
    "OUTSIDE",
    "Budget",
    "InfeasibleTotal",
    "ShareHolder",
    "SharedBudget",
    "auto_total",
    "split_by_need",
]

AUTO_MARGIN = 0.9  # of the CUDA memory left for activations: allocator fragmentation and kernel workspaces
OUTSIDE = "(outside the chains)"  # the need of the model's code around the chains (`Budget.charge_outside`)
OPTIMIZER_STATES = 2  # per parameter, as Adam keeps (SGD with momentum keeps 1): assumed before the optimizer runs


class ShareHolder(Protocol):
    """What a budget asks of a chain that joined it (implemented by `chain_state.ChainState`)."""

    def new_share(self, share: int) -> None:
        """The chain now has `share` bytes at its first shape: it plans every shape again."""
        ...

    def busy(self) -> bool:
        """Whether a call of the chain's step is pending (its share may not shrink now)."""
        ...


class InfeasibleTotal(InfeasibleBudget):
    """The whole model's budget is below the sum of its chains' smallest feasible budgets."""

    def __init__(self, total: int, needs: dict[str, tuple[int, int]]):
        smallest = sum(m for m, _ in needs.values())
        self.mem_limit, self.min_feasible, self.needs = total, smallest, dict(needs)
        if len(needs) == 1:
            where = f"for chain {next(iter(needs))!r}"
        else:
            each = ", ".join(f"{n!r} (>= {format_bytes(m)})" for n, (m, _) in needs.items())
            where = f"(the total) for chains {each}"
        ValueError.__init__(
            self,
            f"budget {format_bytes(total)} ({total} bytes) is below the smallest feasible budget "
            f"{format_bytes(smallest)} ({smallest} bytes) {where}; use mem_limit >= {smallest}",
        )


def split_by_need(total: int, needs: dict[str, tuple[int, int]]) -> dict[str, int]:
    """Shares of `total` bytes: each chain's minimum first, the rest in proportion to `need - min`."""
    smallest = sum(m for m, _ in needs.values())
    if total < smallest:
        raise InfeasibleTotal(total, needs)
    spare = total - smallest
    room = {name: max(0, need - m) for name, (m, need) in needs.items()}
    wanted = sum(room.values())
    if wanted <= spare:  # everyone can run without recomputation; the rest is left over
        return {name: m + room[name] + (spare - wanted) // len(needs) for name, (m, _) in needs.items()}
    return {name: m + spare * room[name] // wanted for name, (m, _) in needs.items()}


def auto_total(device: torch.device, parameters: Iterable[nn.Parameter]) -> int | None:
    """The automatic total in bytes on CUDA (see the module docstring); None elsewhere (no recomputation)."""
    if device.type != "cuda":
        return None
    free = torch.cuda.mem_get_info(device)[0]
    seen: set[int] = set()
    to_come = 0
    for p in parameters:
        if id(p) in seen or not p.requires_grad or p.device != device:
            continue
        seen.add(id(p))
        nbytes = p.numel() * p.element_size()
        to_come += (p.grad is None) * nbytes + OPTIMIZER_STATES * nbytes
    return max(0, int(AUTO_MARGIN * (free - to_come)))


class Budget:
    """The budget of one chain or of several (see the module docstring)."""

    def __init__(self, mem_limit: MemLimit, names: Iterable[str] = ()) -> None:
        self.total = mem_limit
        self.value = None if mem_limit is None else parse_budget(mem_limit)
        self.names = list(names)  # every chain that will join (its share waits for its first call)
        self.needs: dict[str, tuple[int, int]] = {}
        self.grown: dict[str, tuple[int, int]] = {}  # chains with several calls per step: their steps' figures
        self.shares: dict[str, int] = {}  # bytes given to each chain that joined
        self.holders: dict[str, ShareHolder] = {}  # the chains that joined: told their new shares, asked if busy
        self.auto_bytes: int | None = None  # the CUDA automatic total, measured once
        self.auto_measured = False  # a lone chain's automatic budget was resolved (on its first chain)
        self.short = False  # the chains known so far need more than the total; raised once all have joined
        self.hooks: list[
            Any
        ] = []  # handles of the model's hooks measuring the step outside the chains (step_outside.py)

    def charge_outside(self, nbytes: int) -> None:
        """What the step holds outside every chain (`step_outside.measure_step_outside`), before any chain joined:
        one more need of `nbytes`, both its minimum and its peak (so in a fraction's base too), never recomputed."""
        self.needs[OUTSIDE] = (nbytes, nbytes)

    @property
    def shared(self) -> bool:
        """Whether the budget is split between chains (a Lightning strategy's, even for one chain)."""
        return bool(self.names)

    @property
    def no_recompute(self) -> bool:
        """An automatic budget off CUDA: the no-recomputation peak, nothing recomputed, every call."""
        measured = self.shared or self.auto_measured  # a lone chain's bytes saved in a checkpoint were not
        return self.value is None and self.auto_bytes is None and measured

    def total_bytes(self) -> int:
        """The total in bytes for the chains known so far."""
        peaks = sum(need for _, need in self.needs.values())
        if isinstance(self.value, Fraction):
            return int(self.value * peaks)
        if isinstance(self.value, int):
            return self.value
        return self.auto_bytes if self.auto_bytes is not None else peaks

    def bytes_for(
        self,
        chain: Chain,
        device: torch.device,
        parameters: Iterable[nn.Parameter] = (),
        name: str = "",
        holder: ShareHolder | None = None,
    ) -> int:
        """The bytes of chain `name` (profiled as `chain`): the whole budget alone, else its share (`share`)."""
        if self.shared:
            return self.share(name, chain, device, parameters, holder)
        if self.value is None:
            self.auto_bytes, self.auto_measured = auto_total(device, parameters), True
            return no_recompute_peak(chain) if self.auto_bytes is None else self.auto_bytes
        return resolve_budget(self.value, no_recompute_peak(chain))

    def for_shape(self, chain: Chain, first: int, first_need: int, fraction_of: int | None = None) -> int:
        """The bytes of a later input shape of a chain (profiled as `chain`) whose first shape got `first`
        bytes at a no-recomputation peak of `first_need` (docs/checkpointable.md, "Changing shapes").

        A fraction is taken of this shape's own no-recomputation peak (a share of a split budget grows
        with it in proportion); bytes and the automatic CUDA budget (device memory) hold at every shape;
        the automatic budget off CUDA is this shape's no-recomputation peak. The caller checks the result
        against the shape's smallest feasible budget. `fraction_of`: the peak a fraction is taken of, when
        `chain` only bounds the shape's (a predicted shape: a lower bound of its own, lightning_rotor/shapes.py).
        """
        need = no_recompute_peak(chain)
        if isinstance(self.value, Fraction):
            ratio = Fraction(first, max(1, first_need)) if self.shared else self.value
            return max(1, math.floor(ratio * (need if fraction_of is None else fraction_of)))
        if self.value is None and self.auto_bytes is None:  # automatic off CUDA: no recomputation
            return need
        return first

    def share(
        self,
        name: str,
        chain: Chain,
        device: torch.device,
        parameters: Iterable[nn.Parameter] = (),
        holder: ShareHolder | None = None,
    ) -> int:
        """Register chain `name` (profiled as `chain`, its state `holder`) and return its share in bytes.

        Chains that joined before are planned again for their new share (`ShareHolder.new_share`);
        raises `InfeasibleTotal` before changing anything when the total cannot be met.
        """
        if self.value is None and self.auto_bytes is None:
            self.auto_bytes = auto_total(device, parameters)
        if self.hooks:
            self._outside_unmeasured(name)
        needs = dict(self.needs)
        needs[name] = (min_feasible_budget(chain), no_recompute_peak(chain))
        before = self.needs
        self.needs = needs
        waiting = [n for n in self.names if n not in needs]
        try:
            shares = split_by_need(self.total_bytes(), {**needs, **self.grown})
        except InfeasibleTotal:
            if not waiting:
                self.needs = before
                raise
            # other chains have not run yet: the smallest total is known only once they have (`check`);
            # until then this chain runs at its own smallest budget, so that they can be measured
            self.short = True
            shares = {n: m for n, (m, _) in needs.items()}
        if holder is not None:
            self.holders[name] = holder
        self._tell_others(name, shares)
        self.shares[name] = shares[name]
        return shares[name]

    def _outside_unmeasured(self, name: str) -> None:
        """A chain joins before any module holding all the chains was called (the step calls them itself): what
        its code around them holds cannot be measured; said once, in one line, and the hooks taken off."""
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
        warnings.warn(
            f"rotor: chain {name!r} ran before any module holding all the chains {self.names} was called, so what "
            "the step computes around them (a head, the loss) is charged to no chain and may exceed the budget; "
            "call the chains from one module's forward (the model's) to have it measured and charged",
            stacklevel=4,
        )

    def others_busy(self, name: str) -> bool:
        """Whether a chain other than `name` has calls pending in this step (its share may not shrink now)."""
        return any(other != name and holder.busy() for other, holder in self.holders.items())

    def grow(self, name: str, smallest: int, need: int) -> int:
        """Chain `name`'s steps need at least `smallest` bytes and `need` without recomputation
        (several calls per step): split the total again and return its share.

        The other chains are planned again for their new shares; raises `InfeasibleTotal`
        before changing anything when the total cannot hold every chain's minimum.
        """
        old = self.grown.get(name, self.needs.get(name, (0, 0)))
        wanted = (max(old[0], smallest), max(old[1], need))
        shares = split_by_need(self.total_bytes(), {**self.needs, **self.grown, name: wanted})
        self.grown[name] = wanted
        self._tell_others(name, shares)
        self.shares[name] = shares[name]
        return shares[name]

    def _tell_others(self, name: str, shares: dict[str, int]) -> None:
        for other, holder in self.holders.items():
            if other != name and self.shares.get(other) not in (None, shares[other]):
                holder.new_share(shares[other])
                self.shares[other] = shares[other]

    def check(self) -> None:
        """After the first batch: raise `InfeasibleTotal` (all chains that ran, and the smallest total)."""
        if self.short and self.needs:
            total = self.total_bytes()
            if total < sum(m for m, _ in self.needs.values()):
                raise InfeasibleTotal(total, self.needs)
            self.short = False


SharedBudget = Budget  # its name before 0.2.0 (docs/checkpointable.md showed it), kept as an alias
