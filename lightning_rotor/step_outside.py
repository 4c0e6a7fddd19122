"""What a step holds outside several chains that share one budget (`wrap(model, include=[...])`).

Each wrapped chain charges what its own module computes around its blocks (`pipeline.measure_outside`),
but not the model's code around the wrapped modules: an encoder-decoder's LM head and loss, computed
after the decoder chain returns, were charged to no chain, and the step could end above its budget.
`install` puts a forward pre-hook on every module that holds all the chains; the outermost one called
in training measures, once, before any chain runs, one forward of that module with every chain run
without grad and its output handed over as the executor hands it (`HandOver`: requiring grad, its
gradient caught), the loss the output carries (`profile.caller_loss`) and its backward. The peak of
what is alive outside the chains (the peak before each chain's call, and from its return on) is charged
to the budget as one more need (`Budget.charge_outside`): the chains' shares are split from the rest.
Parameters' `.grad`, buffers, the RNG stream and autocast's weight-cast cache are left untouched
(`profile.Untouched`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_rotor._torch_compat import tree_flatten, tree_map, tree_unflatten
from lightning_rotor.engine import HandOver
from lightning_rotor.huggingface import without_kv_cache
from lightning_rotor.memory import MemoryProbe
from lightning_rotor.pipeline import own_leaf

if TYPE_CHECKING:
    from lightning_rotor.checkpointable import Checkpointable
    from lightning_rotor.shared_budget import Budget

__all__ = ["install", "measure_step_outside"]


class _Dropped:
    """`HandOver`'s end for a chain run without grad: hands its output over, drops the gradient that comes
    (the chain's backward would consume it; it is the chain's, charged to it)."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.tensors = tensors

    def hand_over(self) -> list[torch.Tensor]:
        tensors, self.tensors = self.tensors, []
        return tensors

    def receive(self, grads: tuple[torch.Tensor | None, ...]) -> None:
        return None


def _handed_over(out: Any) -> Any:
    """`out` of a chain run without grad, as the chain's autograd Function gives it: requiring grad."""
    flat, spec = tree_flatten(out)
    end = _Dropped([t.detach() for t in flat if isinstance(t, torch.Tensor)])
    token = torch.empty(0, requires_grad=True)
    handed = iter(HandOver.apply(end, token))
    return tree_unflatten([next(handed) if isinstance(t, torch.Tensor) else t for t in flat], spec)


def measure_step_outside(
    root: nn.Module, chains: Sequence[Checkpointable], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> int:
    """The peak bytes a step of `root(*args, **kwargs)` holds outside `chains` (see the module docstring)."""
    from lightning_rotor.profile import Untouched, caller_loss, grads_aside

    probe = MemoryProbe(root)
    peaks: list[int] = []

    def boxed(rotor: Checkpointable, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
        peaks.append(probe.peak)  # what the code before this chain's call held at most
        a, kw = without_kv_cache(rotor.module, a, kw)
        with torch.no_grad():
            out = rotor.module(*a, **kw)
        out = _handed_over(out)
        probe.reset_peak()  # the chain's own bytes are its share's; its output is counted on
        return out

    args, kwargs = tree_map(own_leaf, (args, kwargs))  # as measure_outside: copies, so a write stays ours
    devices = [t.device for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    for rotor in chains:
        rotor.boxed = boxed
    try:
        with Untouched([root], devices), probe:
            output = root(*args, **kwargs)
            loss = caller_loss(output)
            del output  # the caller holds the loss into the backward, not the output
            if loss.requires_grad:
                with grads_aside(loss):
                    loss.backward()
            del loss
    finally:
        for rotor in chains:
            rotor.boxed = None
    return max([*peaks, probe.peak])


def install(model: nn.Module, chains: dict[str, Checkpointable], budget: Budget) -> None:
    """Pre-hooks on every module of `model` holding all `chains` (by name): the first training call of one
    measures the step outside the chains and charges it to `budget`, before any chain has joined."""
    names = list(chains)
    parts = [n.split(".")[:-1] for n in names]
    common: list[str] = []
    for level in zip(*parts, strict=False):
        if len(set(level)) > 1:
            break
        common.append(level[0])
    holders = [model.get_submodule(".".join(common[:i])) for i in range(len(common) + 1)]

    def measure(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        remove(budget)  # once, and not again from an inner holder while measuring
        if not budget.needs:  # no chain has planned yet: the shares are split with the outside charged
            budget.charge_outside(measure_step_outside(module, list(chains.values()), args, kwargs))

    budget.hooks = [m.register_forward_pre_hook(measure, with_kwargs=True) for m in holders]


def remove(budget: Budget) -> None:
    """Take `install`'s hooks off the model (measured, or the chains unwrapped)."""
    for hook in budget.hooks:
        hook.remove()
    budget.hooks = []
