"""Draw docs/architecture.svg, the flow of one training step (docs/architecture.md).

    python docs/architecture_picture.py

Needs only matplotlib; the output is deterministic (no date, fixed hash salt), so a redraw
changes the file only when this script changes.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

STEP = "#dbe8f5"  # a step of the flow
VALUE = "#ffffff"  # what a step hands to the next
BESIDE = "#e6f2dc"  # budget, plan cache, referee
LAYER = "#f5e6d3"  # what wraps the flow

# (label, file, x, y, colour): the flow, left to right
FLOW = [
    ("model", "nn.Module as written", 0.6, 2.0, VALUE),
    ("discover", "discovery/", 2.0, 2.0, STEP),
    ("Stages", "stages.py", 3.4, 2.0, VALUE),
    ("profile", "profile.py\nengine.py", 4.8, 2.0, STEP),
    ("Chain", "chain.py", 6.2, 2.0, VALUE),
    ("plan", "planner.py + cpp/", 7.6, 2.0, STEP),
    ("Plan", "ops.py", 9.0, 2.0, VALUE),
    ("run", "execute.py\nengine.py, rng.py", 10.4, 2.0, STEP),
]
BESIDE_FLOW = [
    ("simulate", "simulate.py: the one\nreplay of the memory model", 8.1, 0.75, BESIDE),
    ("Budget", "shared_budget.py: bytes per\nchain, call and step", 5.9, 0.75, BESIDE),
    ("PlanCache", "cache.py: signature → Plan,\nstate_dict, fingerprints", 10.2, 0.75, BESIDE),
]


def box(ax, label: str, detail: str, x: float, y: float, colour: str, width: float = 1.2) -> None:
    ax.add_patch(
        FancyBboxPatch(
            (x - width / 2, y - 0.38), width, 0.76, boxstyle="round,pad=0.03", fc=colour, ec="#555555", lw=0.8
        )
    )
    ax.text(x, y + 0.15, label, ha="center", va="center", fontsize=9, weight="bold")
    ax.text(x, y - 0.15, detail, ha="center", va="center", fontsize=6.2, linespacing=1.1)


def arrow(ax, start: tuple[float, float], end: tuple[float, float], style: str = "-|>") -> None:
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle=style, mutation_scale=9, color="#333333", lw=0.8))


def band(ax, y: float, height: float, text: str, colour: str) -> None:
    ax.add_patch(FancyBboxPatch((0.0, y), 11.0, height, boxstyle="round,pad=0.02", fc=colour, ec="#999999", lw=0.6))
    ax.text(5.5, y + height - 0.16, text, ha="center", va="center", fontsize=7.5)


def main() -> None:
    plt.rcParams["svg.hashsalt"] = "lightning_rotor"
    plt.rcParams["svg.fonttype"] = "none"  # text stays text: small, searchable, diffable
    fig, ax = plt.subplots(figsize=(11, 3.9))
    ax.set_xlim(-0.1, 11.2)
    ax.set_ylim(0.25, 4.05)
    ax.axis("off")
    band(
        ax,
        3.65,
        0.36,
        "Lightning / Fabric layer (lightning/, fabric/): strategies wrap modules · callback logs · CLI wires",
        LAYER,
    )
    band(
        ax,
        3.1,
        0.36,
        "Checkpointable (checkpointable.py): forward → route → chain state (chain_state.py: plans, budgets) "
        "→ step budget (calls.py) → runner",
        LAYER,
    )
    band(ax, 1.5, 1.42, "pipeline.py: plain functions, data moves one way", "#f4f4f4")
    arrow(ax, (5.5, 3.64), (5.5, 3.47))  # the layer wraps the shell
    arrow(ax, (5.5, 3.09), (5.5, 2.93))  # the shell calls the pipeline
    for (label, detail, x, y, colour), nxt in zip(FLOW, FLOW[1:] + [None], strict=True):
        box(ax, label, detail, x, y, colour)
        if nxt is not None:
            arrow(ax, (x + 0.62, y), (nxt[2] - 0.62, nxt[3]))
    for label, detail, x, y, colour in BESIDE_FLOW:
        box(ax, label, detail, x, y, colour, width=1.9)
    arrow(ax, (8.0, 1.15), (7.75, 1.6), "<|-|>")  # the referee scores plans
    arrow(ax, (6.4, 1.15), (7.3, 1.6))  # the budget gives the planner its bytes
    arrow(ax, (9.3, 1.6), (9.8, 1.15))  # plans are kept per signature
    out = Path(__file__).with_name("architecture.svg")
    fig.savefig(out, format="svg", bbox_inches="tight", metadata={"Date": None})
    print(out)


if __name__ == "__main__":
    main()
