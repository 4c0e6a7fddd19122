"""Every private torch API lightning_rotor uses, each behind one name.

Each entry says why rotor needs it; all were checked against torch `TORCH_CHECKED`.
When torch moves one, this file is the one place to change. Other modules import
these names and never reach into `torch._*`, `torch.utils._*` or private attributes.

Not here, on purpose: `nn.Module`'s own registries (`_modules`, `_parameters`,
`_buffers`, `_non_persistent_buffers_set`) and the `_apply` override in
checkpointable.py and stages.py. They are the documented-in-source extension points
every module wrapper uses (`torch.nn.utils.parametrize` too), not engine internals.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn
from torch.autograd.graph import GradientEdge, _engine_run_backward
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten
from torch.utils.flop_counter import FlopCounterMode, _FlopCounterMode

__all__ = [
    "TORCH_CHECKED",
    "StorageWeakRef",
    "TorchDispatchMode",
    "accumulated_leaf",
    "active_ddp_reduced",
    "activation_memory_budget",
    "allow_recompiles",
    "compiled_parts",
    "disable_dynamo",
    "dispatch_modes_active",
    "disabled_torch_function",
    "optimized_module_type",
    "allocation_bytes",
    "backward_is_full",
    "ddp_pre_forward",
    "checkpoint_calls_watched",
    "fsdp_hooks_passing",
    "fsdp_hooks_restore",
    "fsdp_in_forward",
    "in_backward",
    "fsdp_is_root",
    "fsdp_state",
    "fsdp_tensor_parallel",
    "fsdp_unit_bytes",
    "fsdp_wrap_hooks",
    "fsdp_unit_gathered",
    "fsdp_unit_unsharded",
    "forward_hooks",
    "is_python_backward",
    "own_hooks",
    "GlobalFlops",
    "free_weak_storage",
    "has_post_accumulate_grad_hooks",
    "is_accumulate_grad",
    "is_norm",
    "is_node_of",
    "make_subclass",
    "op_arguments",
    "reset_compiled",
    "run_backward",
    "storage_id",
    "storage_use_count",
    "tensor_version",
    "tree_flatten",
    "tree_leaves",
    "tree_map",
    "tree_unflatten",
    "weak_storage",
    "weak_storage_expired",
    "dispatch_mode_stack",
    "drop_dispatch_mode",
    "innermost_dispatch_mode",
    "view_base",
]

TORCH_CHECKED = "2.13.0"  # the torch version every entry below was checked against

# -- values -------------------------------------------------------------------------------------
# Pytrees (torch.utils._pytree): stage values are nested tuples/lists/dicts of tensors, flattened
# the way torch's own autograd.Function and checkpoint flatten them. No public pytree module in 2.13.0.
# (tree_flatten, tree_leaves, tree_map, tree_unflatten are re-exported above.)
#
# StorageWeakRef (torch.multiprocessing.reductions, undocumented): a weak reference to the C++
# storage itself; `untyped_storage()` makes a new Python wrapper per call, so a plain weakref would
# die with the wrapper. MemoryProbe sees a storage die through it, and the profiler whether a
# stage's graph kept an output's storage. Re-exported above.


# `StorageWeakRef(...).expired()` is a Python method around this C call, taking the reference's `cdata`;
# MemoryProbe asks it for every live storage before every op, so it calls it directly.
weak_storage_expired: Callable[[int], bool] = torch.UntypedStorage._expired  # type: ignore[assignment]


# A weak reference's handle without its Python object (what `StorageWeakRef` holds as `cdata`): MemoryProbe makes one
# per counted storage, for every op's new output, and frees it itself (`free_weak_storage`, once per handle) when
# the storage is seen dead or the probe closes: making and dropping a `StorageWeakRef` costs 10x the C calls.
def weak_storage(storage: torch.UntypedStorage) -> int:
    """A new weak reference to `storage`'s C++ storage, as a handle; free it with `free_weak_storage`, once."""
    return storage._weak_ref()  # type: ignore[return-value]  # an int: the stubs say a storage


free_weak_storage: Callable[[int], None] = torch.UntypedStorage._free_weak_ref


def storage_id(storage: torch.UntypedStorage) -> int:
    """One key per storage, shared by all its views and all Python objects wrapping it.

    `UntypedStorage._cdata` is the address of the C++ StorageImpl. `data_ptr()` is no key:
    every storage of zero bytes has 0, and the executor empties storages in place.
    """
    return storage._cdata


def storage_use_count(storage: torch.UntypedStorage) -> int:
    """References to the C++ storage (tensors, Python storage objects), `storage` itself included.

    The executor frees a consumed gradient in place only when nothing else holds its storage,
    and the profiler tells from it whether a stage's graph keeps its input. No public equivalent.
    """
    return torch._C._storage_Use_Count(storage._cdata)


def view_base(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor `t` is a view of (None when it is none): `Tensor._base`, undocumented but stable."""
    return t._base


def tensor_version(t: torch.Tensor) -> int:
    """The in-place write counter autograd checks saved tensors against (`Tensor._version`).

    Rotor reads it to catch a stage writing into a kept input, and to find buffers a stage changed.
    """
    return t._version


# -- autograd graph -----------------------------------------------------------------------------
_ACCUMULATE_GRAD = "torch::autograd::AccumulateGrad"  # the name() of the node that stores a leaf's .grad


def is_accumulate_grad(node: Any) -> bool:
    """Is `node` a leaf's gradient accumulator? Its class is not exported; its `name()` is fixed in C++."""
    return node.name() == _ACCUMULATE_GRAD


def accumulated_leaf(node: Any) -> torch.Tensor | None:
    """The leaf an accumulator node stores `.grad` into (`AccumulateGrad.variable`, undocumented); else None."""
    return getattr(node, "variable", None)


def is_node_of(node: Any, function: type[torch.autograd.Function]) -> bool:
    """Was `node` added to a graph by the custom autograd Function `function`? (`Function._backward_cls`)."""
    return isinstance(node, function._backward_cls)


def run_backward(roots: Sequence[GradientEdge], grads: Sequence[torch.Tensor]) -> None:
    """Backpropagate `grads` from graph edges, accumulating into `.grad`, as `Tensor.backward` does.

    NOTE: [the engine itself] `torch.autograd.backward` accepts edges too, but first re-checks
    every gradient's shape against its root (`_make_grads`), which δ_{k+1} made for those very
    outputs never fails, at a cost that shows on short stages. `_engine_run_backward` is what it
    calls next. Positional: keep_graph=False, create_graph=False, inputs=().
    """
    _engine_run_backward(tuple(roots), tuple(grads), False, False, (), allow_unreachable=True, accumulate_grad=True)


def backward_is_full() -> bool:
    """False while the engine runs a backward that wants only some gradients.

    `autograd.grad` and `backward(inputs=...)` clear it; the plan's backward, which writes every
    stage's `.grad`, cannot serve them (torch.utils.checkpoint refuses them the same way).
    """
    return torch.autograd._is_checkpoint_valid()


def has_post_accumulate_grad_hooks(p: torch.Tensor) -> bool:
    """Has `p` hooks from `register_post_accumulate_grad_hook`? (kept in `Tensor._post_accumulate_grad_hooks`)."""
    return bool(getattr(p, "_post_accumulate_grad_hooks", None))


# -- modules ------------------------------------------------------------------------------------
def is_norm(module: nn.Module) -> bool:
    """A BatchNorm or InstanceNorm, which may hold running statistics (`nn.modules.batchnorm._NormBase`).

    A recomputation must not update them a second time; no public base class covers both families.
    """
    return isinstance(module, nn.modules.batchnorm._NormBase)


def own_hooks(module: nn.Module) -> list[Callable[..., Any]]:
    """`module`'s own forward (pre-)hooks and backward (pre-)hooks, not the global ones: no registry has a public
    accessor (`_forward_pre_hooks`, `_forward_hooks`, `_backward_pre_hooks`, `_backward_hooks`)."""
    found: list[Callable[..., Any]] = []
    for name in ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks"):
        found.extend(getattr(module, name, {}).values())
    return found


def is_python_backward(node: Any) -> bool:
    """Is autograd graph node `node` a custom autograd Function's, whose backward is Python code? Its class
    (`torch.autograd.function.BackwardCFunction`) is not in torch's documented API."""
    return isinstance(node, torch.autograd.function.BackwardCFunction)


def forward_hooks(module: nn.Module) -> list[Callable[..., Any]]:
    """The forward hooks that would see `module`'s output: its own (`_forward_hooks`) and the global ones.

    Module-level discovery refuses such a hook on a block inside a chain, where the block's output is
    never made, unless it is a recording hook of the model's that records nothing in this call.
    Neither registry has a public accessor (`nn.modules.module._global_forward_hooks`).
    """
    return [*module._forward_hooks.values(), *nn.modules.module._global_forward_hooks.values()]


def make_subclass(cls: type[torch.Tensor], data: torch.Tensor) -> torch.Tensor:
    """`data` as an instance of the tensor subclass `cls`, without a copy (`Tensor._make_subclass`,
    as `nn.Parameter` makes itself)."""
    return torch.Tensor._make_subclass(cls, data)


def ddp_pre_forward() -> Callable:
    """What DDP runs before the module's forward (`DistributedDataParallel._pre_forward`).

    Its allocations (the reducer's gradient buckets) are not activations: `MemoryProbe` leaves out
    what this function allocates, found by its code object on the Python stack.
    """
    return DistributedDataParallel._pre_forward


def active_ddp_reduced() -> tuple[int, list[torch.Tensor]] | None:
    """The DDP whose forward is running (by id) and the parameters its C++ reducer waits for, or None.

    DDP sets `_active_ddp_module` around its module's forward (`_inside_ddp_forward`, for dynamo) and
    lists the parameters it reduces in `_module_parameters`. Its C++ reducer's hooks on the parameters'
    accumulators are invisible from Python; this is the one sign of them. The Python reducer
    (`_use_python_reducer`) sets neither, and hooks with `register_post_accumulate_grad_hook`, which
    `has_post_accumulate_grad_hooks` sees.
    """
    ddp = DistributedDataParallel._get_active_ddp_module()
    if ddp is None:
        return None
    reduced = getattr(ddp, "_module_parameters", None)
    return id(ddp), reduced if isinstance(reduced, list) else list(ddp.parameters())


# -- dispatch -----------------------------------------------------------------------------------
# TorchDispatchMode (torch.utils._python_dispatch, re-exported above): a hook on every aten op with
# its outputs and schema. MemoryProbe counts storages with it; the RNG replay reroutes random ops.
# torch has no public dispatch-mode class in 2.13.0 (torch.overrides.TorchFunctionMode sits above
# autograd and never sees the backward's ops).


# `__torch_function__ = disabled_torch_function` on a class says "none": torch's argument parser then never
# takes an instance for a tensor-like object (which it would let stand for a whole argument list), and
# dispatches on it only through a mode. Graph discovery's traced integers use it
# (lightning_rotor/discovery/graph.py, `_SizeProxy`); `torch._C._disabled_torch_function_impl` has no public name.
disabled_torch_function: Callable[..., Any] = torch._C._disabled_torch_function_impl


def op_arguments(op: Any) -> Sequence[Any]:
    """The arguments of an aten `OpOverload` (`name`, `alias_info`): `op._schema.arguments`.

    The RNG replay finds the overload of a random op that takes a `generator`, and whether the op
    writes into its first argument; there is no public accessor to an overload's schema.
    """
    return op._schema.arguments


# -- torch.compile ------------------------------------------------------------------------------
def optimized_module_type() -> type | None:
    """`torch.compile`'s module wrapper class, or None while dynamo was never imported (importing it
    takes seconds, and a module cannot be compiled before it is)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return None if eval_frame is None else eval_frame.OptimizedModule


def compiled_parts(module: nn.Module) -> tuple[nn.Module, Callable[[nn.Module], nn.Module]]:
    """(the original module, the context that compiled it) of a `torch.compile`d module.

    `OptimizedModule._orig_mod` and `.dynamo_ctx`: applying the same context to each stage keeps
    every option the user gave (backend, mode, options, dynamic, fullgraph).
    """
    original: nn.Module = module._orig_mod  # type: ignore[assignment]
    ctx: Callable[[nn.Module], nn.Module] = module.dynamo_ctx  # type: ignore[assignment]
    return original, ctx


def compiled_backend_name(module: nn.Module) -> str | None:
    """The backend name of a `torch.compile`d module ("inductor", "aot_eager", ...), None when unknown.

    Follows `_torchdynamo_orig_backend` from `.dynamo_ctx.callback` to the wrapper `torch.compile` made of
    the backend (torch 2.13: `_compiler_name` on it); a custom callable backend has no such name.
    """
    fn: Any = getattr(getattr(module, "dynamo_ctx", None), "callback", None)
    for _ in range(8):
        if fn is None:
            return None
        name = getattr(fn, "_compiler_name", None)
        if isinstance(name, str):
            return name
        fn = getattr(fn, "_torchdynamo_orig_backend", None) or getattr(fn, "_inner_convert", None)
    return None


def dispatch_modes_active() -> bool:
    """Whether a TorchDispatchMode is active (`torch._C._len_torch_dispatch_stack`): dynamo does not
    compile under one, and a frame it skipped so stays skipped (compile.py, `CompiledStage`)."""
    return bool(torch._C._len_torch_dispatch_stack())


def dispatch_mode_stack() -> list[Any]:
    """This thread's dispatch modes, innermost last (`_python_dispatch._get_current_dispatch_mode_stack`)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return list(_get_current_dispatch_mode_stack())


def innermost_dispatch_mode() -> Any:
    """The dispatch mode on top of this thread's stack (`_get_current_dispatch_mode`), None where there is none."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return _get_current_dispatch_mode()


def drop_dispatch_mode(mode: Any) -> None:
    """Take `mode` off this thread's dispatch-mode stack wherever it sits, the modes above it kept in order
    (`_pop_mode`, `_push_mode`). For a mode left in a backward node (loss_watch.py): the autograd engine puts
    back the stack a node started with, so the mode is back on the caller's stack after the backward. Its
    `with` flags were restored when it was left, so only the stack entry goes."""
    from torch.utils._python_dispatch import _pop_mode, _push_mode

    if not any(m is mode for m in dispatch_mode_stack()):
        return
    above = []
    while (top := _pop_mode()) is not mode:
        above.append(top)
    for m in reversed(above):
        _push_mode(m)


def allow_recompiles(needed: int) -> None:
    """Raise dynamo's per-code recompile limit (`torch._dynamo.config.recompile_limit`) to `needed`."""
    import torch._dynamo

    if torch._dynamo.config.recompile_limit < needed:
        torch._dynamo.config.recompile_limit = needed


def disable_dynamo(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`torch.compiler.disable`, importing dynamo on the first call rather than at ours
    (`torch._disable_dynamo`, a graph break around `fn`)."""
    return torch._disable_dynamo(fn)


# -- torch.compile and the profiler (bench only) ------------------------------------------------
def activation_memory_budget(fraction: float) -> Any:
    """A context in which `torch.compile` keeps at most `fraction` of the activations.

    The bench compares rotor with it: `torch._functorch.config.activation_memory_budget`.
    """
    import torch._functorch.config as functorch_config

    return functorch_config.patch(activation_memory_budget=fraction)


def reset_compiled() -> None:
    """Forget every compiled graph (`torch._dynamo.reset`), without importing dynamo when it was never used."""
    if "torch._dynamo" in sys.modules:
        sys.modules["torch._dynamo"].reset()


def allocation_bytes(prof: Any) -> Iterator[int]:
    """The signed sizes of a finished `torch.profiler.profile`'s allocation records, in time order.

    The public `FunctionEvent` view folds allocations into ops; the raw kineto records
    (`prof.profiler.kineto_results`, events named "[memory]") keep each one with its time.
    """
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    return (e.nbytes() for e in events)


# -- FSDP2 (torch.distributed.fsdp.fully_shard), for lightning_rotor/sharded.py --------------------
# rotor's profiler runs the stages and backwards of its own before the step's: those runs must leave
# FSDP2's per-step bookkeeping untouched (docs/sharded.md, NOTE: [rotor under FSDP2]). FSDP2 has no
# public "run this unit without its hooks"; its hooks pass a call through when the unit's state is
# PRE_BACKWARD (what they do for activation-checkpointing recomputation), and `FSDPParam.is_dtensor`
# says a parameter was a DTensor (tensor parallelism) before FSDP2 sharded it.


def fsdp_state(unit: nn.Module) -> Any:
    """The `FSDPState` of a `fully_shard`ed module (`FSDPModule._get_fsdp_state`)."""
    return unit._get_fsdp_state()  # type: ignore[operator]


def fsdp_hooks_passing(state: Any) -> Any:
    """Make `state`'s forward hooks pass calls through (unshard only if needed, no reshard, no backward
    hooks): its training state set to PRE_BACKWARD. Returns the previous state, for `fsdp_hooks_restore`."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    previous = state._training_state
    state._training_state = TrainingState.PRE_BACKWARD
    return previous


def fsdp_hooks_restore(state: Any, previous: Any) -> None:
    state._training_state = previous


def fsdp_unit_unsharded(unit: nn.Module) -> bool:
    """Whether every parameter group of the unit holds its unsharded parameters now."""
    return all(group.is_unsharded for group in fsdp_state(unit)._fsdp_param_groups)


def fsdp_unit_gathered(unit: nn.Module) -> bool:
    """Whether every parameter group of the unit is unsharded or being gathered (a prefetch's all-gather issued,
    `_all_gather_result` set, not waited for yet: `is_unsharded` turns true only when its forward waits)."""
    return all(
        group.is_unsharded or group._all_gather_result is not None for group in fsdp_state(unit)._fsdp_param_groups
    )


def in_backward() -> bool:
    """Whether an autograd engine call (a backward) is running in this thread (`_current_graph_task_id`), the
    test FSDP2 itself makes (`is_bw`) to keep a unit unsharded after a forward run inside a backward."""
    return torch._C._current_graph_task_id() != -1


def fsdp_wrap_hooks(unit: nn.Module, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> bool:
    """Replace the unit's FSDP2 forward pre-hook and forward hook by `wrap(hook)`, in place (same order, same
    handles). False, and nothing done, for a unit of several modules (`fully_shard([a, b])`: grouped hooks)."""
    state = fsdp_state(unit)
    if len(state._modules) != 1:
        return False
    for handle in (state._pre_forward_hook_handle, state._post_forward_hook_handle):
        hooks = handle.hooks_dict_ref()
        hooks[handle.id] = wrap(hooks[handle.id])
    return True


def fsdp_is_root(unit: nn.Module) -> bool:
    """Whether the unit is its FSDP2 tree's root (set by the root's lazy init, on its first forward)."""
    return bool(fsdp_state(unit)._is_root)


def fsdp_in_forward(unit: nn.Module) -> bool:
    """Whether an FSDP2 root's forward is running over `unit` (after its lazy init, every unit shares the root's
    state context, whose `iter_forward_root` is set from the root's pre-forward to its post-forward)."""
    return fsdp_state(unit)._state_ctx.iter_forward_root is not None


def fsdp_tensor_parallel(unit: nn.Module) -> str | None:
    """The name of a parameter of the unit that was a DTensor before FSDP2 sharded it (tensor parallel), or None."""
    for group in fsdp_state(unit)._fsdp_param_groups:
        for fsdp_param in group.fsdp_params:
            if fsdp_param.is_dtensor:
                return str(fsdp_param._param_fqn or fsdp_param._module_info.param_name)
    return None


def fsdp_unsharded_tensors(unit: nn.Module) -> list[torch.Tensor]:
    """The unit's unsharded parameters as FSDP2 made them (`FSDPParam._unsharded_param`, made at its lazy init):
    their storages are resized in place by each all-gather and reshard, no dispatched op allocating them."""
    return [
        fsdp_param._unsharded_param
        for group in fsdp_state(unit)._fsdp_param_groups
        for fsdp_param in group.fsdp_params
        if hasattr(fsdp_param, "_unsharded_param")
    ]


def fsdp_unit_bytes(unit: nn.Module) -> int:
    """Bytes of the unit's unsharded parameters (what an all-gather of the unit makes, padding aside)."""
    total = 0
    for group in fsdp_state(unit)._fsdp_param_groups:
        for fsdp_param in group.fsdp_params:
            dtype = fsdp_param.param_dtype or fsdp_param.orig_dtype
            total += fsdp_param._orig_size.numel() * dtype.itemsize
    return total


# -- torch.utils.checkpoint's calls, for own_checkpointing.py --------------------------------------------------
# `torch.utils.checkpoint.checkpoint` reads from its module's globals, at each call, `CheckpointFunction`
# (use_reentrant=True) or `_checkpoint_without_reentrant_generator` (use_reentrant=False), both private. While
# discovery runs, rotor puts stand-ins for both there that tell it of each call, however the caller imported
# `checkpoint` (its callers hold the function itself: `checkpoint_sequential`, `checkpoint_wrapper` too), then run
# the originals. A Python hook on every call instead (`sys.setprofile`) cost ConvNeXt-Atto's discovery 3-3.5 plain
# steps of its 11 (docs/benchmarks.md). The stand-ins are in place while any thread watches (counted), each thread
# told of its own calls only.

_CHECKPOINT_ENTRIES = ("CheckpointFunction", "_checkpoint_without_reentrant_generator")
_checkpoint_watch = threading.local()  # `.told`: this thread's callbacks, innermost last
_checkpoint_lock = threading.Lock()
_checkpoint_originals: dict[str, Any] = {}  # while watched: what the stand-ins replaced
_checkpoint_watchers = [0]  # how many `checkpoint_calls_watched` are open, all threads together


def _tell_checkpoint_call() -> None:
    for told in list(getattr(_checkpoint_watch, "told", ())):
        told()


class _WatchedCheckpointFunction:
    """`CheckpointFunction` as `checkpoint` uses it (`.apply`), telling of the call first."""

    def __init__(self, function: Any) -> None:
        self._function = function

    def apply(self, *args: Any) -> Any:
        _tell_checkpoint_call()
        return self._function.apply(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._function, name)


def _watched_generator(generator: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(generator)
    def entered(*args: Any, **kwargs: Any) -> Any:
        _tell_checkpoint_call()
        return generator(*args, **kwargs)

    return entered


def _set_checkpoint_entries(watched: bool) -> None:
    module = vars(torch.utils.checkpoint)
    if watched:
        _checkpoint_originals.update({name: module[name] for name in _CHECKPOINT_ENTRIES})
        module["CheckpointFunction"] = _WatchedCheckpointFunction(_checkpoint_originals["CheckpointFunction"])
        generator = _checkpoint_originals["_checkpoint_without_reentrant_generator"]
        module["_checkpoint_without_reentrant_generator"] = _watched_generator(generator)
    else:
        module.update(_checkpoint_originals)
        _checkpoint_originals.clear()


@contextlib.contextmanager
def checkpoint_calls_watched(told: Callable[[], None]) -> Iterator[None]:
    """While open, `told()` runs inside each `torch.utils.checkpoint.checkpoint` call this thread makes (its
    caller's frames on the stack), before the call runs its function."""
    with _checkpoint_lock:
        if not _checkpoint_watchers[0]:
            _set_checkpoint_entries(True)
        _checkpoint_watchers[0] += 1
    stack: list[Callable[[], None]] = vars(_checkpoint_watch).setdefault("told", [])
    stack.append(told)
    try:
        yield
    finally:
        stack.remove(told)
        with _checkpoint_lock:
            _checkpoint_watchers[0] -= 1
            if not _checkpoint_watchers[0]:
                _set_checkpoint_entries(False)


# -- torch's checkpoint_wrapper (torch.distributed.algorithms._checkpoint), for own_checkpointing.py ----------
# `checkpoint_wrapper` (and `apply_activation_checkpointing`, which calls it) puts a block under
# `torch.utils.checkpoint` by wrapping it in a `CheckpointWrapper`; the module lives in a private torch
# package. Its forward calls the instance's `checkpoint_fn` on the wrapped block: rotor turns the
# wrapper's checkpointing off, as it turns Hugging Face's flags off, by swapping that function for a
# plain call while it holds the model, and back (docs/checkpointable.md, "The model's own checkpointing").

_WRAPPER_CHECKPOINT_FN: weakref.WeakKeyDictionary[nn.Module, Callable[..., Any]] = weakref.WeakKeyDictionary()
# per wrapper whose checkpointing rotor turned off: its own `checkpoint_fn`


def _plain_call(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return function(*args, **kwargs)


def is_checkpoint_wrapper(module: nn.Module) -> bool:
    """Whether `module` is torch's `CheckpointWrapper` (`checkpoint_wrapper`, `apply_activation_checkpointing`)."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    return isinstance(module, CheckpointWrapper)


def checkpoint_wrapper_on(module: nn.Module) -> bool:
    """Whether `module` is a `CheckpointWrapper` whose checkpointing rotor has not turned off."""
    return is_checkpoint_wrapper(module) and module not in _WRAPPER_CHECKPOINT_FN


def set_checkpoint_wrapper(module: nn.Module, on: bool) -> None:
    """Turn a `CheckpointWrapper`'s checkpointing off (its block called plainly) or back on."""
    if not on and checkpoint_wrapper_on(module):
        _WRAPPER_CHECKPOINT_FN[module] = vars(module)["checkpoint_fn"]
        vars(module)["checkpoint_fn"] = _plain_call
    elif on and module in _WRAPPER_CHECKPOINT_FN:
        vars(module)["checkpoint_fn"] = _WRAPPER_CHECKPOINT_FN.pop(module)


# torch's `offload_wrapper` (same private package) runs its block under `save_on_cpu`: the block's saved tensors go
# to host memory, by hooks nested inside rotor's plan. Rotor turns it off like a `CheckpointWrapper`: while it holds
# the model the wrapper's forward is an instance attribute calling the block plainly (a copy of the model keeps it),
# and back (rotor offloads by its own plan, `offload=`).


def _call_wrapped(wrapper: nn.Module, *args: Any, **kwargs: Any) -> Any:
    block: nn.Module = wrapper.get_submodule("_checkpoint_wrapped_module")
    return block(*args, **kwargs)


def is_offload_wrapper(module: nn.Module) -> bool:
    """Whether `module` is torch's `OffloadWrapper` (`offload_wrapper`): its block's saved tensors on the host."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import OffloadWrapper

    return isinstance(module, OffloadWrapper)


def _offloading_turned_off(module: nn.Module) -> bool:
    forward = vars(module).get("forward")
    return isinstance(forward, functools.partial) and forward.func is _call_wrapped


def offload_wrapper_on(module: nn.Module) -> bool:
    """Whether `module` is an `OffloadWrapper` whose offloading rotor has not turned off."""
    return is_offload_wrapper(module) and not _offloading_turned_off(module)


def set_offload_wrapper(module: nn.Module, on: bool) -> None:
    """Turn an `OffloadWrapper`'s offloading off (its block called plainly, no `save_on_cpu`) or back on."""
    if not on and offload_wrapper_on(module):
        vars(module)["forward"] = functools.partial(_call_wrapped, module)
    elif on and _offloading_turned_off(module):
        del vars(module)["forward"]


@functools.cache
def _checkpoint_code() -> Any:
    """The code of `torch.utils.checkpoint.checkpoint` itself, under its decorators (theirs is shared)."""
    return inspect.unwrap(torch.utils.checkpoint.checkpoint).__code__


def inside_checkpoint() -> bool:
    """Whether the calling code runs inside `torch.utils.checkpoint.checkpoint` (reentrant or not: its frame is on
    the stack while it runs the function it was given)."""
    code, frame = _checkpoint_code(), sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


# -- FLOP counts ----------------------------------------------------------------------------------
# `FlopCounterMode` (public) keeps its counts per module through a `ModuleTracker` (global module hooks around every
# call), and its dispatch (`torch.utils.flop_counter._FlopCounterMode`, private) tries a decomposition of every op,
# re-entering itself, before it runs one: about half of a count's cost on small models (litgpt: a count took 1.5 plain
# steps, a forward 0.3). `GlobalFlops` counts the same ops with the same formulas, to one total: no module tracked,
# and an op without a CompositeImplicitAutograd kernel (which `decompose` would refuse) run at once.
_SIZE_QUERIES = {  # what `_FlopCounterMode` answers `NotImplemented` (torch's own answer), as of TORCH_CHECKED
    torch.ops.aten.sym_is_contiguous.default,
    torch.ops.aten.is_contiguous.default,
    torch.ops.aten.is_contiguous.memory_format,
    torch.ops.aten.is_strides_like_format.default,
    torch.ops.aten.is_non_overlapping_and_dense.default,
    torch.ops.aten.size.default,
    torch.ops.aten.sym_size.default,
    torch.ops.aten.stride.default,
    torch.ops.aten.sym_stride.default,
    torch.ops.aten.storage_offset.default,
    torch.ops.aten.sym_storage_offset.default,
    torch.ops.aten.numel.default,
    torch.ops.aten.sym_numel.default,
    torch.ops.aten.dim.default,
    torch.ops.prim.layout.default,
}
_IMPLICIT = torch._C.DispatchKey.CompositeImplicitAutograd


class _GlobalFlopsMode(_FlopCounterMode):
    """`_FlopCounterMode`'s dispatch, less its decomposition attempt where no decomposition exists."""

    def __init__(self, counter: FlopCounterMode, decomposes: dict[Any, bool]) -> None:
        super().__init__(counter)
        self.decomposes = decomposes  # per op: has a CompositeImplicitAutograd kernel (as `OpOverload.decompose` asks)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if isinstance(func, torch._ops.OpOverload) and func not in _SIZE_QUERIES and not self._decomposes(func):
            kwargs = kwargs or {}
            return self.counter._count_flops(func._overloadpacket, func(*args, **kwargs), args, kwargs)
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _decomposes(self, func: torch._ops.OpOverload) -> bool:
        found = self.decomposes.get(func)
        if found is None:
            found = self.decomposes[func] = torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), _IMPLICIT)
        return found or _IMPLICIT in func.py_kernels


class GlobalFlops(FlopCounterMode):
    """`with counter: ...` counts the FLOPs of the ops run inside, `get_total_flops()` after, as `FlopCounterMode`
    counts them (its formulas, its decompositions), without its per-module counts. Reusable: each block starts at 0."""

    def __init__(self) -> None:
        super().__init__(display=False)
        self._decomposes: dict[Any, bool] = {}

    def __enter__(self) -> GlobalFlops:
        self.flop_counts.clear()
        self.mode = _GlobalFlopsMode(self, self._decomposes)
        self.mode.__enter__()
        return self

    def __exit__(self, *args: Any) -> Any:
        assert self.mode is not None
        done = self.mode.__exit__(*args)
        self.mode = None
        return done
