"""`StepMeasurement`: the measured activation memory of one training step.

Measuring a step (for the Lightning callback, tests and benchmarks)::

    with ckpt.measure_step() as m:      # enter before the forward
        loss = loss_fn(ckpt(x), y)
        loss.backward()                 # leave after the backward
    m.peak          # activation bytes: exact tensor accounting on CPU, allocator on CUDA
    m.curve         # [(op label, bytes alive after the op)] for the plan's ops
    m.predicted     # the simulator's bytes after each op, same order

Only that step pays for the probe; other steps run without it. The measured module learns
that a step is measured through the `watch` function it gave, called with the measurement
on entering and with None on leaving (`closed` tells it the figures are ready).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_rotor.memory import CudaMemoryProbe, MemoryProbe
from lightning_rotor.pipeline import Entry
from lightning_rotor.simulate import simulate

__all__ = ["StepMeasurement"]

Probe = MemoryProbe | CudaMemoryProbe


class StepMeasurement:
    """Measured activation memory of one training step (see the module docstring)."""

    def __init__(
        self,
        probe: Probe,
        watch: Callable[[StepMeasurement | None], None],
        closed: Callable[[StepMeasurement], None] | None = None,
    ) -> None:
        self.probe: Probe | None = probe  # None once the step is measured
        self._watch: Callable[[StepMeasurement | None], None] | None = watch
        self._closed = closed
        self.is_open = False  # between `__enter__` and `__exit__`: the owner's training steps are being measured
        self.entry: Entry | None = None  # the plan the step ran (the latest call's)
        self.peak = 0  # the whole measured block
        self.host_peak = 0  # host copies of offloaded values at most (device memory excludes them)
        self.chain_peak = 0  # while this chain's ops ran (the figure of a per-chain plot)
        self.curve: list[tuple[str, int]] = []
        self.op_peaks: list[int] = []
        self.start_op = 0  # the probe's op count when the chain's first op began

    def __enter__(self) -> StepMeasurement:
        assert self.probe is not None, "a StepMeasurement measures one step"
        self.probe.__enter__()
        self.is_open = True
        if self._watch is not None:
            self._watch(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.is_open = False
        if self._watch is not None:
            self._watch(None)
        closed, self._watch, self._closed = self._closed, None, None  # figures only from here, no functions
        probe, self.probe = self.probe, None  # plain figures only from here: the module stays copyable
        assert probe is not None
        probe.__exit__(*exc)
        if exc[0] is not None:
            return  # the step failed (e.g. InfeasibleBudget): let its error through untouched
        self.peak = probe.peak
        self.host_peak = probe.host_peak
        marks = getattr(probe, "marks", [])
        self.curve = [(label, nbytes) for label, _, nbytes in marks]
        if isinstance(probe, MemoryProbe):
            ends = [i for _, i, _ in marks]
            starts = [self.start_op, *ends[:-1]][: len(ends)]
            curve = probe.curve
            spans = zip(starts, ends, marks, strict=True)
            self.op_peaks = [max(curve[s:e], default=nbytes) for s, e, (_, _, nbytes) in spans]
        self.chain_peak = max(self.op_peaks or [nbytes for _, nbytes in self.curve], default=0)
        if closed is not None:
            closed(self)

    def started(self, entry: Entry) -> Probe | None:
        """A call of the measured step runs `entry`: the probe its runner marks ops with."""
        if self.entry is None:  # the step's first call: its marks start here
            self.start_op = getattr(self.probe, "ops", 0)
        self.entry = entry
        return self.probe

    @property
    def predicted(self) -> list[int]:
        """The simulator's bytes after each op of the measured plan."""
        if self.entry is None:
            return []
        return simulate(self.entry.chain, self.entry.plan.ops).curve

    @property
    def predicted_peak(self) -> int:
        return self.entry.plan.peak if self.entry is not None else 0

    def __getstate__(self) -> dict[str, Any]:
        """Copies keep the figures, not the owner's functions nor a probe (it holds storage handles)."""
        return {**self.__dict__, "_watch": None, "_closed": None, "probe": None}  # an open one, copied
