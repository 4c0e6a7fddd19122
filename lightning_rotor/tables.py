"""The stage table of a plan, rendered in one place: `Checkpointable.summary()` prints it as text,
the Lightning callback logs it as markdown (TensorBoard text)."""

from __future__ import annotations

from lightning_rotor.budget import format_bandwidth, format_bytes
from lightning_rotor.ops import OpKind
from lightning_rotor.pipeline import Entry
from lightning_rotor.simulate import simulate

__all__ = ["offloaded_stages", "saved_offloaded_stages", "stage_markdown", "stage_rows", "stage_text", "transfer_line"]


def stage_rows(entry: Entry) -> list[tuple[str, int, int, float, float, str]]:
    """(name, out bytes, saved bytes, fwd s, bwd s, decision) per stage of a plan."""
    chain = entry.chain
    runs = entry.runs
    kept = [False] * chain.length
    for op in entry.plan.ops:
        if op.kind is OpKind.FC and op.stage is not None:
            kept[op.stage] = True
    moved, saved = offloaded_stages(entry), saved_offloaded_stages(entry)
    rows = []
    for k in range(chain.length):
        decision = "recompute" if runs[k] > 1 else "keep"
        if k < chain.frozen:  # run once without recording, no backward (chain version 4)
            decision = "frozen"
        elif kept[k]:
            decision += " (checkpoint input)"
        if k in moved:
            decision += " (input offloaded)"
        if k in saved:
            decision += " (saved part offloaded)"
        rows.append(
            (chain.names[k], chain.out_size[k], chain.saved_size[k], chain.fwd_time[k], chain.bwd_time[k], decision)
        )
    return rows


def offloaded_stages(entry: Entry) -> set[int]:
    """The stages whose input `a_k` the plan moves to host memory (`Offload k`) at some point."""
    return {op.stage for op in entry.plan.ops if op.kind is OpKind.OFFLOAD and op.stage is not None}


def saved_offloaded_stages(entry: Entry) -> set[int]:
    """The stages whose recorded graph's saved part the plan moves to host memory (`OffloadSaved k`)."""
    return {op.stage for op in entry.plan.ops if op.kind is OpKind.OFFLOAD_SAVED and op.stage is not None}


def transfer_line(entry: Entry) -> str | None:
    """What offloading does in this plan (None when the chain does not offload): the inputs moved, the
    bandwidth, the host memory at most (by the simulator)."""
    chain = entry.chain
    if not chain.offloads:
        return None
    moved, saved = sorted(offloaded_stages(entry)), sorted(saved_offloaded_stages(entry))
    limit = f", host limit {format_bytes(chain.host_limit)}" if chain.host_limit is not None else ""
    if not moved and not saved:
        return f"offloading at {format_bandwidth(chain.bandwidth)}{limit}: nothing offloaded in this plan"
    host = simulate(chain, entry.plan.ops).host_peak
    parts = [
        f"{what} of {', '.join(chain.names[k] for k in ks)}"
        for what, ks in (("inputs", moved), ("saved parts", saved))
        if ks
    ]
    return (
        f"offloading at {format_bandwidth(chain.bandwidth)}{limit}: {' and '.join(parts)} offloaded, "
        f"host memory at most {format_bytes(host)}"
    )


def stage_text(entry: Entry) -> str:
    """A readable table of the stages (sizes, times, runs per step), the budget, the prediction, profiling's cost."""
    chain, chosen, runs = entry.chain, entry.plan, entry.runs
    width = max(len(n) for n in chain.names)
    lines = [f"{'stage':<{width}}  {'out':>10}  {'saved':>10}  {'fwd ms':>8}  {'bwd ms':>8}  runs"]
    moved, parts = offloaded_stages(entry), saved_offloaded_stages(entry)
    for k, (name, out, saved, fwd, bwd, _) in enumerate(stage_rows(entry)):
        lines.append(
            f"{name:<{width}}  {format_bytes(out):>10}  {format_bytes(saved):>10}  {fwd * 1e3:8.3f}  "
            f"{bwd * 1e3:8.3f}  {runs[k]}{' (recomputed)' if runs[k] > 1 else ''}"
            f"{' (frozen)' if k < chain.frozen else ''}{' (input offloaded)' if k in moved else ''}"
            f"{' (saved part offloaded)' if k in parts else ''}"
        )
    base = chain.no_recompute_time()
    budget = f"budget {format_bytes(chosen.budget)}, predicted peak {format_bytes(chosen.peak)}"
    if base > 0:
        budget += f", predicted step {chosen.time * 1e3:.3f} ms ({chosen.time / base:.2f}x no recomputation)"
    lines.append(budget)
    transfers = transfer_line(entry)
    if transfers is not None:
        lines.append(transfers)
    prof = entry.profile
    noise = (
        f"plain step spread {prof.step_spread:.0%} over {prof.repeats} rounds (one stage's up to "
        f"{prof.spread:.0%}; times are medians)"
        if prof.round_seconds
        else f"timing spread up to {prof.spread:.0%} over {prof.repeats} runs"
    )
    lines.append(
        f"profiling took {prof.seconds:.3f} s ({prof.seconds / max(chosen.time, 1e-12):.0f} predicted steps), {noise}"
    )
    return "\n".join(lines)


def stage_markdown(name: str, entry: Entry) -> str:
    """The same table as markdown, headed by chain `name`'s budget and predicted step."""
    chosen = entry.plan
    lines = [
        f"**{name}**: budget {format_bytes(chosen.budget)}, predicted peak {format_bytes(chosen.peak)}, "
        f"predicted step {chosen.time * 1e3:.2f} ms vs {entry.chain.no_recompute_time() * 1e3:.2f} ms without "
        f"recomputation" + (f"; {transfer_line(entry)}" if entry.chain.offloads else ""),
        "",
        "| stage | output | saved | fwd ms | bwd ms | decision |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for stage, out, saved, fwd, bwd, decision in stage_rows(entry):
        lines.append(
            f"| {stage} | {format_bytes(out)} | {format_bytes(saved)} | {fwd * 1e3:.3f} | {bwd * 1e3:.3f} "
            f"| {decision} |"
        )
    return "\n".join(lines)
