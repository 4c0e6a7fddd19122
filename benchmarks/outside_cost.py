"""Where `pipeline.measure_outside` (the code around a module-level chain's run) spends its time, per part.

    PYTHONPATH=. python benchmarks/outside_cost.py --models gpt2 llama --runs 7

The Hugging Face models of `benchmarks/profile_cost.py` (GPT-2 and Llama from tiny configs, batch 4, lengths 124
then 100). Per run: a fresh `Checkpointable` ("50%") takes its first step on shape A (the first profile) and one on
shape B (a measured shape); `measure_outside` runs once in each. Timers (the main thread's CPU time) around its
parts: the run of blocks (without grad, under the probe), the loss's backward, the walks that find what the probe
excludes and what `Untouched` keeps, `Waits.peak`; the rest is the code around the run's forward. After each
measurement the same blocks rerun on the same input without grad and without the probe: their own compute, the
part of the run no probe adds. Printed: the median over `--runs` (after one untimed), in ms and in plain steps
of the same shape. Run against another checkout with `PYTHONPATH=` that checkout (the parts timed are found by
name; reading every `.grad`, `MemoryProbe._gradients`, is timed where it is called, inside the other parts).
"""

from __future__ import annotations

import argparse
import copy
import importlib
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_cost import CASES, plain_steps  # noqa: E402

from lightning_rotor import Checkpointable, pipeline  # noqa: E402

clock = time.thread_time
BLOCKS, BACKWARD, OWN, GRADS = "the blocks (no grad, probed)", "its backward", "the blocks' own compute", ".grad reads"
SETUP = [  # (module, attribute, function): the walks and bookkeeping around the measured run
    ("lightning_rotor.memory", "Excluded", "__init__"),
    ("lightning_rotor.profile", "Untouched", "__init__"),
    ("lightning_rotor.profile", "Untouched", "__enter__"),
    ("lightning_rotor.profile", "Untouched", "__exit__"),
    ("lightning_rotor.profile", None, "leaves_reached"),
    ("lightning_rotor.pipeline", "Waits", "peak"),
]


class Timers:
    """Seconds per part of the measurement running now (`inside`), none outside it."""

    def __init__(self) -> None:
        self.inside = False
        self.seconds: dict[str, float] = {}
        self.blocks: tuple[Any, Any] | None = None  # the stages and their input, to rerun bare

    def wrap(self, owner: Any, name: str, label: str) -> Callable[..., Any]:
        function = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.inside:
                return function(*args, **kwargs)
            start = clock()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + clock() - start

        setattr(owner, name, timed)
        return function


def install(timers: Timers) -> Callable[[], list[dict[str, float]]]:
    """Timers around `measure_outside` and its parts; returns what gives the parts of each measurement so far."""
    run_stages = timers.wrap(pipeline, "run_stages", BLOCKS)
    timed_stages = pipeline.run_stages

    def kept_stages(stages: Any, value: Any) -> Any:
        if timers.inside:
            timers.blocks = (list(stages), value)
        return timed_stages(stages, value)

    pipeline.run_stages = kept_stages
    timers.wrap(torch.Tensor, "backward", BACKWARD)
    memory = importlib.import_module("lightning_rotor.memory")
    timers.wrap(memory.MemoryProbe, "_gradients", GRADS)
    for module, attribute, name in SETUP:
        owner = importlib.import_module(module)
        timers.wrap(getattr(owner, attribute) if attribute else owner, name, "setup")
    measure, found = pipeline.measure_outside, []

    def measured(*args: Any, **kwargs: Any) -> Any:
        timers.seconds, timers.inside, start = {}, True, clock()
        try:
            return measure(*args, **kwargs)
        finally:
            timers.inside, total = False, clock() - start
            parts = dict(timers.seconds, all=total)
            assert timers.blocks is not None
            with torch.no_grad():
                start = clock()
                run_stages(*timers.blocks)
                parts[OWN] = clock() - start
            timers.blocks = None
            parts["the code around the run, forward"] = total - sum(
                parts.get(k, 0.0) for k in (BLOCKS, BACKWARD, "setup")
            )
            found.append(parts)

    pipeline.measure_outside = measured
    return lambda: found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt2", "llama"], choices=["gpt2", "llama"])
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    found = install(Timers())
    for name in args.models:
        plain, loss, a, b = CASES[name]()
        for run in range(args.runs + 1):
            rotor = Checkpointable(copy.deepcopy(plain), "50%")
            opt = torch.optim.SGD(rotor.parameters(), lr=0.0)
            for x in (a, b):
                opt.zero_grad(set_to_none=True)
                loss(rotor, x).backward()
            if run == 0:
                found().clear()  # untimed: what a process pays once
        steps = [statistics.median(plain_steps(plain, loss, x, 9)) for x in (a, b)]
        for shape, rows, step in (
            ("first profile", found()[0::2], steps[0]),
            ("a measured shape", found()[1::2], steps[1]),
        ):
            print(f"{name} {shape} (plain step {step * 1e3:.1f} ms), median of {args.runs}:")
            labels = ["all", BLOCKS, OWN, "the code around the run, forward", BACKWARD, "setup", GRADS]
            for label in labels:
                value = statistics.median(r.get(label, 0.0) for r in rows)
                print(f"    {label:34s} {value * 1e3:6.2f} ms {value / step:5.2f} plain steps")
        found().clear()


if __name__ == "__main__":
    main()
