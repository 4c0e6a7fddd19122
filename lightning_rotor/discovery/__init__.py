"""Discovery: find the chain `a_{k+1} = F_k(a_k)` in a model as users write it.

Three producers of `Stages` (lightning_rotor/stages.py), picked by `discover=`:

- "sequential": an `nn.Sequential`'s leaves (`sequential_stages`);
- "graph": a torch.fx trace on the sample, cut where few tensors cross
  (`lightning_rotor.discovery.graph`); the chain input is the forward's tensor
  arguments, non-tensor arguments are fixed and checked on every call;
- "modules": the longest run of sibling blocks seen in one real forward
  (`lightning_rotor.discovery.modules`); the rest of the forward runs as written.

"auto" tries them in that order (an `nn.Sequential` with a plain forward is
sequential; otherwise the graph; where tracing fails or finds a value-dependent
branch in the top-level forward, the modules), and says in `Discovery.notes`
why a fallback was taken. docs/discovery.md states the guarantees and limits.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_rotor._torch_compat import tensor_version, tree_flatten, tree_map
from lightning_rotor.discovery.graph import (
    DEFAULT_MAX_CARRY,
    DiscoveryError,
    GraphChain,
    GuardFailed,
    ValueBranch,
    trace_chain,
)
from lightning_rotor.discovery.modules import ChainDiverged, ModuleRun, find_runs
from lightning_rotor.engine import no_cast_cache
from lightning_rotor.stages import Stages, sequential_stages

__all__ = [
    "DISCOVER_METHODS",
    "ChainDiverged",
    "Discovery",
    "DiscoveryError",
    "GuardFailed",
    "ValueBranch",
    "block_types",
    "discover",
    "discover_chain",
    "join_in_place",
]

DISCOVER_METHODS = ("auto", "sequential", "graph", "modules")  # what `discover=` accepts, everywhere


@dataclass
class Discovery:
    """What discovery found: the stages and how a call of the module becomes the chain input."""

    stages: Stages
    graph: GraphChain | None = None  # discover="graph": the whole forward is the chain
    run: ModuleRun | None = None  # discover="modules": only this run of blocks is the chain
    notes: list[str] = field(default_factory=list)

    @property
    def kind(self) -> str:
        return self.stages.kind


def block_types(module: nn.Module) -> tuple[type, ...]:
    """Classes worth keeping whole in a stage: user classes (not torch.nn's) with parameters, used twice or more."""
    counts: dict[type, int] = {}
    for sub in module.modules():
        cls = type(sub)
        if sub is module or cls.__module__.startswith("torch.") or not any(True for _ in sub.parameters()):
            continue
        counts[cls] = counts.get(cls, 0) + 1
    return tuple(cls for cls, n in counts.items() if n >= 2)


def join_in_place(stages: Stages, sample: Any) -> Stages:
    """`stages` with every stage that writes into its input in place joined to the stage before.

    The writes are seen on one run of the chain on `sample` (without grad; buffers and the RNG
    stream put back). A stage of its own, such a write would corrupt the checkpoint a recomputation
    starts from (NOTE: [in-place block start] in lightning_rotor/discovery/graph.py); in one stage with
    its producer it is as harmless as in the unwrapped model. The first stage has no producer to join:
    a write into the chain input stays, and `InplaceError` names it when the chain is profiled.
    """
    modules = list(stages.modules)
    saved = [(b, b.detach().clone()) for m in modules for b in m.buffers()]
    devices = [torch.device("cuda", i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    writes: list[bool] = []
    value = _copy(sample)
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad(), no_cast_cache():
            for stage in modules:
                before = [tensor_version(t) for t in _tensors(value)]
                out = stage(value)
                writes.append(before != [tensor_version(t) for t in _tensors(value)])
                value = out
    finally:
        with torch.no_grad():
            for b, copy in saved:
                b.copy_(copy)
    groups: list[list[int]] = []
    for k, w in enumerate(writes):
        if groups and w:
            groups[-1].append(k)
        else:
            groups.append([k])
    if len(groups) == len(modules):
        return stages
    names = ["+".join(stages.names[k] for k in g) for g in groups]
    joined = [modules[g[0]] if len(g) == 1 else nn.Sequential(*(modules[k] for k in g)) for g in groups]
    notes = (
        *stages.notes,
        "one stage (writes in place into the previous stage's output): "
        + ", ".join(n for n, g in zip(names, groups, strict=True) if len(g) > 1),
    )
    return Stages(tuple(names), tuple(joined), kind=stages.kind, notes=notes)


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def _copy(value: Any) -> Any:
    """Tensors copied (a forward may write into its arguments; discovery must leave the caller's as they are)."""
    return tree_map(
        lambda t: t.detach().clone().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t, value
    )


def _bind(module: nn.Module, args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    sig = inspect.signature(module.forward)
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in sig.parameters.values()):
        raise DiscoveryError(
            f"{type(module).__name__}.forward takes *args or **kwargs, which graph discovery "
            "cannot name; use discover='modules'"
        )
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _graph(
    module: nn.Module,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    checkpoint_modules: Sequence[type] | None,
    max_carry: int,
) -> Discovery:
    leaf_types = tuple(checkpoint_modules) if checkpoint_modules is not None else block_types(module)
    bound = _bind(module, args, kwargs)
    with training_modes(module):
        chain = trace_chain(
            module,
            bound,
            leaf_types=leaf_types,
            max_carry=max_carry,
            trace_into_writers=checkpoint_modules is None,
            split_floor=checkpoint_modules is None,
        )
    notes = [f"graph: {len(chain.stages)} stages, {chain.guards} shape guard(s)"]
    if chain.leaves:
        notes.append("kept whole (value-dependent branch inside): " + ", ".join(chain.leaves))
    if chain.floor_split:
        notes.append("traced into to lower the floor (they were the heaviest stages): " + ", ".join(chain.floor_split))
    notes += chain.cuts
    stages = Stages(tuple(chain.names), tuple(chain.stages), kind="graph", notes=tuple(notes))
    return Discovery(stages, graph=chain, notes=notes)


@contextlib.contextmanager
def training_modes(module: nn.Module) -> Iterator[None]:
    """Discovery in the modes training runs in: each module's own `training` flag (a block the user froze
    with `.eval()`, frozen BatchNorm statistics say, stays in eval); a module itself in eval mode is traced
    with every flag on, as stages are for training. Every flag is put back as it was, module by module."""
    modes = [(m, m.training) for m in module.modules()]
    if not module.training:
        module.train()
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode


def _modules(
    module: nn.Module, args: Sequence[Any], kwargs: dict[str, Any], checkpoint_modules: Sequence[type] | None
) -> Discovery:
    with training_modes(module):
        runs = find_runs(module, args, kwargs, checkpoint_modules=checkpoint_modules)
    if not runs:
        which = f" of {[t.__name__ for t in checkpoint_modules]}" if checkpoint_modules else ""
        raise DiscoveryError(
            f"no run of two or more sibling blocks{which} calling one another in {type(module).__name__}'s forward"
        )
    run = runs[0]
    stages = run.stages()
    return Discovery(stages, run=run, notes=list(stages.notes))


def discover_chain(
    module: nn.Module,
    sample_args: Sequence[Any] | Any,
    discover: str = "auto",
    checkpoint_modules: Sequence[type] | set[type] | None = None,
    *,
    sample_kwargs: dict[str, Any] | None = None,
    max_carry: int = DEFAULT_MAX_CARRY,
    how: str | None = None,
) -> Discovery:
    """Find the chain in `module` on a sample call `module(*sample_args, **sample_kwargs)`.

    Leaves no trace: buffers, the RNG stream and autocast's weight-cast cache are as before
    (a cast cached here would be the one the step's forward reuses: its backward node, made
    earlier, runs later and a tied weight's gradient sums in another order). Raises
    `DiscoveryError` (or `ValueBranch`, with file and line) when `discover` cannot find a
    chain. (`how=`, deprecated in 0.2.0, still works, with a DeprecationWarning.)
    """
    with no_cast_cache():
        return _discover_chain(module, sample_args, discover, checkpoint_modules, sample_kwargs, max_carry, how)


def _discover_chain(
    module: nn.Module,
    sample_args: Sequence[Any] | Any,
    discover: str,
    checkpoint_modules: Sequence[type] | set[type] | None,
    sample_kwargs: dict[str, Any] | None,
    max_carry: int,
    how: str | None,
) -> Discovery:
    method = _method(discover, how)
    if not isinstance(module, nn.Module):
        raise TypeError(f"discover needs an nn.Module, got {type(module).__name__}")
    args = _copy(tuple(sample_args) if isinstance(sample_args, (tuple, list)) else (sample_args,))
    kwargs = _copy(dict(sample_kwargs or {}))
    types = tuple(checkpoint_modules) if checkpoint_modules else None
    if types is not None and not all(isinstance(t, type) and issubclass(t, nn.Module) for t in types):
        raise TypeError(f"checkpoint_modules must be nn.Module classes, got {list(types)!r}")
    plain = module if isinstance(module, nn.Sequential) and type(module).forward is nn.Sequential.forward else None
    if method == "sequential" or (method == "auto" and plain is not None and types is None):
        if plain is None:
            raise DiscoveryError(
                f"discover='sequential' needs a plain nn.Sequential, got {type(module).__name__}; "
                "use discover='graph' or 'modules'"
            )
        stages = join_in_place(sequential_stages(plain), args[0] if len(args) == 1 else args)
        return Discovery(stages, notes=[f"sequential: {len(stages)} stages", *stages.notes])
    if method == "modules":
        return _modules(module, args, kwargs, types)
    if method == "graph":
        return _graph(module, args, kwargs, types, max_carry)
    try:
        found = _graph(module, args, kwargs, types, max_carry)
        if len(found.stages) >= 2:
            return found
        why = f"the graph gave {len(found.stages)} stage"
    except Exception as err:  # noqa: BLE001 (any failure of the trace falls back; the user's own errors recur there)
        first = str(err).splitlines()[0][:300] if str(err) else ""
        why = f"graph discovery failed: {type(err).__name__}: {first}"
    try:
        found = _modules(module, args, kwargs, types)
    except DiscoveryError as err:
        raise DiscoveryError(f"nothing to checkpoint in {type(module).__name__}: {why}, and {err}") from None
    found.notes.insert(0, why + "; module-level discovery used instead")
    return found


def discover(
    module: nn.Module,
    sample_args: Sequence[Any] | Any,
    discover: str = "auto",
    checkpoint_modules: Sequence[type] | set[type] | None = None,
    **options: Any,
) -> Stages:
    """The stages of `module`'s chain (see `discover_chain`, which also says how to call them)."""
    return discover_chain(module, sample_args, discover, checkpoint_modules, **options).stages


def _method(discover: str, how: str | None) -> str:
    """The discovery method asked for; `how=` (deprecated in 0.2.0) still works, with a DeprecationWarning."""
    if how is not None:
        warnings.warn(
            "discover_chain(how=...) is deprecated since 0.2.0: give the method as discover=",
            DeprecationWarning,
            stacklevel=3,
        )
        discover = how
    if discover not in DISCOVER_METHODS:
        raise ValueError(f"discover={discover!r} is not a discovery method; use one of {', '.join(DISCOVER_METHODS)}")
    return discover
