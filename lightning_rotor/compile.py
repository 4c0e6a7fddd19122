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
`"aot_eager"` the stages run the same aten ops as eager code. With inductor, a stage's
forwards without grad run its training graph (`CompiledStage.same_forward`), the kernels of
the recorded one. Dropout in a recomputed stage draws the numbers of its first run
(lightning_rotor/rng.py): the executor rewinds or replays the generators around the stage
call, and compiled code draws from them as eager code does (aot_eager: the aten random ops;
inductor: its seeds are drawn from the default generator).

The private torch APIs this needs (the compiled module's parts, the dispatch-mode stack,
dynamo's recompile limit, a lazy `torch.compiler.disable`) are in `_torch_compat.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
from torch import nn

from lightning_rotor._torch_compat import (
    allow_recompiles,
    compiled_backend_name,
    compiled_parts,
    disable_dynamo,
    dispatch_modes_active,
    optimized_module_type,
    tree_leaves,
    tree_map,
)
from lightning_rotor.stages import Stages

__all__ = [
    "COMPILE_KEYS",
    "StageCompiler",
    "compile_stages",
    "rewinds",
    "stage_compiler",
    "train_eagerly",
    "in_compiled_caller",
    "unwrap_compiled",
]

StageCompiler = Callable[[nn.Module], nn.Module]
COMPILE_KEYS = ("fullgraph", "dynamic", "backend", "mode", "options", "disable")


def is_compiled(module: nn.Module) -> bool:
    """Whether `module` is a `torch.compile`d module (without importing dynamo: seconds, when nothing compiles)."""
    optimized = optimized_module_type()
    return optimized is not None and isinstance(module, optimized)


def unwrap_compiled(module: nn.Module) -> tuple[nn.Module, StageCompiler | None]:
    """(the original module, a compiler of stages with its options) for a `torch.compile`d module;
    `(module, None)` for any other."""
    if is_compiled(module):
        original, ctx = compiled_parts(module)
        return original, lambda stage: ctx(stage)
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
        return lambda stage: cast(nn.Module, torch.compile(stage))
    if not isinstance(compile, Mapping):
        raise TypeError(f"compile= takes True, False or a dict of torch.compile arguments, got {compile!r}")
    unknown = sorted(set(compile) - set(COMPILE_KEYS))
    if unknown:
        raise ValueError(f"compile= got {unknown}, which torch.compile does not take; use {', '.join(COMPILE_KEYS)}")
    options = dict(compile)
    return lambda stage: cast(nn.Module, torch.compile(stage, **options))


class CompiledStage(nn.Module):
    """A stage run compiled, or as written while a TorchDispatchMode is active.

    NOTE: [no compiled frame under a dispatch mode] dynamo does not compile under a TorchDispatchMode
    ("non-infra torch dispatch mode present", torch 2.13 convert_frame.py), and a frame it skipped so
    stays skipped: one call of a compiled module under rotor's `MemoryProbe` (profiling, a measured
    step on the CPU) would leave every compiled module of the process running eagerly from then on.
    So under a mode the stage calls its module as written (the profiler measures the memory of that
    eager run; times are measured without a mode, compiled), and outside one the compiled module.

    `same_forward`: forwards without grad run the training graph (NOTE: [no-grad forwards through the
    training graph]); rotor turns it on for inductor (`wants_same_forward`).
    """

    def __init__(self, compiled: nn.Module, same_forward: bool = False):
        super().__init__()
        self.compiled = compiled
        self.same_forward = same_forward
        self.recorded_as: tuple[bool, ...] | None = None  # requires_grad of each input tensor when recorded

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        eager = dispatch_modes_active()
        module = compiled_parts(self.compiled)[0] if eager else self.compiled
        if not self.same_forward:
            return module(*args, **kwargs)
        if torch.is_grad_enabled():
            self.recorded_as = tuple(t.requires_grad for t in _tensors((args, kwargs)))
            return module(*args, **kwargs)
        return self._forward_as_recorded(module, eager, args, kwargs)

    def _forward_as_recorded(self, module: nn.Module, eager: bool, args: Any, kwargs: Any) -> Any:
        """A forward without grad run through the training graph, its graph (what it saved) freed on return.

        NOTE: [no-grad forwards through the training graph] inductor compiles a stage's inference graph
        (no grad) apart from its training graph's forward, with other fusions, so a recomputed or no-grad
        forward (`Fn`, `Fc`) would round otherwise than the recorded one (`Fe`), and the gradients of
        rotor would differ from those of the compiled stages run in turn. Here grad is on, each input
        tensor requires grad as it did when the stage was recorded (dynamo guards on it, and the
        partition of the joint graph depends on it), and the outputs are detached. The cost is the
        training graph's: its forward returns what it saves, which lives until the call returns, so the
        transient is that of `Fe`, not of an inference forward. Under a dispatch mode (`MemoryProbe`)
        the stage runs eagerly in the same way, keeping what autograd saves until it returns, so
        `fwd_tmp_nograd` is measured with that cost. Before the stage was ever recorded (the profiler
        measures `Fn k` before `Fe k`; a frozen stage never records), eagerly every floating input
        requires grad (charged as if recorded: the safe side) and compiled it runs its inference graph
        (a frozen stage runs it in plain training too).
        """
        leaves = _tensors((args, kwargs))
        pattern = self.recorded_as
        if pattern is None or len(pattern) != len(leaves):
            if not eager:
                return module(*args, **kwargs)
            pattern = tuple(t.is_floating_point() or t.is_complex() for t in leaves)
        flags = iter(pattern)

        def enter(v: Any) -> Any:
            return v.detach().requires_grad_(next(flags)) if isinstance(v, torch.Tensor) else v

        args, kwargs = tree_map(enter, (args, kwargs))
        with torch.enable_grad():
            out = module(*args, **kwargs)
        return tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, out)


def _tensors(value: Any) -> list[torch.Tensor]:
    return [v for v in tree_leaves(value) if isinstance(v, torch.Tensor)]


def wants_same_forward(compiler: StageCompiler, probe: nn.Module) -> bool:
    """Whether `compiler`'s stages should run their no-grad forwards through the training graph: with
    inductor (other kernels in the inference graph); other backends (aot_eager: the aten ops of eager
    code) keep the cheaper inference graph."""
    return compiled_backend_name(compiler(probe)) == "inductor"


def compile_stages(stages: Stages, compiler: StageCompiler | None) -> Stages:
    """`stages` with each stage's module compiled (the same parameters: the compiled module wraps it)."""
    if compiler is None or all(isinstance(m, CompiledStage) for m in stages):
        return stages
    _allow_recompiles(4 * len(stages))
    same = wants_same_forward(compiler, nn.Identity())
    modules = tuple(
        m if isinstance(m, CompiledStage) else CompiledStage(m if is_compiled(m) else compiler(m), same) for m in stages
    )
    return Stages(stages.names, modules, kind=stages.kind, notes=(*stages.notes, "stages compiled"), sides=stages.sides)


def _allow_recompiles(needed: int) -> None:
    """Raise dynamo's per-code recompile limit to `needed` when lower.

    NOTE: [one code object for every compiled module] every compiled module runs through one shared
    frame (torch 2.13: `external_utils.inner` for torch.nn modules, `Module._call_impl` for others),
    and dynamo keeps at most `recompile_limit` (8) graphs per code object. Stages of several classes,
    each run with and without grad (recomputations), pass 8 at once; past it dynamo runs every compiled
    module of the process eagerly, silently. Stages of one class (a transformer's blocks) share graphs.
    """
    allow_recompiles(needed)


def compiled_inner(module: nn.Module) -> nn.Module | None:
    """The module a `torch.compile`d module compiles (None when `module` is not compiled)."""
    return compiled_parts(module)[0] if is_compiled(module) else None


def rewinds(stage: nn.Module) -> bool:
    """Whether a recomputed stage replays its random numbers by rewinding the default generators.

    NOTE: [compiled stages rewind] dynamo runs a frame eagerly while a TorchDispatchMode is active
    ("non-infra torch dispatch mode present", torch 2.13 convert_frame.py), so rng.py's per-op modes
    (chosen when other non-daemon threads live, and inductor leaves one: its compile thread pool)
    would run a compiled stage eagerly, slower and with other rounding. A compiled stage is replayed
    as torch.utils.checkpoint replays: the default generators rewound to their state before the first
    run and put back after (`rng.Rewind`); exact unless another thread draws in between.
    """
    if isinstance(stage, nn.Sequential):  # compiled stages joined by `join_in_place`
        return any(isinstance(m, CompiledStage) for m in stage)
    return isinstance(stage, CompiledStage)


_eager_steps = 0  # rotor steps running now from a compiled caller (`train_eagerly`)


@disable_dynamo  # torch.compiler.disable, importing dynamo on the first call only
def train_eagerly(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """`module.forward` run eagerly under torch.compile: a graph break around rotor's training step.

    Dynamo cannot trace rotor's step (profiling, a custom autograd Function holding Python
    state, dispatch modes); outside dynamo the step runs as in eager training.
    """
    global _eager_steps
    _eager_steps += 1
    try:
        return module.forward(*args, **kwargs)
    finally:
        _eager_steps -= 1


def in_compiled_caller() -> bool:
    """Whether rotor's step runs for a compiled caller: what follows the chain is compiled code, which a
    dispatch mode would leave eager for good (NOTE: [the real loss], loss_watch.py)."""
    return _eager_steps > 0
