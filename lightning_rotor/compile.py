"""torch.compile with rotor: rotor outside, compile inside.

Rotor needs the chain's stages as separate calls (it runs, frees and recomputes them
one by one), so a chain is never compiled as one graph. Instead:

- `Checkpointable(torch.compile(m))` (or `compile=True`, or a dict of `torch.compile`
  keyword arguments): the chain is discovered on the original module `m`, and each
  stage's callable is compiled with the same options. The profiler measures and the
  executor runs the compiled stages, so the plan is made for what actually runs.
- `torch.compile(Checkpointable(m))`, or a compiled model holding a `Checkpointable`:
  dynamo breaks the graph at rotor's training forward, which runs eagerly
  (`train_eagerly`); the rest of the model is compiled. Evaluation and `no_grad`
  calls are compiled as usual.

NOTE: [compiled stages and equality] A compiled stage is bitwise equal to itself run
again (same graph, same kernels), but not necessarily to the same code run eagerly or
compiled as part of a bigger graph (other fusions round differently). So rotor with
compiled stages is compared with the *same compiled stages* run one after the other
without recomputation, the "plain training" of this setup. With `backend="eager"` or
`"aot_eager"` the stages run the same aten ops as eager code. Dropout in a recomputed
stage draws the numbers of its first run (lightning_rotor/rng.py): the executor rewinds
or replays the generators around the stage call, and compiled code draws from them as
eager code does (aot_eager: the aten random ops; inductor: its seeds are drawn from the
default generator).

Private torch API used here (torch 2.13): `OptimizedModule` and its `dynamo_ctx`, the
context that compiled it, applied again to each stage so that every option (backend,
mode, options, dynamic, fullgraph) is the user's own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch._dynamo.eval_frame import OptimizedModule

from lightning_rotor.stages import Stages

__all__ = ["COMPILE_KEYS", "StageCompiler", "compile_stages", "stage_compiler", "train_eagerly", "unwrap_compiled"]

StageCompiler = Callable[[nn.Module], nn.Module]
COMPILE_KEYS = ("fullgraph", "dynamic", "backend", "mode", "options", "disable")


def unwrap_compiled(module: nn.Module) -> tuple[nn.Module, StageCompiler | None]:
    """(the original module, a compiler of stages with its options) for a `torch.compile`d module;
    `(module, None)` for any other."""
    if isinstance(module, OptimizedModule):
        ctx = module.dynamo_ctx
        return module._orig_mod, lambda stage: ctx(stage)
    return module, None


def stage_compiler(
    compile: bool | Mapping[str, Any] | None, found: StageCompiler | None = None
) -> StageCompiler | None:
    """The compiler of stages for `compile=` (False/None: none, True: torch.compile's defaults,
    a dict: torch.compile's keyword arguments), or `found` on an already compiled module."""
    if compile is None or compile is False:
        return found
    if found is not None:
        raise ValueError(
            "the module is compiled already (torch.compile(m)); its stages are compiled with its "
            "options: leave compile= out, or pass the uncompiled module with compile="
        )
    if compile is True:
        return torch.compile
    if not isinstance(compile, Mapping):
        raise TypeError(f"compile= takes True, False or a dict of torch.compile arguments, got {compile!r}")
    unknown = sorted(set(compile) - set(COMPILE_KEYS))
    if unknown:
        raise ValueError(f"compile= got {unknown}, which torch.compile does not take; use {', '.join(COMPILE_KEYS)}")
    options = dict(compile)
    return lambda stage: torch.compile(stage, **options)


def compile_stages(stages: Stages, compiler: StageCompiler | None) -> Stages:
    """`stages` with each stage's module compiled (the same parameters: an OptimizedModule wraps it)."""
    if compiler is None or all(isinstance(m, OptimizedModule) for m in stages):
        return stages
    modules = tuple(m if isinstance(m, OptimizedModule) else compiler(m) for m in stages)
    return Stages(stages.names, modules, kind=stages.kind, notes=(*stages.notes, "stages compiled"))


def compiled_inner(module: nn.Module) -> nn.Module | None:
    """The module a `torch.compile`d module compiles (None when `module` is not compiled)."""
    return module._orig_mod if isinstance(module, OptimizedModule) else None


@torch.compiler.disable
def train_eagerly(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """`module.forward` run eagerly under torch.compile: a graph break around rotor's training step.

    Dynamo cannot trace rotor's step (profiling, a custom autograd Function holding Python
    state, dispatch modes); outside dynamo the step runs as in eager training.
    """
    return module.forward(*args, **kwargs)
