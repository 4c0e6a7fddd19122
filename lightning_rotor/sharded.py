"""rotor under FSDP2 (`fully_shard`): the supported order, profiling out of FSDP2's reach, one plan for all ranks.

FSDP2 keeps each unit's parameters sharded outside its forward and does its per-step work
(all-gather, reduce-scatter, reshard, the end-of-backward callback) from hooks on the units.
rotor's executor composes with those hooks (it calls the units through them, inside the root's
forward); its profiler must not fire them, and every rank must run the same schedule, since
every rank must issue the same collectives in the same order (docs/sharded.md).
"""

from __future__ import annotations

import dataclasses
import functools
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from lightning_rotor._torch_compat import (
    fsdp_hooks_passing,
    fsdp_hooks_restore,
    fsdp_in_forward,
    fsdp_state,
    fsdp_tensor_parallel,
    fsdp_unit_gathered,
    fsdp_unit_unsharded,
    in_backward,
)
from lightning_rotor.chain import Chain
from lightning_rotor.memory import MemoryProbe, storage_key

SUPPORTED_ORDER = (
    "wrap the model in Checkpointable first, then fully_shard each block, then fully_shard the "
    "Checkpointable (or a module whose forward calls it) last, as the root (docs/sharded.md)"
)


def fsdp_units(module: nn.Module) -> list[nn.Module]:
    """The `fully_shard`ed modules in `module` (itself included), in `modules()` order."""
    if not torch.distributed.is_available():
        return []
    from torch.distributed.fsdp import FSDPModule

    return [sub for sub in module.modules() if isinstance(sub, FSDPModule)]


def refuse_sharded_root(module: nn.Module) -> None:
    """`Checkpointable(m)` on an `m` that is itself `fully_shard`ed: for a chain of stages the root's forward
    (which unshards the parameters no block owns) would never run. One line naming the supported order."""
    if isinstance(module, nn.Module) and fsdp_units(module)[:1] == [module]:
        raise ValueError(
            f"Checkpointable got a fully_shard'ed {type(module).__name__}, the FSDP root: {SUPPORTED_ORDER}"
        )


def _tensor_parallel(module: nn.Module, units: list[nn.Module]) -> str | None:
    for unit in units:
        name = fsdp_tensor_parallel(unit)
        if name is not None:
            return name
    if not units:  # DTensor parameters without FSDP2: tensor parallelism alone
        from torch.distributed.tensor import DTensor

        return next((n for n, p in module.named_parameters() if isinstance(p, DTensor)), None)
    return None


def check_sharded(module: nn.Module) -> bool:
    """Whether `module` holds FSDP2 units, after refusing in one line what rotor cannot train correctly:
    tensor-parallel (DTensor) parameters, and a call outside the FSDP root's forward (the wrong order).
    Asked on each training call until the first plan exists, before any profile or optimizer step."""
    if not torch.distributed.is_available():
        return False
    units = fsdp_units(module)
    name = _tensor_parallel(module, units)
    if name is not None:
        raise NotImplementedError(
            f"rotor does not support tensor parallelism yet (parameter {name!r} is a DTensor sharded by "
            "DTensor/tensor-parallel plans): train it without rotor, or shard it with fully_shard alone"
        )
    if units and not fsdp_in_forward(units[0]):
        raise ValueError(f"rotor ran outside its FSDP root's forward: {SUPPORTED_ORDER}")
    if units:
        hook_units(module)
    return bool(units)


def _sharded_blocks(module: nn.Module) -> list[nn.Module]:
    from lightning_rotor._torch_compat import fsdp_is_root

    return [unit for unit in fsdp_units(module) if not fsdp_is_root(unit)]


def discovery_method(module: nn.Module, method: str) -> str:
    """The discovery to run under FSDP2: with blocks `fully_shard`ed, "auto" skips graph discovery (whose stages
    run the blocks' traced ops, never their calls, so FSDP2 never gathers them) for module-level discovery; a
    plain `nn.Sequential` stays "auto" (its stages are its children)."""
    plain = isinstance(module, nn.Sequential) and type(module).forward is nn.Sequential.forward
    return "modules" if method == "auto" and not plain and _sharded_blocks(module) else method


def check_discovered(module: nn.Module, kind: str, calls: list[str]) -> None:
    """Refuse in one line, before any profile or optimizer step, a discovered chain FSDP2 cannot run under rotor:

    - graph discovery with blocks `fully_shard`ed: its stages run the traced ops of the blocks, never the blocks'
      calls, so FSDP2's hooks never gather them ("mixed torch.Tensor and DTensor" in the first forward);
    - `torch.utils.checkpoint` called in the forward (not a `checkpoint_wrapper`, which rotor turns off): it
      recomputes inside rotor's plan, and under FSDP2 its recomputation saves a different number of tensors
      (`CheckpointError` in the first backward)."""
    owner = type(module).__name__
    if kind == "graph" and _sharded_blocks(module):
        raise NotImplementedError(
            f"rotor under FSDP2 needs stages that call the fully_shard'ed blocks, and graph discovery traced "
            f"{owner}'s forward through them: give discover='modules' (docs/sharded.md)"
        )
    if calls:
        raise NotImplementedError(
            f"{owner}'s forward calls torch.utils.checkpoint ({calls[0]}), which rotor cannot plan around under "
            "FSDP2: remove the call and let rotor plan (a checkpoint_wrapper or Hugging Face's "
            "gradient_checkpointing, rotor turns off) (docs/sharded.md)"
        )


GATHER_SECONDS: weakref.WeakKeyDictionary[nn.Module, float] = weakref.WeakKeyDictionary()  # per unit: last all-gather


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


@contextmanager
def outside_fsdp(module: nn.Module, sharded: bool = True) -> Iterator[list[nn.Module]]:
    """The profiler's runs (and discovery's) out of FSDP2's reach: every unit unsharded explicitly (one
    all-gather each, the same on every rank), its hooks passing calls through (no backward hook, no
    reshard, no reduce-scatter, no end-of-backward callback), then the units that were sharded resharded.

    NOTE: [rotor under FSDP2] in docs/sharded.md says why: a backward of the profiler's own through FSDP2's
    hooks would run FSDP2's end-of-step callback in the middle of the root's forward."""
    units = fsdp_units(module) if sharded else []
    gathered = [unit for unit in units if not fsdp_unit_unsharded(unit)]
    for unit in gathered:
        _synchronize()
        start = time.perf_counter()
        unit.unshard()  # type: ignore[operator]
        _synchronize()
        GATHER_SECONDS[unit] = time.perf_counter() - start
    states = {id(state): state for state in map(fsdp_state, units)}
    previous = {key: fsdp_hooks_passing(state) for key, state in states.items()}
    try:
        yield units
    finally:
        for key, state in states.items():
            fsdp_hooks_restore(state, previous[key])
        for unit in gathered:
            unit.reshard()  # type: ignore[operator]


TIME_FIELDS = frozenset({"fwd_time", "bwd_time", "bandwidth"})  # seconds, bytes/s: reduced as doubles
# the smallest is what every rank may count on: the bytes a release frees, the transfer channel's speed
MIN_FIELDS = frozenset({"out_free", "in_free", "bandwidth"})
AGREED_FIELDS = frozenset(
    {"offloadable"}
)  # per stage: the bytes every rank moves, or 0 (nothing moves) where ranks differ


def same_chain_on_ranks(chain: Chain, group: object | None = None) -> Chain:
    """`chain` with every per-stage figure reduced across the process group (max; min for the bytes a
    release frees, and for the transfer bandwidth: the slowest link); where the ranks' offloadable bytes of a
    stage differ, none (a saved part moved by one count would be charged wrongly on the others, on the device
    or on the host): every rank plans on the same numbers, so the deterministic planner gives every rank
    the same plan and every rank issues the same collectives in the same order. Sizes are reduced as
    integers (exact), times as doubles."""
    names = [
        f.name for f in dataclasses.fields(chain) if f.name not in AGREED_FIELDS and _numeric(getattr(chain, f.name))
    ]
    changes: dict[str, object] = {}
    for kind in (torch.int64, torch.float64):
        of_kind = [n for n in names if (n in TIME_FIELDS) == (kind is torch.float64)]
        flat = [(-v if n in MIN_FIELDS else v) for n in of_kind for v in _values(getattr(chain, n))]
        reduced = _max_over_ranks(flat, kind, group)
        at = 0
        for name in of_kind:
            old = getattr(chain, name)
            count = len(_values(old))
            new = [(-v if name in MIN_FIELDS else v) for v in reduced[at : at + count]]
            changes[name] = new if isinstance(old, list) else new[0]
            at += count
    changes["offloadable"] = _agreed_on_ranks(list(chain.offloadable), group)
    return dataclasses.replace(chain, **changes)  # type: ignore[arg-type]


def _agreed_on_ranks(values: list[int], group: object | None) -> list[int]:
    """Each of `values` where every rank has the same, else 0."""
    reduced = _max_over_ranks([*values, *(-v for v in values)], torch.int64, group)
    n = len(values)
    return [int(high) if high == -low else 0 for high, low in zip(reduced[:n], reduced[n:], strict=True)]


def slowest_on_ranks(bandwidth: float, group: object | None = None) -> float:
    """The transfer bandwidth every rank plans with: the slowest rank's (bytes/s), so that no rank's copies take
    longer than the plan they share gives them (each rank measures its own link, `offload=True`)."""
    return -float(_max_over_ranks([-float(bandwidth)], torch.float64, group)[0])


def _max_over_ranks(values: list, dtype: torch.dtype, group: object | None) -> list:
    import torch.distributed as dist

    if not values:
        return []
    tensor = torch.tensor(values, dtype=dtype)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor.tolist()


def _numeric(value: object) -> bool:
    if isinstance(value, list):
        return bool(value) and all(_number(v) for v in value)
    return _number(value)


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _values(value: object) -> list:
    return list(value) if isinstance(value, list) else [value]


@dataclasses.dataclass
class UnitBytes:
    """Per stage, what FSDP2 gathers for it: `units[k]` the unsharded bytes of the units inside stage k (each a
    block), `root[k]` the bytes of its parameters the root owns (gathered for the whole step)."""

    units: list[int]
    root: list[int]
    seconds: list[float]  # per stage: the all-gathers of its units, timed when the profile gathered them


def unit_bytes(stages: list[nn.Module], names: list[str], units: list[nn.Module]) -> UnitBytes:
    """What each stage gathers; a stage inside a unit (a unit spanning stages) is refused in one line: the
    unit's hooks would never run around the stage, so its parameters would stay sharded."""
    from lightning_rotor._torch_compat import fsdp_is_root, fsdp_unit_bytes

    outer = {unit for unit in units if fsdp_is_root(unit)}  # gathered from the root's forward to the step's end
    per_unit, per_root, per_seconds = [], [], []
    for stage, name in zip(stages, names, strict=True):
        inside = set(stage.modules())
        mine = [unit for unit in units if unit not in outer and unit in inside]
        # a stage holding part of a unit but not the unit (discovered inside a block, or a wrapper of its parts)
        around = [unit for unit in units if unit not in outer and unit not in inside and inside & set(unit.modules())]
        if around:
            raise NotImplementedError(
                f"rotor's stage {name!r} is inside a fully_shard'ed unit ({type(around[0]).__name__}): stages must "
                "be whole units; fully_shard whole blocks (docs/sharded.md)"
            )
        gathered = sum(fsdp_unit_bytes(unit) for unit in mine)
        total = sum(p.numel() * p.element_size() for p in stage.parameters())
        per_unit.append(gathered)
        per_root.append(max(0, total - gathered))
        per_seconds.append(sum(GATHER_SECONDS.get(unit, 0.0) for unit in mine))
    return UnitBytes(per_unit, per_root, per_seconds)


def with_fsdp_bytes(chain: Chain, gathered: UnitBytes) -> Chain:
    """`chain` with what FSDP2 adds on a rank during the step (docs/memory-model.md, "Sharded training").

    Unit bytes `U_k` (stage k's units, unsharded) and their gradients `G_k` (as many bytes):
    - the root's parameters, gathered from the root's pre-forward to the step's end: with the chain input;
    - each forward of stage k: `U_k` (`fwd_tmp`, `fwd_tmp_nograd`), and from the first unit on the largest
      unit's bytes: the latest all-gather's output buffer, kept until the next unit's all-gather;
    - its backward: `U_k` and the gradients as they are made, or, at its end, `U_k`, `G_k` and the
      reduce-scatter's copy of them (`bwd_tmp`: the larger);
    - after the last unit's reduce-scatter, FSDP2 keeps its input until the next one: the largest unit's
      bytes on every op of the stages before the last unit's;
    - from the loss on: the unit FSDP2 prefetches for the next backward, and the root's gradients of the
      stages after the first unit (`loss_value`); the first stages' root gradients and the root's final
      reduce-scatter copy: `bwd_tmp[0]`.
    """
    units, root = gathered.units, gathered.root
    first_unit = next((k for k, u in enumerate(units) if u), len(units))
    last_unit = max((k for k, u in enumerate(units) if u), default=-1)
    largest = max(units, default=0)
    kept = [largest if k < last_unit else 0 for k in range(len(units))]
    # forwards from the first unit on: the output buffer of the latest all-gather, which FSDP2 keeps until the
    # next unit's all-gather (NOTE: [measuring under FSDP2]); the stages after the last unit held it uncharged
    ahead = [largest if k >= first_unit else 0 for k in range(len(units))]
    bwd = [max(t + 2 * u, 3 * u) + r for t, u, r in zip(chain.bwd_tmp, units, kept, strict=True)]
    bwd[0] += sum(root[:first_unit]) + sum(root)
    return dataclasses.replace(
        chain,
        input_size=chain.input_size + sum(root),
        fwd_tmp=[t + u + max(r, a) for t, u, r, a in zip(chain.fwd_tmp, units, kept, ahead, strict=True)],
        fwd_tmp_nograd=[t + u + max(r, a) for t, u, r, a in zip(chain.fwd_tmp_nograd, units, kept, ahead, strict=True)],
        bwd_tmp=bwd,
        loss_value=chain.loss_value + largest + sum(root[first_unit:]),
    )


def rank_chain(chain: Chain, stages: list[nn.Module], names: list[str], module: nn.Module) -> Chain:
    """The chain every rank plans on: each forward of a stage charged its units' all-gather time (a forward of
    a resharded unit gathers it), the figures reduced across ranks (`same_chain_on_ranks`), then what FSDP2
    gathers for each stage added (`with_fsdp_bytes`)."""
    gathered = unit_bytes(list(stages), list(names), fsdp_units(module))
    timed = dataclasses.replace(chain, fwd_time=[t + s for t, s in zip(chain.fwd_time, gathered.seconds, strict=True)])
    return with_fsdp_bytes(same_chain_on_ranks(timed), gathered)


class ShardedMemoryProbe(MemoryProbe):
    """`MemoryProbe` that also counts the parameters FSDP2 holds unsharded (NOTE: [measuring under FSDP2]).

    FSDP2 makes a unit's unsharded parameters once and, at each all-gather, resizes their storages in place
    (`untyped_storage().resize_`, no dispatched op) before copying the gathered bytes into them; reshard
    resizes them back to 0. Tensor accounting alone never sees them, so a per-rank peak it measured left out
    the running unit, the prefetched one and the root's parameters. After every op, and at every mark, this
    probe adds the bytes those storages hold then (a storage also counted as an op's output is counted once).
    """

    def __init__(self, module: nn.Module, exclude: Any = (), **kwargs: Any):
        super().__init__(exclude, **kwargs)
        self._units = fsdp_units(module)

    def gathered(self) -> int:
        """Bytes of unsharded parameters FSDP2 holds now, beyond the storages already counted."""
        from lightning_rotor._torch_compat import fsdp_unsharded_tensors

        held: dict[int, int] = {}
        for unit in self._units:
            for t in fsdp_unsharded_tensors(unit):
                key = storage_key(t)
                if key not in self._live:
                    held[key] = t.untyped_storage().nbytes()
        return sum(held.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = super().__torch_dispatch__(func, types, args, kwargs)
        extra = self.gathered()
        if extra:
            self.peak = max(self.peak, self.current + extra)
            if self.record_curve:
                self.curve[-1] += extra
        return out

    def mark(self, label: str) -> None:
        super().mark(label)
        name, ops, nbytes = self.marks[-1]
        self.marks[-1] = (name, ops, nbytes + self.gathered())


_HOOKED: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # units `hook_units` has hooked


class OuterCallsPass:
    """A unit's forward hook, off for the calls a model's own loop makes to a block of an installed module-level
    chain (lightning_rotor/discovery/modules.py: block 0's call runs the whole chain, the later ones return a
    placeholder): FSDP2 must neither gather for those calls nor read the placeholder. rotor's own calls to the
    block (inside the chain, or in the backward) go through the hook."""

    def __init__(self, hook: Callable[..., Any], unit: nn.Module):
        self.hook, self.unit = hook, unit

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        patched = self.unit.__dict__.get("forward")
        run = getattr(patched, "run", None)
        if run is not None and run._state.get("installed") and not run._state.get("inside"):
            return None  # a pre-hook or forward hook returning None changes nothing
        return self.hook(*args, **kwargs)


def _outer_calls_pass(unit: nn.Module, hook: Callable[..., Any]) -> Callable[..., Any]:
    return OuterCallsPass(hook, unit)


def passes_outer_calls(hook: object) -> bool:
    """Whether a block's forward hook is off for the model's own calls (`OuterCallsPass`): it never sees the
    placeholder a module-level chain returns."""
    return isinstance(hook, OuterCallsPass)


def hook_units(module: nn.Module) -> None:
    """Once per unit but the root: FSDP2's hooks off for a module-level chain's outer calls (`OuterCallsPass`),
    and a forward inside the backward that had to gather its unit reshards it after (`_reshard_after`).

    FSDP2 leaves a unit unsharded after a forward inside a backward (it expects its backward next), so a
    recomputed `Fn`/`Fc` would hold its unit's parameters until that unit's own backward, however far.
    With the hook a rank holds, beside the running unit, only the unit FSDP2 prefetched for the next
    backward, which is what the memory model charges (`with_fsdp_bytes`); each recomputation of a unit that
    was not prefetched costs one all-gather (docs/sharded.md)."""
    from lightning_rotor._torch_compat import fsdp_is_root, fsdp_wrap_hooks

    for unit in fsdp_units(module):
        if unit in _HOOKED or fsdp_is_root(unit):
            continue
        if not fsdp_wrap_hooks(unit, functools.partial(_outer_calls_pass, unit)):
            raise NotImplementedError(
                f"rotor does not support a fully_shard unit of several modules ({type(unit).__name__}): "
                "fully_shard each block alone (docs/sharded.md)"
            )
        _HOOKED.add(unit)
        gathered: list[bool] = []  # per call in progress: whether this forward had to gather the unit

        def before(unit: nn.Module, args: object, _gathered: list[bool] = gathered) -> None:
            _gathered.append(in_backward() and not fsdp_unit_gathered(unit))

        def after(unit: nn.Module, args: object, output: object, _gathered: list[bool] = gathered) -> None:
            if _gathered.pop() and fsdp_unit_unsharded(unit):
                unit.reshard()  # type: ignore[operator]

        unit.register_forward_pre_hook(OuterCallsPass(before, unit), prepend=True)  # before FSDP2's, which gathers
        unit.register_forward_hook(OuterCallsPass(after, unit))  # after FSDP2's, which keeps it gathered in a backward
