"""Offloading with recomputation, simulated: how much of recompute-only's overhead offloading removes.

Like the figures of rotor's NeurIPS 2021 paper (offloading and rematerialization), on the zoo's
chains (`benchmarks/zoo.py`'s models, profiled here) and the example chains (`examples/*.json`):
for each chain, at each link bandwidth, at budgets from the smallest feasible one to 100% of the
no-recomputation peak, the fastest plan with offloading against the fastest recompute-only plan,
both from `plan()` and both replayed by the simulator (the referee), which gives the times and
checks the peaks. Nothing runs on a device: the times are the chains' profiled stage times.

    python benchmarks/offload_sim.py --out benchmarks/results/offload_sim
    python benchmarks/offload_sim.py --reprofile   # profile the zoo models again (CPU, one thread)

Writes `<out>.md` (tables), `<out>.csv` (every point) and the chart `docs/benchmarks/offload_sim.png`.
docs/benchmarks.md, "Offloading (simulated)", records the figures and what they mean.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's package, not an installed one

from lightning_rotor.budget import format_bandwidth, format_bytes  # noqa: E402
from lightning_rotor.chain import Chain  # noqa: E402
from lightning_rotor.ops import OpKind  # noqa: E402
from lightning_rotor.planner import InfeasibleBudget, min_feasible_budget, plan  # noqa: E402
from lightning_rotor.simulate import no_recompute_peak, simulate  # noqa: E402

ZOO = ["hetero", "mobilenet", "gpt", "resnet50", "resnet18", "mlp"]  # benchmarks/zoo.py's models, bench sizes
EXAMPLE_TIMES = {  # where the example chains' times come from
    "gpt_tiny_sac_options": "examples/, CPU, 1 thread (options_profile.py)",
}
HAND_WRITTEN = "examples/, hand-written, GPU-like (origin not recorded)"
CHAINS_DIR = ROOT / "benchmarks" / "results" / "offload_sim_chains"
GPU_CHAINS = ROOT / "benchmarks" / "results" / "gpu_chains"  # benchmarks/gpu_chains.py writes them
GPU_SOURCE = "gpu_chains.py: sizes profiled, times V100 fp32 roofline"
SLOWDOWN = 1.2  # the paper's mark: the smallest budget whose plan runs within 1.2x the no-recomputation time
CHART = ROOT / "docs" / "benchmarks" / "offload_sim.png"
BANDWIDTHS = [12e9, 25e9, 64e9]  # about PCIe 3 x16, PCIe 4 x16, PCIe 5 x16 (each way, in practice less)
IDEAL = 1e15  # a link no copy waits on: what the planner's family of offloading schedules could give at best
LINK_STYLES = {  # per link of the chart: colour and line style, each its own (the ideal link dotted, a reference)
    12e9: ("tab:blue", "-s"),
    25e9: ("tab:green", "-^"),
    64e9: ("tab:purple", "-D"),
    IDEAL: ("tab:gray", ":"),
}
MARKS = [0.5, 0.3]  # budgets, as fractions of the no-recomputation peak, where the share removed is reported


@dataclass
class Point:
    """One chain at one bandwidth and one budget: the two plans' simulated times and what offloading moved."""

    chain: str
    bandwidth: float
    budget: int
    fraction: float  # of the no-recomputation peak
    no_recompute: float
    recompute_only: float
    offload: float
    offloaded: int  # Offload ops in the plan
    host_peak: int
    peak_offload: int
    peak_recompute: int

    @property
    def removed(self) -> float | None:
        """The share of recompute-only's overhead (its time above no recomputation) that offloading removes."""
        overhead = self.recompute_only - self.no_recompute
        if overhead <= 1e-12 * self.no_recompute:
            return None  # nothing to remove: recompute-only recomputes nothing here
        return (self.recompute_only - self.offload) / overhead


def profile_zoo(models: list[str], out: Path) -> None:
    """Profile each zoo model as `benchmarks/zoo.py` does (CPU, bench size) and save its chain."""
    import torch

    from lightning_rotor.bench.workload import load_workload
    from lightning_rotor.profile import profile_chain

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from zoo import BATCH

    torch.set_num_threads(1)
    out.mkdir(parents=True, exist_ok=True)
    for name in models:
        start = time.perf_counter()
        w = load_workload(name, batch_size=BATCH.get(name, 8), size="bench", device=torch.device("cpu"))
        chain = profile_chain(
            w.stages, w.x, names=w.stage_names, loss_tmp=lambda o, w=w: w.loss(o, w.y), offload=True
        ).chain  # offload=True: each stage's offloadable saved bytes measured as the executor moves them
        chain.save(out / f"{name}.json")
        print(f"profiled {name}: {chain.length} stages in {time.perf_counter() - start:.1f} s", flush=True)


def estimated_saved_parts(chain: Chain) -> Chain:
    """`chain` whose stages may move what they save beyond their output, where it says nothing of it.

    The example chains carry no `offloadable` figures (they were not profiled with offloading on); what a
    stage saves beyond its output is about what the profiler finds (it leaves out a_k, a_{k+1} and
    parameters).
    """
    if any(chain.offloadable):
        return chain
    beyond = [max(0, s - o) for s, o in zip(chain.saved_size, chain.out_size, strict=True)]
    return dataclasses.replace(chain, offloadable=beyond)


def chains_to_study(
    models: list[str], examples: bool, saved_parts: bool = True, gpu: bool = False, gpu_dir: Path = GPU_CHAINS
) -> dict[str, tuple[Chain, str]]:
    """name -> (chain, where its times come from); without `saved_parts` only stage inputs may move; `gpu`: the
    GPU-like chains of benchmarks/gpu_chains.py too."""
    found: dict[str, tuple[Chain, str]] = {}
    if gpu:
        source = GPU_SOURCE if gpu_dir == GPU_CHAINS else f"{gpu_dir.name}: times measured (gpu_chain_times.py)"
        for path in sorted(gpu_dir.glob("*.json")):
            found[path.stem] = (Chain.load(path), source)
    for name in models:  # profiled with offloading on: their offloadable bytes are measured (0 where none)
        found[name] = (Chain.load(CHAINS_DIR / f"{name}.json"), "profiled here, CPU, 1 thread")
    if examples:
        for path in sorted((ROOT / "examples").glob("*.json")):
            chain, source = Chain.load(path), EXAMPLE_TIMES.get(path.stem, HAND_WRITTEN)
            if saved_parts and not any(chain.offloadable):
                chain, source = estimated_saved_parts(chain), source + "; saved parts estimated"
            found[path.stem] = (chain, source)
    if not saved_parts:
        found = {name: (dataclasses.replace(c, offloadable=None), source) for name, (c, source) in found.items()}
    return found


def budgets_of(chain: Chain, count: int) -> list[int]:
    """`count` budgets evenly from the smallest feasible one to the no-recomputation peak, and the `MARKS`."""
    floor, peak = min_feasible_budget(chain), no_recompute_peak(chain)
    even = {round(floor + (peak - floor) * i / (count - 1)) for i in range(count)} if count > 1 else {peak}
    marks = {math.floor(f * peak) for f in MARKS if math.floor(f * peak) >= floor}
    return sorted(even | marks)


def study(name: str, chain: Chain, bandwidth: float, budgets: list[int], slots: int | None) -> list[Point]:
    """Both plans at every budget; the simulator replays each (times, peaks, host bytes)."""
    moving = chain.with_transfer(bandwidth)
    peak = no_recompute_peak(chain)
    points = []
    for budget in budgets:
        try:
            rec = plan(chain, budget, bandwidth=0, slots=slots)
            off = plan(chain, budget, bandwidth=bandwidth, slots=slots)
        except InfeasibleBudget:
            continue
        rec_sim, off_sim = simulate(chain, rec.ops), simulate(moving, off.ops)
        if rec_sim.peak > budget or off_sim.peak > budget:
            raise AssertionError(f"{name} at {budget} bytes: a plan replays above its budget")
        if off.recompute_only_time is not None and not math.isclose(off.recompute_only_time, rec_sim.time):
            print(
                f"warning: {name} at {budget} bytes: plan() reports recompute-only {off.recompute_only_time:.6g} s, "
                f"the recompute-only plan replays in {rec_sim.time:.6g} s",
                file=sys.stderr,
            )
        points.append(
            Point(
                chain=name,
                bandwidth=bandwidth,
                budget=budget,
                fraction=budget / peak,
                no_recompute=chain.no_recompute_time(),
                recompute_only=rec_sim.time,
                offload=off_sim.time,
                offloaded=sum(1 for op in off.ops if op.kind is OpKind.OFFLOAD or op.kind is OpKind.OFFLOAD_SAVED),
                host_peak=off_sim.host_peak,
                peak_offload=off_sim.peak,
                peak_recompute=rec_sim.peak,
            )
        )
    return points


def link_name(bandwidth: float) -> str:
    return "ideal (1 PB/s)" if bandwidth == IDEAL else format_bandwidth(bandwidth)


def checkpoint_share(chain: Chain) -> float:
    """Bytes of the stage inputs a_1 … a_{L-1} (what can be offloaded) per byte of what recording the stages saves.

    Offloading moves checkpoints (values held without graph); recomputation is about graphs. Small: the
    memory an offload frees is small beside what the plan must find room for.
    """
    saved = sum(chain.saved_size[chain.frozen :])
    return sum(chain.sizes[chain.frozen + 1 : chain.length]) / saved if saved else math.inf


def link_ratio(chain: Chain, bandwidth: float) -> float:
    """Seconds to copy every offloadable stage input and saved part once over the link, per second of forward
    compute.

    Far below 1: copies hide behind the forwards and offloading is nearly free. Near or above 1: they cannot.
    """
    moved = (sum(chain.sizes[chain.frozen + 1 : chain.length]) + sum(chain.offloadable[chain.frozen :])) / bandwidth
    forward = sum(chain.fwd_time)
    return moved / forward if forward > 0 else math.inf


def at_mark(points: list[Point], peak: int, fraction: float) -> Point | None:
    budget = math.floor(fraction * peak)
    return next((p for p in points if p.budget == budget), None)


def within(points: list[Point], which: str) -> str:
    """The smallest budget of the sweep, as a share of the plain peak, whose plan runs within `SLOWDOWN`x."""
    fast = [p.fraction for p in points if getattr(p, which) <= SLOWDOWN * p.no_recompute]
    return f"{100 * min(fast):.0f}%" if fast else "none"


def share(p: Point | None) -> str:
    if p is None:
        return "below floor"
    removed = p.removed
    return "no overhead" if removed is None else f"{100 * removed:.0f}%"


def report(results: dict[tuple[str, float], list[Point]], chains: dict[str, tuple[Chain, str]], command: str) -> str:
    lines = [
        f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {platform.processor() or platform.machine()} "
        f"({platform.system()}), simulated (no device runs); `{command}`",
        "",
        "| chain (stages) | times from | checkpoints/saved | link | copy/forward | floor, recompute-only "
        "| floor, offload | overhead removed at 50% | at 30% | mean over the sweep | best (budget) "
        f"| points offloading | smallest budget within {SLOWDOWN}x, recompute-only / offload |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    links = sorted({bw for _, bw in results})
    means: dict[float, dict[float, list[float]]] = {bw: {f: [] for f in MARKS} for bw in links}
    for (name, bandwidth), points in results.items():
        chain, source = chains[name]
        peak = no_recompute_peak(chain)
        marks = [at_mark(points, peak, f) for f in MARKS]
        for f, p in zip(MARKS, marks, strict=True):
            if p is not None and p.removed is not None:
                means[bandwidth][f].append(p.removed)
        removed = [p.removed for p in points if p.removed is not None]
        best = max((p for p in points if p.removed is not None), key=lambda p: p.removed or 0.0, default=None)
        best_cell = (
            "-"
            if best is None
            else f"{100 * (best.removed or 0.0):.0f}% ({100 * best.fraction:.0f}%)"
            if (best.removed or 0.0) > 0
            else "0%"
        )
        lines.append(
            f"| {name} ({chain.length}) | {source} | {checkpoint_share(chain):.3f} | {link_name(bandwidth)} | "
            f"{link_ratio(chain, bandwidth):.3g} | {format_bytes(min_feasible_budget(chain))} | "
            f"{format_bytes(min_feasible_budget(chain, bandwidth=bandwidth))} | "
            f"{share(marks[0])} | {share(marks[1])} | "
            f"{f'{100 * statistics.fmean(removed):.0f}%' if removed else '-'} | {best_cell} | "
            f"{sum(1 for p in points if p.offloaded)} of {len(points)} | {within(points, 'recompute_only')} / "
            f"{within(points, 'offload')} |"
        )
    lines += ["", "Share of recompute-only's overhead removed, by chain:", "", *compact(results, chains, links)]
    lines += [
        "",
        "Mean share of recompute-only's overhead removed (chains where both plans exist and it has overhead):",
        "",
    ]
    lines += ["| link | at 50% of the plain peak | at 30% |", "|---|---|---|"]
    for bandwidth in links:
        cells = [
            f"{100 * statistics.fmean(v):.0f}% over {len(v)} chains" if v else "-"
            for v in (means[bandwidth][f] for f in MARKS)
        ]
        lines.append(f"| {link_name(bandwidth)} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines) + "\n"


def compact(
    results: dict[tuple[str, float], list[Point]], chains: dict[str, tuple[Chain, str]], links: list[float]
) -> list[str]:
    """One row per chain: the share of recompute-only's overhead removed at 50% and 30% of the plain peak and
    over the sweep, one column per link (what docs/benchmarks.md shows)."""
    head = " | ".join(f"{link_name(bw)}: 50% / 30% / mean" for bw in links)
    lines = [
        f"| chain (stages) | times from | checkpoints/saved | floor, % of plain peak | {head} |",
        "|---|---|---|---|" + "---|" * len(links),
    ]
    for name, (chain, source) in chains.items():
        peak = no_recompute_peak(chain)
        cells = []
        for bw in links:
            points = results[(name, bw)]
            removed = [p.removed for p in points if p.removed is not None]
            mean = f"{100 * statistics.fmean(removed):.0f}%" if removed else "-"
            cells.append(" / ".join([*(share(at_mark(points, peak, f)) for f in MARKS), mean]))
        lines.append(
            f"| {name} ({chain.length}) | {source} | {checkpoint_share(chain):.2f} | "
            f"{100 * min_feasible_budget(chain) / peak:.0f}% | {' | '.join(cells)} |"
        )
    return lines


def write_csv(results: dict[tuple[str, float], list[Point]], path: Path) -> None:
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(
            [
                "chain",
                "bandwidth_bytes_per_s",
                "budget_bytes",
                "budget_fraction_of_plain_peak",
                "no_recompute_s",
                "recompute_only_s",
                "offload_s",
                "overhead_removed",
                "offloaded_values",
                "host_peak_bytes",
                "peak_offload_bytes",
                "peak_recompute_only_bytes",
            ]
        )
        for points in results.values():
            for p in points:
                out.writerow(
                    [
                        p.chain,
                        p.bandwidth,
                        p.budget,
                        f"{p.fraction:.4f}",
                        f"{p.no_recompute:.6g}",
                        f"{p.recompute_only:.6g}",
                        f"{p.offload:.6g}",
                        "" if p.removed is None else f"{p.removed:.4f}",
                        p.offloaded,
                        p.host_peak,
                        p.peak_offload,
                        p.peak_recompute,
                    ]
                )


def chart(results: dict[tuple[str, float], list[Point]], names: list[str], path: Path) -> Any:
    """Time (relative to no recomputation) against budget (share of the plain peak), both curves per chain, each
    link in its own style (`LINK_STYLES`); saved to `path`, and the matplotlib figure returned."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    cols = 4
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.2 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names, strict=False):
        first = results[(name, BANDWIDTHS[0])]
        ax.plot(
            [100 * p.fraction for p in first],
            [p.recompute_only / p.no_recompute for p in first],
            "-o",
            markersize=3,
            color="black",
            label="recompute only",
        )
        for bandwidth in [*BANDWIDTHS, IDEAL]:
            points = results.get((name, bandwidth))
            if points is None:
                continue
            color, style = LINK_STYLES[bandwidth]  # a link without a style fails here, not drawn as another
            ax.plot(
                [100 * p.fraction for p in points],
                [p.offload / p.no_recompute for p in points],
                style,
                markersize=3,
                color=color,
                label=f"offload + recompute, {link_name(bandwidth)}",
            )
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("budget, % of the no-recomputation peak", fontsize=7)
        ax.set_ylabel("time / no-recomputation time", fontsize=7)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(names) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle("Simulated step time against budget: recompute-only vs offloading (benchmarks/offload_sim.py)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return fig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=ZOO, help="zoo models (their chains under offload_sim_chains/)")
    parser.add_argument("--no-examples", action="store_true", help="leave out examples/*.json")
    parser.add_argument("--reprofile", action="store_true", help="profile the zoo models again before simulating")
    parser.add_argument(
        "--budgets", type=int, default=12, help="budgets per chain, floor to plain peak (plus 50%%, 30%%)"
    )
    parser.add_argument("--slots", type=int, default=None, help="planner memory precision (default: automatic)")
    parser.add_argument("--no-ideal", action="store_true", help="leave out the ideal link (1 PB/s), a reference")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "offload_sim"), help="<out>.md, .csv")
    parser.add_argument("--chart", default=str(CHART))
    parser.add_argument(
        "--inputs-only", action="store_true", help="offload stage inputs only (no saved parts of recorded stages)"
    )
    parser.add_argument("--gpu", action="store_true", help="the chains of benchmarks/gpu_chains.py only")
    parser.add_argument(
        "--gpu-dir", type=Path, default=GPU_CHAINS, help="with --gpu: their folder (gpu_chain_times.py: measured)"
    )
    args = parser.parse_args(argv)
    if args.gpu:
        args.models, args.no_examples = [], True
    missing = [m for m in args.models if not (CHAINS_DIR / f"{m}.json").exists()]
    if args.reprofile or missing:
        profile_zoo(args.models if args.reprofile else missing, CHAINS_DIR)
    chains = chains_to_study(
        args.models, not args.no_examples, saved_parts=not args.inputs_only, gpu=args.gpu, gpu_dir=args.gpu_dir
    )
    results: dict[tuple[str, float], list[Point]] = {}
    for name, (chain, _) in chains.items():
        budgets = budgets_of(chain, args.budgets)
        for bandwidth in BANDWIDTHS if args.no_ideal else [*BANDWIDTHS, IDEAL]:
            start = time.perf_counter()
            results[(name, bandwidth)] = study(name, chain, bandwidth, budgets, args.slots)
            seconds = time.perf_counter() - start
            print(f"{name} at {link_name(bandwidth)}: {len(budgets)} budgets in {seconds:.1f} s", flush=True)
    command = "python benchmarks/offload_sim.py " + " ".join(sys.argv[1:] if argv is None else argv)
    text = report(results, chains, command.strip())
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(text)
    write_csv(results, out.with_suffix(".csv"))
    chart(results, list(chains), Path(args.chart))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
