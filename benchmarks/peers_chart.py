"""rotor and rotor+options against each model's own checkpointing: the table and chart of `lightning-rotor bench` CSVs.

Each CSV is one `lightning-rotor bench --model hf:NAME | timm:NAME` run (peers `own` and `sac`, rotor
and rotor+options planned for each peer's measured peak). Printed: per model and peer, the peer's
measured peak and median step, each rotor's at that peak, the ratio (target <= 0.97) and the spreads.
The chart: per model, step time relative to no checkpointing against peak memory relative to it,
rotor and rotor+options as curves, the peers as points.

    python benchmarks/peers_chart.py bench_out/hf_gpt2.csv bench_out/timm_convnext_atto.csv --png docs/peers.png
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lightning_rotor.bench.methods import Row
from lightning_rotor.bench.report import PEER_TARGET, read_csv


def table(runs: dict[str, list[Row]]) -> str:
    lines = [
        "| model | peer | peer peak (/ none) | peer median ms (spread) | method at that peak | its peak | "
        "median ms (spread) | / peer |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for model, rows in runs.items():
        none = next(r for r in rows if r.method == "none")
        for peer in (r for r in rows if r.method in ("own", "sac") and r.step_ms):
            for name in ("rotor", "rotor+options"):
                r = next((r for r in rows if r.method == name and r.mem_limit == peer.method), None)
                if r is None or r.step_ms is None or r.measured_peak is None:
                    continue
                assert peer.measured_peak and none.measured_peak and peer.step_ms
                ratio = r.step_ms / peer.step_ms
                verdict = "**holds**" if ratio <= PEER_TARGET and r.measured_peak <= peer.measured_peak else "misses"
                lines.append(
                    f"| {model} | {peer.method} | {peer.measured_peak / 2**20:.1f} MiB "
                    f"({peer.measured_peak / none.measured_peak:.2f}) | {peer.step_ms:.0f} ({peer.spread:.0%}) | "
                    f"{name}: {r.note} | {r.measured_peak / 2**20:.1f} MiB | {r.step_ms:.0f} ({r.spread:.0%}) | "
                    f"{ratio:.3f} {verdict} |"
                )
    return "\n".join(lines)


def chart(runs: dict[str, list[Row]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(runs)
    cols = min(n, 3)
    fig, axes = plt.subplots((n + cols - 1) // cols, cols, figsize=(4.2 * cols, 3.4 * ((n + cols - 1) // cols)),
                             dpi=80, squeeze=False)  # fmt: skip
    for ax, (model, rows) in zip(axes.flat, runs.items(), strict=False):
        none = next(r for r in rows if r.method == "none")
        assert none.step_ms and none.measured_peak

        def xy(rs: list[Row], none: Row = none) -> tuple[list[float], list[float]]:
            rs = sorted((r for r in rs if r.step_ms and r.measured_peak), key=lambda r: r.measured_peak or 0)
            return [r.step_ms / none.step_ms for r in rs], [r.measured_peak / none.measured_peak for r in rs]

        for name, style, color in (("rotor", "o-", "C3"), ("rotor+options", "v:", "C4")):
            ax.plot(*xy([r for r in rows if r.method == name]), style, color=color, label=name)
        for name, marker, color in (("own", "P", "C0"), ("sac", "D", "C8"), ("none", "*", "k")):
            ax.scatter(*xy([r for r in rows if r.method == name]), marker=marker, s=70, color=color, label=name)
        ax.set_title(model, fontsize=9)
        ax.set_xlabel("step time / none (median)", fontsize=8)
        ax.set_ylabel("peak memory / none", fontsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", nargs="+", type=Path)
    parser.add_argument("--png", type=Path, default=None)
    args = parser.parse_args()
    runs = {}
    for path in args.csv:
        rows = read_csv(path)
        runs[rows[0].model] = rows
    print(table(runs))
    if args.png:
        chart(runs, args.png)
        print(f"\nwrote {args.png}")


if __name__ == "__main__":
    main()
