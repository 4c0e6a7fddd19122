"""The caller's real loss, measured on the first step a plan runs, and the chain raised to it.

Where the caller's loss is unknown (no `loss_fn=`, no `loss_tmp=`, no outside measured), the
profiler charges a cross-entropy stand-in (`profile.proxy_loss`). A loss that holds more (an MSE
keeps `a_L` and its loss value shares a buffer of `a_L`'s size; a contrastive loss saves a B x B
similarity) put the step over its budget with nothing said. So the first step each plan key runs
measures the real loss between the hand-over of `a_L` and the arrival of `δ_L`, in the stand-in's
terms (`profile.measure_loss_tmp`), and where it holds more the chain is raised and planned again
(`LossPerByte` carries it to shapes planned later), before the backward goes on (docs/memory-model.md,
section 2, "The real loss").

NOTE: [the real loss] the window is one `MemoryProbe` entered in `HandOver`'s forward and left in its
backward, which the engine runs under the modes of the thread that called `backward()`; after that node the
engine puts the probe back on that thread's stack, and `settle_watches` takes it off outside any backward.
Measured on the CPU only, with no other dispatch mode entered before the forward, no chain called inside the
window (`spoiled`: a GAN's generator output fed to its discriminator), not under FSDP2 (its ranks keep one
plan). Elsewhere the stand-in stays charged and `loss_fn=` is the way out (one warning says so).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import warnings
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any, NamedTuple

import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from lightning_rotor._torch_compat import (
    StorageWeakRef,
    dispatch_mode_stack,
    drop_dispatch_mode,
    in_backward,
    innermost_dispatch_mode,
    tree_flatten,
)
from lightning_rotor.chain import Chain
from lightning_rotor.compile import in_compiled_caller
from lightning_rotor.memory import MemoryProbe, storage_bytes, storage_key
from lightning_rotor.planner import InfeasibleBudget


def _bookkeeping() -> tuple[Callable, ...]:
    """Lightning's copies of logged values and of the loss (for its progress bar): no activations for the step's
    probe (docs/memory-model.md, section 5), so no loss bytes either."""
    if "lightning.pytorch" not in sys.modules:
        return ()
    from lightning_rotor.lightning.callback import LIGHTNING_BOOKKEEPING

    return LIGHTNING_BOOKKEEPING


class LossBytes(NamedTuple):
    """The real loss's figures, as `profile.measure_loss_tmp` gives the stand-in's."""

    tmp: int  # peak above `a_L` and `δ_L` with a plain `a_L` (a bound where the step kept it)
    tmp_kept: int  # the same with `a_L` alive throughout (a bound where the step dropped it)
    value: int  # bytes the loss left alive for the rest of the step (its value, the seed gradient)


class LossOverBudget(InfeasibleBudget):
    """The caller's loss holds more than the stand-in charged, and with it no plan meets the budget."""

    def __init__(self, budget: int, min_feasible: int) -> None:
        super().__init__(budget, min_feasible)
        self.args = (
            f"the training step's loss holds more than the cross-entropy stand-in the budget was planned with, and "
            f"with it {self.args[0]}, or pass Checkpointable(..., loss_fn=...) to plan with the real loss",
        )


_OPEN: list[LossWatch] = []  # windows between a hand-over and its gradient, in every chain
_ENDED: list[MemoryProbe] = []  # probes of windows left in a backward node: back on the caller's stack after it
_WARNED: set[str] = set()  # why a window could not open, said once
_settle_hook: RemovableHandle | None = None  # while a window is `_ENDED`: settles before any optimizer step


def settle_watches() -> None:
    """Outside any backward (a chain is called, a step's backward is over, a probe around the step is left): a
    window still open saw a chain call, or no `δ_L`, so what it counted is no loss's: it is left unmeasured. A
    window left in a backward node is taken off the dispatch-mode stack, where the engine put it back."""
    for watch in list(_OPEN):
        watch.spoiled = True
        watch.leave()
        if watch.probe is not None:
            drop_dispatch_mode(watch.probe)
            watch.probe = None
    while _ENDED:
        drop_dispatch_mode(_ENDED.pop())
    global _settle_hook
    if _settle_hook is not None:
        _settle_hook.remove()
        _settle_hook = None


def _ended(probe: MemoryProbe) -> None:
    """`probe`'s window was left in a backward node: settled at the next optimizer step at the latest (a loop
    without a Trainer calls no chain between its backward and its step; one hook, on every optimizer)."""
    global _settle_hook
    _ENDED.append(probe)
    if _settle_hook is None:
        _settle_hook = register_optimizer_step_pre_hook(lambda *_: settle_watches())


def off_this_node() -> None:
    """In a backward node: windows left in an earlier node are back on this node's dispatch-mode stack (the
    engine runs every node under the modes of the `backward()` call): off it for this node."""
    for probe in _ENDED:
        drop_dispatch_mode(probe)


def _refused(tensors: Sequence[torch.Tensor]) -> str | None:
    """Why a window cannot open at this hand-over, if it cannot."""
    if in_compiled_caller():  # a mode over compiled code leaves it eager for good (docs/compile.md)
        return "under torch.compile"
    device = next((t.device for t in tensors if t.device.type != "cpu"), None)
    if device is not None:  # the engine runs a device's backward in threads of its own
        return f"on {device.type}"
    outer = [m for m in dispatch_mode_stack() if not isinstance(m, MemoryProbe)]
    if outer:  # it would leave the stack before the window does, taking the window with it
        return f"under {type(outer[-1]).__name__}"
    return None


class _WindowProbe(MemoryProbe):
    """A `MemoryProbe` that notes which storages the backward made (`in_backward`), at which op.

    Those still alive when `δ_L` comes are gradients of leaves (the parameters of a head after the chain,
    DDP's or not): parameter memory, which the step's probe leaves out too, so the window's figures do.
    """

    def __init__(self) -> None:
        super().__init__(bookkeeping=_bookkeeping(), record_curve=True)
        self.start = 0  # bytes alive when the window opened (`a_L`)
        self.made_in_backward: dict[int, int] = {}  # storage key -> the op (its curve index) that made it

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self._closed or not in_backward():
            return super().__torch_dispatch__(func, types, args, kwargs)
        before = set(self._live)  # a loss's window holds few storages
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.made_in_backward.update(dict.fromkeys(self._live.keys() - before, self.ops - 1))
        return out

    def figures(self, grads: Sequence[torch.Tensor]) -> tuple[int, int]:
        """The peak and the bytes alive now, less the storages the backward made that are still alive, bar
        `δ_L`'s (`grads`): from the op that made each on."""
        self.mark("δ_L")  # sweeps what died
        skip = {storage_key(g) for g in grads}
        leaves = [(op, self._live[k]) for k, op in self.made_in_backward.items() if k in self._live and k not in skip]
        peak = self.start
        for i, nbytes in enumerate(self.curve):
            peak = max(peak, nbytes - sum(n for op, n in leaves if op <= i))
        return peak, self.current - sum(n for _, n in leaves)


class LossWatch:
    """Counts what is made between the hand-over of `a_L` (`start`) and the arrival of `δ_L` (`finish`).

    A `MemoryProbe` is entered at `start`, in the forward, and left at `finish`, in `HandOver`'s backward:
    the engine runs that backward under the dispatch modes of the thread that called `backward()`, so
    the probe sees the loss's forward and backward. Leaving it there holds for the rest of that node only
    (the engine then puts back the stack the node started with): `settle_watches` takes it off for good.
    """

    def __init__(self, done: Callable[[LossBytes], None]):
        self.done = done
        self.probe: _WindowProbe | None = None
        self.refs: list[tuple[StorageWeakRef, int]] = []
        self.size = 0
        self.spoiled = False  # a chain was called inside the window: its bytes are no loss's

    def start(self, tensors: Sequence[torch.Tensor]) -> None:
        refused = _refused(tensors)
        if refused is not None:
            _warn_once(refused)
            return
        storages = {storage_key(t): t for t in tensors}
        self.refs = [(StorageWeakRef(t.untyped_storage()), storage_bytes(t)) for t in storages.values()]
        self.size = storage_bytes(list(tensors))
        self.probe = _WindowProbe()
        self.probe.__enter__()
        self.probe.track(list(tensors))
        self.probe.start = self.probe.current
        _OPEN.append(self)

    def leave(self) -> None:
        """Stop counting; off the stack where the probe is on top (its `with` flags restored), else later."""
        probe = self.probe
        if probe is None:
            return
        _OPEN.remove(self)
        if innermost_dispatch_mode() is probe:
            probe.__exit__(None, None, None)
            self.probe = None
        else:
            probe.end()

    def finish(self, grads: Sequence[torch.Tensor | None]) -> None:
        """`δ_L` came: the loss's figures to `done` (which may replan, or refuse in one line)."""
        probe = self.probe
        if probe is None:
            return
        present = [g for g in grads if g is not None]
        peak, current = probe.figures(present)
        alive = sum(n for ref, n in self.refs if not ref.expired())
        self.refs = []
        self.leave()  # in this backward node: the plan's backward runs with no mode
        _ended(probe)
        self.probe = None
        if self.spoiled:
            return
        figures = loss_bytes(peak, current, alive, self.size, storage_bytes(present))
        self.done(figures)


def watched(output: Any, watch: LossWatch) -> Any:
    """A plain run's `output` (nothing recomputed) watched as the plan's `HandOver` is: the window opens now and
    ends when the gradients of its tensors that require grad come (a hook on them; the output stays as it is:
    an identity node would make it a view that no in-place op may change)."""
    tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    if not tensors:
        return output
    watch.start(tensors)
    if watch.probe is None:
        return output

    def arrived(grads: Sequence[torch.Tensor | None]) -> None:
        handle.remove()
        watch.finish(grads)

    handle = register_multi_grad_hook(tensors, arrived, mode="all")
    return output


def _warn_once(why: str) -> None:
    if why in _WARNED:
        return
    _WARNED.add(why)
    warnings.warn(
        f"rotor: the training step's loss is not measured {why}: it is charged as a cross-entropy stand-in, and a "
        "loss that holds more (MSE, L1, a B x B similarity) can go over the budget; pass "
        "Checkpointable(..., loss_fn=...) to plan with the real loss",
        stacklevel=2,
    )


def loss_bytes(peak: int, current: int, alive: int, size: int, grad: int) -> LossBytes:
    """The figures of a window that peaked at `peak` and holds `current` bytes when `δ_L` (`grad` bytes) comes,
    `alive` of `a_L`'s `size` bytes still alive then (the step kept it: the graph of `B L-1`, or the caller)."""
    above = max(-size, peak - 2 * size)  # as the stand-in's: above `a_L` and `δ_L`
    kept = alive > 0
    # keeping `a_L` adds at most its bytes to any moment; dropping it takes nothing away
    plain, with_kept = (above, above) if kept else (above, above + size)
    return LossBytes(plain, max(plain, with_kept), max(0, current - grad - alive))


class LossPerByte(NamedTuple):
    """A measured real loss's figures per byte of the chain's output `a_L`, and beyond it: what a shape planned
    later is charged at its own `a_L` until its own first step measures it (an elementwise loss, MSE or L1,
    holds a multiple of `a_L` plus a constant: both forms kept, the larger charged)."""

    ratios: tuple[Fraction, Fraction, Fraction]  # (tmp, tmp_kept, value) / a_L bytes
    beyond: tuple[int, int, int]  # (tmp, tmp_kept, value) - a_L bytes

    @classmethod
    def of(cls, real: LossBytes, out: int) -> LossPerByte:
        return cls(tuple(Fraction(f, max(1, out)) for f in real), tuple(f - out for f in real))  # type: ignore[arg-type]

    def at(self, out: int) -> LossBytes:
        """The figures charged where `a_L` has `out` bytes."""
        return LossBytes(*(max(math.ceil(r * out), b + out) for r, b in zip(self.ratios, self.beyond, strict=True)))

    def max(self, other: LossPerByte | None) -> LossPerByte:
        if other is None:
            return self
        ratios = tuple(max(a, b) for a, b in zip(self.ratios, other.ratios, strict=True))
        beyond = tuple(max(a, b) for a, b in zip(self.beyond, other.beyond, strict=True))
        return LossPerByte(ratios, beyond)  # type: ignore[arg-type]


def raised_chain(chain: Chain, real: LossBytes) -> Chain | None:
    """`chain` charged at least the real loss's figures; None where it already was."""
    tmp = max(chain.loss_tmp, real.tmp)
    kept = max(chain.loss_tmp_kept, real.tmp_kept, tmp)
    value = max(chain.loss_value, real.value)
    if (tmp, kept, value) == (chain.loss_tmp, chain.loss_tmp_kept, chain.loss_value):
        return None
    return dataclasses.replace(chain, loss_tmp=tmp, loss_tmp_kept=kept, loss_value=value)
