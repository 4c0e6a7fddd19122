"""`lightning-rotor bench`: rotor against the checkpointing a user would pick instead.

On one model, one input and one seed, every method runs the same training step
(forward, loss, backward) and is measured the same way:

- `none`: plain autograd, nothing recomputed;
- `rotor`: `Checkpointable` at each budget (predicted and measured peak, the
  plan's predicted time, profiling time);
- `checkpoint_sequential`: torch's uniform segments, every count from 2 to the
  number of stages, non-reentrant, on the same flattened stages rotor sees;
- `recompute_all`: every stage checkpointed;
- `compile`: `torch.compile` with `torch._functorch.config.activation_memory_budget`
  at the same fractions, where it runs (a failure is recorded in its row).

Memory: exact tensor accounting (`MemoryProbe`) on CPU, the allocator's peak on
CUDA. Compiled code allocates outside the dispatcher, where tensor accounting
cannot see, so on CPU compiled rows use the CPU allocator events of
`torch.profiler` instead; their note says so, with the eager baseline measured
that way for comparison.

Timing: the eager methods' timed steps are interleaved (one step of each method
per round), so machine noise hits all alike; medians and the spread
((max - min) / median) are reported. Compiled methods are timed in their own
block, because dynamo's cache is global.
"""

from __future__ import annotations

import argparse
import ast
import csv
import importlib
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

from lightning_rotor.budget import BudgetError, format_bytes, parse_budget
from lightning_rotor.checkpointable import Checkpointable, InfeasibleBudget
from lightning_rotor.memory import probe_for, storage_bytes
from lightning_rotor.models import MODELS, ModelSpec
from lightning_rotor.profile import synchronize
from lightning_rotor.stages import sequential_stages

DEFAULT_BUDGETS = "min,0.25,0.5,0.75,1.0"
COLUMNS = (
    "model", "device", "method", "budget", "segments", "mem_limit", "predicted_peak", "measured_peak", "peak_gap",
    "step_ms", "step_ms_min", "spread", "vs_none", "plan_ms", "profile_s", "note",
)  # fmt: skip


class BenchError(ValueError):
    """Bad bench input (model path, budgets, sizes): reported as one line."""


# -- the workload ---------------------------------------------------------------------------
@dataclass
class Workload:
    """One model, one batch, one loss: what every method trains on."""

    name: str
    model: nn.Sequential
    x: torch.Tensor
    y: torch.Tensor | None
    loss: Callable[[Any, Any], torch.Tensor]
    device: torch.device
    stage_names: list[str] = field(default_factory=list)
    stages: list[nn.Module] = field(default_factory=list)

    def __post_init__(self) -> None:
        found = sequential_stages(self.model)
        self.stage_names, self.stages = list(found.names), list(found.modules)
        self.model.train()


def _square_loss(output: Any, _target: Any) -> torch.Tensor:
    return output.float().pow(2).mean()


def _parse_kwargs(items: list[str]) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise BenchError(f"--set expects KEY=VALUE (e.g. --set n_layer=4), got {item!r}")
        try:
            kwargs[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            kwargs[key] = value
    return kwargs


def _from_factory(path: str, kwargs: dict[str, Any], batch_size: int, input_shape: tuple[int, ...] | None) -> tuple:
    module_name, _, attr = path.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise BenchError(
            f"cannot import model {path!r} ({type(err).__name__}: {err}); give a registered name or pkg.module:factory"
        ) from None
    try:
        made = factory(**kwargs)
    except TypeError as err:
        raise BenchError(f"{path} does not accept the size arguments {kwargs}: {err}") from None
    if isinstance(made, ModelSpec):
        return _from_spec(made, kwargs, batch_size)
    if isinstance(made, nn.Sequential):
        if input_shape is None:
            raise BenchError(f"{path} returned an nn.Sequential; give --input-shape (e.g. --input-shape 8,3,224,224)")
        return made, torch.randn(*input_shape, generator=torch.Generator().manual_seed(0)), None, _square_loss
    if isinstance(made, tuple) and made and isinstance(made[0], nn.Sequential) and len(made) in (2, 3):
        loss = made[2] if len(made) == 3 else _square_loss
        return made[0], made[1], None, (lambda out, _y: loss(out)) if len(made) == 3 else loss
    raise BenchError(
        f"{path} returned {type(made).__name__}; a factory returns a ModelSpec, an nn.Sequential, "
        "or (nn.Sequential, input[, loss_fn])"
    )


def _from_spec(spec: ModelSpec, kwargs: dict[str, Any], batch_size: int) -> tuple:
    try:
        model = spec.build(**spec.model_kwargs(kwargs))
    except TypeError as err:
        raise BenchError(f"bad size arguments for model {spec.name!r}: {err}") from None
    x, y = spec.sample(batch_size, seed=0, **kwargs)
    return model, x, y, spec.loss


def load_workload(
    model: str,
    *,
    batch_size: int,
    size: str = "bench",
    overrides: dict[str, Any] | None = None,
    input_shape: tuple[int, ...] | None = None,
    device: torch.device | None = None,
    seed: int = 0,
) -> Workload:
    """Build MODEL (a registered name, or `pkg.module:factory`) and its batch on `device`."""
    if batch_size < 1:
        raise BenchError(f"--batch-size must be a positive integer, got {batch_size}")
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(seed)
    if ":" in model:
        built, x, y, loss = _from_factory(model, dict(overrides or {}), batch_size, input_shape)
    elif model in MODELS:
        spec = MODELS[model]
        kwargs = {"tiny": spec.tiny, "bench": spec.bench, "full": {}}[size] | dict(overrides or {})
        built, x, y, loss = _from_spec(spec, kwargs, batch_size)
    else:
        raise BenchError(
            f"unknown model {model!r}; give a registered name ({', '.join(MODELS)}) "
            "or an import path pkg.module:factory"
        )
    built = built.to(device)
    x = x.to(device)
    y = y.to(device) if isinstance(y, torch.Tensor) else y
    return Workload(model, built, x, y, loss, device)


# -- the methods ----------------------------------------------------------------------------
@dataclass
class Row:
    """One measured configuration; missing figures are None (e.g. an infeasible budget)."""

    model: str
    device: str
    method: str
    budget: str = ""
    segments: int | None = None
    mem_limit: int | None = None
    predicted_peak: int | None = None
    measured_peak: int | None = None
    peak_gap: float | None = None
    step_ms: float | None = None
    step_ms_min: float | None = None
    spread: float | None = None
    vs_none: float | None = None
    plan_ms: float | None = None
    profile_s: float | None = None
    note: str = ""
    times: list[float] = field(default_factory=list, repr=False)


@dataclass
class Method:
    row: Row
    forward: Callable[[torch.Tensor], Any] | None  # None: nothing to run (infeasible, failed)


def _each_checkpointed(stages: list[nn.Module]) -> Callable[[torch.Tensor], Any]:
    def forward(x: torch.Tensor) -> Any:
        for stage in stages:
            x = checkpoint(stage, x, use_reentrant=False)
        return x

    return forward


def _segments(seq: nn.Sequential, n: int) -> Callable[[torch.Tensor], Any]:
    return lambda x: checkpoint_sequential(seq, n, x, use_reentrant=False)


def rotor_methods(w: Workload, budgets: list[str], row: Callable[..., Row]) -> list[Method]:
    """One `Checkpointable` per budget, profiled and planned before any timing."""
    methods: list[Method] = []
    smallest: int | None = None
    for token in budgets:
        if token == "min":
            if smallest is None:
                try:  # a 1-byte budget is refused with the smallest feasible one
                    Checkpointable(w.model, 1).prepare_for(w.x)
                except InfeasibleBudget as err:
                    smallest = err.min_feasible
            spec: Any = smallest
        else:
            spec = parse_budget(token)
            spec = float(spec) if not isinstance(spec, int) else spec
        ckpt = Checkpointable(w.model, spec)
        r = row("rotor", budget=token)
        try:
            entry = ckpt.prepare_for(w.x)
        except InfeasibleBudget as err:
            r.mem_limit = getattr(err, "mem_limit", None)
            r.note = f"infeasible; smallest feasible budget {format_bytes(err.min_feasible)}"
            methods.append(Method(r, None))
            continue
        r.mem_limit = entry.plan.mem_limit
        r.predicted_peak = entry.plan.peak
        r.plan_ms = entry.plan.time * 1e3
        r.profile_s = ckpt.profile_seconds
        r.note = f"{entry.plan.recomputed_stages} of {entry.chain.length} stages recomputed"
        methods.append(Method(r, ckpt))
    return methods


def eager_methods(w: Workload, budgets: list[str], max_segments: int | None) -> list[Method]:
    dev = str(w.device)

    def row(method: str, **kw: Any) -> Row:  # noqa: E306
        return Row(w.name, dev, method, **kw)

    seq = nn.Sequential(*w.stages)
    n = len(w.stages)
    methods = [Method(row("none"), w.model)]
    methods += rotor_methods(w, budgets, row)
    top = n if max_segments is None else min(n, max_segments)
    methods += [Method(row("checkpoint_sequential", segments=s), _segments(seq, s)) for s in range(2, top + 1)]
    methods.append(Method(row("recompute_all", segments=n), _each_checkpointed(w.stages)))
    return methods


# -- measuring ------------------------------------------------------------------------------
def train_step(w: Workload, forward: Callable[[torch.Tensor], Any], seed: int) -> None:
    """Forward, loss and backward from the same seed; parameter gradients dropped first."""
    w.model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = w.loss(forward(w.x), w.y)
    loss.backward()


def measure_peak(w: Workload, forward: Callable[[torch.Tensor], Any], seed: int) -> int:
    """Activation bytes at the step's peak, the chain input included (see the module docstring)."""
    w.model.zero_grad(set_to_none=True)
    probe = probe_for(w.device, exclude=w.model)
    with probe:
        probe.track(w.x)
        torch.manual_seed(seed)
        loss = w.loss(forward(w.x), w.y)
        loss.backward()
        del loss
    return probe.peak


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
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=_start_ns)
    current = peak = 0
    for e in events:
        current += e.nbytes()
        peak = max(peak, current)
    w.model.zero_grad(set_to_none=True)
    return peak + storage_bytes(w.x)


def _start_ns(event: Any) -> int:
    return event.start_ns()


def _summarize(r: Row) -> None:
    if r.times:
        med = statistics.median(r.times)
        r.step_ms = med * 1e3
        r.step_ms_min = min(r.times) * 1e3
        r.spread = (max(r.times) - min(r.times)) / med if med > 0 else 0.0


def run_interleaved(w: Workload, methods: list[Method], repeats: int, warmup: int, seed: int, bar: Any) -> None:
    """Warm up, measure memory once, then time `repeats` rounds of one step per method."""
    live = [m for m in methods if m.forward is not None]
    for m in live:
        for _ in range(warmup):
            train_step(w, m.forward, seed)
        m.row.measured_peak = measure_peak(w, m.forward, seed)
        bar.update(warmup + 1)
    for _ in range(repeats):
        for m in live:
            synchronize(w.device)
            start = time.perf_counter()
            train_step(w, m.forward, seed)
            synchronize(w.device)
            m.row.times.append(time.perf_counter() - start)
            bar.update(1)
    for m in live:
        _summarize(m.row)


def run_compiled(w: Workload, fractions: list[str], repeats: int, warmup: int, seed: int, bar: Any) -> list[Row]:
    """`torch.compile` at each activation-memory budget, each in its own block; failures become notes."""
    rows: list[Row] = []
    eager_alloc: int | None = None
    for token in fractions:
        r = Row(w.name, str(w.device), "compile", budget=token)
        rows.append(r)
        try:
            import torch._dynamo
            import torch._functorch.config as functorch_config

            fraction = float(parse_budget(token))
            if w.device.type == "cpu" and eager_alloc is None:
                eager_alloc = allocator_peak(w, w.model, seed)
            torch._dynamo.reset()
            with functorch_config.patch(activation_memory_budget=fraction):
                compiled = torch.compile(w.model)
                start = time.perf_counter()
                train_step(w, compiled, seed)  # compiles forward and backward under this budget
                compile_s = time.perf_counter() - start
                for _ in range(warmup):
                    train_step(w, compiled, seed)
                if w.device.type == "cpu":
                    r.measured_peak = allocator_peak(w, compiled, seed)
                    r.note = (
                        f"CPU allocator via torch.profiler (eager none the same way: {format_bytes(eager_alloc)}); "
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
            torch._dynamo.reset() if "torch._dynamo" in sys.modules else None
        bar.update(warmup + repeats + 2)
    return rows


# -- output ---------------------------------------------------------------------------------
def _fmt(col: str, v: Any) -> str:
    if v is None:
        return ""
    if col in ("mem_limit", "predicted_peak", "measured_peak"):
        return format_bytes(v)
    if col in ("peak_gap", "spread"):
        return f"{v:+.1%}" if col == "peak_gap" else f"{v:.0%}"
    if col == "vs_none":
        return f"{v:.3f}x"
    if col in ("step_ms", "step_ms_min", "plan_ms"):
        return f"{v:.1f}"
    if col == "profile_s":
        return f"{v:.2f}"
    return str(v)


TABLE = (
    ("method", "method"), ("budget", "budget"), ("segments", "segments"), ("mem_limit", "budget bytes"),
    ("predicted_peak", "predicted peak"), ("measured_peak", "measured peak"), ("peak_gap", "gap"),
    ("step_ms", "step ms (median)"), ("step_ms_min", "min"), ("spread", "spread"), ("vs_none", "vs none"),
    ("plan_ms", "plan ms"),
    ("profile_s", "profile s"), ("note", "note"),
)  # fmt: skip


def markdown(rows: list[Row]) -> str:
    lines = ["| " + " | ".join(h for _, h in TABLE) + " |", "|" + "---|" * len(TABLE)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(c, getattr(r, c)) for c, _ in TABLE) + " |")
    return "\n".join(lines)


def targets(rows: list[Row], stat: str = "step_ms") -> list[str]:
    """The issue-5 targets read off the rows (`stat`: median "step_ms" or "step_ms_min"), one line each."""
    ran = [replace(r, step_ms=getattr(r, stat)) for r in rows if getattr(r, stat) is not None]
    ran = [r for r in ran if r.measured_peak is not None]
    rotor = [r for r in ran if r.method == "rotor"]
    seg = [r for r in ran if r.method == "checkpoint_sequential"]
    none = next((r for r in ran if r.method == "none"), None)
    lines: list[str] = []
    if not rotor:
        return ["no rotor budget planned: no target can be read"]
    for r in rotor:
        fits = [c for c in seg if c.measured_peak <= r.measured_peak]
        if not fits:
            lines.append(f"budget {r.budget}: no checkpoint_sequential fits in rotor's {format_bytes(r.measured_peak)}")
            continue
        best = min(fits, key=lambda c: c.step_ms)
        verdict = "holds" if r.step_ms <= best.step_ms else "fails"
        lines.append(
            f"budget {r.budget}: rotor {r.step_ms:.1f} ms at {format_bytes(r.measured_peak)} vs fastest fitting "
            f"checkpoint_sequential ({best.segments} segments) {best.step_ms:.1f} ms at "
            f"{format_bytes(best.measured_peak)}: {r.step_ms / best.step_ms:.3f}x, {verdict}"
        )
    if seg:
        low_r = min(r.measured_peak for r in rotor)
        low_s = min(c.measured_peak for c in seg)
        lines.append(
            f"lowest peak: rotor {format_bytes(low_r)} vs checkpoint_sequential {format_bytes(low_s)}: "
            f"{'holds' if low_r < low_s else 'fails'}"
        )
    top = max(rotor, key=lambda r: r.mem_limit or 0)
    if none is not None:
        ratio = top.step_ms / none.step_ms
        lines.append(
            f"largest budget ({top.budget}): rotor {top.step_ms:.1f} ms vs none {none.step_ms:.1f} ms = {ratio:.3f}x "
            f"(target <= 1.03): {'holds' if ratio <= 1.03 else 'fails'}"
        )
    gap = max(rotor, key=lambda r: abs(r.peak_gap or 0))
    lines.append(
        f"largest measured/predicted gap: {gap.peak_gap:+.1%} (budget {gap.budget}; target < 10%): "
        f"{'holds' if abs(gap.peak_gap or 0) < 0.10 else 'fails'}"
    )
    return lines


def write_csv(rows: list[Row], path: Path) -> None:
    with path.open("w", newline="") as f:
        out = csv.DictWriter(f, fieldnames=COLUMNS)
        out.writeheader()
        for r in rows:
            d = asdict(r)
            out.writerow({c: "" if d[c] is None else d[c] for c in COLUMNS})


def read_csv(path: Path) -> list[Row]:
    """Rows back from a CSV written by `write_csv` (to re-report or re-plot a run)."""
    ints = ("segments", "mem_limit", "predicted_peak", "measured_peak")
    floats = ("peak_gap", "step_ms", "step_ms_min", "spread", "vs_none", "plan_ms", "profile_s")
    rows = []
    with path.open() as f:
        for d in csv.DictReader(f):
            kw: dict[str, Any] = dict(d)
            for k in ints:
                kw[k] = int(d[k]) if d[k] else None
            for k in floats:
                kw[k] = float(d[k]) if d.get(k) else None
            rows.append(Row(**kw))
    return rows


def write_plot(rows: list[Row], path: Path, title: str) -> None:
    """Peak activation memory against step time: rotor as a curve, the others as points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def pts(method: str) -> list[Row]:
        return [r for r in rows if r.method == method and r.step_ms is not None and r.measured_peak is not None]

    mib = 2**20
    fig, ax = plt.subplots(figsize=(8.4, 4.2), dpi=80)
    rotor = sorted(pts("rotor"), key=lambda r: r.measured_peak)
    if rotor:
        ax.plot([r.step_ms for r in rotor], [r.measured_peak / mib for r in rotor], "o-", color="C3", label="rotor")
        for r in rotor:
            ax.annotate(r.budget, (r.step_ms, r.measured_peak / mib), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")  # fmt: skip
    seg = pts("checkpoint_sequential")
    if seg:
        ax.scatter([r.step_ms for r in seg], [r.measured_peak / mib for r in seg], s=18, color="C0",
                   label="checkpoint_sequential\n(segment count)")  # fmt: skip
        for r in seg:
            ax.annotate(str(r.segments), (r.step_ms, r.measured_peak / mib), fontsize=6, color="C0",
                        xytext=(2, -7), textcoords="offset points")  # fmt: skip
    comp = sorted(pts("compile"), key=lambda r: r.measured_peak)
    if comp:
        ax.plot([r.step_ms for r in comp], [r.measured_peak / mib for r in comp], "s--", color="C2",
                label="torch.compile +\nactivation_memory_budget\n(CPU: allocator)")  # fmt: skip
    for method, marker, color in (("none", "*", "k"), ("recompute_all", "X", "C1")):
        for r in pts(method):
            ax.scatter([r.step_ms], [r.measured_peak / mib], marker=marker, s=80, color=color, label=method)
    ax.set_xlabel("step time, median (ms)")
    ax.set_ylabel("peak activation memory (MiB)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# -- the command ----------------------------------------------------------------------------
def _budget_tokens(text: str) -> list[str]:
    tokens = [t.strip() for t in text.split(",") if t.strip()]
    if not tokens:
        raise BenchError("--budgets is empty; give e.g. min,0.25,0.5,0.75,1.0")
    for t in tokens:
        if t != "min":
            try:
                parse_budget(t)
            except BudgetError as err:
                raise BenchError(f"bad budget {t!r} in --budgets: {err}") from None
    return tokens


def _fraction_tokens(tokens: list[str]) -> list[str]:
    out = []
    for t in tokens:
        if t == "min":
            continue
        v = parse_budget(t)
        if not isinstance(v, int) and 0 < v <= 1:
            out.append(t)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lightning-rotor bench",
        description="Compare rotor with no checkpointing, checkpoint_sequential, recompute-all and torch.compile's "
        "activation_memory_budget on one model: peak activation memory and step time.",
    )
    p.add_argument("--from-csv", default=None, help="re-report (table, targets, PNG) a CSV of an earlier run")
    p.add_argument("--model", help=f"registered name ({', '.join(MODELS)}) or pkg.module:factory")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument(
        "--budgets",
        default=DEFAULT_BUDGETS,
        help="rotor budgets: fractions of the no-recomputation peak, sizes, or 'min' (smallest feasible)",
    )
    p.add_argument("--out", default="bench_out", help="folder for the CSV and the PNG")
    p.add_argument(
        "--size",
        choices=("tiny", "bench", "full"),
        default="bench",
        help="registered model's preset sizes (full: the standard network)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="model/sample size argument, e.g. --set n_layer=4 (repeatable)",
    )
    p.add_argument("--input-shape", default=None, help="input shape for a factory returning a bare nn.Sequential")
    p.add_argument("--repeats", type=int, default=7, help="timed steps per method (interleaved)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--max-segments", type=int, default=None, help="cap checkpoint_sequential's segment counts")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    p.add_argument(
        "--compile-budgets",
        default=None,
        help="activation_memory_budget fractions for torch.compile (default: the fractions in --budgets)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p  # fmt: skip


def run(args: argparse.Namespace) -> list[Row]:
    """Everything but argument parsing and printing: the rows, in table order."""
    from tqdm.auto import tqdm

    if args.threads:
        torch.set_num_threads(args.threads)
    budgets = _budget_tokens(args.budgets)
    try:
        shape = tuple(int(s) for s in args.input_shape.split(",")) if args.input_shape else None
    except ValueError:
        raise BenchError(f"--input-shape expects integers like 8,3,224,224, got {args.input_shape!r}") from None
    w = load_workload(
        args.model, batch_size=args.batch_size, size=args.size, overrides=_parse_kwargs(args.set),
        input_shape=shape, device=torch.device(args.device) if args.device else None, seed=args.seed,
    )  # fmt: skip
    for name, value in (("--repeats", args.repeats), ("--warmup", args.warmup)):
        if value < (1 if name == "--repeats" else 0):
            raise BenchError(f"{name} must be {'positive' if name == '--repeats' else 'non-negative'}, got {value}")
    compile_tokens = budgets if args.compile_budgets is None else _budget_tokens(args.compile_budgets)
    fractions = [] if args.no_compile else _fraction_tokens(compile_tokens)
    with tqdm(total=1, desc=f"bench {args.model}: profiling", disable=args.quiet, file=sys.stderr) as bar:
        methods = eager_methods(w, budgets, args.max_segments)
        bar.update(1)
        live = sum(m.forward is not None for m in methods)
        bar.total = 1 + live * (args.warmup + 1 + args.repeats) + len(fractions) * (args.warmup + args.repeats + 2)
        bar.set_description(f"bench {args.model}: timing {live} methods")
        run_interleaved(w, methods, args.repeats, args.warmup, args.seed, bar)
        rows = [m.row for m in methods]
        if fractions:
            bar.set_description(f"bench {args.model}: torch.compile")
            rows += run_compiled(w, fractions, args.repeats, args.warmup, args.seed, bar)
    base = next((r.step_ms for r in rows if r.method == "none"), None)
    for r in rows:
        if r.step_ms is not None and base:
            r.vs_none = r.step_ms / base
        if r.predicted_peak and r.measured_peak is not None:
            r.peak_gap = r.measured_peak / r.predicted_peak - 1
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.from_csv:
        rows = read_csv(Path(args.from_csv))
        args.model = rows[0].model if rows else "?"
    elif not args.model:
        parser.error("--model is required (a registered name or pkg.module:factory)")
    try:
        rows = rows if args.from_csv else run(args)
    except (BenchError, BudgetError) as err:
        print(f"lightning-rotor bench: error: {err}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = args.model.replace(":", "_").replace(".", "_").replace("/", "_")
    csv_path, png_path = out / f"{stem}.csv", out / f"{stem}.png"
    write_csv(rows, csv_path)
    device = rows[0].device if rows else "?"
    title = (
        f"{args.model}, {device} (from {Path(args.from_csv).name})"
        if args.from_csv
        else f"{args.model}, batch {args.batch_size}, {device}, {torch.get_num_threads()} threads"
    )
    write_plot(rows, png_path, title)
    print(f"## {title}\n")
    print(markdown(rows))
    for stat, label in (("step_ms", "medians"), ("step_ms_min", "fastest runs")):
        if any(getattr(r, stat) is not None for r in rows):
            print(f"\nissue-5 targets on {label} (see the spread column for noise):")
            for line in targets(rows, stat):
                print(f"- {line}")
    print(f"\nwrote {csv_path} and {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
