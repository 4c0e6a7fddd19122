"""Variable image sizes: a ConvNeXt-Atto classifier and a diffusers U-Net trained over an epoch of three
resolutions, each resolution's batches ending on a partial one, plain training against rotor.

    PYTHONPATH=. python benchmarks/shapes_images.py --model convnext --runs 3
    PYTHONPATH=. python benchmarks/shapes_images.py --model unet --runs 3

Models, built from configs (nothing downloaded): `convnext` is timm's `convnext_atto` (`timm.create_model(...,
pretrained=False, num_classes=10)`) where timm imports, else the project's own `convnext_atto` (timm's layout
and sizes, written anew; the line printed first says which), cross-entropy on random labels; `unet` is
diffusers' `UNet2DModel` (two levels 16 and 32 wide, attention at the lower one and in the mid block, one
layer per block), noise-prediction MSE at random timesteps. The epoch: per resolution (`--sides`), `--full`
batches of `--batch` images and one of `--last`, all in a seeded random order; SGD with momentum.

Variants: `plain`; `rotor` (the default: a later shape along one size of three measured ones gets its sizes
from their traced profiles, no run, `fit_shapes`); `rotor-measure` (`fit_shapes=False`: every later shape
profiled for sizes). Per variant and round (variants interleaved in each round): the total time of steps 2..N
(the first step, which discovers and profiles the first shape, excluded), its ratio to plain's in the same
round; medians and spread ((max - min) / median) over `--runs` rounds; per kind of step (the first, a measured
shape, a derived one) its time above plain's same step, in plain steps. Then (unless `--no-check`) one untimed
pass per rotor variant: every step's activation peak by independent tensor accounting (`MemoryProbe` over the
model and the step's inputs, the shape prepared before the probe) against the budget of the plan that step
ran, and every step's gradients `torch.equal` to plain's. Prints markdown table rows.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.shapes import overhead_by_kind
from lightning_rotor import Checkpointable, MemoryProbe
from lightning_rotor.models.convnext import convnext_atto

if os.environ.get("LIGHTNING_ROTOR_TEST_MODELS"):  # diffusers (and timm) installed apart, as for the tests
    sys.path.append(os.environ["LIGHTNING_ROTOR_TEST_MODELS"])

Batch = tuple[torch.Tensor, ...]  # (images, labels) or (noisy images, timesteps, noise)


def epoch(args: argparse.Namespace) -> list[Batch]:
    """Per side, `--full` batches of `--batch` and one of `--last`, in a seeded random order."""
    sizes = [(side, args.batch) for side in args.sides for _ in range(args.full)]
    sizes += [(side, args.last) for side in args.sides]
    random.Random(0).shuffle(sizes)
    g = torch.Generator().manual_seed(0)
    if args.model == "convnext":
        return [(torch.randn(b, 3, s, s, generator=g), torch.randint(0, 10, (b,), generator=g)) for s, b in sizes]
    noisy = [(torch.randn(b, 3, s, s, generator=g), torch.randint(0, 1000, (b,), generator=g)) for s, b in sizes]
    return [(x, t, torch.randn(x.shape, generator=g)) for x, t in noisy]


def convnext() -> tuple[nn.Module, str]:
    try:
        import timm
    except ImportError:
        return convnext_atto(num_classes=10), "lightning_rotor.models.convnext.convnext_atto (timm not importable)"
    return timm.create_model("convnext_atto", pretrained=False, num_classes=10), f"timm {timm.__version__}"


def unet() -> tuple[nn.Module, str]:
    import diffusers

    model = diffusers.UNet2DModel(
        sample_size=32,
        in_channels=3,
        out_channels=3,
        block_out_channels=(16, 32),
        layers_per_block=1,
        norm_num_groups=4,
        attention_head_dim=8,
        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"),
    )
    return model, f"diffusers {diffusers.__version__} UNet2DModel"


def make(args: argparse.Namespace, variant: str) -> nn.Module:
    torch.manual_seed(0)
    model, _ = convnext() if args.model == "convnext" else unet()
    if variant == "plain":
        return model
    return Checkpointable(model, args.budget, repeats=args.repeats, fit_shapes=variant != "rotor-measure")


def loss_of(model: nn.Module, batch: Batch) -> torch.Tensor:
    if len(batch) == 2:
        return F.cross_entropy(model(batch[0]), batch[1])
    return F.mse_loss(model(batch[0], batch[1]).sample, batch[2])


def train(model: nn.Module, data: list[Batch], on_step: Callable[[int], None] | None = None) -> list[float]:
    """Per step, its wall time; `on_step(i)` after each backward (before the optimizer step)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    seconds = []
    for i, batch in enumerate(data):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        torch.manual_seed(i)
        loss_of(model, batch).backward()
        if on_step is not None:
            on_step(i)
        opt.step()
        seconds.append(time.perf_counter() - start)
    return seconds


def kind_of_step(model: nn.Module, kinds: list[str]) -> Callable[[int], None]:
    """After each step: what made its plan ("first", "derived", "measured", "" for a shape seen before)."""
    seen = {"plans": 0, "derived": 0}

    def note(i: int) -> None:
        plans, derived = len(getattr(model, "entries", {})), len(getattr(model, "fitted", {}))
        if len(kinds) == i:  # the first round names the steps (the data is the same in every round)
            new = plans > seen["plans"]
            kinds.append("first" if i == 0 else "derived" if derived > seen["derived"] else "measured" if new else "")
        seen["plans"], seen["derived"] = plans, derived

    return note


def check(args: argparse.Namespace, variant: str, data: list[Batch]) -> str:
    """Untimed: each step's measured peak within its plan's budget, each step's gradients equal to plain's."""
    plain, rotor = make(args, "plain"), make(args, variant)
    assert isinstance(rotor, Checkpointable)
    plain_grads: list[list[torch.Tensor]] = []
    train(plain, data, lambda i: plain_grads.append([p.grad.clone() for p in plain.parameters()]))
    over, unequal, worst = 0, 0, 0.0
    opt = torch.optim.SGD(rotor.parameters(), lr=0.01, momentum=0.9)
    for i, batch in enumerate(data):
        opt.zero_grad(set_to_none=True)
        inputs = batch[:1] if len(batch) == 2 else batch[:2]
        if i:  # the first step discovers the chain (a profiling step is not held to the budget)
            rotor.prepare_for(inputs[0] if len(inputs) == 1 else inputs)  # profiling is no part of the step
        torch.manual_seed(i)
        with MemoryProbe(rotor) as probe:
            probe.track(*batch)
            loss_of(rotor, batch).backward()
        budget = rotor.last_entry.plan.budget
        if i:
            over += probe.peak > budget
            worst = max(worst, probe.peak / budget)
        unequal += not all(torch.equal(p.grad, g) for p, g in zip(rotor.parameters(), plain_grads[i], strict=True))
        opt.step()
    measured = len(rotor.entries) - len(rotor.fitted)
    return (
        f"{variant}: {len(rotor.entries)} plans ({measured} measured, {len(rotor.fitted)} derived); steps 2..N "
        f"above budget {over}/{len(data) - 1} (max peak/budget {worst:.3f}); grads unequal {unequal}/{len(data)}"
    )


def overheads(runs: list[list[float]], plain: list[list[float]], kinds: list[str], step: float) -> str:
    """Per kind of step, its mean time above plain's same step, in plain steps (median over rounds)."""
    found = overhead_by_kind(runs, plain, kinds, step)
    return ", ".join(f"{n} {kind} +{extra:.2f}" for kind, n, extra in found) or "-"


def report(args: argparse.Namespace, steps: dict[str, list[list[float]]], kinds: dict[str, list[str]]) -> None:
    plain = steps["plain"]
    step = statistics.median(t for r in plain for t in r[1:])
    print(f"| {args.model} variant | steps 2..{len(plain[0])} (median) | spread | x plain (median, min-max) "
          "| per new shape: how many, plain steps above plain's each |")  # fmt: skip
    print("|---|---|---|---|---|")
    for variant, runs in steps.items():
        totals = [sum(r[1:]) for r in runs]
        med = statistics.median(totals)
        ratios = [t / sum(p[1:]) for t, p in zip(totals, plain, strict=True)]
        ratio = f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
        extra = (
            f"a plain step {step * 1e3:.0f} ms" if variant == "plain" else overheads(runs, plain, kinds[variant], step)
        )
        print(f"| {variant} | {med:.2f} s | {(max(totals) - min(totals)) / med:.0%} | {ratio} | {extra} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", choices=["convnext", "unet"], default="convnext")
    parser.add_argument("--sides", type=int, nargs="+", help="default: 64 96 128 (convnext), 32 48 64 (unet)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--full", type=int, default=3, help="full batches per side")
    parser.add_argument("--last", type=int, default=3, help="the last, partial batch of each side")
    parser.add_argument("--budget", default="60%")
    parser.add_argument("--repeats", type=int, default=3, help="timing rounds of the first shape's profile")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--variants", nargs="+", default=["rotor", "rotor-measure"])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    parser.add_argument("--no-check", action="store_true")
    args = parser.parse_args()
    args.sides = args.sides or ([64, 96, 128] if args.model == "convnext" else [32, 48, 64])
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    data = epoch(args)
    name = (convnext if args.model == "convnext" else unet)()[1]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {name}; budget {args.budget}; "
          f"steps (batch, side): {[(b[0].shape[0], b[0].shape[-1]) for b in data]}")  # fmt: skip
    steps: dict[str, list[list[float]]] = {v: [] for v in ["plain", *args.variants]}
    kinds: dict[str, list[str]] = {}
    for _ in range(args.runs):
        for variant in steps:
            model = make(args, variant)
            steps[variant].append(train(model, data, kind_of_step(model, kinds.setdefault(variant, []))))
    report(args, steps, kinds)
    if not args.no_check:
        for variant in args.variants:
            print(check(args, variant, data), flush=True)


if __name__ == "__main__":
    main()
