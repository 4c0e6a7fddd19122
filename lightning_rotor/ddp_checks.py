"""A chain under DistributedDataParallel: is a call inside DDP's forward, and are its stages free of tied weights?

The executor runs each stage's backward on its own and, under DDP, leaves the parameters'
accumulators to the plan's backward alone (NOTE: [no parameter edges under DDP] in execute.py).
A parameter several stages use (tied weights) gets its gradient once per stage; DDP all-reduces it
at the first and misses the rest, so such a chain is refused before any profile or optimizer step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from torch import nn

from lightning_rotor._torch_compat import active_ddp_reduced

if TYPE_CHECKING:
    from lightning_rotor.discovery import Discovery
    from lightning_rotor.stages import Stages

__all__ = ["DdpWatch", "refuse_tied", "shared_parameters"]


def shared_parameters(
    module: nn.Module, names: Sequence[str], stages: Stages | Sequence[nn.Module], discovery: Discovery | None
) -> dict[str, list[str]]:
    """Parameters whose gradient several stages add to (tied weights), by name, with their users.

    A stage of a module-level run shares also with the forward outside the run.
    """
    by_id = {id(p): n for n, p in module.named_parameters(remove_duplicate=True)}
    users: dict[int, list[str]] = {}
    inside: set[int] = set()
    for name, stage in zip(names, stages, strict=True):
        for ident in {id(p) for p in stage.parameters()}:
            users.setdefault(ident, []).append(name)
            inside.add(ident)
    if discovery is not None and discovery.run is not None:
        staged = {id(m) for stage in stages for m in stage.modules()}
        for outer in module.modules():
            if id(outer) in staged or any(id(m) in staged for m in outer.children()):
                continue
            for p in outer.parameters(recurse=False):
                if id(p) in inside:
                    users[id(p)].append("(outside the run)")
    return {by_id.get(p, "?"): u for p, u in users.items() if len(u) > 1}


def refuse_tied(shared: dict[str, list[str]]) -> None:
    """One clear error for the first tied parameter of `shared` (`shared_parameters`), if any."""
    if shared:
        name, users = next(iter(shared.items()))
        raise RuntimeError(
            f"rotor under DDP: parameter {name!r} is used by stages {', '.join(users)} (tied weights); "
            "DDP would all-reduce its gradient after the first stage's backward and miss the rest. "
            "Untie it, or train this model with DDP without rotor"
        )


class DdpWatch:
    """Whether a chain's calls run inside a DistributedDataParallel whose reducer waits for its parameters,
    and which stages were found free of tied weights (each worked out once per DDP and set of stages)."""

    def __init__(self) -> None:
        self.seen: tuple[int, object, bool] | None = None  # (DDP's id, the stages, the answer)
        self.untied: object = None  # the stages found free of tied weights under DDP

    def under_ddp(self, stages: object, parameters: Sequence[nn.Parameter]) -> bool:
        """Does this call run inside the forward of a DDP reducing some of `parameters` (the stages')? Asked on
        every training call (a model may be wrapped after its first steps): plain torch DDP under torchrun,
        with no Lightning strategy to set `distributed`, is found here."""
        active = active_ddp_reduced()
        if active is None:
            return False
        seen = self.seen
        if seen is not None and seen[0] == active[0] and seen[1] is stages:
            return seen[2]
        reduced = {id(p) for p in active[1]}
        under = any(id(p) in reduced for p in parameters)
        self.seen = (active[0], stages, under)
        return under
