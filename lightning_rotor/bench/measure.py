"""Measuring the bench's methods: peaks by exact tensor accounting, steps timed interleaved."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from lightning_rotor._torch_compat import activation_memory_budget, allocation_bytes, reset_compiled
from lightning_rotor.bench.methods import Method, Row
from lightning_rotor.bench.workload import Workload, measure_peak
from lightning_rotor.budget import format_bytes, parse_budget
from lightning_rotor.memory import storage_bytes
from lightning_rotor.profile import synchronize


class Progress(Protocol):
    """What the bench reports its progress to (a tqdm bar)."""

    def update(self, n: int, /) -> object: ...


def train_step(w: Workload, forward: Callable[[torch.Tensor], Any], seed: int) -> None:
    """Forward, loss and backward from the same seed; parameter gradients dropped first."""
    w.model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = w.loss(forward(w.x), w.y)
    loss.backward()


def allocator_peak(w: Workload, forward: Callable[[torch.Tensor], Any], seed: int) -> int:
    """Peak of the CPU allocator during a step, from torch.profiler's memory events (for compiled code).

    Parameter gradients are allocated before the step (zeros) so the figure, like the
    tensor accounting, holds activations only.
    """
    from torch.profiler import ProfilerActivity, profile

    for p in w.model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    torch.manual_seed(seed)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = w.loss(forward(w.x), w.y)
        loss.backward()
        del loss
    # the raw allocation records, in time order (the FunctionEvent view folds allocations into ops)
    current = peak = 0
    for nbytes in allocation_bytes(prof):
        current += nbytes
        peak = max(peak, current)
    w.model.zero_grad(set_to_none=True)
    return peak + storage_bytes(w.x)


def _summarize(r: Row) -> None:
    if r.times:
        med = statistics.median(r.times)
        r.step_ms = med * 1e3
        r.step_ms_min = min(r.times) * 1e3
        r.spread = (max(r.times) - min(r.times)) / med if med > 0 else 0.0


def run_interleaved(w: Workload, methods: list[Method], repeats: int, warmup: int, seed: int, bar: Progress) -> None:
    """Warm up, measure memory once, then time `repeats` rounds of one step per method."""
    live = [(m.row, forward) for m in methods if (forward := m.forward) is not None]
    for row, forward in live:
        for _ in range(warmup):
            train_step(w, forward, seed)
        row.measured_peak = measure_peak(w, forward, seed)
        bar.update(warmup + 1)
    for _ in range(repeats):
        for row, forward in live:
            synchronize(w.device)
            start = time.perf_counter()
            train_step(w, forward, seed)
            synchronize(w.device)
            row.times.append(time.perf_counter() - start)
            bar.update(1)
    for row, _ in live:
        _summarize(row)


def run_compiled(w: Workload, fractions: list[str], repeats: int, warmup: int, seed: int, bar: Progress) -> list[Row]:
    """`torch.compile` at each activation-memory budget, each in its own block; failures become notes."""
    rows: list[Row] = []
    eager_alloc: int | None = None
    for token in fractions:
        r = Row(w.name, str(w.device), "compile", mem_limit=token)
        rows.append(r)
        try:
            fraction = float(parse_budget(token))
            eager_text = ""  # on CPU: the eager step's allocator peak, for comparison
            if w.device.type == "cpu":
                if eager_alloc is None:
                    eager_alloc = allocator_peak(w, w.model, seed)
                eager_text = format_bytes(eager_alloc)
            reset_compiled()
            with activation_memory_budget(fraction):
                compiled = torch.compile(w.model)
                start = time.perf_counter()
                train_step(w, compiled, seed)  # compiles forward and backward under this budget
                compile_s = time.perf_counter() - start
                for _ in range(warmup):
                    train_step(w, compiled, seed)
                if w.device.type == "cpu":
                    r.measured_peak = allocator_peak(w, compiled, seed)
                    r.note = (
                        f"CPU allocator via torch.profiler (eager none the same way: {eager_text}); "
                        f"compiled in {compile_s:.0f} s"
                    )
                else:
                    r.measured_peak = measure_peak(w, compiled, seed)
                    r.note = f"compiled in {compile_s:.0f} s"
                for _ in range(repeats):
                    synchronize(w.device)
                    start = time.perf_counter()
                    train_step(w, compiled, seed)
                    synchronize(w.device)
                    r.times.append(time.perf_counter() - start)
            _summarize(r)
        except Exception as err:  # noqa: BLE001 - any compile failure is a result to report, not a crash
            first = str(err).strip().splitlines()[0] if str(err).strip() else ""
            r.note = f"torch.compile failed: {type(err).__name__}: {first[:160]}"
            r.times.clear()
        finally:
            reset_compiled()
        bar.update(warmup + repeats + 2)
    return rows
