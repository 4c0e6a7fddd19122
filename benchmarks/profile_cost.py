"""What profiling costs, in plain training steps: the first step of a model (discovery, a timed profile, the plan)
and the first step of a later shape that is measured for sizes (a sizes-only traced profile, times from FLOPs).

    PYTHONPATH=. python benchmarks/profile_cost.py --runs 5
    PYTHONPATH=. python benchmarks/profile_cost.py --models gpt llama --runs 3

Models, all built from configs with tiny sizes (nothing downloaded): `gpt` (the small GPT of benchmarks/shapes.py,
batch 4, lengths 124 then 100), `gpt2` and `llama` (Hugging Face, as benchmarks/shapes_hf.py), `convnext`
(ConvNeXt-Atto in timm's layout, `lightning_rotor.models.convnext`, batch 4, images 64 then 48), `litgpt` (a
Llama-like litgpt `GPT`, length 64, batch 2 then 3: its traced graph fixes the length). Default settings, budget
"50%", SGD.

Per run: a fresh `Checkpointable` takes its first step on shape A, then its first step on shape B, each between
plain steps of the same model on the same shape (interleaved, so that a burst of load meets both). The cost of a
step is its time minus the median plain step's of its shape, in plain steps; printed as the median over `--runs`
(with min-max). One untimed profile runs first: what a process pays once (importing `torch._dynamo`, which the
first dispatch mode triggers) is no part of any figure. `--clock cpu` (the default) times the main thread's CPU
time, which other processes' load on a shared machine does not inflate (with one torch thread, CPU autograd runs
every op there); `--clock wall` the wall time.

`--parts` also times the parts of both steps (timers wrapped around the profiler's functions, the same clock) and
prints their medians in plain steps: the walk (the memory runs: the two recorded runs per stage measured in full,
a twin stage's recorded forward alone and what it takes from its twin, docs/memory-model.md "Twin stages", the
`in_free` run, which in a timed profile is also each stage's first timing sample, and the no-grad run, in which the
FLOPs are counted), the timing rounds, a separate FLOP count (`stage_flops`: only where the walk could not count),
the code around a module-level chain's run (`measure_outside`), discovery, the loss's measurement, the traced sizes
recorded (`ShapeLaws.add`: the trace's arrays, or a numbered shape's check against a traced one's), the planner, the
whole profile (`pipeline.profile`: the walk, the rounds, the loss), the whole new shape (`ChainState._prepare`: the
profile, the laws, the plan; the rest of the step is its own forward and backward), and Python's cyclic collector.

    PYTHONPATH=. python benchmarks/profile_cost.py --models gpt gpt2 --runs 5 --parts
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_rotor import Checkpointable

Step = Callable[[nn.Module, Any], torch.Tensor]  # the loss of a model on a batch
Case = tuple[nn.Module, Step, Any, Any]  # plain model, loss, batch of shape A, batch of shape B


def _gpt() -> Case:
    from lightning_rotor.models.gpt import gpt, lm_loss

    torch.manual_seed(0)
    model = gpt(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=64, dropout=0.1)
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randint(0, 256, (4, n), generator=g) for n in (124, 100))
    return model, lambda m, x: lm_loss(m(x), x), a, b


def _hf(kind: str) -> Case:
    import transformers

    torch.manual_seed(0)
    if kind == "gpt2":
        config: Any = transformers.GPT2Config(
            n_layer=4, n_embd=64, n_head=4, vocab_size=256, n_positions=128, use_cache=False
        )
        model: nn.Module = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(
            num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=4, vocab_size=256, max_position_embeddings=128, use_cache=False,
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randint(0, 256, (4, n), generator=g) for n in (124, 100))
    return model, lambda m, x: m(input_ids=x, labels=x).loss, a, b


def _convnext() -> Case:
    from lightning_rotor.models.convnext import convnext_atto

    torch.manual_seed(0)
    model = convnext_atto(num_classes=10)
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(4, 3, n, n, generator=g) for n in (64, 48))
    return model, lambda m, x: m(x).square().mean(), a, b


def _litgpt() -> Case:
    from litgpt.config import Config
    from litgpt.model import GPT

    config = Config(
        n_layer=6, n_embd=64, n_head=4, n_query_groups=2, vocab_size=256, padded_vocab_size=256, block_size=64,
        bias=False, norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", intermediate_size=172,
        parallel_residual=False, rotary_percentage=1.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = GPT(config)
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randint(0, 256, (n, 64), generator=g) for n in (2, 3))  # its graph fixes the length: batch sizes

    def loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(m(x).flatten(0, 1), x.flatten())

    return model, loss, a, b


CASES: dict[str, Callable[[], Case]] = {
    "gpt": _gpt,
    "gpt2": lambda: _hf("gpt2"),
    "llama": lambda: _hf("llama"),
    "convnext": _convnext,
    "litgpt": _litgpt,
}


CLOCK = {"cpu": time.thread_time, "wall": time.perf_counter}
clock = time.thread_time  # `--clock`


# (module, attribute of it, function, label) of the parts `--parts` times; nested parts are timed each on its own
PARTS = [
    ("lightning_rotor.profile", None, "_walk_chain", "walk"),
    ("lightning_rotor.profile", None, "_measure_recorded", "recorded"),
    ("lightning_rotor.profile", None, "_forward_only", "twin forwards"),
    ("lightning_rotor.profile", None, "_twin_record", "twins"),
    ("lightning_rotor.profile", None, "_in_free", "in_free"),
    ("lightning_rotor.profile", None, "_measure_nograd", "no-grad"),
    ("lightning_rotor.profile", None, "_timed_rounds", "rounds"),
    ("lightning_rotor.chain_state", None, "stage_flops", "FLOPs"),
    ("lightning_rotor.pipeline", None, "measure_outside", "outside"),
    ("lightning_rotor.chain_state", "ChainState", "_discover_chain", "discovery"),
    ("lightning_rotor.profile", None, "_loss_figures", "loss"),
    ("lightning_rotor.symbolic_sizes", "ShapeLaws", "add", "laws"),
    ("lightning_rotor.pipeline", None, "plan_chain", "plan"),
    ("lightning_rotor.pipeline", None, "profile", "profile"),
    ("lightning_rotor.chain_state", "ChainState", "_prepare", "prepare"),
]


class Parts:
    """Seconds spent in each part of `PARTS`, and in Python's cyclic collector ("GC"), since the last `take`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._gc_start = 0.0
        for module, attribute, name, label in PARTS:
            owner = importlib.import_module(module)
            owner = getattr(owner, attribute) if attribute else owner
            setattr(owner, name, self._timed(getattr(owner, name), label))
        gc.callbacks.append(self._collector)

    def _timed(self, function: Callable[..., Any], label: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = clock()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + clock() - start

        return timed

    def _collector(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_start = clock()
        else:
            self.seconds["GC"] = self.seconds.get("GC", 0.0) + clock() - self._gc_start

    def take(self) -> dict[str, float]:
        taken, self.seconds = self.seconds, {}
        return taken


def parts_line(kind: str, parts: list[dict[str, float]]) -> str:
    """Median seconds of each part over the runs (already in plain steps), in `PARTS` order, GC last."""
    labels = [label for *_, label in PARTS] + ["GC"]
    found = [(label, statistics.median(p.get(label, 0.0) for p in parts)) for label in labels]
    return f"    {kind}: " + ", ".join(f"{label} {value:.2f}" for label, value in found if value >= 0.005)


def timed_step(model: nn.Module, loss: Step, x: Any, opt: torch.optim.Optimizer) -> float:
    start = clock()
    opt.zero_grad(set_to_none=True)
    loss(model, x).backward()
    opt.step()
    return clock() - start


def plain_steps(model: nn.Module, loss: Step, x: Any, n: int) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: every run starts from the same weights
    return [timed_step(model, loss, x, opt) for _ in range(n)]


def one_run(
    plain: nn.Module, loss: Step, a: Any, b: Any, budget: str, parts: Parts | None = None
) -> tuple[float, float, dict[str, float], dict[str, float]]:
    """(first step's cost, a measured shape's cost) in plain steps of their shapes, plain steps interleaved; with
    `parts`, each step's parts too, in the same plain steps."""
    rotor = Checkpointable(copy.deepcopy(plain), budget)
    opt = torch.optim.SGD(rotor.parameters(), lr=0.0)
    before = plain_steps(plain, loss, a, 3)
    if parts is not None:
        parts.take()
    first = timed_step(rotor, loss, a, opt)
    first_parts = parts.take() if parts is not None else {}
    step_a = statistics.median(before + plain_steps(plain, loss, a, 3))
    before = plain_steps(plain, loss, b, 3)
    if parts is not None:
        parts.take()
    measured = timed_step(rotor, loss, b, opt)
    measured_parts = parts.take() if parts is not None else {}
    step_b = statistics.median(before + plain_steps(plain, loss, b, 3))
    return (
        (first - step_a) / step_a,
        (measured - step_b) / step_b,
        {k: v / step_a for k, v in first_parts.items()},
        {k: v / step_b for k, v in measured_parts.items()},
    )


def summary(values: list[float]) -> str:
    return f"+{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def add_test_models() -> None:
    """The folder of the models installed apart (litgpt, diffusers), where the tests find them, on the path."""
    sys.path.append(os.environ.get("LIGHTNING_ROTOR_TEST_MODELS", str(Path(__file__).resolve().parents[1] / ".models")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--budget", default="50%")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--clock", choices=list(CLOCK), default="cpu", help="cpu: the thread's CPU time (with 1 thread, all of a step)"
    )
    parser.add_argument("--parts", action="store_true", help="also time the parts of each step (see above)")
    args = parser.parse_args()
    global clock
    clock = CLOCK[args.clock]
    torch.set_num_threads(args.threads)
    add_test_models()
    warnings.filterwarnings("ignore")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.clock} clock")
    parts = Parts() if args.parts else None
    for name in args.models:
        plain, loss, a, b = CASES[name]()
        one_run(plain, loss, a, b, args.budget)  # untimed: what a process pays once, and warm caches
        plain_ms = statistics.median(plain_steps(plain, loss, a, 10)) * 1e3
        runs = [one_run(plain, loss, a, b, args.budget, parts) for _ in range(args.runs)]
        first, measured = summary([r[0] for r in runs]), summary([r[1] for r in runs])
        print(
            f"{name:9s} plain step {plain_ms:5.1f} ms; first profile {first} plain steps; "
            f"a measured shape {measured} (median, min-max of {args.runs})",
            flush=True,
        )
        if parts is not None:
            print(parts_line("first profile", [r[2] for r in runs]), flush=True)
            print(parts_line("a measured shape", [r[3] for r in runs]), flush=True)


if __name__ == "__main__":
    main()
