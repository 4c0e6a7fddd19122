"""The caller's real loss, measured on the first step a plan runs, and the chain raised to it.

Where the caller's loss is unknown (no `loss_fn=`, no `loss_tmp=`, no outside measured), the
profiler charges a cross-entropy stand-in (`profile.proxy_loss`). A loss that holds more (an MSE
keeps `a_L` and its loss value shares a buffer of `a_L`'s size; a contrastive loss saves a B x B
similarity) put the step over its budget with nothing said. So the first step each plan key runs
measures the real loss between the hand-over of `a_L` and the arrival of `δ_L`, in the stand-in's
terms (`profile.measure_loss_tmp`), and where it holds more the chain is raised and every shape
planned again, before the backward goes on (docs/memory-model.md, section 2, "The real loss").

NOTE: [the real loss] the window is one `MemoryProbe` entered in `HandOver`'s forward and left in its
backward, so it is measured only where both run in one thread (the CPU), and only when no chain is called
inside it (`spoiled`: a GAN's generator output fed to its discriminator); not under FSDP2, whose ranks
keep one plan. Elsewhere the stand-in stays charged and `loss_fn=` is the way out.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from lightning_rotor._torch_compat import StorageWeakRef, innermost_dispatch_mode, storage_id
from lightning_rotor.chain import Chain
from lightning_rotor.memory import MemoryProbe, storage_bytes
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


def spoil_open_watches() -> None:
    """A chain is called: what it makes inside an open window is its own (its share of the budget), no loss's.
    The window is left now (a forward whose output never gets a gradient leaves none open for long)."""
    for watch in list(_OPEN):
        watch.spoiled = True
        watch._leave()


class LossWatch:
    """Counts what is made between the hand-over of `a_L` (`start`) and the arrival of `δ_L` (`finish`).

    A `MemoryProbe` is entered at `start` and left at `finish`: on the CPU the autograd engine runs
    the backward in the thread of the forward, so the probe sees the loss's forward and backward.
    Other devices run the backward in threads of their own: nothing is measured there.
    """

    def __init__(self, done: Callable[[LossBytes], None]):
        self.done = done
        self.probe: MemoryProbe | None = None
        self.refs: list[tuple[StorageWeakRef, int]] = []
        self.size = 0
        self.spoiled = False  # a chain was called inside the window: its bytes are no loss's

    def start(self, tensors: Sequence[torch.Tensor]) -> None:
        if any(t.device.type != "cpu" for t in tensors):
            return
        storages = {storage_id(t.untyped_storage()): t for t in tensors}
        self.refs = [(StorageWeakRef(t.untyped_storage()), storage_bytes(t)) for t in storages.values()]
        self.size = storage_bytes(list(tensors))
        self.probe = MemoryProbe(bookkeeping=_bookkeeping())
        self.probe.__enter__()
        self.probe.track(list(tensors))
        _OPEN.append(self)

    def _leave(self) -> None:
        probe = self.probe
        if probe is None or innermost_dispatch_mode() is not probe:  # a mode entered after it: left at `finish`
            return
        self.probe, self.refs = None, []
        probe.__exit__(None, None, None)
        _OPEN.remove(self)

    def finish(self, grads: Sequence[torch.Tensor | None]) -> None:
        """`δ_L` came: the loss's figures to `done` (which may replan, or refuse in one line)."""
        probe = self.probe
        if probe is None:
            return
        probe.mark("δ_L")  # sweeps what died
        peak, current = probe.peak, probe.current
        alive = sum(n for ref, n in self.refs if not ref.expired())
        self._leave()
        if self.spoiled or self.probe is not None:  # a chain ran inside, or a mode above it is still entered
            return
        figures = loss_bytes(peak, current, alive, self.size, storage_bytes([g for g in grads if g is not None]))
        self.done(figures)


def loss_bytes(peak: int, current: int, alive: int, size: int, grad: int) -> LossBytes:
    """The figures of a window that peaked at `peak` and holds `current` bytes when `δ_L` (`grad` bytes) comes,
    `alive` of `a_L`'s `size` bytes still alive then (the step kept it: the graph of `B L-1`, or the caller)."""
    above = max(-size, peak - 2 * size)  # as the stand-in's: above `a_L` and `δ_L`
    kept = alive > 0
    # keeping `a_L` adds at most its bytes to any moment; dropping it takes nothing away
    plain, with_kept = (above, above) if kept else (above, above + size)
    return LossBytes(plain, max(plain, with_kept), max(0, current - grad - alive))


def raised_chain(chain: Chain, real: LossBytes) -> Chain | None:
    """`chain` charged at least the real loss's figures; None where it already was."""
    tmp = max(chain.loss_tmp, real.tmp)
    kept = max(chain.loss_tmp_kept, real.tmp_kept, tmp)
    value = max(chain.loss_value, real.value)
    if (tmp, kept, value) == (chain.loss_tmp, chain.loss_tmp_kept, chain.loss_value):
        return None
    return dataclasses.replace(chain, loss_tmp=tmp, loss_tmp_kept=kept, loss_value=value)
