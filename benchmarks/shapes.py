"""Changing shapes: a GPT trained on `--lengths` distinct sequence lengths over `--steps` steps in random
order (dynamic padding), plain training against rotor.

    python benchmarks/shapes.py --n-layer 4 --n-embd 64 --batch 4 --lengths 20 --steps 40 --runs 3 --threads 1
    python benchmarks/shapes.py --device cuda --n-layer 12 --n-embd 768 --batch 8 --max-len 1024 --runs 2

Variants: `plain`; `rotor` (the default: a later shape along one size of three measured ones gets its sizes
exactly from their traced profiles, `fit_shapes`, and no run; others are profiled for sizes only, their times
derived by FLOPs); `rotor-measure` (`fit_shapes=False`: every later shape profiled for sizes); `rotor-predict`
(`predict_shapes=True` too: a shape not derived gets no run when a bound from the measured shapes' chains meets
its budget); `rotor-full` (`derive_shapes=False`, `fit_shapes=False`: every shape timed); `rotor-buckets`
(`shape_buckets={1: --buckets}`). Per variant and run: the total time of steps 2..N (the first step, which
profiles the first shape, excluded) and its ratio to plain's in the same round; printed as medians and
spread ((max - min) / median) over `--runs` rounds. Then one untimed check per rotor variant: every step's
activation peak measured by independent tensor accounting (`MemoryProbe` over the model and the step's
input) against the budget of the plan that step ran, and every step's gradients `torch.equal` to plain's; on CUDA
also each step's caching-allocator peak (`measure_step`, a target) against that budget.
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from lightning_rotor import Checkpointable, MemoryProbe
from lightning_rotor.models.gpt import gpt, lm_loss

Batches = list[tuple[torch.Tensor, torch.Tensor]]


def batches(args: argparse.Namespace) -> Batches:
    """`--steps` batches of `--lengths` distinct lengths, each length used as often, in a seeded random order."""
    rng = random.Random(0)
    lengths = sorted(rng.sample(range(args.min_len, args.max_len + 1), args.lengths))
    order = [lengths[i % len(lengths)] for i in range(args.steps)]
    rng.shuffle(order)
    g = torch.Generator().manual_seed(0)
    return [
        (
            torch.randint(0, args.vocab, (args.batch, n), generator=g).to(args.device),
            torch.randint(0, args.vocab, (args.batch, n), generator=g).to(args.device),
        )
        for n in order
    ]


def make(args: argparse.Namespace, variant: str) -> nn.Module:
    torch.manual_seed(0)
    model = gpt(
        vocab_size=args.vocab, block_size=args.max_len, n_layer=args.n_layer, n_head=4, n_embd=args.n_embd, dropout=0.1
    ).to(args.device)
    if variant == "plain":
        return model
    options: dict = {"repeats": args.repeats}
    if variant == "rotor-full":
        options["derive_shapes"] = options["fit_shapes"] = False
    if variant == "rotor-measure":
        options["fit_shapes"] = False
    if variant == "rotor-predict":
        options["predict_shapes"] = True
    if variant == "rotor-buckets":
        options["shape_buckets"] = {1: args.buckets}
    return Checkpointable(model, args.budget, **options)


def train(model: nn.Module, data: Batches, on_step: Callable[[int], None] | None = None) -> list[float]:
    """Per step, its wall time; `on_step(i)` after each backward (before the optimizer step)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    seconds = []
    for i, (x, y) in enumerate(data):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        torch.manual_seed(i)
        lm_loss(model(x), y).backward()
        if on_step is not None:
            on_step(i)
        opt.step()
        if x.is_cuda:
            torch.cuda.synchronize(x.device)
        seconds.append(time.perf_counter() - start)
    return seconds


def check(args: argparse.Namespace, variant: str, data: Batches) -> str:
    """Untimed: each step's measured peak within its plan's budget, each step's gradients equal to plain's."""
    plain, rotor = make(args, "plain"), make(args, variant)
    plain_grads: list[list[torch.Tensor]] = []
    train(plain, data, lambda i: plain_grads.append([p.grad.clone() for p in plain.parameters()]))
    over, unequal, worst, allocator = 0, 0, 0.0, []
    opt = torch.optim.SGD(rotor.parameters(), lr=0.01, momentum=0.9)
    for i, (x, y) in enumerate(data):
        opt.zero_grad(set_to_none=True)
        rotor.prepare_for(x)  # profiling is no part of the step measured
        torch.manual_seed(i)
        with MemoryProbe(rotor) as probe:
            probe.track(x)
            lm_loss(rotor(x), y).backward()
        budget = rotor.last_entry.plan.budget
        over += probe.peak > budget
        worst = max(worst, probe.peak / budget)
        unequal += not all(torch.equal(p.grad, g) for p, g in zip(rotor.parameters(), plain_grads[i], strict=True))
        if x.is_cuda:
            allocator.append(allocator_peak(rotor, x, y, i) / budget)
        opt.step()
    plans = len(rotor.entries)
    measured = plans - len(rotor.predicted) - len(rotor.fitted)
    told = (
        f"; the allocator's peak above budget {sum(r > 1 for r in allocator)} (max {max(allocator):.3f})"
        if allocator
        else ""
    )
    return (
        f"{variant}: {plans} plans ({measured} measured); steps above budget {over}/{len(data)} "
        f"(max peak/budget {worst:.3f}){told}; grads unequal {unequal}"
    )


def allocator_peak(rotor: nn.Module, x: torch.Tensor, y: torch.Tensor, step: int) -> int:
    """On CUDA, the step run again under `measure_step` (the caching allocator's peak, a target), its gradients
    kept allocated so that it sees activations only, and put back as they were."""
    grads = [p.grad.clone() for p in rotor.parameters()]
    rotor.zero_grad(set_to_none=False)
    torch.manual_seed(step)
    with rotor.measure_step() as measured:
        lm_loss(rotor(x), y).backward()
    for p, g in zip(rotor.parameters(), grads, strict=True):
        p.grad.copy_(g)
    return measured.peak


def on_new_shape(model: nn.Module, kinds: list[str]) -> Callable[[int], None]:
    """After each step: what made its plan ("first", "derived", "measured", "" for a shape seen before)."""
    seen = {"plans": 0}

    def note(i: int) -> None:
        plans = len(getattr(model, "entries", {}))
        derived = len(getattr(model, "fitted", {})) + len(getattr(model, "predicted", {}))
        if len(kinds) == i:  # the first run of a variant names the steps (the data is the same in every run)
            new = plans > seen["plans"]
            kinds.append("first" if i == 0 else ("derived" if new and derived > seen.get("derived", 0) else ""))
            if new and kinds[-1] == "":
                kinds[-1] = "measured"
        seen["plans"], seen["derived"] = plans, derived

    return note


def derivation_seconds(model: nn.Module) -> list[float]:
    """Per shape derived without a run: the seconds its chain and plan took (its profile's `seconds`)."""
    entries, derived = (
        getattr(model, "entries", {}),
        {**getattr(model, "fitted", {}), **getattr(model, "predicted", {})},
    )
    return [entries[key].profile.seconds for key in derived if key in entries]


def overhead_by_kind(
    runs: list[list[float]], plain: list[list[float]], kinds: list[str], step: float
) -> list[tuple[str, int, float]]:
    """Per kind of step (the first, a measured shape, a derived one): how many, and their mean time above plain's
    same steps in plain steps of `step` seconds (median over rounds)."""
    found = []
    for kind in ("first", "measured", "derived"):
        idx = [i for i, k in enumerate(kinds) if k == kind]
        if idx:
            extra = statistics.median(
                statistics.mean(r[i] - p[i] for i in idx) for r, p in zip(runs, plain, strict=True)
            )
            found.append((kind, len(idx), extra / step))
    return found


def overheads(runs: list[list[float]], plain: list[list[float]], kinds: list[str]) -> str:
    """Per kind of step, its mean overhead over plain's same step, in plain steps (medians over runs)."""
    step = statistics.median(t for r in plain for t in r[1:])
    parts = [
        f"{n} {kind}: +{extra:.2f} plain steps each" for kind, n, extra in overhead_by_kind(runs, plain, kinds, step)
    ]
    return "; ".join(parts) + f" (a plain step {step * 1e3:.0f} ms)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--lengths", type=int, default=20)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=128)
    parser.add_argument("--buckets", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--budget", default="60%")
    parser.add_argument("--repeats", type=int, default=3, help="timing rounds of the first shape's profile")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--variants", nargs="+", default=["rotor", "rotor-predict", "rotor-buckets", "rotor-full"])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    parser.add_argument("--no-check", action="store_true")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (steps end with a synchronisation on cuda)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    data = batches(args)
    lengths = sorted({x.shape[1] for x, _ in data})
    print(f"torch {torch.__version__}, {args.device}, {torch.get_num_threads()} threads; lengths {lengths}")
    totals: dict[str, list[float]] = {v: [] for v in ["plain", *args.variants]}
    ratios: dict[str, list[float]] = {v: [] for v in args.variants}
    steps: dict[str, list[list[float]]] = {v: [] for v in totals}
    kinds: dict[str, list[str]] = {}
    derivations: dict[str, list[float]] = {v: [] for v in totals}
    for _ in range(args.runs):
        for variant in totals:
            model = make(args, variant)
            steps[variant].append(train(model, data, on_new_shape(model, kinds.setdefault(variant, []))))
            totals[variant].append(sum(steps[variant][-1][1:]))
            derivations[variant] += derivation_seconds(model)
        for variant in args.variants:
            ratios[variant].append(totals[variant][-1] / totals["plain"][-1])
    for variant, runs in totals.items():
        med = statistics.median(runs)
        line = f"{variant:14s} steps 2..{args.steps}: median {med:.2f} s, spread {(max(runs) - min(runs)) / med:.0%}"
        if variant in ratios:
            r = ratios[variant]
            line += f"; x plain: median {statistics.median(r):.2f} (min {min(r):.2f}, max {max(r):.2f})"
        print(line, flush=True)
        if variant in ratios:
            derived = derivations[variant]
            told = f"; a derivation {statistics.median(derived) * 1e3:.1f} ms (median)" if derived else ""
            print("    " + overheads(steps[variant], steps["plain"], kinds[variant]) + told, flush=True)
    if not args.no_check:
        for variant in args.variants:
            print(check(args, variant, copy.copy(data)), flush=True)


if __name__ == "__main__":
    main()
