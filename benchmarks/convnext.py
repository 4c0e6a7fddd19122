"""ConvNeXt-Atto: rotor's default discovery against the model's own per-block checkpointing and plain training.

    python benchmarks/convnext.py --image-size 96 --batch 16 --rounds 7

The model is `lightning_rotor.models.convnext.convnext_atto` (timm's layout and sizes, written
anew; timm itself is not needed). Methods: plain training; the model's own checkpointing
(`set_grad_checkpointing()`: each block under `torch.utils.checkpoint`, as timm); rotor with
default settings (`Checkpointable(model, budget)`, discovery "auto") at its smallest feasible
budget and at the own checkpointing's measured peak; rotor with `checkpoint_modules=[ConvNeXtBlock]`
at its smallest budget. Peaks: one step under `MemoryProbe(exclude=model)`, the same meter around
every method (not rotor's own accounting; exact, so one step suffices). Times: `--rounds`
interleaved rounds of one step per method after a warm-up step each; median, and spread
(max - min) / median. Prints a markdown table; every method's gradients are compared with plain's
(`torch.equal`).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from lightning_rotor import Checkpointable, MemoryProbe
from lightning_rotor.models.convnext import ConvNeXtBlock, convnext_atto
from lightning_rotor.planner import InfeasibleBudget


def step(model: torch.nn.Module, forward: Callable[[torch.Tensor], Any], x: torch.Tensor, y: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    F.cross_entropy(forward(x), y).backward()


def peak(model: torch.nn.Module, forward: Callable[[torch.Tensor], Any], x: torch.Tensor, y: torch.Tensor) -> int:
    model.zero_grad(set_to_none=True)
    with MemoryProbe(exclude=model) as probe:
        probe.track(x)
        torch.manual_seed(1)
        F.cross_entropy(forward(x), y).backward()
    return probe.peak


def smallest(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, **options: Any) -> int:
    try:
        F.cross_entropy(Checkpointable(copy.deepcopy(model), 1, **options)(x), y).backward()
    except InfeasibleBudget as err:
        return err.min_feasible
    raise RuntimeError("a 1-byte budget was accepted")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image-size", type=int, default=96)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    plain = convnext_atto(num_classes=1000)
    x = torch.randn(args.batch, 3, args.image_size, args.image_size)
    y = torch.randint(1000, (args.batch,))

    own = copy.deepcopy(plain)
    own.set_grad_checkpointing(True)
    own_peak = peak(own, own, x, y)
    methods: dict[str, tuple[torch.nn.Module, Any, str]] = {
        "plain": (plain, plain, ""),
        "own checkpointing": (own, own, ""),
    }
    for label, budget, options in (
        ("rotor default, smallest budget", smallest(plain, x, y), {}),
        ("rotor default, own's peak", own_peak, {}),
        (
            "rotor [ConvNeXtBlock], smallest",
            smallest(plain, x, y, checkpoint_modules=[ConvNeXtBlock]),
            {"checkpoint_modules": [ConvNeXtBlock]},
        ),
    ):
        rotor = Checkpointable(copy.deepcopy(plain), budget, **options)
        step(rotor, rotor, x, y)  # discovery, profile, plan
        methods[label] = (rotor, rotor, f"{len(rotor.stages)} stages, {rotor.plan.recomputed_stages} recomputed")

    peaks = {name: peak(m, f, x, y) for name, (m, f, _) in methods.items()}
    grads: dict[str, list[torch.Tensor]] = {}
    for name, (m, f, _) in methods.items():
        step(m, f, x, y)  # warm-up
        grads[name] = [p.grad.clone() for p in m.parameters()]
    times: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(args.rounds):
        for name, (m, f, _) in methods.items():
            start = time.perf_counter()
            step(m, f, x, y)
            times[name].append(time.perf_counter() - start)
    base_peak, base_time = peaks["plain"], statistics.median(times["plain"])
    print(
        f"ConvNeXt-Atto, {args.image_size}x{args.image_size}, batch {args.batch}, "
        f"{args.threads} thread(s), {args.rounds} rounds"
    )
    print("| method | peak MiB | peak / plain | median step ms | time / plain | spread | grads == plain | notes |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (_m, _, note) in methods.items():
        med = statistics.median(times[name])
        spread = (max(times[name]) - min(times[name])) / med
        same = all(torch.equal(a, b) for a, b in zip(grads["plain"], grads[name], strict=True))
        print(
            f"| {name} | {peaks[name] / 2**20:.2f} | {peaks[name] / base_peak:.3f} | {med * 1e3:.1f} | "
            f"{med / base_time:.3f} | {spread:.0%} | {same} | {note} |"
        )
    lowest_peer = min(peaks["own checkpointing"], peaks["plain"])
    print(
        f"rotor default's smallest peak / lowest peer peak: {peaks['rotor default, smallest budget'] / lowest_peer:.3f}"
    )


if __name__ == "__main__":
    main()
