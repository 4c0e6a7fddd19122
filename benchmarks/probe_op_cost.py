"""What the memory probe costs per op: one stage's `Fe`+`B` bare, under a pass-through dispatch mode, under
`MemoryProbe` (as a profile makes it: `Excluded(..., by_autograd=True)`) and under the probe traced (the first
profile's default, lightning_rotor/size_trace.py), in microseconds an op above the bare run.

    PYTHONPATH=. python benchmarks/probe_op_cost.py --models litgpt gpt --stage 1
    cd /other/checkout && PYTHONPATH=. python /this/checkout/benchmarks/probe_op_cost.py   # another checkout's probe

The stages are those the first step of `benchmarks/profile_cost.py`'s models profiles (caught at `profile_chain`);
stage `--stage` runs on its input as the profile makes it (the stages before it, without grad). Each variant is
timed `--repeats` times, interleaved, by the main thread's CPU time; the fastest run counts. The ops are those the
dispatch mode sees (forward and backward).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_cost import CASES, add_test_models, timed_step  # noqa: E402

import lightning_rotor.pipeline as pipeline  # noqa: E402
from lightning_rotor import Checkpointable  # noqa: E402
from lightning_rotor._torch_compat import TorchDispatchMode  # noqa: E402
from lightning_rotor.engine import detach_value, tensors_of  # noqa: E402
from lightning_rotor.memory import Excluded, MemoryProbe  # noqa: E402
from lightning_rotor.size_trace import traced  # noqa: E402


class PassThrough(TorchDispatchMode):
    """Every op through Python's dispatch, nothing else."""

    ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        PassThrough.ops += 1
        return func(*args, **(kwargs or {}))


def profiled_stages(name: str) -> tuple[list[nn.Module], Any]:
    """The stages and chain input the first step of model `name` profiles."""
    plain, loss, a, _ = CASES[name]()
    caught: list[tuple[list[nn.Module], Any]] = []
    profile_chain = pipeline.profile_chain

    def catch(stages: Any, sample: Any, **kwargs: Any) -> Any:
        caught.append((list(stages), sample))
        return profile_chain(stages, sample, **kwargs)

    pipeline.profile_chain = catch  # type: ignore[assignment]
    try:
        rotor = Checkpointable(copy.deepcopy(plain), "50%")
        timed_step(rotor, loss, a, torch.optim.SGD(rotor.parameters(), lr=0.0))
    finally:
        pipeline.profile_chain = profile_chain
    return caught[0]


def variants(stage: nn.Module, value: Any) -> dict[str, Callable[[], None]]:
    def run() -> None:
        out = tensors_of(stage(detach_value(value, True)))
        roots = [t for t in out if t.requires_grad]
        torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])
        for p in stage.parameters():
            p.grad = None

    exclude = Excluded([stage], by_autograd=True)

    def passing() -> None:
        with PassThrough():
            run()

    def probed() -> None:
        with exclude, MemoryProbe(exclude) as probe:
            probe.track(value)
            run()

    def probed_traced() -> None:
        with traced():
            probed()

    return {"bare": run, "pass-through": passing, "probe": probed, "probe traced": probed_traced}


def stage_arguments(description: str, repeats: int) -> argparse.Namespace:
    """`--models`, `--stage` and `--repeats` of a benchmark of one stage's ops, the process set up for it (one
    thread, the models installed apart on the path, warnings off)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--models", nargs="+", default=["litgpt", "gpt"], choices=list(CASES))
    parser.add_argument("--stage", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=repeats)
    args = parser.parse_args()
    torch.set_num_threads(1)
    add_test_models()
    warnings.filterwarnings("ignore")
    return args


def main() -> None:
    args = stage_arguments(__doc__.splitlines()[0], repeats=30)
    for name in args.models:
        stages, value = profiled_stages(name)
        with torch.no_grad():
            for stage in stages[: args.stage]:
                value = stage(value)
        runs = variants(stages[args.stage], value)
        PassThrough.ops = 0
        runs["pass-through"]()
        ops = PassThrough.ops
        seconds: dict[str, list[float]] = {label: [] for label in runs}
        for _ in range(args.repeats):
            for label, run in runs.items():
                start = time.thread_time()
                run()
                seconds[label].append(time.thread_time() - start)
        bare = min(seconds["bare"])
        print(f"{name} stage {args.stage}: {ops} ops, bare {bare * 1e3:.3f} ms", flush=True)
        for label, values in seconds.items():
            above = (min(values) - bare) / ops * 1e6
            print(f"    {label:13s} {min(values) * 1e3:7.3f} ms, {above:5.2f} us an op above bare")


if __name__ == "__main__":
    main()
