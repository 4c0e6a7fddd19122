"""Which `nn.Sequential` parts of a model rotor takes over, and with what budget.

Policy (docs/lightning.md):

- candidates are `nn.Sequential` submodules whose `forward` is `nn.Sequential.forward`
  (a subclass with its own forward means something else than "run the stages in order")
  and that have at least two stages once nested Sequentials are flattened;
- the outermost candidates are wrapped: a Sequential inside a wrapped one becomes
  stages of it (rotor plans across the whole chain), never a second chain;
- `include` (names, globs or classes) replaces the search: exactly the matching
  submodules are wrapped; `exclude` removes matches and everything below them;
- one budget for several chains: a fraction (`0.5`, `"50%"`) is given to each chain as
  the same fraction of its own no-recomputation peak, so the total is split in
  proportion to what each chain needs; a byte budget is split in proportion to the
  number of stages (activations are unknown before the first batch); a dict
  `{name: budget}` sets each chain's budget itself.

Wrapping swaps a `Checkpointable` in where the Sequential stood: same parameter
objects, same `state_dict` keys. `unwrap` puts the user's Sequentials back.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction

from torch import nn

from lightning_rotor.budget import parse_budget
from lightning_rotor.checkpointable import Checkpointable
from lightning_rotor.stages import sequential_stages

Budget = int | float | str | None
Selector = str | type


@dataclass
class Wrapped:
    """One swapped-in chain: where it stands, what stood there, and the rotor module."""

    name: str
    original: nn.Sequential
    rotor: Checkpointable


def is_candidate(module: nn.Module) -> bool:
    """A plain `nn.Sequential` (no custom forward) with at least two stages."""
    if not isinstance(module, nn.Sequential) or type(module).forward is not nn.Sequential.forward:
        return False
    try:
        return len(sequential_stages(module)) >= 2
    except ValueError:
        return False


def _matches(name: str, module: nn.Module, selectors: Sequence[Selector]) -> bool:
    for sel in selectors:
        if isinstance(sel, type):
            if isinstance(module, sel):
                return True
        elif fnmatch.fnmatchcase(name, sel) or type(module).__name__ == sel:
            return True
    return False


def find_chains(
    model: nn.Module, include: Sequence[Selector] | None = None, exclude: Sequence[Selector] = ()
) -> tuple[list[tuple[str, nn.Sequential]], str]:
    """The submodules to wrap (outermost first, in module order) and, when none, why not."""
    found: list[tuple[str, nn.Sequential]] = []
    skipped: set[str] = set()
    seen_sequential = 0
    for name, module in model.named_modules():
        if not name or any(name.startswith(p + ".") for p in skipped):
            continue
        if isinstance(module, Checkpointable):
            skipped.add(name)  # already rotor's (wrapped by hand)
            continue
        seen_sequential += isinstance(module, nn.Sequential)
        if exclude and _matches(name, module, exclude):
            skipped.add(name)
            continue
        if include is not None:
            if not _matches(name, module, include):
                continue
            if not isinstance(module, nn.Sequential) or type(module).forward is not nn.Sequential.forward:
                raise TypeError(
                    f"include matched {name!r}, a {type(module).__name__}; rotor wraps plain nn.Sequential modules only"
                )
        elif not is_candidate(module):
            continue
        found.append((name, module))
        skipped.add(name)
    if found:
        return found, ""
    cls = type(model).__name__
    if include is not None:
        why = f"no submodule of {cls} matches include={list(include)!r}"
    elif seen_sequential:
        why = (
            f"{cls} has {seen_sequential} nn.Sequential submodule(s) but none is a plain Sequential with at least "
            "two stages outside `exclude`"
        )
    else:
        why = f"{cls} has no nn.Sequential submodule"
    return [], why


def split_budget(mem_limit: Budget | Mapping[str, Budget], chains: Sequence[tuple[str, nn.Sequential]]) -> list[Budget]:
    """Each chain's share of one budget, by the policy in the module docstring."""
    names = [name for name, _ in chains]
    if isinstance(mem_limit, Mapping):
        unknown = sorted(set(mem_limit) - set(names))
        if unknown:
            raise ValueError(f"mem_limit names {unknown} but the wrapped chains are {names}")
        missing = [n for n in names if n not in mem_limit]
        if missing:
            raise ValueError(f"mem_limit gives no budget for wrapped chain(s) {missing}; give one per chain: {names}")
        return [mem_limit[n] for n in names]
    if mem_limit is None or len(chains) == 1:
        return [mem_limit] * len(chains)
    value = parse_budget(mem_limit)
    if isinstance(value, Fraction):
        return [mem_limit] * len(chains)
    stages = [len(sequential_stages(seq)) for _, seq in chains]
    total = sum(stages)
    return [max(1, value * n // total) for n in stages]


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def wrap(
    model: nn.Module,
    mem_limit: Budget | Mapping[str, Budget] = None,
    *,
    include: Sequence[Selector] | None = None,
    exclude: Sequence[Selector] = (),
    slots: int = 500,
) -> tuple[list[Wrapped], str]:
    """Swap `Checkpointable`s in for the chosen Sequentials of `model`, in place."""
    chains, why = find_chains(model, include, exclude)
    wrapped = []
    for (name, seq), budget in zip(chains, split_budget(mem_limit, chains), strict=True):
        rotor = Checkpointable(seq, budget, slots=slots)
        _set(model, name, rotor)
        wrapped.append(Wrapped(name, seq, rotor))
    return wrapped, why


def unwrap(model: nn.Module, wrapped: Sequence[Wrapped]) -> None:
    """Put the user's Sequentials back where `wrap` put rotor modules."""
    for item in reversed(wrapped):
        _set(model, item.name, item.original)
