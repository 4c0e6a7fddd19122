"""The model's own checkpointing, under rotor: rotor plans the whole chain itself, and says so.

The ways a model checkpoints itself (docs/checkpointable.md, "The model's own checkpointing"):

- a `gradient_checkpointing` flag on its modules: Hugging Face transformers layers after
  `gradient_checkpointing_enable()`, diffusers blocks after `enable_gradient_checkpointing()`; and torch's
  `checkpoint_wrapper` modules (`apply_activation_checkpointing`, torchtitan's recipe, before `fully_shard`),
  whose checkpointing is turned off the same way (their `checkpoint_fn` swapped for a plain call), and torch's
  `offload_wrapper` modules, whose `save_on_cpu` offloading is turned off the same way (their forward a plain call
  of the block: rotor offloads by its own plan, `offload=`).
  Left on, rotor would profile blocks that checkpoint themselves and recompute them again on top
  (a block run up to five times for a few percent of memory). Rotor turns the flags off on the module
  it wraps while it holds it (`unwrap`, at the end of a Trainer's fit, turns them back on);
- `torch.utils.checkpoint.checkpoint` called in a forward: graph discovery traces through the call, so
  rotor's plan replaces it; discovery sees the call (`checkpoint_calls`).

Either way one warning says what rotor did, its budget, and what the user's own checkpointing held, so that a
budget above what the user had is never silent. With flags, that is measured (`measured_peak`: one step of the
module as the user has it, before rotor turns the flags off); with `torch.utils.checkpoint` calls that discovery
traced through, nothing is left to measure, and the figure is the simulator's estimate of recomputing every stage
once (`every_stage_peak`).
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from lightning_rotor._torch_compat import (
    checkpoint_calls_watched,
    checkpoint_wrapper_on,
    is_checkpoint_wrapper,
    is_offload_wrapper,
    offload_wrapper_on,
    set_checkpoint_wrapper,
    set_offload_wrapper,
    tree_flatten,
    tree_map,
)
from lightning_rotor.budget import format_bytes
from lightning_rotor.chain import Chain
from lightning_rotor.frames import first_outside
from lightning_rotor.memory import MemoryProbe
from lightning_rotor.ops import Op
from lightning_rotor.pipeline import LossFn, own_leaf
from lightning_rotor.profile import Untouched, caller_loss, grads_aside
from lightning_rotor.simulate import simulate


def _own_on(module: nn.Module) -> bool:
    if is_checkpoint_wrapper(module):  # its attributes read through to the block it wraps: not its own flag
        return checkpoint_wrapper_on(module)
    if is_offload_wrapper(module):  # the same
        return offload_wrapper_on(module)
    return getattr(module, "gradient_checkpointing", False) is True


def flagged(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """`module`'s submodules (itself included) whose own checkpointing is on: a `gradient_checkpointing=True` flag,
    or torch's `checkpoint_wrapper` (`CheckpointWrapper`), whose checkpointing rotor turns off the same way, or
    torch's `offload_wrapper` (`OffloadWrapper`, activation offloading), turned off the same way too."""
    return [(n, m) for n, m in module.named_modules() if _own_on(m)]


def turn_off(modules: list[tuple[str, nn.Module]]) -> None:
    _set_own(modules, False)


def turn_on(modules: list[tuple[str, nn.Module]]) -> None:
    _set_own(modules, True)


def _set_own(modules: list[tuple[str, nn.Module]], on: bool) -> None:
    """Each module's own checkpointing on or off: a `checkpoint_wrapper`'s, an `offload_wrapper`'s offloading, or a
    `gradient_checkpointing` flag."""
    for _, m in modules:
        if is_checkpoint_wrapper(m):
            set_checkpoint_wrapper(m, on)
        elif is_offload_wrapper(m):
            set_offload_wrapper(m, on)
        else:
            setattr(m, "gradient_checkpointing", on)  # noqa: B010 (a flag of the user's class, not nn.Module's)


@contextlib.contextmanager
def turned_on(modules: list[tuple[str, nn.Module]]) -> Iterator[None]:
    """The flags rotor turned off, on again while open (to measure the user's own checkpointing)."""
    turn_on(modules)
    try:
        yield
    finally:
        turn_off(modules)


def measured_peak(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], loss_fn: LossFn | None) -> int:
    """The activation peak of one training step of `module` as it runs now (its own checkpointing on), measured.

    Forward, the step's loss (`loss_fn`, else the output's own `.loss`: `profile.caller_loss`) and its backward,
    under `MemoryProbe`, on copies of the call's tensors cut from the caller's graph. Parameters' `.grad`, buffers,
    the RNG stream and autocast's cast cache are left as they were (`profile.Untouched`), so the step that follows
    trains bitwise as without it.
    """
    args, kwargs = tree_map(own_leaf, (args, kwargs))
    devices = [t.device for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    with Untouched([module], devices), MemoryProbe(module) as probe:
        loss = caller_loss(module(*args, **kwargs), loss_fn)
        if loss.requires_grad:
            with grads_aside(loss):  # parameters outside `module` (a loss_fn's): their .grad is the caller's
                loss.backward()
        del loss
    return probe.peak


def _listed(found: list[tuple[str, nn.Module]]) -> str:
    names = ", ".join(n or "<root>" for n, _ in found[:3]) + (", ..." if len(found) > 3 else "")
    return f"{len(found)} modules: {names}"


def _own_kind(found: list[tuple[str, nn.Module]]) -> str:
    """What the modules of `found` do themselves: checkpointing, torch's `offload_wrapper`'s offloading, or both."""
    offloading = sum(is_offload_wrapper(m) for _, m in found)
    if not offloading:
        return "gradient checkpointing"
    kind = f"activation offloading (torch's offload_wrapper, {offloading} modules)"
    return kind if offloading == len(found) else f"gradient checkpointing and {kind}"


def turned_off(owner: str, found: list[tuple[str, nn.Module]]) -> str:
    """What rotor did with the flags of `found` (the modules of one chain), for `warning`."""
    return (
        f"{owner} had its own {_own_kind(found)} on ({_listed(found)}); rotor turned it off while it trains "
        "this module (a Trainer's fit or a Fabric strategy's teardown() turns it back on; "
        "`restore_own_checkpointing()` does by hand)"
    )


def turned_off_in_chains(owner: str, found: dict[str, list[tuple[str, nn.Module]]]) -> str:
    """The same for several chains of one model (an encoder's and a decoder's stacks): one note naming each."""
    chains = "; ".join(f"{name}: {_listed(modules)}" for name, modules in found.items() if modules)
    kind = _own_kind([item for modules in found.values() for item in modules])
    return (
        f"{owner} had its own {kind} on ({chains}); rotor turned it off while it trains "
        "these chains (a Trainer's fit or a Fabric strategy's teardown() turns it back on)"
    )


@contextlib.contextmanager
def checkpoint_calls() -> Iterator[list[str]]:
    """Records, while open, where `torch.utils.checkpoint.checkpoint` is called from on this thread (`file:line` of
    the first caller outside torch and rotor), however the caller imported it (a `checkpoint_wrapper` module too).

    Told by torch's checkpoint itself (`checkpoint_calls_watched`), not by a hook on every Python call: the
    discovering forward runs at its own speed, under whatever profiler the user set."""
    seen: list[str] = []
    skipped = (os.path.dirname(torch.__file__), os.path.dirname(__file__))

    def told() -> None:
        caller = first_outside(sys._getframe(1), skipped)
        seen.append(f"{caller.f_code.co_filename}:{caller.f_lineno}" if caller else "torch")

    with checkpoint_calls_watched(told):
        yield seen


def every_stage_ops(length: int) -> list[Op]:
    """Per-stage checkpointing as a plan: each stage input kept, each stage recomputed once for its backward."""
    ops = [Op("Fc", k) for k in range(length - 1)] + [Op("Fe", length - 1), Op("Loss"), Op("B", length - 1)]
    for k in reversed(range(length - 1)):
        ops += [Op("Fe", k), Op("B", k)]
    return ops


def every_stage_peak(chain: Chain) -> int:
    """What recomputing every stage once holds at its peak (chain with no frozen prefix; else the no-recompute
    figure is not comparable and 0 is returned)."""
    if chain.frozen or chain.length < 2:
        return 0
    return simulate(chain, every_stage_ops(chain.length)).peak


def warning(what: str, budget: int, chain: Chain, share: str = "", measured: int = 0) -> str:
    """The one line telling what rotor did with the model's own checkpointing, and how its budget compares.

    `measured`: the peak the user's own checkpointing measured (`measured_peak`); 0 where nothing could be
    measured, and the simulator's estimate of per-block checkpointing is given instead. `share`: the chain's name
    where several chains share one budget; its bytes are then its share of the budget, not a `mem_limit` to give."""
    whole = f"{share}'s chain itself within its share" if share else "the whole chain itself within"
    line = f"rotor: {what}; rotor plans {whole} {format_bytes(budget)}"
    if measured:
        theirs = f"your own checkpointing measured {measured} B a step; rotor's budget {budget} B"
        return _compared(line + f": {theirs}", budget, measured, share, "")
    per_stage = every_stage_peak(chain)
    if not per_stage:
        return line
    per_block = "recomputing every stage once holds (rotor's estimate of per-block checkpointing, not measured)"
    return _compared(line, budget, per_stage, share, f"the {format_bytes(per_stage)} that {per_block}")


def _compared(line: str, budget: int, theirs: int, share: str, named: str) -> str:
    """`line` with whether `budget` is above `theirs` (what the user's checkpointing held, `named` if not said)."""
    if budget > theirs:
        advice = "a smaller budget holds less" if share else f"give mem_limit={theirs} or less to hold no more"
        more = f", more than {named}" if named else ""
        return f"{line}{more}: it runs faster but may hold more than before; {advice}"
    return f"{line}, within {named}" if named else f"{line}: no more than before"


class OwnCheckpointing:
    """One chain's hand-off with its module's own checkpointing: the flags rotor turned off (`held`), what to
    tell with the chain's first plan (`tell`), and the peak one step with the flags on measured (`peak`)."""

    def __init__(self) -> None:
        self.held: list[tuple[str, nn.Module]] = []  # modules whose own flag rotor turned off
        self.note = ""  # what rotor did with the model's own checkpointing, told with the first plan
        self.model_note: list[str] = [""]  # the same for several chains of one model, shared: the first plan tells
        self.peak = 0  # the peak a step with the module's own checkpointing on measured (`measure`)

    def take(self, module: nn.Module) -> None:
        """Turn off `module`'s own `gradient_checkpointing` flags: rotor plans the whole chain."""
        found = flagged(module)
        if found:
            turn_off(found)
            self.hold(found, turned_off(type(module).__name__, found))

    def measure(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], loss_fn: LossFn | None) -> None:
        """Where `module` has its own checkpointing flags (on, or turned off by rotor and turned on again
        meanwhile): one step of it as the user has it, measured once, for the warning to compare."""
        if self.peak:
            return
        if self.held or flagged(module):
            with turned_on(self.held):
                self.peak = measured_peak(module, args, kwargs, loss_fn)

    def hold(self, found: list[tuple[str, nn.Module]], note: str | list[str]) -> None:
        """Flags turned off for this chain (`restore` turns them back on), and what to tell with its first plan:
        a list is one note shared by several chains of one model (lightning/wrap.py), told by whichever plans
        first (a chain that finds none, and runs as written, leaves it to the others)."""
        self.held += found
        if isinstance(note, list):
            self.model_note = note
        else:
            self.note = note

    def note_calls(self, owner: str, calls: list[str], kind: str) -> None:
        """`torch.utils.checkpoint` calls that discovery of kind `kind` saw in `owner`'s forward, to tell."""
        where = calls[0] + (f" and {len(calls) - 1} more" if len(calls) > 1 else "")
        if kind == "graph":
            did = "graph discovery traced through them: rotor's plan replaces them"
        else:
            did = f"{kind} discovery runs the forward as written: they stay, nested in rotor's plan"
            did += " (discover='graph' replaces them)"
        self.note = f"{owner}'s forward calls torch.utils.checkpoint ({where}); {did}"

    def restore(self) -> None:
        """Turn the flags rotor turned off back on."""
        turn_on(self.held)
        self.held = []

    def tell(self, budget: int, chain: Chain, share: str, stacklevel: int) -> None:
        """With the chain's first plan (`budget` bytes for `chain`): one warning, once per model."""
        note = self.note or self.model_note[0]
        if note:
            warnings.warn(warning(note, budget, chain, share, self.peak), stacklevel=stacklevel + 1)
            self.note = self.model_note[0] = ""
