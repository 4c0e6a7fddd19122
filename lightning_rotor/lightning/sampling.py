"""Which training steps run under the memory probe: by the plans they run (`StepSampler`).

The Trainer's `RotorCallback` and `RotorFabricStrategy` share it. Measuring a step costs time (tensor accounting
sees every op), so a step is sampled when a plan it will run was never measured (a schedule, the plan's ops: shapes
that share one share the sample), or has run `measure_every_n_steps` steps since its last sample. The probe must be
on from the start of a step, before its plans are chosen: they are told by its batch (`batch_key`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lightning_rotor._torch_compat import tree_flatten
from lightning_rotor.checkpointable import Checkpointable
from lightning_rotor.measure import StepMeasurement
from lightning_rotor.pipeline import Entry

__all__ = ["Measured", "Sample", "StepSampler", "batch_key", "clean_samples", "schedule_key"]


def schedule_key(entry: Entry | None) -> tuple[str, ...]:
    """What the probe samples by: the plan's schedule, whatever the input shape it was made for."""
    return () if entry is None else tuple(repr(op) for op in entry.plan.ops)


Schedule = tuple[str, ...]


def batch_key(batch: Any) -> tuple[Any, ...]:
    """What tells which plans a step will run before it runs: its batch's tensor shapes and dtypes (and the
    types of the other leaves), so that a last partial batch is told from the full ones."""
    leaves = tree_flatten(batch)[0]
    return tuple((tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else type(v).__name__ for v in leaves)


Measured = tuple[str, Checkpointable, StepMeasurement, int]  # a chain's name, it, its measurement, entries before
Sample = tuple[str, Checkpointable, StepMeasurement, Entry]  # the same, with the plan its clean sample measured


def clean_samples(measured: Sequence[Measured]) -> list[Sample]:
    """The clean samples of a step's `measured` chains, with the plan each measured: a chain that profiled a new
    signature in the measured step gives none."""
    clean: list[Sample] = []
    for name, rotor, m, before in measured:
        if len(rotor.entries) == before and m.entry is not None:
            clean.append((name, rotor, m, m.entry))
    return clean


class StepSampler:
    """Which training steps run under the memory probe, by the plans they run (the Trainer's callback and the
    Fabric strategy share it).

    A step's plans are known only once it has run, and the probe must be on from its start: the plans a step
    will run are those the latest step with the same `batch_key` ran (a batch not seen yet: the latest step's,
    as a guess). A step is sampled when one of those schedules was never measured, or has run `every` steps
    since its last sample; so with alternating shapes (a last partial batch) each shape's plan is sampled, and
    the step after a partial batch is not probed for the partial batch's plan. A sample spoilt by a new shape
    (it profiled) makes the next try wait for a step that profiles nothing (dynamic padding would otherwise run
    profile after profile under the probe).
    """

    def __init__(self, every: int):
        self.every = every
        self.measured_once: set[Schedule] = set()  # schedules measured by a clean sample
        self.since: dict[Schedule, int] = {}  # per schedule: steps that ran it since its last sample
        self.plans_of: dict[tuple[Any, ...], tuple[Schedule, ...]] = {}  # batch key -> the schedules it ran
        self.latest: tuple[Schedule, ...] = ()
        self.retry_after_known = False

    def wants(self, chains: dict[str, Checkpointable], key: tuple[Any, ...]) -> bool:
        """Whether the step about to run with a batch of `key` runs under the probe."""
        if not chains or any(not rotor.entries for rotor in chains.values()):
            return False  # the first batch profiles; a probe would slow and pollute it
        expected = self.plans_of.get(key, self.latest)
        if any(s not in self.measured_once for s in expected) and not self.retry_after_known:
            return True  # a schedule the step will run has not been measured yet
        return self.every > 0 and any(self.since.get(s, 0) >= self.every for s in expected)

    def ran(
        self,
        key: tuple[Any, ...],
        chains: dict[str, Checkpointable],
        before: dict[str, int],
        measured: Sequence[Measured],
    ) -> list[Sample]:
        """After a step with a batch of `key`: what `chains` (by name, those that planned) ran, given how many
        entries each had `before` the step and the step's `measured` chains. Returns the clean samples.

        A chain's first step runs each call at its smallest budget, a plan no later step runs: what it tells of
        its batch is the plan a call alone in its step runs (`entry`), and it counts as no run (never sampled)."""
        clean = clean_samples(measured)
        first = {name for name in chains if before.get(name, 0) == 0}
        self.plans_of[key] = self.latest = schedules = tuple(
            schedule_key(rotor.entry if name in first else rotor.last_entry) for name, rotor in chains.items()
        )
        if first:
            return clean
        sampled = {schedule_key(entry) for _, _, _, entry in clean}
        for schedule in schedules:
            self.since[schedule] = 0 if schedule in sampled else self.since.get(schedule, 0) + 1
        self.measured_once |= sampled
        profiled = any(len(rotor.entries) != before.get(name, 0) for name, rotor in chains.items())
        self.retry_after_known = len(clean) < len(measured) or (self.retry_after_known and profiled)
        return clean
