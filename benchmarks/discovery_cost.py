"""What discovery costs, in plain training steps: `discover_chain` under `checkpoint_calls`, as a first step runs it.

    PYTHONPATH=. LIGHTNING_ROTOR_TEST_MODELS=/work/main/.models python benchmarks/discovery_cost.py convnext litgpt

The models of `benchmarks/profile_cost.py` (built from configs with tiny sizes, shape A), "auto" discovery of a fresh
copy each run. Per model: the median plain step of 7 (the main thread's CPU time, 1 torch thread), then discovery
timed 4 times, the first dropped (what a process pays once); printed as the median (min-max) of the other 3.
"""

from __future__ import annotations

import copy
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_cost import CASES, plain_steps  # noqa: E402 (the models and plain steps profile_cost times)

from lightning_rotor.discovery import discover_chain  # noqa: E402
from lightning_rotor.own_checkpointing import checkpoint_calls  # noqa: E402


def discovery_times(name: str, runs: int = 4) -> tuple[float, list[float]]:
    """(the median plain step, each discovery after the first) of model `name`, in seconds of CPU time."""
    plain, loss, a, _ = CASES[name]()
    step = statistics.median(plain_steps(plain, loss, a, 7))
    times = []
    for _ in range(runs):
        model = copy.deepcopy(plain)
        start = time.thread_time()
        with checkpoint_calls():
            discover_chain(model, (a,), "auto", None, sample_kwargs={})
        times.append(time.thread_time() - start)
    return step, times[1:]


def main() -> None:
    torch.set_num_threads(1)
    sys.path.append(os.environ.get("LIGHTNING_ROTOR_TEST_MODELS", str(Path(__file__).resolve().parents[1] / ".models")))
    for name in sys.argv[1:] or list(CASES):
        step, times = discovery_times(name)
        steps = [t / step for t in times]
        print(
            f"{name:9s} plain step {step * 1e3:5.1f} ms; discovery {statistics.median(steps):.1f} plain steps "
            f"({min(steps):.1f}-{max(steps):.1f})",
            flush=True,
        )


if __name__ == "__main__":
    main()
