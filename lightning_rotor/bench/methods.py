"""The configurations a bench compares, each a `Row` to fill and a step to run."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

from lightning_rotor.bench.peers import restore_forwards, sac_per_block
from lightning_rotor.bench.workload import Workload, measure_peak
from lightning_rotor.budget import format_bytes, parse_budget
from lightning_rotor.checkpointable import Checkpointable, InfeasibleBudget
from lightning_rotor.ops import OpKind

COLUMNS = (
    "model", "device", "method", "mem_limit", "segments", "budget_bytes", "predicted_peak", "measured_peak", "peak_gap",
    "step_ms", "step_ms_min", "spread", "vs_none", "plan_ms", "profile_s", "note",
)  # fmt: skip


@dataclass
class Row:
    """One measured configuration; missing figures are None (e.g. an infeasible budget)."""

    model: str
    device: str
    method: str
    mem_limit: str = ""
    segments: int | None = None
    budget_bytes: int | None = None
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


def _per_block(model: nn.Module, block: type) -> Callable[..., Any]:
    """Full activation checkpointing as torchtitan and FSDP policies do it: every `block` through
    `torch.utils.checkpoint`, the rest of the model as written."""
    blocks = [m for m in model.modules() if isinstance(m, block)]

    def forward(*args: Any, **kwargs: Any) -> Any:
        originals = [b.__dict__.get("forward") for b in blocks]
        for b in blocks:
            b.forward = partial(checkpoint, type(b).forward.__get__(b), use_reentrant=False)
        try:
            return model(*args, **kwargs)
        finally:
            restore_forwards(blocks, originals)

    return forward


def _prepare(w: Workload, ckpt: Checkpointable, base: Checkpointable | None = None) -> Any:
    """Profile and plan: a Sequential on its input; a model as written through one training step (discovery).

    `base`: an earlier `Checkpointable` of the same model and settings whose profile is reused (the new
    budget planned on it), so that each budget does not profile again.
    """
    if w.stages:
        if base is not None and base.entries:
            ckpt.restore_plans(base.plan_state())
        return ckpt.prepare_for(w.x)
    if base is not None and base.entries:
        ckpt.discover_on(w.x)
        ckpt.restore_plans(base.plan_state())
    try:
        w.loss(ckpt(w.x), w.y).backward()
    finally:
        w.model.zero_grad(set_to_none=True)
    return ckpt.entry  # the whole-budget plan (a first step runs the smallest budget's, docs/checkpointable.md)


def rotor_methods(
    w: Workload,
    budgets: list[str],
    row: Callable[..., Row],
    options: bool = False,
    labels: dict[str, str] | None = None,
) -> list[Method]:
    """One `Checkpointable` per budget, planned before any timing on one profile (the first budget's).

    `options`: `Checkpointable(options=True)`, rows named "rotor+options"; `labels`: a budget token's
    `mem_limit` label (e.g. a peer's measured peak in bytes labelled by the peer's name).
    """
    methods: list[Method] = []
    name = "rotor+options" if options else "rotor"
    base = Checkpointable(w.model, 1.0, options=options)  # profiled once; every budget is planned on its profile
    try:
        _prepare(w, base)
    except RuntimeError as err:  # e.g. torch's selective checkpointing refusing a stage: a result, not a crash
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        w.model.zero_grad(set_to_none=True)
        return [Method(row(name, note=f"failed when profiling: {type(err).__name__}: {first[:160]}"), None)]
    smallest: int | None = None
    for token in budgets:
        if token == "min":
            if smallest is None:
                try:  # a 1-byte budget is refused with the smallest feasible one
                    _prepare(w, Checkpointable(w.model, 1, options=options), base)
                except InfeasibleBudget as err:
                    smallest = err.min_feasible
            spec: Any = smallest
        else:
            spec = parse_budget(token)
            spec = float(spec) if not isinstance(spec, int) else spec
        ckpt = Checkpointable(w.model, spec, options=options)
        r = row(name, mem_limit=(labels or {}).get(token, token))
        try:
            entry = _prepare(w, ckpt, base)
        except InfeasibleBudget as err:
            r.budget_bytes = getattr(err, "budget", None)
            r.note = f"infeasible; smallest feasible budget {format_bytes(err.min_feasible)}"
            methods.append(Method(r, None))
            continue
        r.budget_bytes = entry.plan.budget
        r.predicted_peak = entry.plan.peak
        r.plan_ms = entry.plan.time * 1e3
        r.profile_s = base.profile_seconds
        fs = sum(op.kind is OpKind.FS for op in entry.plan.ops)
        r.note = f"{entry.plan.recomputed_stages} of {entry.chain.length} stages recomputed" + (
            f", {fs} sac runs" if options else ""
        )
        methods.append(Method(r, ckpt))
    return methods


def peer_methods(w: Workload, budgets: list[str], row: Callable[..., Row]) -> list[Method]:
    """hf:/timm: models: the model's own checkpointing and SAC per block, then rotor and rotor+options at
    `budgets` and at each peer's measured peak (labelled by the peer), so that they compare at equal memory."""
    peers: list[Method] = []
    if w.own is not None:
        peers.append(Method(row("own", note=f"{len(w.blocks)} blocks, the library's checkpointing"), w.own))
    if w.blocks:
        sac = sac_per_block(w.model, w.blocks)
        peers.append(Method(row("sac", note=f"{len(w.blocks)} blocks, matmul/conv/attention outputs saved"), sac))
    labels: dict[str, str] = {}
    for m in peers:
        assert m.forward is not None
        m.row.measured_peak = measure_peak(w, m.forward, 0)
        labels[str(m.row.measured_peak)] = m.row.method
    tokens = [*budgets, *(t for t in labels if t not in budgets)]
    return [
        Method(row("none"), w.model),
        *peers,
        *rotor_methods(w, tokens, row, labels=labels),
        *rotor_methods(w, tokens, row, options=True, labels=labels),
    ]


def per_block_methods(w: Workload, budgets: list[str], row: Callable[..., Row], block: type) -> list[Method]:
    """Every `block` checkpointed (`per_block`), and rotor at `budgets` and at per_block's measured peak
    (its row's mem_limit "per_block"), so that the two compare at equal memory."""
    per_block = _per_block(w.model, block)
    peak = measure_peak(w, per_block, 0)  # rotor is also planned for exactly this many bytes ("per_block")
    methods = rotor_methods(w, [*budgets, str(peak)], row)
    methods[-1].row.mem_limit = "per_block"
    r = row("per_block", note=f"torch.utils.checkpoint around every {block.__name__}")
    return [*methods, Method(r, per_block)]


def eager_methods(w: Workload, budgets: list[str], max_segments: int | None) -> list[Method]:
    dev = str(w.device)

    def row(method: str, **kw: Any) -> Row:  # noqa: E306
        return Row(w.name, dev, method, **kw)

    if w.own is not None or w.blocks:
        return peer_methods(w, budgets, row)
    methods = [Method(row("none"), w.model)]
    if not w.stages:  # a model as written: per-block checkpointing is the uniform scheme to beat
        if w.block is None:
            return [*methods, *rotor_methods(w, budgets, row)]
        return [*methods, *per_block_methods(w, budgets, row, w.block)]
    methods += rotor_methods(w, budgets, row)
    seq = nn.Sequential(*w.stages)
    n = len(w.stages)
    top = n if max_segments is None else min(n, max_segments)
    methods += [Method(row("checkpoint_sequential", segments=s), _segments(seq, s)) for s in range(2, top + 1)]
    methods.append(Method(row("recompute_all", segments=n), _each_checkpointed(w.stages)))
    return methods
