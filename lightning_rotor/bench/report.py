"""The bench's output: a markdown table, the checks read off the rows, CSV and a plot."""

from __future__ import annotations

import csv
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lightning_rotor.bench.methods import COLUMNS, Row
from lightning_rotor.budget import format_bytes


def _fmt(col: str, v: Any) -> str:
    if v is None:
        return ""
    if col in ("budget_bytes", "predicted_peak", "measured_peak"):
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
    ("method", "method"), ("mem_limit", "mem_limit"), ("segments", "segments"), ("budget_bytes", "budget bytes"),
    ("predicted_peak", "predicted peak"), ("measured_peak", "measured peak"), ("peak_gap", "gap"),
    ("step_ms", "step ms (median)"), ("step_ms_min", "min"), ("spread", "spread"), ("vs_none", "vs none"),
    ("plan_ms", "plan ms"),
    ("profile_s", "profile s"), ("note", "note"),
)  # fmt: skip


def add_ratios(rows: list[Row]) -> None:
    """Fill each row's `vs_none` (its median step over the `none` row's) and `peak_gap` (measured over predicted
    peak, minus 1) where the figures exist."""
    base = next((r.step_ms for r in rows if r.method == "none"), None)
    for r in rows:
        if r.step_ms is not None and base:
            r.vs_none = r.step_ms / base
        if r.predicted_peak and r.measured_peak is not None:
            r.peak_gap = r.measured_peak / r.predicted_peak - 1


def markdown(rows: list[Row]) -> str:
    lines = ["| " + " | ".join(h for _, h in TABLE) + " |", "|" + "---|" * len(TABLE)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(c, getattr(r, c)) for c, _ in TABLE) + " |")
    return "\n".join(lines)


@dataclass(frozen=True)
class Ran:
    """A row whose step time (the statistic read) and measured peak are both known."""

    method: str
    mem_limit: str
    segments: int | None
    budget_bytes: int | None
    peak_gap: float | None
    step_ms: float
    peak: int  # measured


def ran(rows: list[Row], stat: str = "step_ms") -> list[Ran]:
    """The rows that ran, with `stat` ("step_ms" median or "step_ms_min") as their step time."""
    out = []
    for r in rows:
        step_ms = getattr(r, stat)
        if step_ms is not None and r.measured_peak is not None:
            out.append(Ran(r.method, r.mem_limit, r.segments, r.budget_bytes, r.peak_gap, step_ms, r.measured_peak))
    return out


def checks(rows: list[Row], stat: str = "step_ms") -> list[str]:
    """What rotor promises against the others, read off the rows (`stat`: median "step_ms" or "step_ms_min").

    One line each: rotor against the fastest checkpoint_sequential that fits in its memory, the lowest
    peaks, rotor at its largest budget against no checkpointing, and measured against predicted peaks.
    """
    done = ran(rows, stat)
    rotor = [r for r in done if r.method == "rotor"]
    if not rotor:
        return ["no rotor budget planned: no target can be read"]
    lines = segment_checks(rotor, [r for r in done if r.method == "checkpoint_sequential"])
    block = next((r for r in done if r.method == "per_block"), None)
    if block is not None:  # models as written: full activation checkpointing, one checkpoint per block
        lines += per_block_checks(rotor, block)
    lines += peer_checks(done)
    top = max(rotor, key=lambda r: r.budget_bytes or 0)
    none = next((r for r in done if r.method == "none"), None)
    if none is not None:
        ratio = top.step_ms / none.step_ms
        lines.append(
            f"largest mem_limit ({top.mem_limit}): rotor {top.step_ms:.1f} ms vs none {none.step_ms:.1f} ms "
            f"= {ratio:.3f}x "
            f"(target <= 1.03): {'holds' if ratio <= 1.03 else 'fails'}"
        )
    gap = max(rotor, key=lambda r: abs(r.peak_gap or 0))
    lines.append(
        f"largest measured/predicted gap: {gap.peak_gap:+.1%} (mem_limit {gap.mem_limit}; target < 10%): "
        f"{'holds' if abs(gap.peak_gap or 0) < 0.10 else 'fails'}"
    )
    return lines


def segment_checks(rotor: list[Ran], seg: list[Ran]) -> list[str]:
    """Each rotor budget against the fastest checkpoint_sequential that fits in its peak; the lowest peaks."""
    if not seg:
        return []
    lines = []
    for r in rotor:
        fits = [c for c in seg if c.peak <= r.peak]
        if not fits:
            lines.append(f"mem_limit {r.mem_limit}: no checkpoint_sequential fits in rotor's {format_bytes(r.peak)}")
            continue
        best = min(fits, key=lambda c: c.step_ms)
        verdict = "holds" if r.step_ms <= best.step_ms else "fails"
        lines.append(
            f"mem_limit {r.mem_limit}: rotor {r.step_ms:.1f} ms at {format_bytes(r.peak)} vs fastest fitting "
            f"checkpoint_sequential ({best.segments} segments) {best.step_ms:.1f} ms at "
            f"{format_bytes(best.peak)}: {r.step_ms / best.step_ms:.3f}x, {verdict}"
        )
    low_r = min(r.peak for r in rotor)
    low_s = min(c.peak for c in seg)
    lines.append(
        f"lowest peak: rotor {format_bytes(low_r)} vs checkpoint_sequential {format_bytes(low_s)}: "
        f"{'holds' if low_r < low_s else 'fails'}"
    )
    return lines


def per_block_checks(rotor: list[Ran], block: Ran) -> list[str]:
    """Models as written: the fastest rotor budget within per-block checkpointing's peak; the lowest peaks."""
    lines = []
    fits = [r for r in rotor if r.peak <= block.peak]
    if fits:
        best = min(fits, key=lambda r: r.step_ms)
        lines.append(
            f"at per_block's peak {format_bytes(block.peak)}: rotor (mem_limit {best.mem_limit}) "
            f"{best.step_ms:.1f} ms vs per_block {block.step_ms:.1f} ms = {best.step_ms / block.step_ms:.3f}x: "
            f"{'holds' if best.step_ms <= block.step_ms else 'fails'}"
        )
    else:
        lines.append(f"no rotor budget fits in per_block's peak {format_bytes(block.peak)}")
    low_r = min(r.peak for r in rotor)
    lines.append(
        f"lowest peak: rotor {format_bytes(low_r)} vs per_block {format_bytes(block.peak)}: "
        f"{'holds' if low_r < block.peak else 'fails'}"
    )
    return lines


PEER_TARGET = 0.97  # rotor's step at a peer's measured peak, at most this fraction of the peer's


def peer_checks(done: list[Ran]) -> list[str]:
    """hf:/timm: models: rotor and rotor+options planned for each peer's (own, sac) measured peak against it."""
    lines = []
    for peer in (r for r in done if r.method in ("own", "sac")):
        for name in ("rotor", "rotor+options"):
            r = next((r for r in done if r.method == name and r.mem_limit == peer.method), None)
            if r is None:
                lines.append(f"at {peer.method}'s peak {format_bytes(peer.peak)}: {name} did not run")
                continue
            ratio = r.step_ms / peer.step_ms
            fits = r.peak <= peer.peak
            lines.append(
                f"at {peer.method}'s peak {format_bytes(peer.peak)}: {name} {r.step_ms:.1f} ms at "
                f"{format_bytes(r.peak)} vs {peer.method} {peer.step_ms:.1f} ms = {ratio:.3f}x "
                f"(target <= {PEER_TARGET}): {'holds' if ratio <= PEER_TARGET and fits else 'fails'}"
                + ("" if fits else " (over the peer's peak)")
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
    ints = ("segments", "budget_bytes", "predicted_peak", "measured_peak")
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

    done = ran(rows)

    def pts(method: str) -> list[Ran]:
        return [r for r in done if r.method == method]

    mib = 2**20
    fig, ax = plt.subplots(figsize=(8.4, 4.2), dpi=80)
    rotor = sorted(pts("rotor"), key=lambda r: r.peak)
    if rotor:
        ax.plot([r.step_ms for r in rotor], [r.peak / mib for r in rotor], "o-", color="C3", label="rotor")
        for r in rotor:
            ax.annotate(r.mem_limit, (r.step_ms, r.peak / mib), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")  # fmt: skip
    seg = pts("checkpoint_sequential")
    if seg:
        ax.scatter([r.step_ms for r in seg], [r.peak / mib for r in seg], s=18, color="C0",
                   label="checkpoint_sequential\n(segment count)")  # fmt: skip
        for r in seg:
            ax.annotate(str(r.segments), (r.step_ms, r.peak / mib), fontsize=6, color="C0",
                        xytext=(2, -7), textcoords="offset points")  # fmt: skip
    plus = sorted(pts("rotor+options"), key=lambda r: r.peak)
    if plus:
        ax.plot([r.step_ms for r in plus], [r.peak / mib for r in plus], "v:", color="C4",
                label="rotor+options")  # fmt: skip
    comp = sorted(pts("compile"), key=lambda r: r.peak)
    if comp:
        ax.plot([r.step_ms for r in comp], [r.peak / mib for r in comp], "s--", color="C2",
                label="torch.compile +\nactivation_memory_budget\n(CPU: allocator)")  # fmt: skip
    marks = (("none", "*", "k"), ("recompute_all", "X", "C1"), ("own", "P", "C0"), ("sac", "D", "C8"))
    for method, marker, color in marks:
        for r in pts(method):
            ax.scatter([r.step_ms], [r.peak / mib], marker=marker, s=80, color=color, label=method)
    ax.set_xlabel("step time, median (ms)")
    ax.set_ylabel("peak activation memory (MiB)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
