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
STATE = "#fff2c2"  # settings and state, one object each: RotorConfig, ChainState, StepBudget
LAYER = "#f5e6d3"  # what wraps the flow

# (label, file, x, y, colour): a training call's way, left to right: the rooms that hold state
CALL = [
    ("forward", "Checkpointable\ncheckpointable.py", 1.0, 3.1, STEP),
    ("route", "the chain's input, or the\nforward with the chain in it", 3.2, 3.1, STEP),
    ("ChainState", "chain_state.py: entries,\nshape budgets, replanning", 5.5, 3.1, STATE),
    ("step budget", "calls.StepBudget: what the\nstep's pending calls leave", 7.8, 3.1, STATE),
    ("runner", "execute.PlanRunner:\nthe entry's Plan, run", 10.1, 3.1, STEP),
]
# the pipeline a new signature goes through (pipeline.prepare), left to right
FLOW = [
    ("model", "nn.Module as written", 0.6, 1.55, VALUE),
    ("discover", "discovery/", 2.0, 1.55, STEP),
    ("Stages", "stages.py", 3.4, 1.55, VALUE),
    ("profile", "profile.py\nengine.py", 4.8, 1.55, STEP),
    ("Chain", "chain.py", 6.2, 1.55, VALUE),
    ("plan", "planner.py + cpp/", 7.6, 1.55, STEP),
    ("Plan", "ops.py", 9.0, 1.55, VALUE),
    ("runner", "pipeline.runner\nexecute.py, rng.py", 10.4, 1.55, STEP),
]
BESIDE_FLOW = [
    ("simulate", "simulate.py: the one\nreplay of the memory model", 8.1, 0.3, BESIDE),
    ("Budget", "shared_budget.py: bytes per\nchain, call and step", 5.9, 0.3, BESIDE),
    ("PlanCache", "cache.py: signature → Plan,\nstate_dict, fingerprints", 10.2, 0.3, BESIDE),
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
    fig, ax = plt.subplots(figsize=(11, 5.2))
    ax.set_xlim(-0.1, 11.2)
    ax.set_ylim(-0.15, 4.95)
    ax.axis("off")
    box(ax, "RotorConfig", "config.py: every setting,\nchecked once, frozen", 1.0, 4.45, STATE, width=1.8)
    ax.add_patch(FancyBboxPatch((2.1, 4.2), 8.9, 0.5, boxstyle="round,pad=0.02", fc=LAYER, ec="#999999", lw=0.6))
    ax.text(
        6.55,
        4.45,
        "Lightning / Fabric layer (lightning/, fabric/): strategies and wrap() take one RotorConfig\n"
        "and wrap modules in Checkpointable · callback logs · CLI wires",
        ha="center",
        va="center",
        fontsize=7.5,
        linespacing=1.3,
    )
    arrow(ax, (1.0, 4.06), (1.0, 3.5))  # the settings, given once
    arrow(ax, (4.5, 4.19), (1.5, 3.5))  # the layer wraps modules
    ax.text(1.1, 3.78, "settings", fontsize=6.2, ha="left", va="center", style="italic")
    for (label, detail, x, y, colour), nxt in zip(CALL, CALL[1:] + [None], strict=True):
        box(ax, label, detail, x, y, colour, width=1.9)
        if nxt is not None:
            arrow(ax, (x + 0.97, y), (nxt[2] - 0.97, nxt[3]))
    band(
        ax,
        0.95,
        1.45,
        "pipeline.py: plain functions, data moves one way (pipeline.prepare: a new signature's entry)",
        "#f4f4f4",
    )
    arrow(ax, (5.5, 2.7), (5.5, 2.42))  # a new signature: the chain state calls pipeline.prepare
    ax.text(5.6, 2.56, "new signature", fontsize=6.2, ha="left", va="center", style="italic")
    arrow(ax, (10.4, 1.95), (10.25, 2.7))  # the entry's runner, kept in the chain state's plan cache
    for (label, detail, x, y, colour), nxt in zip(FLOW, FLOW[1:] + [None], strict=True):
        box(ax, label, detail, x, y, colour)
        if nxt is not None:
            arrow(ax, (x + 0.62, y), (nxt[2] - 0.62, nxt[3]))
    for label, detail, x, y, colour in BESIDE_FLOW:
        box(ax, label, detail, x, y, colour, width=1.9)
    arrow(ax, (8.0, 0.7), (7.75, 1.15), "<|-|>")  # the referee scores plans
    arrow(ax, (6.4, 0.7), (7.3, 1.15))  # the budget gives the planner its bytes
    arrow(ax, (9.3, 1.15), (9.8, 0.7))  # plans are kept per signature
    out = Path(__file__).with_name("architecture.svg")
    fig.savefig(out, format="svg", bbox_inches="tight", metadata={"Date": None})
    print(out)


if __name__ == "__main__":
    main()
