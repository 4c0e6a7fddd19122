"""Where a derived shape's first step goes: the small GPT of `benchmarks/shapes.py` (`--model gpt`, `"60%"`) or a
Hugging Face GPT-2 of `benchmarks/shapes_hf.py` (`--model gpt2`, `"50%"`), default settings, on their 40 steps.

    PYTHONPATH=. python benchmarks/derived_parts.py --model gpt --runs 5
    PYTHONPATH=. python benchmarks/derived_parts.py --model gpt2 --runs 5

Per round, plain training then rotor on the same data, the rotor run with wall-clock timers wrapped around the
functions a derived shape's first step calls (nested timers counted in their own part only):

- `laws`: the chain evaluated from the traces (`ShapeLaws.chain_for`, and `ShapeLaws.call`: a module-level
  chain's call derived from its arguments); `flops`: `stage_flops` where the law gives none; `times`: derived
  by FLOPs; `budget`: the shape's bytes (`_shape_bytes`); `planner`: `pipeline.plan_chain`; `runner`:
  `PlanCache.build`; `step figures`: the call's figures in its step (`PlanCache.call_figures`, `smallest`);
  `loss window`: the first step's window over the real loss (`loss_watch.py`: its probe, its ops included).

In plain steps (the median of plain's steps 2..N), medians over rounds of the mean over derived shapes. Beside
them, per kind of step, its time above plain's same step: `derived` (a derived shape's first step),
`derived again` (the same shapes' second steps: the plan's recomputation and the executor, no first-step
cost), and their difference: what a derived shape's first step costs above its later ones.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from lightning_rotor import cache, chain_state, loss_watch, pipeline, symbolic_sizes

PARTS = ("laws", "flops", "times", "budget", "planner", "runner", "step figures", "loss window")


class Timers:
    """Seconds per (step, part); a part's time excludes the timed parts it calls."""

    def __init__(self) -> None:
        self.step = 0
        self.seconds: dict[tuple[int, str], float] = defaultdict(float)
        self._stack: list[list[float]] = []  # per open timer: [start, inner seconds]

    def wrap(self, owner: Any, name: str, part: str) -> None:
        inner = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            self._stack.append([time.perf_counter(), 0.0])
            try:
                return inner(*args, **kwargs)
            finally:
                start, nested = self._stack.pop()
                spent = time.perf_counter() - start
                self.seconds[(self.step, part)] += spent - nested
                if self._stack:
                    self._stack[-1][1] += spent

        setattr(owner, name, timed)


def install(timers: Timers) -> None:
    """Timers around the functions of a derived shape's first step (this process only)."""
    laws = symbolic_sizes.ShapeLaws
    for owner, name, part in (
        (laws, "chain_for", "laws"),
        (laws, "call", "laws"),
        (chain_state, "stage_flops", "flops"),
        (chain_state, "derived_times", "times"),
        (chain_state.ChainState, "_shape_bytes", "budget"),
        (pipeline, "plan_chain", "planner"),
        (cache.PlanCache, "build", "runner"),
        (cache.PlanCache, "call_figures", "step figures"),
        (cache.PlanCache, "smallest", "step figures"),
        (chain_state.ChainState, "_loss_watch", "loss window"),
        (loss_watch.LossWatch, "start", "loss window"),
        (loss_watch.LossWatch, "finish", "loss window"),
        (loss_watch._WindowProbe, "__torch_dispatch__", "loss window"),
        (loss_watch, "settle_watches", "loss window"),
        (chain_state, "settle_watches", "loss window"),
    ):
        timers.wrap(owner, name, part)


def gpt_setup() -> tuple[list[Any], Callable[[str], torch.nn.Module], Callable[[torch.nn.Module, Any], None]]:
    from benchmarks.shapes import batches, lm_loss, make

    args = argparse.Namespace(
        n_layer=4, n_embd=64, vocab=256, batch=4, lengths=20, steps=40, min_len=16, max_len=128,
        budget="60%", repeats=3, buckets=[32, 64, 128],
    )  # fmt: skip

    def step(model: torch.nn.Module, batch: Any) -> None:
        lm_loss(model(batch[0]), batch[1]).backward()

    return batches(args), lambda variant: make(args, variant), step


def gpt2_setup() -> tuple[list[Any], Callable[[str], torch.nn.Module], Callable[[torch.nn.Module, Any], None]]:
    from benchmarks.shapes_hf import batches, make

    def step(model: torch.nn.Module, x: Any) -> None:
        model(input_ids=x, labels=x).loss.backward()

    return batches(20, 40), lambda variant: make(variant, "gpt2"), step


def run(
    model: torch.nn.Module, data: list[Any], step: Callable[[torch.nn.Module, Any], None], timers: Timers | None
) -> tuple[list[float], list[str]]:
    """Per step, its wall time and what made its plan ("first", "derived", "measured", "" for a shape seen before)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    seconds, kinds, plans, derived = [], [], 0, 0
    for i, batch in enumerate(data):
        if timers is not None:
            timers.step = i
        start = time.perf_counter()
        opt.zero_grad()
        torch.manual_seed(i)
        step(model, batch)
        opt.step()
        seconds.append(time.perf_counter() - start)
        now, now_derived = len(getattr(model, "entries", {})), len(getattr(model, "fitted", {}))
        kinds.append("first" if i == 0 else "derived" if now_derived > derived else "measured" if now > plans else "")
        plans, derived = now, now_derived
    return seconds, kinds


def again(data: list[Any], kinds: list[str]) -> list[int]:
    """The steps that meet a shape a second time whose first step was derived."""
    shape = [tuple(torch.as_tensor(b[0] if isinstance(b, tuple) else b).shape) for b in data]
    return [i for i, k in enumerate(kinds) if k == "" and kinds[shape.index(shape[i])] == "derived"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["gpt", "gpt2"], default="gpt")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    import warnings

    warnings.filterwarnings("ignore")
    data, make, step = gpt_setup() if args.model == "gpt" else gpt2_setup()
    timers = Timers()
    install(timers)
    plain_runs, rotor_runs, parts = [], [], defaultdict(list)
    kinds: list[str] = []
    for _ in range(args.runs):
        plain_runs.append(run(make("plain"), data, step, None)[0])
        timers.seconds.clear()
        seconds, kinds = run(make("rotor"), data, step, timers)
        rotor_runs.append(seconds)
        derived = [i for i, k in enumerate(kinds) if k == "derived"]
        for part in PARTS:
            parts[part].append(statistics.mean(timers.seconds[(i, part)] for i in derived))
    plain_step = statistics.median(t for r in plain_runs for t in r[1:])

    def above(idx: list[int]) -> float:
        means = [statistics.mean(r[i] - p[i] for i in idx) for r, p in zip(rotor_runs, plain_runs, strict=True)]
        return statistics.median(means) / plain_step

    derived = [i for i, k in enumerate(kinds) if k == "derived"]
    repeat = again(data, kinds)
    print(f"{args.model}: a plain step {plain_step * 1e3:.1f} ms; {len(derived)} derived shapes, {args.runs} rounds")
    told = {part: statistics.median(v) for part, v in parts.items()}
    for part in PARTS:
        print(f"  {part:13s} {told[part] * 1e3:6.2f} ms  {told[part] / plain_step:5.3f} plain steps")
    total = sum(told.values())
    print(f"  {'parts':13s} {total * 1e3:6.2f} ms  {total / plain_step:5.3f} plain steps")
    first, later = above(derived), above(repeat)
    print(
        f"  above plain's same step: derived +{first:.3f}, derived again ({len(repeat)} steps) +{later:.3f}, "
        f"difference {first - later:+.3f} plain steps"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
