"""Memory probes: how many activation bytes are alive, exactly.

`MemoryProbe` counts live tensor storages on any device. It is a
`TorchDispatchMode`: every op's output storages are recorded (weakly), dead
ones are swept before the next op runs, and the current and peak totals are
updated after each op. So

- a storage shared by several tensors is counted once, and views are free;
- parameters, buffers and parameter gradients of the modules given in
  `exclude` are never counted (they are not activations);
- tensors that existed before the probe started (the chain input) count only
  when passed to `track`;
- the count is deterministic: it depends on the ops run, not on an allocator;
- a fresh parameter gradient counts until it is stored as `.grad` (autograd
  stores it without a copy when `.grad` was None, but only after a view op or
  two, by which time the op that made it has been counted) or, when `.grad`
  exists, until it has been added into it and freed;
- a storage emptied in place (`resize_(0)`, the executor's release of a consumed
  gradient) stops counting when `storage_emptied` reports it;
- storages made while one of the `bookkeeping` functions runs (anywhere up the
  Python stack) are never counted: training-loop state that is not activation
  memory, such as Lightning's copies of logged values;
- a `DistributedDataParallel` in `exclude` also excludes what its forward
  allocates before running the module (`_pre_forward`): the reducer's gradient
  buckets, which DDP reallocates once, before the second step's forward, in the
  order the first backward made gradients. Like parameter gradients (which may
  be views into them, `gradient_as_bucket_view`) they are not activations.

Host copies of offloaded values (lightning_rotor/offload.py) are host memory, not
device memory: storages made inside `host_allocations()`, and preallocated host buffers
while `host_buffer_used` says they hold a copy, count in `host_current` and `host_peak`
and never in `current` and `peak`. The transfer channel says so explicitly: on CPU a host
copy is an ordinary CPU tensor, which tensor accounting could not tell apart.

Allocations inside kernels that never become tensors (workspaces) are not
seen; on CUDA, `CudaMemoryProbe` reads the caching allocator's own statistics,
which include them.

The autograd engine runs backward ops in the thread that called `backward`
on CPU (and copies the dispatch mode to its device threads), so a probe
entered around forward and backward sees both.
"""

from __future__ import annotations

import functools
import operator
import sys
import threading
import weakref
from collections.abc import Callable, Container, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from itertools import compress
from types import FrameType
from typing import Any, Protocol

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_rotor._torch_compat import (
    StorageWeakRef,
    TorchDispatchMode,
    ddp_pre_forward,
    free_weak_storage,
    innermost_dispatch_mode,
    storage_id,
    tree_leaves,
    weak_storage,
    weak_storage_expired,
)

_GRAD = operator.attrgetter("grad")
_CDATA = operator.attrgetter("_cdata")  # a storage's key (`storage_id`)
_LAYOUT = operator.attrgetter("layout")
_STORAGE = operator.methodcaller("untyped_storage")
_NOT_NONE = functools.partial(operator.is_not, None)
_PLAIN_TENSOR = {torch.Tensor}
_STRIDED = {torch.strided}


def storage_key(tensor: torch.Tensor) -> int:
    """Identity of the storage behind `tensor` (shared by all its views)."""
    return storage_id(tensor.untyped_storage())


def gradient_keys(params: list[torch.Tensor]) -> set[int]:
    """Storages of the `.grad` of `params` (those that have one).

    A probe runs it before every op: the common case (no gradient, or plain strided tensors) is found by C-level
    iteration (`map`, `filter`), without a Python step per parameter."""
    grads = list(filter(_NOT_NONE, map(_GRAD, params)))
    if not grads:
        return set()
    if set(map(type, grads)) <= _PLAIN_TENSOR and set(map(_LAYOUT, grads)) == _STRIDED:
        return set(map(_CDATA, map(_STORAGE, grads)))
    keys = set()
    for g in grads:
        if type(g) is not torch.Tensor and hasattr(g, "to_local"):  # FSDP2: a DTensor gradient, its shard
            g = g.to_local()
        if g.layout == torch.strided:
            keys.add(storage_id(g.untyped_storage()))
    return keys


def _hookable(t: torch.Tensor) -> bool:
    """A leaf that requires grad: autograd accumulates into its `.grad` (and runs its accumulation hooks)."""
    return t.requires_grad and t.is_leaf


def _strided(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.layout == torch.strided


def _op_tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in an op's arguments or results (tensors, lists, tuples, dicts of them), in order: what
    `tree_leaves` finds there, without its per-node cost, which the probe pays on every op (and no call per leaf)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if not isinstance(value, (list, tuple)):
        return []
    out = []
    for v in value:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple, dict)):
            out.extend(_op_tensors(v))
    return out


# NOTE: [storage sizes traced] while lightning_rotor/size_trace.py traces a profile, each storage's bytes come
# from its sizer: an int that also knows which storage it is, so that every figure the profile derives from
# them is known as a sum of storage sizes (and a new shape's figures follow from the storages' own sizes); a
# probe's peak rises through the sizer too, which keeps every level the peak is the largest of
class Sizer(Protocol):
    def size(self, storage: torch.UntypedStorage, tensor: torch.Tensor) -> int: ...

    def higher(self, peak: int, current: int) -> int: ...


class _PlainBytes:
    """Bytes as they are, outside a traced profile."""

    def size(self, storage: torch.UntypedStorage, tensor: torch.Tensor) -> int:
        return storage.nbytes()

    def higher(self, peak: int, current: int) -> int:
        return current if current > peak else peak


PLAIN_BYTES: Sizer = _PlainBytes()
_SIZERS: list[Sizer] = []


def storage_nbytes(storage: torch.UntypedStorage, tensor: torch.Tensor) -> int:
    """Bytes of `storage` (behind `tensor`), as every probe counts them (NOTE: [storage sizes traced])."""
    return _SIZERS[-1].size(storage, tensor) if _SIZERS else storage.nbytes()


@contextmanager
def storages_sized_by(sizer: Sizer) -> Iterator[None]:
    """Inside, `storage_nbytes` and the probes entered inside (what they count, how their peak rises) ask `sizer`
    (NOTE: [storage sizes traced])."""
    _SIZERS.append(sizer)
    try:
        yield
    finally:
        _SIZERS.remove(sizer)


@contextmanager
def storages_sized_plainly() -> Iterator[None]:
    """Inside, storage sizes are plain ints, whatever sizer was entered around (a profile beside a traced one)."""
    sizers = _SIZERS[:]
    _SIZERS.clear()
    try:
        yield
    finally:
        _SIZERS[:] = sizers


def storage_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages behind the tensors in a (nested) structure."""
    seen: dict[int, int] = {}
    for t in tree_leaves(tensors):
        if isinstance(t, torch.Tensor) and t.layout == torch.strided:
            storage = t.untyped_storage()
            seen[storage_id(storage)] = storage_nbytes(storage, t)
    return sum(seen.values())


_ACTIVE: weakref.WeakSet = weakref.WeakSet()  # probes inside their block
_HOST = threading.local()  # `making`: what storages made now are ("copies", "buffers"), or None
# how many `_making` blocks are open, in any thread: while none is, no thread makes host storages, and a probe's op
# need not read the thread-local (a probe asks at every op; reading a `threading.local` costs some 0.3 us)
_MAKING_OPEN = [0]
_MAKING_LOCK = threading.Lock()


def _making_host() -> str | None:
    return getattr(_HOST, "making", None) if _MAKING_OPEN[0] else None


@contextmanager
def _making(what: str) -> Iterator[None]:
    with _MAKING_LOCK:
        _MAKING_OPEN[0] += 1
    before = getattr(_HOST, "making", None)
    _HOST.making = what
    try:
        yield
    finally:
        _HOST.making = before
        with _MAKING_LOCK:
            _MAKING_OPEN[0] -= 1


def host_allocations() -> AbstractContextManager[None]:
    """Storages made inside are host copies of offloaded values: probes count them as host memory.

    On CPU a host copy is a CPU tensor like any activation; without being told, a probe
    would charge it to the device and the measured device peak would include what the
    plan moved away.
    """
    return _making("copies")


def host_buffers() -> AbstractContextManager[None]:
    """Storages made inside are reserved host buffers (pinned, per plan): never counted by themselves,
    only while `host_buffer_used` says they hold a copy."""
    return _making("buffers")


def host_buffer_used(storage: torch.UntypedStorage, nbytes: int) -> None:
    """A preallocated host buffer (pinned, made once per plan) now holds a copy of `nbytes` bytes.

    The buffer outlives the step, so its bytes count as host memory only while it holds
    a copy, from the offload to the end of the prefetch (`host_buffer_free`).
    """
    key = storage_id(storage)
    for probe in list(_ACTIVE_HOST):
        probe._host_use(key, nbytes)


def host_buffer_free(storage: torch.UntypedStorage) -> None:
    """The preallocated host buffer no longer holds a copy (its prefetch has been issued and waited for)."""
    key = storage_id(storage)
    for probe in list(_ACTIVE_HOST):
        probe._host_unuse(key)


_ACTIVE_HOST: weakref.WeakSet = weakref.WeakSet()  # probes (tensor or allocator) inside their block


class _HostAccount:
    """Host bytes held by copies of offloaded values: `host_current` now, `host_peak` at most."""

    def _host_init(self) -> None:
        self.host_current = 0
        self.host_peak = 0
        self._host_buffers: dict[int, int] = {}  # preallocated buffers in use: key -> bytes

    def _host_use(self, key: int, nbytes: int) -> None:
        self.host_current += nbytes - self._host_buffers.get(key, 0)
        self._host_buffers[key] = nbytes
        self.host_peak = max(self.host_peak, self.host_current)

    def _host_unuse(self, key: int) -> None:
        self.host_current -= self._host_buffers.pop(key, 0)


def _code(function: Callable) -> Any:
    """The code object that runs when `function` is called (decorators unwrapped)."""
    while hasattr(function, "__wrapped__"):
        function = function.__wrapped__
    return getattr(function, "__func__", function).__code__


def storage_emptied(storage: torch.UntypedStorage) -> None:
    """Tell the active probes that `storage` was emptied in place (`resize_(0)`) while references remain.

    A probe sees storages die by reference counting; one freed by resizing (the
    executor's release of a consumed gradient) would otherwise count until its last
    reference goes.
    """
    if _ACTIVE:
        for probe in list(_ACTIVE):
            probe._forget(storage_id(storage))


class Excluded:
    """What a probe never counts, found once: the storages of the parameters and buffers of the modules (or the
    tensors) given, and the parameters whose gradients are parameter memory too.

    Finding them walks every module; a profile makes a probe per measured run, so it finds them once per profile
    (`MemoryProbe(Excluded(stages))`) rather than once per run.

    NOTE: [gradients stored by autograd] a fresh parameter gradient stops counting once it is stored as `.grad`.
    By default a probe reads every excluded parameter's `.grad` before every op to find the stored ones (some
    300 ns a parameter: 0.2 ms an op for a model of 150 parameters with gradients). With `by_autograd`, for a
    block where only autograd stores gradients (no `p.grad = ...` in it, as in the profiler's measured runs),
    a hook after each accumulation (`register_post_accumulate_grad_hook`) tells the probes inside which
    parameter's `.grad` to read, at the same op boundary: the same figures, at a cost per gradient stored, not per
    op. The hooks are set while the `Excluded` is entered (`with Excluded(stages, by_autograd=True) as exclude:`),
    once for all the probes made from it inside.
    """

    def __init__(self, exclude: nn.Module | Iterable[nn.Module | torch.Tensor] = (), *, by_autograd: bool = False):
        self.by_autograd = by_autograd  # NOTE: [gradients stored by autograd]
        if isinstance(exclude, nn.Module):
            exclude = [exclude]
        self.fixed: set[int] = set()
        self.params: list[torch.Tensor] = []
        self.bookkeeping: set[Any] = set()
        seen: set[int] = set()  # a tensor reachable from two excluded modules (a DDP and its module) once
        for item in exclude:
            if isinstance(item, DistributedDataParallel):
                self.bookkeeping.add(_code(ddp_pre_forward()))
            tensors = list(item.parameters()) + list(item.buffers()) if isinstance(item, nn.Module) else [item]
            for t in tensors:
                if id(t) in seen:
                    continue
                seen.add(id(t))
                if t.layout == torch.strided:
                    self.fixed.add(storage_key(t))
                if isinstance(t, nn.Parameter) or t.requires_grad:
                    self.params.append(t)
        self.probes: list[MemoryProbe] = []  # inside their block, told of stored gradients (`by_autograd`)
        self._hooks: list[Any] = []

    def __enter__(self) -> Excluded:
        if self.by_autograd:
            self._hooks = [p.register_post_accumulate_grad_hook(self._stored) for p in self.params if _hookable(p)]
        return self

    def __exit__(self, *exc: Any) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _stored(self, param: torch.Tensor) -> None:
        """Autograd stored (or accumulated into) `param.grad`: the probes inside read it at their next sweep."""
        for probe in self.probes:
            probe._stored.append(param)


_NOTHING = Excluded()


class MemoryProbe(TorchDispatchMode, _HostAccount):
    """Exact live activation bytes: `with MemoryProbe(exclude=model) as probe: ...`.

    `probe.current` and `probe.peak` are bytes; `probe.curve` (when
    `record_curve=True`) is the bytes alive after each op, `probe.op_log` (when `record_ops=True`)
    each op run, and `mark(label)` records where in that curve a labelled moment is (e.g. the end
    of a plan op).
    `bookkeeping`: functions whose allocations are not activations (never counted).
    `host_current` and `host_peak`: bytes of host copies of offloaded values (module docstring).
    """

    def __init__(
        self,
        exclude: nn.Module | Iterable[nn.Module | torch.Tensor] | Excluded = (),
        *,
        record_curve: bool = False,
        record_ops: bool = False,
        bookkeeping: Iterable[Callable] = (),
    ):
        super().__init__()
        excluded = exclude if isinstance(exclude, Excluded) else Excluded(exclude)
        self._fixed: set[int] = set(excluded.fixed)
        self._params: list[torch.Tensor] = excluded.params
        self._excluded = excluded
        self._by_autograd = excluded.by_autograd  # NOTE: [gradients stored by autograd]
        self._stored: list[torch.Tensor] = []  # parameters whose `.grad` autograd stored since the last sweep
        self._bookkeeping = {_code(f) for f in bookkeeping} | excluded.bookkeeping
        self._uncounted: dict[int, StorageWeakRef] = {}  # storages made by bookkeeping
        self._live: dict[int, int] = {}  # counted storage -> its bytes
        # NOTE: [live handles] per counted storage, in `_live`'s order, a weak reference to it as a bare handle
        # (`weak_storage`): what the sweep before every op asks expiry of, without two lookups per live storage. The
        # probe frees each handle itself, once: when it drops the storage (`_drop`) or closes
        self._handles: dict[int, int] = {}
        self._fixed_grew = False  # a storage counted before was made fixed since the last sweep (`_add`, buffers)
        self._host_live: dict[int, tuple[StorageWeakRef, int]] = {}  # host copies made under host_allocations
        self._host_init()
        self.current = 0
        self.peak = 0
        self.ops = 0
        self.data_dependent = False  # an op ran whose output's shape or value follows its input's values
        self.record_curve = record_curve
        self.curve: list[int] = []
        self.op_log: list[Any] | None = [] if record_ops else None  # `record_ops`: each op run, in order
        self.marks: list[tuple[str, int, int]] = []  # (label, op index, bytes alive)
        self._closed = False
        self._sizer: Sizer = PLAIN_BYTES

    # -- accounting -------------------------------------------------------------------------
    def _gradients(self) -> set[int]:
        """Storages of the excluded parameters' gradients (parameter memory, not activations): every parameter's
        `.grad` read, or with `by_autograd` those autograd stored since the last sweep (NOTE: [gradients stored
        by autograd])."""
        if not self._by_autograd:
            return gradient_keys(self._params)
        stored, self._stored = self._stored, []
        return gradient_keys(stored)

    def _sweep(self) -> None:
        live = self._live
        if live:
            # the expired storages, found without a Python step per live storage (the common case: none beside)
            handles = self._handles
            dead = list(compress(handles.keys(), map(weak_storage_expired, handles.values())))
            # a fixed storage is never counted (`_add`), unless made fixed after it was: only then look for one
            gone = self._fixed.intersection(live) if self._fixed_grew else set()
            self._fixed_grew = False
            if self._params and (self._stored or not self._by_autograd):  # by autograd: only once one was stored
                gone |= self._gradients().intersection(live)
            if gone:
                gone.update(dead)
                dead = [k for k in live if k in gone]  # in the order they were counted, as before
            for k in dead:
                self._drop(k)
        elif self._stored:
            self._stored = []  # nothing counted that could be a gradient
        if self._host_live:
            for k in [k for k, (ref, _) in self._host_live.items() if ref.expired()]:
                self.host_current -= self._host_live.pop(k)[1]

    def _in_bookkeeping(self) -> bool:
        """True when a `bookkeeping` function is running, i.e. its frame is on the Python stack."""
        frame: FrameType | None = sys._getframe(1)
        while frame is not None:
            if frame.f_code in self._bookkeeping:
                return True
            frame = frame.f_back
        return False

    def _drop(self, key: int) -> None:
        """Stop counting the storage `key` (dead, emptied, or a gradient now), its handle freed."""
        free_weak_storage(self._handles.pop(key))
        self.current -= self._live.pop(key)

    def _add(self, tensors: list[Any], inputs: Container[int] = frozenset(), bookkeeping: bool | None = None) -> None:
        """Count the new storages behind `tensors` (flattened); `bookkeeping` None: look up (once) whether a
        bookkeeping function made them."""
        making = _making_host()
        if making == "copies":
            self._add_host(tensors, inputs)
            return
        if making == "buffers":
            self._fixed.update(storage_key(t) for t in tree_leaves(tensors) if _strided(t))
            self._fixed_grew = True
            return
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.is_meta:
                continue
            storage = t.untyped_storage()
            key = storage_id(storage)
            if key in self._fixed:
                continue
            old = self._handles.get(key)
            if old is not None and not weak_storage_expired(old):
                continue  # counted already (a view, an in-place op): the op's inputs need not be looked at
            if key in inputs:
                continue
            host = self._host_live.get(key)
            if host is not None:
                if not host[0].expired():
                    continue  # a host copy, counted as host memory
                self.host_current -= self._host_live.pop(key)[1]
            if old is not None:
                self._drop(key)
            if self._bookkeeping:
                ref = self._uncounted.get(key)
                if ref is not None and not ref.expired():
                    continue
                if bookkeeping is None:
                    bookkeeping = self._in_bookkeeping()
                if bookkeeping:
                    self._uncounted[key] = StorageWeakRef(storage)
                    continue
            nbytes = self._sizer.size(storage, t)
            self._live[key] = nbytes
            self._handles[key] = weak_storage(storage)
            self.current += nbytes
        self.peak = self._sizer.higher(self.peak, self.current)

    def _add_host(self, tensors: Any, inputs: Container[int]) -> None:
        """Count new storages as host copies (made inside `host_allocations`)."""
        for t in tree_leaves(tensors):
            if not _strided(t) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key = storage_id(storage)
            if key in inputs or key in self._live:
                continue
            old = self._host_live.get(key)
            if old is not None and not old[0].expired():
                continue
            if old is not None:
                self.host_current -= old[1]
            self._host_live[key] = (StorageWeakRef(storage), storage.nbytes())
            self.host_current += storage.nbytes()
        self.host_peak = max(self.host_peak, self.host_current)

    def track(self, *tensors: Any) -> None:
        """Count tensors that existed before the probe (e.g. the chain input `a_0`), whoever made them."""
        self._sweep()
        for t in tree_leaves(tensors):
            if _strided(t):
                self._uncounted.pop(storage_key(t), None)
        self._add(tree_leaves(tensors), bookkeeping=False)

    def reset_peak(self) -> None:
        """Start a new peak from what is alive now."""
        self._sweep()
        self.peak = self.current

    def mark(self, label: str) -> None:
        """Remember the bytes alive now under `label` (sweeping first)."""
        self._sweep()
        self.marks.append((label, self.ops, self.current))

    def _forget(self, key: int) -> None:
        if key in self._live:
            self._drop(key)

    def __enter__(self) -> MemoryProbe:
        if self._closed:
            raise RuntimeError("a MemoryProbe measures one block and is closed; make a new MemoryProbe")
        _ACTIVE.add(self)
        _ACTIVE_HOST.add(self)
        # a probe entered while a profile is traced counts through its sizer; one entered before (a step's
        # measurement around a step that profiles) counts plain bytes (NOTE: [storage sizes traced])
        self._sizer = _SIZERS[-1] if _SIZERS else PLAIN_BYTES
        if self._by_autograd:  # NOTE: [gradients stored by autograd]
            if not self._excluded._hooks and any(map(_hookable, self._params)):
                raise RuntimeError("a MemoryProbe of Excluded(..., by_autograd=True) runs inside `with excluded:`")
            self._excluded.probes.append(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        if innermost_dispatch_mode() is not self:  # a loss window opened inside this block, still on the stack
            from lightning_rotor.loss_watch import settle_watches  # which imports this module

            settle_watches()
        super().__exit__(*exc)
        self.end()

    def end(self) -> None:
        """Stop counting, keeping the figures, as leaving the block does. Alone, for a probe left on a dispatch-mode
        stack that is not its block's own (loss_watch.py: a backward node's, which the autograd engine restores)."""
        _ACTIVE.discard(self)
        _ACTIVE_HOST.discard(self)
        self._sweep()  # host copies that died with the block's last op are no longer held
        if self._by_autograd:
            self._excluded.probes.remove(self)
        self.close()

    def close(self) -> None:
        """Drop every storage handle, keeping the figures (`peak`, `current`, `curve`, `marks`).

        Raw storage handles (`StorageWeakRef`) must not outlive the block: a copy
        of one (`copy.deepcopy`, pickling a module that holds the probe) would
        free the same weak reference twice and corrupt the heap.
        """
        self._closed = True
        handles, self._live, self._handles = self._handles, {}, {}
        for handle in handles.values():
            free_weak_storage(handle)
        self._host_live = {}
        self._uncounted = {}
        self._fixed = set()
        self._params = []
        self._excluded, self._stored = _NOTHING, []  # the excluded parameters not held by a closed probe

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self._closed:  # ended, yet on a stack the autograd engine put back (`end`)
            return func(*args, **(kwargs or {}))
        self._sweep()
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # an output on an input's storage (a view, an in-place op) is no new allocation
        self._add(_op_tensors(out), _InputStorages(args, kwargs))
        self.ops += 1
        if func not in _VALUE_FREE:
            self.data_dependent |= _follows_values(func)
        if self.record_curve:
            self.curve.append(self.current)
        if self.op_log is not None:
            self.op_log.append(func)
        return out


_VALUE_FREE: set[Any] = set()  # ops seen whose outputs' shapes follow their inputs' shapes only


def _follows_values(func: Any) -> bool:
    """Does `func`'s output shape or host value follow its inputs' values (`nonzero`, `.item()`, a boolean mask)?"""
    tags = getattr(func, "tags", ())
    if torch.Tag.dynamic_output_shape in tags or torch.Tag.data_dependent_output in tags:
        return True
    _VALUE_FREE.add(func)
    return False


class _InputStorages:
    """The storages of an op's inputs, found when first asked: an output on a storage already counted (a view, an
    in-place op) needs no look at them."""

    __slots__ = ("_args", "_keys", "_kwargs")

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]):
        self._args = args
        self._kwargs = kwargs
        self._keys: set[int] | None = None

    def __contains__(self, key: object) -> bool:
        if self._keys is None:
            tensors = _op_tensors(self._args) + _op_tensors(self._kwargs) if self._kwargs else _op_tensors(self._args)
            strided = [t for t in tensors if t.layout == torch.strided]
            self._keys = set(map(_CDATA, map(_STORAGE, strided)))  # `storage_key` of each, by C-level iteration
        return key in self._keys


class CudaMemoryProbe(_HostAccount):
    """Activation bytes from the CUDA caching allocator's statistics.

    Peak is `max_memory_allocated` during the block minus what was allocated
    when it started, plus the bytes of tensors passed to `track` (the chain
    input, which existed before). Unlike `MemoryProbe` it sees kernel
    workspaces; like any allocator figure it also sees parameter gradients
    allocated during the block (zero them with `set_to_none=False` to keep them
    out) and rounds sizes up to the allocator's blocks. Host copies of offloaded values are
    not in the allocator's figures; `host_peak` counts the pinned buffers while they hold one.
    """

    def __init__(self, device: torch.device | str | int | None = None):
        if not torch.cuda.is_available():
            raise RuntimeError("CudaMemoryProbe needs CUDA, which is not available; use MemoryProbe on CPU")
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        self._base = 0
        self._tracked = 0
        self.peak = 0
        self.current = 0
        self.marks: list[tuple[str, int, int]] = []  # (label, -1, bytes allocated), like MemoryProbe.marks
        self._host_init()

    def track(self, *tensors: Any) -> None:
        self._tracked += storage_bytes(tensors)

    def mark(self, label: str) -> None:
        """Remember the bytes allocated now (the allocator's counters need no synchronization)."""
        self.marks.append((label, -1, torch.cuda.memory_allocated(self.device) - self._base + self._tracked))

    def __enter__(self) -> CudaMemoryProbe:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._base = torch.cuda.memory_allocated(self.device)
        _ACTIVE_HOST.add(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _ACTIVE_HOST.discard(self)
        torch.cuda.synchronize(self.device)
        self.peak = torch.cuda.max_memory_allocated(self.device) - self._base + self._tracked
        self.current = torch.cuda.memory_allocated(self.device) - self._base + self._tracked


def probe_for(device: torch.device, exclude: Any = (), *, record_curve: bool = False) -> MemoryProbe | CudaMemoryProbe:
    """The probe that measures `device` best: the allocator on CUDA, tensor accounting elsewhere."""
    if device.type == "cuda":
        return CudaMemoryProbe(device)
    return MemoryProbe(exclude, record_curve=record_curve)
