"""Every CUDA path of lightning_rotor, checked in one run (under 8 minutes on one H100 or H200), one markdown report.

    python benchmarks/gpu_check.py --out docs/gpu_check_h100.md     # a CUDA machine, `pip install -e .` done
    python benchmarks/gpu_check.py --cpu --out /tmp/gpu_check.md     # the same checks at tiny sizes (seconds)

Sections (each with its own time budget, a failure recorded without stopping the others):

1. allocator probe: one rotor step measured by `CudaMemoryProbe` (the allocator) and `MemoryProbe` (exact
   tensor accounting), against the plan's prediction and against `torch.cuda.max_memory_allocated` minus
   the persistent state (parameters, gradients, buffers, batch);
2. RNG replay with dropout: rotor under a recomputing plan trains bitwise like plain training (losses,
   gradients, generator states, parameters over SGD steps), alone (generators rewound) and with another
   thread alive (per-op replay);
3. bf16 autocast: the same against plain autocast training, and the measured peak within the budget;
4. offloading (lightning_rotor/offload.py): copy stream, events, pinned pool: bitwise, device peak within
   the budget, host memory back to 0, the pool reserved once; measured bandwidth;
5. measured against predicted step time and peak: a GPT-2-small-like GPT (12 layers, 768 wide, 1024 tokens)
   and ResNet-50 at the smallest feasible budget, 50% and 100%;
6. rotor against each model's own checkpointing at equal memory (`lightning-rotor bench`'s methods):
   per-block checkpointing on ResNet-50 and the GPT, Hugging Face's on GPT-2 where transformers is installed.

Statuses: PASS / FAIL are promises (bitwise equality, tensor-accounted peak within the budget, host memory
given back, probes agreeing); HOLDS / MISSES are targets (speed, the allocator's peak against the plan),
judged on CUDA only; SKIP says why a check did not run (CUDA-only parts on `--cpu`). Bitwise sections run
under `torch.use_deterministic_algorithms(True, warn_only=True)` with cuDNN deterministic, and a control
(plain training run twice) says whether the device itself is reproducible.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import importlib.util
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import offload_gpu  # benchmarks/offload_gpu.py, beside this script
import torch

from lightning_rotor import Checkpointable
from lightning_rotor.bench.measure import run_interleaved, train_step
from lightning_rotor.bench.methods import Method, Row, eager_methods, per_block_methods, rotor_methods
from lightning_rotor.bench.report import add_ratios, checks, markdown
from lightning_rotor.bench.workload import Workload, load_workload, measure_peak
from lightning_rotor.budget import format_bandwidth, format_bytes
from lightning_rotor.memory import CudaMemoryProbe, MemoryProbe, storage_bytes
from lightning_rotor.models.gpt import Block
from lightning_rotor.models.resnet import Bottleneck
from lightning_rotor.offload import buffer_sizes, measure_bandwidth
from lightning_rotor.ops import OpKind
from lightning_rotor.planner import min_feasible_budget
from lightning_rotor.profile import profile_chain
from lightning_rotor.rng import alone
from lightning_rotor.simulate import no_recompute_peak

PASS, FAIL, SKIP, HOLDS, MISSES = "PASS", "FAIL", "SKIP", "HOLDS", "MISSES"
STEPS = 3  # SGD steps compared bitwise
TIME_BAND = (0.8, 1.25)  # measured / predicted step time, a target on CUDA
PEAK_GAP = 0.10  # the bench's target: measured peak within 10% of the prediction
MIN_SECTION_S = 5.0  # a section with less time left is not started
SLACK = 2**16  # bytes tensor accounting may count beside the CUDA allocator (CPU generator states, scalars)


# -- sizes ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sizes:
    """Models and batches per device: CUDA at the issue's sizes, `--cpu` tiny."""

    batch: int  # the small GPT of sections 1-4 (dropout in every block)
    gpt: dict[str, Any]
    resnet18: dict[str, Any]  # section 4's second model (BatchNorm)
    resnet18_batch: int
    gpt2: dict[str, Any]  # GPT-2-small-like: sections 5 and 6
    gpt2_batch: int
    resnet50: dict[str, Any]
    resnet50_batch: int
    hf: dict[str, Any]  # hf:gpt2 overrides (section 6)
    hf_batch: int
    limit: float  # seconds for the whole run
    repeats: tuple[int, int]  # interleaved timing rounds: (fewest, most)


CUDA_SIZES = Sizes(
    batch=8,
    gpt=dict(vocab_size=8192, block_size=512, n_layer=8, n_head=8, n_embd=512, dropout=0.1),
    resnet18=dict(width=64, num_classes=1000, image_size=112),
    resnet18_batch=32,
    gpt2=dict(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768, dropout=0.1),
    gpt2_batch=8,  # no-recomputation peak about 24 GB in fp32: comfortable on 80 GB
    resnet50=dict(width=64, num_classes=1000, image_size=224),
    resnet50_batch=64,
    hf=dict(n_layer=12, n_embd=768, n_head=12, n_positions=1024, seq=1024),
    hf_batch=8,
    limit=450.0,  # 8 minutes less the start and the report
    repeats=(3, 7),
)
CPU_SIZES = Sizes(
    batch=4,
    gpt=dict(vocab_size=64, block_size=16, n_layer=6, n_head=2, n_embd=16, dropout=0.1),
    resnet18=dict(width=4, num_classes=10, image_size=32),
    resnet18_batch=4,
    gpt2=dict(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=16, dropout=0.1),
    gpt2_batch=4,
    resnet50=dict(width=4, num_classes=10, image_size=32),
    resnet50_batch=4,
    hf=dict(n_layer=2, n_embd=32, n_head=2, n_positions=32, vocab_size=128, seq=32),
    hf_batch=4,
    limit=300.0,
    repeats=(2, 2),
)


# -- sections and their checks -------------------------------------------------------------------------------
class SectionTimeout(Exception):
    """A section ran past its time budget (raised by the alarm)."""


@dataclass
class Section:
    number: int
    title: str
    share: float  # of the run's time limit
    lines: list[tuple[str, str]] = field(default_factory=list)  # (status, text)
    blocks: list[str] = field(default_factory=list)  # markdown tables and notes
    notes: set[str] = field(default_factory=set)  # torch's nondeterminism warnings met under deterministic mode
    seconds: float = 0.0
    budget: float = 0.0
    ran: bool = False

    def check(self, ok: bool, text: str) -> bool:
        self.lines.append((PASS if ok else FAIL, text))
        return ok

    def target(self, ok: bool, text: str, judged: bool = True) -> None:
        if judged:
            self.lines.append((HOLDS if ok else MISSES, text))
        else:
            self.lines.append((SKIP, f"{text} (targets are judged on CUDA only)"))

    def skip(self, text: str) -> None:
        self.lines.append((SKIP, text))

    def count(self, status: str) -> int:
        return sum(s == status for s, _ in self.lines)

    @property
    def verdict(self) -> str:
        if not self.ran:
            return "NOT RUN"
        return FAIL if self.count(FAIL) else PASS


@dataclass
class Context:
    device: torch.device
    cuda: bool
    sizes: Sizes
    deadline: float  # time.perf_counter() by which the last section must end
    section_end: float = float("inf")  # ... and the running section

    def left(self) -> float:
        """Seconds left to the running section."""
        return min(self.deadline, self.section_end) - time.perf_counter()

    def workload(self, name: str, batch: int, kwargs: dict[str, Any]) -> Workload:
        return load_workload(name, batch_size=batch, size="full", overrides=dict(kwargs), device=self.device)

    def repeats(self, seconds_per_round: float, share: float) -> int:
        """Timing rounds that fit in `share` of the section's time left, within the sizes' bounds."""
        low, high = self.sizes.repeats
        fits = int(share * max(self.left(), 0.0) / max(seconds_per_round, 1e-3))
        return max(low, min(high, fits))


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise `SectionTimeout` in this (main) thread after `seconds`; no limit where there is no SIGALRM."""
    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def alarm(_signum: int, _frame: Any) -> None:
        raise SectionTimeout(f"ran past its time budget of {seconds:.0f} s")

    before = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)


@contextlib.contextmanager
def deterministic(notes: set[str]) -> Iterator[None]:
    """Deterministic kernels where torch has them (warnings where it has not, collected in `notes`)."""
    before = (
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    torch.use_deterministic_algorithms(True, warn_only=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield
        finally:
            torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[:2]
            torch.use_deterministic_algorithms(before[2], warn_only=before[3])
            notes.update(str(w.message).splitlines()[0][:200] for w in caught if "determinis" in str(w.message))


def cleanup(ctx: Context) -> None:
    """Device memory back between models (on CPU nothing to give back, and a collection costs seconds)."""
    if ctx.cuda:
        gc.collect()
        torch.cuda.synchronize(ctx.device)
        torch.cuda.empty_cache()


def error_line(err: BaseException) -> str:
    """An exception in one line: its type, first line and where it was raised."""
    where = traceback.extract_tb(err.__traceback__)[-1] if err.__traceback__ else None
    first = str(err).strip().splitlines()[0][:300] if str(err).strip() else ""
    place = f" ({Path(where.filename).name}:{where.lineno})" if where is not None else ""
    return f"error: {type(err).__name__}: {first}{place}"


def part(sec: Section, ctx: Context, label: str, fn: Callable[[], None]) -> None:
    """One model or case of a section: an error is recorded as its failure and the section goes on."""
    try:
        fn()
    except SectionTimeout:
        raise
    except Exception as err:  # noqa: BLE001 - a failure is a result, recorded
        sec.lines.append((FAIL, f"[{label}] {error_line(err)}"))
    finally:
        cleanup(ctx)


class _Quiet:
    """The bench's progress bar, silent."""

    def update(self, _n: int) -> None:
        pass


def seconds_of(times: list[float]) -> str:
    """Median and spread ((max - min) / median) of step times, in ms."""
    if not times:
        return "-"
    med = statistics.median(times)
    spread = (max(times) - min(times)) / med if med > 0 else 0.0
    return f"{med * 1e3:.1f} ({spread:.0%})"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


# -- bitwise training ----------------------------------------------------------------------------------------
@dataclass
class Trace:
    """What `STEPS` SGD steps of one model gave: per step its loss, gradients and generator states."""

    losses: list[torch.Tensor] = field(default_factory=list)
    grads: list[list[torch.Tensor | None]] = field(default_factory=list)
    rng: list[list[torch.Tensor]] = field(default_factory=list)
    params: list[torch.Tensor] = field(default_factory=list)


def rng_states(device: torch.device) -> list[torch.Tensor]:
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


def train_traces(models: list[torch.nn.Module], w: Workload, cast: Callable[[], Any]) -> list[Trace]:
    """`STEPS` SGD steps of each model from the same seeds, the models' steps interleaved."""
    opts = [torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for m in models]
    traces = [Trace() for _ in models]
    for step in range(STEPS):
        for model, opt, trace in zip(models, opts, traces, strict=True):
            opt.zero_grad(set_to_none=True)
            torch.manual_seed(100 + step)
            with cast():
                loss = w.loss(model(w.x), w.y)
            loss.backward()
            trace.losses.append(loss.detach().clone())
            trace.grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
            trace.rng.append(rng_states(w.device))
            opt.step()
            del loss
    for model, trace in zip(models, traces, strict=True):
        trace.params = [p.detach().clone() for p in model.parameters()]
    return traces


def same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def first_difference(a: Trace, b: Trace, names: list[str]) -> str | None:
    """Where two traces first differ, in words; None when bitwise equal throughout."""
    for step in range(len(a.losses)):
        if not same(a.losses[step], b.losses[step]):
            return f"loss of step {step + 1}: {a.losses[step].item()!r} vs {b.losses[step].item()!r}"
        for name, g, h in zip(names, a.grads[step], b.grads[step], strict=True):
            if not same(g, h):
                gap = (g - h).abs().max().item() if g is not None and h is not None else "one is None"
                return f"gradient of {name} at step {step + 1} (largest difference {gap})"
        for which, r, s in zip(("CPU", "CUDA"), a.rng[step], b.rng[step], strict=False):
            if not torch.equal(r, s):
                return f"{which} generator state after step {step + 1}"
    for name, p, q in zip(names, a.params, b.params, strict=True):
        if not torch.equal(p, q):
            return f"parameter {name} after {len(a.losses)} SGD steps"
    return None


def recomputing(w: Workload, fraction: float, cast: Callable[[], Any]) -> Checkpointable:
    """rotor on `w.model` planned (under `cast`) at `fraction` of its plain peak, or at its smallest feasible
    budget where that fraction recomputes nothing."""
    rotor = Checkpointable(w.model, fraction)
    with cast():
        entry = rotor.prepare_for(w.x)
    if entry.plan.recomputed_stages == 0:
        rotor.replan(min_feasible_budget(entry.chain))
    return rotor


def bitwise_case(sec: Section, ctx: Context, label: str, cast: Callable[[], Any]) -> tuple[Checkpointable, Workload]:
    """Plain, a plain control and rotor (recomputing) trained `STEPS` steps from the same seeds: checks added."""
    w = ctx.workload("gpt", ctx.sizes.batch, ctx.sizes.gpt)
    plain, control = copy.deepcopy(w.model), copy.deepcopy(w.model)
    rotor = recomputing(w, 0.4, cast)
    plan = rotor.plan
    sec.check(
        plan.recomputed_stages > 0,
        f"[{label}] the plan recomputes {plan.recomputed_stages} of {rotor.chain.length} stages at "
        f"{format_bytes(plan.budget)} (no recomputation: {format_bytes(no_recompute_peak(rotor.chain))}); "
        f"dropout p={ctx.sizes.gpt['dropout']} in every block",
    )
    names = [n for n, _ in w.model.named_parameters()]
    with deterministic(sec.notes):
        traced = train_traces([plain, control, rotor], w, cast)
    control_diff = first_difference(traced[0], traced[1], names)
    sec.check(
        control_diff is None,
        f"[{label}] control: plain training run twice is bitwise reproducible on {ctx.device.type}"
        + ("" if control_diff is None else f"; differs at {control_diff}: the comparison below cannot be judged"),
    )
    diff = first_difference(traced[0], traced[2], names)
    sec.check(
        diff is None,
        f"[{label}] rotor bitwise equal to plain training over {STEPS} SGD steps: losses, every gradient, "
        "the CPU and CUDA generators' states after each step, parameters after"
        + ("" if diff is None else f"; first difference: {diff}"),
    )
    return rotor, w


# -- 1. allocator probe ----------------------------------------------------------------------------------------
def measured(rotor: Checkpointable, w: Workload, probe: Any, cast: Callable[[], Any] = contextlib.nullcontext) -> Any:
    """One training step of `rotor` under `rotor.measure_step(probe)`."""
    torch.manual_seed(7)
    with rotor.measure_step(probe) as m:
        with cast():
            loss = w.loss(rotor(w.x), w.y)
        loss.backward()
        del loss
    return m


def check_exact(sec: Section, label: str, m: Any, budget: int) -> None:
    """A tensor-accounted step: within the budget and the prediction (promises), close to it (target)."""
    predicted = m.predicted_peak
    sec.check(
        m.peak <= budget and m.peak <= predicted,
        f"[{label}] tensor-accounted peak {format_bytes(m.peak)} <= budget {format_bytes(budget)} and <= "
        f"predicted {format_bytes(predicted)}",
    )
    sec.target(
        m.peak >= (1 - PEAK_GAP) * predicted,
        f"[{label}] tensor-accounted peak within {PEAK_GAP:.0%} of the prediction: "
        f"{m.peak / max(predicted, 1) - 1:+.1%}",
    )
    if m.curve and len(m.curve) == len(m.predicted):
        over = [(label_, got, sim) for (label_, got), sim in zip(m.curve, m.predicted, strict=True) if got > sim]
        sec.check(
            not over,
            f"[{label}] after each of the plan's {len(m.curve)} ops, bytes alive <= the simulator's"
            + ("" if not over else f"; over at {over[0][0]}: {format_bytes(over[0][1])} > {format_bytes(over[0][2])}"),
        )


def section_allocator(sec: Section, ctx: Context) -> None:
    w = ctx.workload("gpt", ctx.sizes.batch, ctx.sizes.gpt)
    rotor = recomputing(w, 0.5, contextlib.nullcontext)
    train_step(w, rotor, 0)  # warm: kernels, cuBLAS workspaces, the allocator's segments
    plan = rotor.plan
    exact = measured(rotor, w, MemoryProbe(rotor, record_curve=True))
    check_exact(sec, "tensor accounting", exact, plan.budget)
    rows = [["plan (simulator)", format_bytes(plan.peak), ""], ["MemoryProbe", format_bytes(exact.peak), ""]]
    if not ctx.cuda:
        sec.skip("CudaMemoryProbe against torch.cuda.max_memory_allocated: needs CUDA")
        sec.blocks.append(table(["measured by", "activation peak", "note"], rows))
        return
    rotor.zero_grad(set_to_none=False)  # gradients allocated before the step: the allocator then sees activations
    persistent = storage_bytes([list(rotor.parameters()), [p.grad for p in rotor.parameters()]])
    persistent += storage_bytes([list(rotor.buffers()), w.x, w.y])
    torch.cuda.synchronize(ctx.device)
    start = torch.cuda.memory_allocated(ctx.device)
    alloc = measured(rotor, w, CudaMemoryProbe(ctx.device))
    top = torch.cuda.max_memory_allocated(ctx.device)  # the probe reset the peak when the step began
    raw = top - start + storage_bytes(w.x)
    sec.check(
        alloc.peak == raw,
        f"CudaMemoryProbe's peak {alloc.peak:,} B == max_memory_allocated - memory_allocated at the step's "
        f"start + the input = {raw:,} B",
    )
    sec.check(
        alloc.peak >= exact.peak - SLACK,
        f"the allocator's peak {format_bytes(alloc.peak)} >= the tensor-accounted {format_bytes(exact.peak)} "
        f"less {format_bytes(SLACK)} of host-side state tensors (the allocator also sees rounding and workspaces: "
        f"{alloc.peak / max(exact.peak, 1) - 1:+.1%})",
    )
    sec.target(
        alloc.peak <= plan.budget, f"allocator peak {format_bytes(alloc.peak)} <= budget {format_bytes(plan.budget)}"
    )
    sec.target(
        abs(alloc.peak / max(plan.peak, 1) - 1) < PEAK_GAP,
        f"allocator peak within {PEAK_GAP:.0%} of the prediction: {alloc.peak / max(plan.peak, 1) - 1:+.1%}",
    )
    over = [got - sim for (_, got), sim in zip(alloc.curve, alloc.predicted, strict=False)]
    rows += [
        ["CudaMemoryProbe (measure_step)", format_bytes(alloc.peak), "max_memory_allocated above the step's start"],
        [
            "max_memory_allocated - persistent",
            format_bytes(top - persistent),
            f"persistent = parameters, gradients, buffers, batch: {format_bytes(persistent)}",
        ],  # fmt: skip
        ["held outside the step", format_bytes(start - persistent), "memory_allocated before the step - persistent"],
        ["largest allocator excess over the simulator at an op's end", format_bytes(max(over, default=0)), ""],
    ]
    sec.blocks.append(table(["measured by", "activation peak", "note"], rows))


# -- 2. RNG replay, 3. bf16 autocast ---------------------------------------------------------------------------
def section_rng(sec: Section, ctx: Context) -> None:
    for label in ("alone", "another thread alive"):
        part(sec, ctx, label, lambda label=label: rng_case(sec, ctx, label))


def rng_case(sec: Section, ctx: Context, label: str) -> None:
    stop = threading.Event()
    other = threading.Thread(target=stop.wait) if label != "alone" else None
    if other is not None:
        other.start()  # an ordinary thread that may draw: rotor takes its per-op replay
    try:
        sec.check(alone() == (other is None), f"[{label}] rotor.rng.alone() is {alone()}: the expected path")
        bitwise_case(sec, ctx, label, contextlib.nullcontext)
    finally:
        stop.set()
        if other is not None:
            other.join()


def section_autocast(sec: Section, ctx: Context) -> None:
    def cast() -> Any:
        return torch.autocast(ctx.device.type, dtype=torch.bfloat16)

    rotor, w = bitwise_case(sec, ctx, "bf16 autocast", cast)
    check_exact(
        sec, "bf16 autocast", measured(rotor, w, MemoryProbe(rotor, record_curve=True), cast), rotor.plan.budget
    )


# -- 4. offloading ------------------------------------------------------------------------------------------------
def offloads(run: Any) -> int:
    return sum(op.kind in (OpKind.OFFLOAD, OpKind.OFFLOAD_SAVED) for op in run.ops)


def grads_of(model: torch.nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def plain_grads(plain: torch.nn.Module, w: Workload, seed: int) -> list[torch.Tensor | None]:
    for p in plain.parameters():
        p.grad = torch.zeros_like(p)  # as offload_gpu.step does for rotor: the same accumulation
    torch.manual_seed(seed)
    w.loss(plain(w.x), w.y).backward()
    return grads_of(plain)


def offload_model(sec: Section, ctx: Context, name: str, batch: int, kwargs: dict[str, Any]) -> None:
    w = ctx.workload(name, batch, kwargs)
    plain = copy.deepcopy(w.model)
    chain = profile_chain(w.stages, w.x, names=w.stage_names, offload=True).chain
    largest = max(chain.sizes[1 : chain.length], default=0)
    bandwidth = measure_bandwidth(ctx.device, min(max(largest, 2**20), 2**28))
    budget = max(int(0.4 * no_recompute_peak(chain)), min_feasible_budget(chain))
    runs = offload_gpu.runs_for(w, chain, bandwidth, budget)
    sec.check(
        any(offloads(r) for r in runs),
        f"[{name}] schedules that move values to the host: {', '.join(r.label for r in runs if offloads(r)) or 'none'}",
    )
    with deterministic(sec.notes):
        expected = plain_grads(plain, w, 0)
        control = all(same(a, b) for a, b in zip(expected, plain_grads(plain, w, 0), strict=True))
        differ = []
        for run in runs:  # the warm-up step of each schedule, compared with plain training
            offload_gpu.step(w, run, 0, ctx.cuda)
            if not all(same(a, b) for a, b in zip(expected, grads_of(w.model), strict=True)):
                differ.append(run.label)
    sec.check(
        control,
        f"[{name}] control: plain training's gradients, run twice, are bitwise reproducible on {ctx.device.type}"
        + ("" if control else ": the comparison below cannot be judged"),
    )
    sec.check(
        not differ, f"[{name}] gradients bitwise equal to plain training: {', '.join(differ) or 'every schedule'}"
    )
    exact = {}
    for run in runs:  # tensor accounting (on CPU offload_gpu.step's own probe)
        if ctx.cuda:
            probe = MemoryProbe(w.model)
            measure_peak(w, run.runner, 0, probe)
            exact[run.label] = (probe.peak, probe.host_peak, probe.host_current)
        else:
            exact[run.label] = (run.peaks[0], run.hosts[0], run.left[0])
        run.times.clear(), run.peaks.clear(), run.hosts.clear(), run.left.clear()
    per_round = sum(r.predicted_time for r in runs) * 1.5 + 0.01 * len(runs)
    repeats = ctx.repeats(per_round, share=0.3 if name == "gpt" else 0.5)
    for r in range(repeats):  # interleaved, so that drift hits every schedule alike
        for run in runs:
            offload_gpu.step(w, run, r + 1, ctx.cuda)
    offload_checks(sec, ctx, name, chain, budget, runs, exact)
    rows = []
    for run in runs:
        measured_ms = statistics.median(run.times)
        rows.append([
            run.label, str(offloads(run)), f"{run.predicted_time * 1e3:.2f}", seconds_of(run.times),
            f"{measured_ms / max(run.predicted_time, 1e-9):.2f}", format_bytes(run.predicted_peak),
            format_bytes(exact[run.label][0]), format_bytes(max(run.peaks)) if ctx.cuda else "-",
            format_bytes(run.predicted_host), format_bytes(max(run.hosts)),
        ])  # fmt: skip
    header = ["schedule", "offloads", "pred ms", "meas ms (spread)", "meas/pred", "pred peak", "tensor peak",
              "allocator peak", "pred host", "meas host"]  # fmt: skip
    sec.blocks.append(
        f"**{name}**, batch {batch}: budget {format_bytes(budget)} (40% of {format_bytes(no_recompute_peak(chain))}), "
        f"bandwidth {format_bandwidth(bandwidth)} (measured), {repeats} interleaved rounds\n\n" + table(header, rows)
    )


def offload_checks(
    sec: Section, ctx: Context, name: str, chain: Any, budget: int, runs: list[Any], exact: dict[str, tuple[int, ...]]
) -> None:
    """`exact`: per schedule, the tensor-accounted (device peak, host peak, host bytes left after the step)."""
    over = [f"{r.label} {format_bytes(exact[r.label][0])}" for r in runs if exact[r.label][0] > budget]
    sec.check(
        not over,
        f"[{name}] tensor-accounted device peak <= budget {format_bytes(budget)}: "
        f"{', '.join(over) or 'every schedule'}",
    )
    host = [r.label for r in runs if exact[r.label][1:] != (r.predicted_host, 0)]
    host += [r.label for r in runs if any(r.left) or any(h != r.predicted_host for h in r.hosts)]
    sec.check(
        not host,
        f"[{name}] host memory exactly the simulator's at its peak and back to 0 after every step"
        + (f"; not so for {', '.join(sorted(set(host)))}" if host else ""),
    )
    moving = [r for r in runs if offloads(r)]
    if not ctx.cuda:
        sec.skip(f"[{name}] pinned pool, copy stream and events: CUDA only (on CPU the copies are synchronous)")
    else:
        wrong = []
        for r in moving:
            pool = r.runner.channel.pool if r.runner.channel is not None else None
            need = len(buffer_sizes(r.ops, chain.sizes, chain.offloadable))
            if pool is None or pool.allocations != need or not all(b.is_pinned() for b in pool.buffers):
                wrong.append(
                    f"{r.label} ({'no pool' if pool is None else f'{pool.allocations} buffers, {need} reserved'})"
                )
        sec.check(not wrong, f"[{name}] pinned host buffers reserved once per plan, none made by a step: "
                  f"{', '.join(wrong) or 'every offloading schedule'}")  # fmt: skip
        over = [f"{r.label} {format_bytes(max(r.peaks))}" for r in runs if max(r.peaks) > budget]
        sec.target(not over, f"[{name}] allocator peak <= budget: {', '.join(over) or 'every schedule'}")
    slow = [
        f"{r.label} {statistics.median(r.times) / max(r.predicted_time, 1e-9):.2f}"
        for r in moving
        if not TIME_BAND[0] <= statistics.median(r.times) / max(r.predicted_time, 1e-9) <= TIME_BAND[1]
    ]
    sec.target(
        not slow,
        f"[{name}] offloading schedules' measured / predicted step time within {TIME_BAND}: {', '.join(slow) or 'all'}",
        judged=ctx.cuda,
    )


def section_offload(sec: Section, ctx: Context) -> None:
    s = ctx.sizes
    for name, batch, kwargs in (("gpt", s.batch, s.gpt), ("resnet18", s.resnet18_batch, s.resnet18)):
        part(sec, ctx, name, lambda name=name, batch=batch, kwargs=kwargs: offload_model(sec, ctx, name, batch, kwargs))
    rate = measure_bandwidth(ctx.device, 256 * 2**20 if ctx.cuda else 2**20)
    sec.target(rate >= 10e9, f"transfer bandwidth {format_bandwidth(rate)} (256 MiB pinned copies) >= 10 GB/s",
               judged=ctx.cuda)  # fmt: skip


# -- 5. measured against predicted, 6. against the models' own checkpointing ---------------------------------
def timed(ctx: Context, w: Workload, methods: list[Method], share: float) -> list[Row]:
    """The bench's interleaved timing, rounds fitted to the time left; rows with their ratios."""
    predicted = [m.row.plan_ms for m in methods if m.row.plan_ms]
    per_step = (max(predicted) if predicted else 10.0) / 1e3 * 1.5 + 0.005
    live = sum(m.forward is not None for m in methods)
    run_interleaved(w, methods, ctx.repeats(per_step * live, share), 1, 0, _Quiet())
    rows = [m.row for m in methods]
    add_ratios(rows)
    return rows


def predicted_model(
    sec: Section, ctx: Context, label: str, name: str, batch: int, kwargs: dict[str, Any], share: float
) -> None:
    w = ctx.workload(name, batch, kwargs)

    def row(method: str, **kw: Any) -> Row:
        return Row(label, str(ctx.device), method, **kw)

    methods = [Method(row("none"), w.model), *rotor_methods(w, ["min", "0.5", "1.0"], row)]
    rows = timed(ctx, w, methods, share)
    rotor = [m for m in methods if m.row.method == "rotor"]
    sec.check(all(m.forward is not None for m in rotor), f"[{label}] every budget planned: "
              + ", ".join(f"{m.row.mem_limit} {m.row.note}" for m in rotor))  # fmt: skip
    table_rows = []
    for m in rotor:
        r = m.row
        if m.forward is None or r.budget_bytes is None or r.predicted_peak is None:
            continue
        probe = MemoryProbe(w.model)
        exact = measure_peak(w, m.forward, 0, probe)
        sec.check(
            exact <= r.budget_bytes and exact <= r.predicted_peak,
            f"[{label} at {r.mem_limit}] tensor-accounted peak {format_bytes(exact)} <= budget "
            f"{format_bytes(r.budget_bytes)} and <= predicted {format_bytes(r.predicted_peak)}",
        )
        assert r.measured_peak is not None and r.step_ms is not None and r.plan_ms is not None
        gap = r.measured_peak / r.predicted_peak - 1
        ratio = r.step_ms / r.plan_ms
        sec.target(
            abs(gap) < PEAK_GAP and r.measured_peak <= r.budget_bytes,
            f"[{label} at {r.mem_limit}] {'allocator' if ctx.cuda else 'tensor-accounted'} peak "
            f"{format_bytes(r.measured_peak)} within the budget and {PEAK_GAP:.0%} of the prediction ({gap:+.1%})",
        )
        sec.target(
            TIME_BAND[0] <= ratio <= TIME_BAND[1],
            f"[{label} at {r.mem_limit}] measured / predicted step time {ratio:.2f} within {TIME_BAND}",
            judged=ctx.cuda,
        )
        table_rows.append([
            r.mem_limit, format_bytes(r.budget_bytes), format_bytes(r.predicted_peak), format_bytes(r.measured_peak),
            format_bytes(exact), f"{r.plan_ms:.1f}", f"{r.step_ms:.1f} ({r.spread:.0%})", f"{ratio:.2f}",
            f"{r.vs_none:.2f}" if r.vs_none else "-", r.note,
        ])  # fmt: skip
    none = next(r for r in rows if r.method == "none")
    header = ["budget", "bytes", "pred peak", "meas peak (probe_for)", "tensor peak", "pred ms", "meas ms (spread)",
              "meas/pred", "vs none", "plan"]  # fmt: skip
    sec.blocks.append(
        f"**{label}** ({name}, {w.x.shape[0]} per batch, input {tuple(w.x.shape)}): none "
        f"{none.step_ms:.1f} ms ({none.spread:.0%}), measured peak {format_bytes(none.measured_peak or 0)}; "
        f"{len(rows[0].times)} interleaved rounds\n\n" + table(header, table_rows)
    )


def section_predicted(sec: Section, ctx: Context) -> None:
    s = ctx.sizes
    for label, name, batch, kwargs, share in (
        ("GPT-2-small-like", "gpt", s.gpt2_batch, s.gpt2, 0.3),  # of the section's time left: the rest for ResNet
        ("ResNet-50", "resnet50", s.resnet50_batch, s.resnet50, 0.5),
    ):
        part(sec, ctx, label, lambda a=(label, name, batch, kwargs, share): predicted_model(sec, ctx, *a))


def compare(sec: Section, ctx: Context, label: str, w: Workload, methods: list[Method], share: float) -> None:
    """The bench's methods timed interleaved, its table, and its checks as targets (an infeasible budget is a
    result, read off by the checks; a method that failed is a failure)."""
    rows = timed(ctx, w, methods, share)
    failed = [f"{r.method} {r.mem_limit}: {r.note}" for r in rows if r.step_ms is None and "infeasible" not in r.note]
    sec.check(not failed, f"[{label}] every method ran: {'; '.join(failed) or ', '.join(r.method for r in rows)}")
    for line in checks(rows):
        if not line.startswith("largest mem_limit"):  # rotor at its largest budget against none: section 5's
            sec.target("holds" in line, f"[{label}] {line}", judged=ctx.cuda)
    sec.blocks.append(f"**{label}**: {len(rows[0].times)} interleaved rounds\n\n" + markdown(rows))


def own_model(sec: Section, ctx: Context, label: str, name: str, batch: int, kwargs: dict[str, Any], block: type,
              share: float) -> None:  # fmt: skip
    w = ctx.workload(name, batch, kwargs)

    def row(method: str, **kw: Any) -> Row:
        return Row(label, str(ctx.device), method, **kw)

    compare(sec, ctx, label, w, [Method(row("none"), w.model), *per_block_methods(w, ["min"], row, block)], share)


def own_hf(sec: Section, ctx: Context) -> None:
    what = "Hugging Face GPT-2 with its own gradient checkpointing"
    if importlib.util.find_spec("transformers") is None:
        sec.skip(f"{what}: transformers is not installed (pip install transformers)")
        return
    if ctx.left() < 0.35 * sec.budget:
        sec.skip(f"{what}: {ctx.left():.0f} s of the section's {sec.budget:.0f} s left, too few to profile it")
        return
    s = ctx.sizes
    w = load_workload("hf:gpt2", batch_size=s.hf_batch, overrides=dict(s.hf), device=ctx.device)
    compare(sec, ctx, "hf:gpt2, Hugging Face checkpointing and SAC", w, eager_methods(w, [], None), 0.6)


def section_own(sec: Section, ctx: Context) -> None:
    s = ctx.sizes
    for label, name, batch, kwargs, block, share in (
        ("ResNet-50, per-block checkpointing", "resnet50", s.resnet50_batch, s.resnet50, Bottleneck, 0.2),
        ("GPT-2-small-like, per-block checkpointing", "gpt", s.gpt2_batch, s.gpt2, Block, 0.25),
    ):
        args = (label, name, batch, kwargs, block, share)
        part(sec, ctx, label, lambda args=args: own_model(sec, ctx, *args))
    part(sec, ctx, "hf:gpt2", lambda: own_hf(sec, ctx))


# -- the run --------------------------------------------------------------------------------------------------
SECTIONS: list[tuple[str, float, Callable[[Section, Context], None]]] = [
    ("Allocator probe against torch.cuda.max_memory_allocated", 0.09, section_allocator),
    ("CUDA RNG replay with dropout", 0.11, section_rng),
    ("bf16 autocast", 0.08, section_autocast),
    ("Offloading: copy stream, events, pinned pool", 0.16, section_offload),
    ("Measured against predicted step time and peak", 0.25, section_predicted),
    ("rotor against each model's own checkpointing at equal memory", 0.31, section_own),
]


def run_section(sec: Section, fn: Callable[[Section, Context], None], ctx: Context, limit: float) -> None:
    """Run one section within its share of the time, recording any failure in it."""
    ctx.section_end = float("inf")
    sec.budget = min(sec.share * limit, ctx.left())
    if sec.budget < MIN_SECTION_S:
        sec.lines.append((FAIL, f"not run: {ctx.left():.0f} s of the run's time were left"))
        return
    sec.ran = True
    start = time.perf_counter()
    ctx.section_end = start + sec.budget
    try:
        with time_limit(sec.budget):
            fn(sec, ctx)
    except SectionTimeout as err:
        sec.lines.append((FAIL, f"stopped: {err}"))
    except Exception as err:  # noqa: BLE001 - a failure is a result of this section, not the end of the run
        sec.lines.append((FAIL, error_line(err)))
    finally:
        sec.seconds = time.perf_counter() - start
        cleanup(ctx)


def describe(ctx: Context) -> list[str]:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, timeout=10).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        commit = ""
    lines = [
        f"- date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; commit {commit or 'unknown'}",
        f"- command: `python {' '.join(sys.argv)}`",
        f"- torch {torch.__version__}, Python {sys.version.split()[0]}, {torch.get_num_threads()} intra-op threads",
    ]
    if ctx.cuda:
        props = torch.cuda.get_device_properties(ctx.device)
        lines.append(
            f"- device: {props.name}, {format_bytes(props.total_memory)}, CUDA {torch.version.cuda}, "
            f"cuDNN {torch.backends.cudnn.version()}; TF32 matmul {torch.backends.cuda.matmul.allow_tf32}, "
            f"TF32 cuDNN {torch.backends.cudnn.allow_tf32}; "
            f"CUBLAS_WORKSPACE_CONFIG={os.environ.get('CUBLAS_WORKSPACE_CONFIG')}"
            " (set by the script for reproducible matmuls; it also applies to the timed sections)"
        )
    else:
        lines.append("- device: CPU (`--cpu`: tiny sizes, a smoke test; CUDA-only checks are SKIP)")
    return lines


def render(sections: list[Section], ctx: Context, header: list[str], wall: float, limit: float) -> str:
    out = ["# GPU check", "", *header, "", "## Summary", ""]
    rows = [
        [f"{s.number}. {s.title}", s.verdict, str(s.count(PASS)), str(s.count(FAIL)), str(s.count(SKIP)),
         f"{s.count(HOLDS)} of {s.count(HOLDS) + s.count(MISSES)}", f"{s.seconds:.0f} / {s.budget:.0f}"]
        for s in sections
    ]  # fmt: skip
    out += [table(["section", "verdict", "pass", "fail", "skip", "targets held", "seconds / budget"], rows), ""]
    for s in sections:
        out += [
            f"## {s.number}. {s.title}",
            "",
            f"Verdict: **{s.verdict}** ({s.seconds:.0f} s of {s.budget:.0f} s)",
            "",
        ]
        out += [f"- {status}: {text}" for status, text in s.lines]
        if s.notes:
            out += ["", "torch's warnings under deterministic mode (ops without a deterministic kernel):"]
            out += [f"- {note}" for note in sorted(s.notes)]
        for block in s.blocks:
            out += ["", block]
        out.append("")
    verdict = "within" if wall <= 480 else "over"
    out.append(
        f"Total wall time: {wall:.0f} s since the process started ({verdict} the 8-minute target; the run limited "
        f"to {limit:.0f} s)."
    )
    return "\n".join(out) + "\n"


def process_seconds(started: float) -> float:
    """Seconds since this process started (Linux: from /proc), else since `started` (a perf_counter time)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        return float(Path("/proc/uptime").read_text().split()[0]) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    before = process_seconds(started)  # the interpreter and the imports
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu_check.md", help="the markdown report (written after every section)")
    parser.add_argument("--cpu", action="store_true", help="run on CPU at tiny sizes: a smoke test of the script")
    parser.add_argument("--sections", default=None, help="comma-separated section numbers (default: all)")
    parser.add_argument(
        "--limit", type=float, default=None, help="seconds for the whole run, start included (default: 450 on CUDA)"
    )
    args = parser.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        print("gpu_check.py needs CUDA, which is not available here; run it on a GPU machine, or with --cpu for "
              "the CPU smoke test", file=sys.stderr)  # fmt: skip
        return 2
    if args.cpu:
        torch.set_num_threads(1)  # a smoke test on a shared machine
    else:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS starts: reproducible matmuls
    sizes = CPU_SIZES if args.cpu else CUDA_SIZES
    limit = args.limit if args.limit is not None else sizes.limit
    device = torch.device("cpu") if args.cpu else torch.device("cuda", torch.cuda.current_device())
    ctx = Context(device, device.type == "cuda", sizes, started + limit - before)
    chosen = {int(n) for n in args.sections.split(",")} if args.sections else set(range(1, len(SECTIONS) + 1))
    header = describe(ctx)
    sections = [Section(i + 1, title, share) for i, (title, share, _) in enumerate(SECTIONS)]
    out = Path(args.out)
    for sec, (_, _, fn) in zip(sections, SECTIONS, strict=True):
        if sec.number not in chosen:
            sec.skip("not chosen (--sections)")
            continue
        print(f"gpu_check: section {sec.number}. {sec.title}", file=sys.stderr, flush=True)
        run_section(sec, fn, ctx, limit)
        out.write_text(render(sections, ctx, header, process_seconds(started), limit))
    out.write_text(render(sections, ctx, header, process_seconds(started), limit))
    failed = [s for s in sections if s.number in chosen and s.verdict != PASS]
    print(f"gpu_check: wrote {out}; {len(failed)} section(s) not passed", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
