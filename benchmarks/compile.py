"""Rotor with compiled stages against compiled per-block checkpointing and torch's activation_memory_budget.

    python benchmarks/compile.py                      # inductor on the CPU, a small GPT
    python benchmarks/compile.py --backend aot_eager --steps 3   # a quick smoke run

Methods, each a copy of one GPT (lightning_rotor.models.gpt, dropout on), one forward+backward per step,
the methods in turn (one step each per round, after every method's warm-up):

- `stages`: the GPT's stages (embedding, each block, final norm, head) compiled one by one and run in
  turn, no checkpointing: what rotor's stages are, without recomputation;
- `ckpt-blocks`: the same compiled stages, `torch.utils.checkpoint` (non-reentrant) around each block;
- `rotor`: `Checkpointable(gpt, mem_limit=B, compile=...)`, where B is `ckpt-blocks`' peak measured by
  rotor's own meter (`MemoryProbe`, tensor accounting): rotor at per-block checkpointing's memory;
- `rotor xF`: the same at F times B (`--rotor-scales`): a sweep of rotor budgets, so that rotor can be
  compared with each other method at equal memory by the independent meter below;
- `amb=f`: the whole GPT compiled as one graph with `torch._functorch.config.activation_memory_budget = f`
  (the partitioner recomputes to fit a fraction f of the activations it would save).

Every step is also measured independently of both meters: the process's peak resident memory above its
resident memory before the step (`/proc/self/clear_refs` resets the peak; the script re-runs itself with
`MALLOC_MMAP_THRESHOLD_` fixed so that freed tensors leave the resident set). Prints per method the median
step time with its spread (min-max over the timed steps), the median resident peak, and whether the
gradients equal `stages`' bitwise (same seed, same parameters). Then, at equal memory by that one meter:
for each of `ckpt-blocks` and the `amb=f` methods, the fastest rotor run whose median resident peak is at
most that method's, and the ratio of their median step times. Figures in docs/compile.md.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_rotor import Checkpointable, MemoryProbe
from lightning_rotor.compile import compile_stages
from lightning_rotor.models.gpt import gpt, lm_loss
from lightning_rotor.stages import sequential_stages

MMAP_THRESHOLD = "65536"  # bytes: every tensor above it is its own mapping, returned to the system when freed


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


class ResidentPeak:
    """Peak resident bytes of the process above its resident bytes when entered."""

    def __enter__(self) -> ResidentPeak:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # resets VmHWM, the peak resident set size
        self.base = _status_kib("VmRSS")
        return self

    def __exit__(self, *exc: Any) -> None:
        self.peak = (_status_kib("VmHWM") - self.base) * 1024


class InTurn(nn.Module):
    """Compiled stages run one after the other; `checkpoint_blocks` puts torch.utils.checkpoint around blocks."""

    def __init__(self, model: nn.Sequential, compile_stage: Callable[[nn.Module], nn.Module], checkpoint_blocks: bool):
        super().__init__()
        self.model = model
        self.stages = compile_stages(sequential_stages(model), compile_stage)
        self.checkpoint_blocks = checkpoint_blocks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for name, stage in zip(self.stages.names, self.stages, strict=True):
            if self.checkpoint_blocks and name.startswith("blocks."):
                x = checkpoint(stage, x, use_reentrant=False)
            else:
                x = stage(x)
        return x


def _whole(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x)


class Whole(nn.Module):
    """The model compiled as one graph under `activation_memory_budget = fraction`.

    Each fraction compiles a function of its own code object: dynamo caches graphs per code object and
    does not guard on the budget, so two copies of one model would share the first one's graph.
    """

    def __init__(self, model: nn.Module, fraction: float, options: dict[str, Any]):
        super().__init__()
        self.model = model
        self.fraction = fraction
        code = _whole.__code__.replace(co_name=f"whole_amb_{str(fraction).replace('.', '_')}")
        self.compiled = torch.compile(types.FunctionType(code, _whole.__globals__), **options)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch._functorch.config.patch(activation_memory_budget=self.fraction):
            return self.compiled(self.model, x)


def step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, seed: int) -> tuple[float, int]:
    """Seconds and resident peak of one forward+backward."""
    model.zero_grad(set_to_none=False)  # gradients stay allocated: they are in the resident base
    torch.manual_seed(seed)
    with ResidentPeak() as resident:
        start = time.perf_counter()
        lm_loss(model(x), y).backward()
        seconds = time.perf_counter() - start
    return seconds, resident.peak


def run_all(
    models: dict[str, nn.Module], x: torch.Tensor, y: torch.Tensor, warmup: int, steps: int
) -> dict[str, dict[str, Any]]:
    """Warm every model up (compiling, profiling), then time them in turn, one step each per round:
    a burst of load on the shared machine slows one round of every method, not one method."""
    for model in models.values():
        for i in range(warmup):
            step(model, x, y, i)
    results: dict[str, dict[str, Any]] = {name: {"times": [], "peaks": []} for name in models}
    for i in range(steps):
        for name, model in models.items():
            seconds, peak = step(model, x, y, warmup + i)
            results[name]["times"].append(seconds)
            results[name]["peaks"].append(peak)
    for name, model in models.items():
        results[name]["grads"] = [p.grad.clone() for p in model.parameters()]
    return results


def probe_peak(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    """Activation peak of one step by rotor's meter (MemoryProbe; dynamo runs the step eagerly under it)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    with MemoryProbe(model) as probe:
        probe.track(x)
        lm_loss(model(x), y).backward()
    return probe.peak


def mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--steps", type=int, default=11)
    parser.add_argument("--amb", type=float, nargs="*", default=[0.5, 0.1], help="activation_memory_budget values")
    parser.add_argument(
        "--rotor-scales",
        type=float,
        nargs="*",
        default=[0.95, 1.5, 2.0, 3.0],
        help="more rotor budgets, as multiples of ckpt-blocks' MemoryProbe peak",
    )
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != MMAP_THRESHOLD:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = MMAP_THRESHOLD
        os.execv(sys.executable, [sys.executable, *sys.argv])
    torch.set_num_threads(args.threads)
    torch._dynamo.config.recompile_limit = 64  # every method compiles the same block class again
    options = {"backend": args.backend}
    torch.manual_seed(0)
    base = gpt(
        vocab_size=args.vocab,
        block_size=args.seq,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        dropout=args.dropout,
    )
    g = torch.Generator().manual_seed(1)
    x = torch.randint(args.vocab, (args.batch, args.seq), generator=g)
    y = torch.randint(args.vocab, (args.batch, args.seq), generator=g)
    print(
        f"# GPT n_layer={args.n_layer} n_embd={args.n_embd} n_head={args.n_head} seq={args.seq} "
        f"batch={args.batch} vocab={args.vocab} dropout={args.dropout}; backend={args.backend}; "
        f"torch {torch.__version__}; "
        f"{args.threads} threads; {args.steps} timed steps after {args.warmup}"
    )
    compile_stage = lambda m: torch.compile(m, **options)  # noqa: E731
    started = time.perf_counter()
    ckpt = InTurn(copy.deepcopy(base), compile_stage, True)
    for i in range(args.warmup):
        step(ckpt, x, y, i)
    budget = probe_peak(ckpt, x, y)  # per-block checkpointing's peak by rotor's meter: rotor's budget
    rotor = Checkpointable(copy.deepcopy(base), budget, compile=options)
    models: dict[str, nn.Module] = {
        "stages": InTurn(copy.deepcopy(base), compile_stage, False),
        "ckpt-blocks": ckpt,
        "rotor": rotor,
        **{
            f"rotor x{f}": Checkpointable(copy.deepcopy(base), int(f * budget), compile=options)
            for f in args.rotor_scales
        },
        **{f"amb={f}": Whole(copy.deepcopy(base), f, options) for f in args.amb},
    }
    results = run_all(models, x, y, args.warmup, args.steps)
    runs = rotor.entry.runs
    for name in ("stages", "ckpt-blocks", *(n for n in models if n.startswith("rotor"))):
        results[name]["probe"] = probe_peak(models[name], x, y)
    print(
        f"# rotor budget {mib(budget)} MiB (ckpt-blocks' MemoryProbe peak); rotor runs per stage {runs}; "
        f"predicted peak {mib(rotor.plan.peak)} MiB; total {time.perf_counter() - started:.0f} s"
    )
    print(
        "| method | step ms (median) | spread (min-max) | resident peak MiB (median) | MemoryProbe peak MiB "
        "| grads bitwise = stages |"
    )
    print("|---|---|---|---|---|---|")
    reference = results["stages"]["grads"]
    for name, r in results.items():
        ms = [t * 1e3 for t in r["times"]]
        same = all(torch.equal(a, b) for a, b in zip(r["grads"], reference, strict=True))
        probe = mib(r["probe"]) if "probe" in r else "-"
        print(
            f"| {name} | {statistics.median(ms):.1f} | {min(ms):.1f}-{max(ms):.1f} | "
            f"{mib(statistics.median(r['peaks']))} | {probe} | {same if not name.startswith('amb') else '-'} |"
        )
    equal_memory(results)


def equal_memory(results: dict[str, dict[str, Any]]) -> None:
    """For each non-rotor checkpointing method, the fastest rotor run at no more resident memory (one meter)."""
    median = {name: (statistics.median(r["times"]), statistics.median(r["peaks"])) for name, r in results.items()}
    rotors = [name for name in results if name.startswith("rotor")]
    print("\n| method | its ms | its resident MiB | fastest rotor at <= its peak | rotor ms | rotor MiB | ratio |")
    print("|---|---|---|---|---|---|---|")
    for name, (ms, peak) in median.items():
        if name == "stages" or name.startswith("rotor"):
            continue
        fits = [r for r in rotors if median[r][1] <= peak]
        best = min(fits, key=lambda r: median[r][0]) if fits else None
        if best is None:
            print(f"| {name} | {ms * 1e3:.1f} | {mib(peak)} | none | - | - | - |")
            continue
        rms, rpeak = median[best]
        print(f"| {name} | {ms * 1e3:.1f} | {mib(peak)} | {best} | {rms * 1e3:.1f} | {mib(rpeak)} | {rms / ms:.2f} |")


if __name__ == "__main__":
    main()
