"""What discovery costs, in plain training steps: `discover_chain` under `checkpoint_calls`, as a first step runs it.

    PYTHONPATH=. LIGHTNING_ROTOR_TEST_MODELS=/work/main/.models python benchmarks/discovery_cost.py convnext litgpt
    PYTHONPATH=. LIGHTNING_ROTOR_TEST_MODELS=/work/main/.models python benchmarks/discovery_cost.py --parts convnext

The models of `benchmarks/profile_cost.py` (built from configs with tiny sizes, shape A), "auto" discovery of a fresh
copy each run. Per model: the median plain step of 7 (the main thread's CPU time, 1 torch thread), then discovery
timed 4 times, the first dropped (what a process pays once); printed as the median (min-max) of the other 3.

`--parts`: a first step of a fresh `Checkpointable` (default settings, "50%") by parts instead, after one untimed:
timers around discovery, the profiler's walk (`_walk_chain`) and timing rounds (`_timed_rounds`), the FLOP count
(`stage_flops`), the code around a module-level chain's run (`measure_outside`) and the planner (`plan_chain`); the
rest is the step itself and what lies between. Each of 3 steps printed, in plain steps.
"""

from __future__ import annotations

import copy
import functools
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_cost import CASES, add_test_models, plain_steps, timed_step  # noqa: E402 (the models and steps profile_cost times)

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


PARTS = {  # module, function, part: what `--parts` times
    ("lightning_rotor.discovery", "discover_chain"): "discovery",
    ("lightning_rotor.profile", "_walk_chain"): "walk",
    ("lightning_rotor.profile", "_timed_rounds"): "timing rounds",
    ("lightning_rotor.chain_state", "stage_flops"): "FLOPs",
    ("lightning_rotor.pipeline", "measure_outside"): "outside",
    ("lightning_rotor.pipeline", "plan_chain"): "planner",
}


def timed_parts(spent: dict[str, float]) -> None:
    """Wrap each function of `PARTS` so that its CPU time adds to `spent[part]`."""
    import importlib

    for (module_name, function), part in PARTS.items():
        module = importlib.import_module(module_name)
        original = getattr(module, function)

        def timed(*args: Any, _original: Any = original, _part: str = part, **kwargs: Any) -> Any:
            start = time.thread_time()
            try:
                return _original(*args, **kwargs)
            finally:
                spent[_part] = spent.get(_part, 0.0) + time.thread_time() - start

        setattr(module, function, functools.wraps(original)(timed))


def first_step_parts(name: str, steps: int = 3) -> None:
    """Print `steps` first steps of model `name` by parts (`--parts`), in plain steps."""
    from lightning_rotor import Checkpointable

    plain, loss, a, _ = CASES[name]()
    step = statistics.median(plain_steps(plain, loss, a, 9))
    spent: dict[str, float] = {}
    timed_parts(spent)
    for run in range(steps + 1):
        rotor = Checkpointable(copy.deepcopy(plain), "50%")
        spent.clear()
        total = timed_step(rotor, loss, a, torch.optim.SGD(rotor.parameters(), lr=0.0))
        if run:  # the first: what a process pays once
            parts = ", ".join(f"{part} {t / step:.1f}" for part, t in spent.items())
            rest = (total - sum(spent.values())) / step
            print(f"{name:9s} plain step {step * 1e3:5.1f} ms; first step {total / step:.1f}: {parts}, rest {rest:.1f}")


def main() -> None:
    torch.set_num_threads(1)
    add_test_models()
    if sys.argv[1:2] == ["--parts"]:
        warnings.filterwarnings("ignore")
        for name in sys.argv[2:] or list(CASES):
            first_step_parts(name)
        return
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
