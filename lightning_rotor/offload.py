"""The transfer channel: a stage input `a_k` to host memory and back (`Offload k`, `Prefetch k`; chain version 6).

One job: move a plain value (a tensor or a nested tuple of tensors) off the device and bring
it back bitwise equal, laid out as it was. What is copied is each distinct storage behind the
value, whole: the chain's `s_k` is those storages' bytes (`memory.storage_bytes`), so the
host copy holds exactly what the simulator charges, and views into a larger storage, or two
tensors of one storage, come back as they were (same offsets and strides, so the kernels that
read them round alike).

- CPU (and any device but CUDA): the host copy is a separate CPU tensor per value, copied
  synchronously; `memory.host_allocations` tells the probes it is host memory.
- CUDA: copies run on one copy stream per channel, after the compute stream's work so far;
  host copies go into pinned buffers reserved once per plan (`HostPool`, sized by
  `buffer_sizes` from the plan's ops and the chain's sizes) and reused every step; a device
  storage read by an offload is `record_stream`-ed on the copy stream, so the allocator does
  not reuse it before the copy has read it; a prefetched value carries an event that compute
  waits on before the first op that reads it (`Transfers.ready`).

What a recorded stage saved for its backward moves the same way (`OffloadSaved k`,
`PrefetchSaved k`, docs/memory-model.md): `SavedPart` records `Fe k` under
`torch.autograd.graph.saved_tensors_hooks`, so the graph keeps a handle per saved tensor instead of
the tensor; the handled storages go to the host as one value and come back as they were, and the
handles then give the graph device tensors again. The profiler measures the chain's
`offloadable[k]` with the same class, so the executor moves exactly the bytes the planner was told.

`measure_bandwidth` times the copies the channel makes: what `Checkpointable(offload=True)`
gives the planner as the chain's `bandwidth`.
"""

from __future__ import annotations

import statistics
import time
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_rotor._torch_compat import (
    storage_id,
    storage_use_count,
    tensor_version,
    tree_flatten,
    tree_leaves,
    tree_unflatten,
)
from lightning_rotor.memory import host_allocations, host_buffer_free, host_buffer_used, host_buffers, storage_nbytes
from lightning_rotor.ops import Op, OpKind, parse_ops

__all__ = [
    "HostCopy",
    "HostPool",
    "SavedPart",
    "TransferChannel",
    "Transfers",
    "buffer_sizes",
    "measure_bandwidth",
]


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor on `storage` (no copy): what the channel copies."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


@dataclass
class _Leaf:
    """Where one tensor of an offloaded value lies in its storage, to rebuild it on the device."""

    storage: int  # index of its storage among the value's distinct storages
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


@dataclass
class HostCopy:
    """An offloaded value: its storages' bytes in one host tensor, and how to rebuild it."""

    spec: Any
    leaves: list[Any]  # _Leaf for each tensor, the other leaves as they were
    extents: list[tuple[int, int]]  # per storage: (offset in `host`, bytes)
    host: torch.Tensor  # uint8, on the CPU (pinned on CUDA: a slice of a pool buffer)
    device: torch.device
    buffer: torch.Tensor | None = None  # the pool buffer `host` is a slice of (CUDA), released after the prefetch
    done: Any = None  # CUDA: event recorded after the offload's copies

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.extents)


def _storages(value: Any) -> tuple[Any, list[Any], list[torch.UntypedStorage]]:
    """(spec, leaves, distinct storages) of a value; tensors become `_Leaf`s."""
    flat, spec = tree_flatten(value)
    index: dict[int, int] = {}
    storages: list[torch.UntypedStorage] = []
    leaves: list[Any] = []
    for t in flat:
        if not isinstance(t, torch.Tensor):
            leaves.append(t)
            continue
        if t.layout != torch.strided:
            raise RuntimeError(f"cannot offload a {t.layout} tensor: the transfer channel moves strided tensors only")
        storage = t.untyped_storage()
        key = storage_id(storage)
        if key not in index:
            index[key] = len(storages)
            storages.append(storage)
        leaves.append(
            _Leaf(index[key], int(t.storage_offset()), tuple(t.size()), tuple(t.stride()), t.dtype, t.requires_grad)
        )
    return spec, leaves, storages


def buffer_sizes(ops: Sequence[Any], sizes: Sequence[int], saved: Sequence[int] = ()) -> list[int]:
    """The host buffers one step of `ops` uses, given the bytes `sizes[k]` of each value `a_k` and
    `saved[k]` of stage k's saved part (the chain's `offloadable`; none when empty).

    Replays the offloads and prefetches in op order, each offload taking the smallest free
    buffer large enough (best fit), else a new one: what `HostPool` does in a step, so
    reserving these buffers before the first step means no step allocates host memory.
    """
    free: list[int] = []
    held: dict[tuple[OpKind, int], int] = {}
    made: list[int] = []
    for op in parse_ops(ops):
        k = op.stage
        if k is None:  # the loss
            continue
        kind = op.kind
        if kind is OpKind.OFFLOAD or kind is OpKind.OFFLOAD_SAVED:
            need = sizes[k] if kind is OpKind.OFFLOAD else (saved[k] if k < len(saved) else 0)
            fits = [b for b in free if b >= need]
            if fits:
                size = min(fits)
                free.remove(size)
            else:
                size = need
                made.append(size)
            held[(kind, k)] = size
        elif kind is OpKind.PREFETCH or kind is OpKind.PREFETCH_SAVED:
            key = (OpKind.OFFLOAD if kind is OpKind.PREFETCH else OpKind.OFFLOAD_SAVED, k)
            if key in held:
                free.append(held.pop(key))
    return made


class HostPool:
    """Host buffers reserved once (pinned on CUDA) and handed out per offload, best fit.

    A step that finds no free buffer large enough allocates one more, which stays in the
    pool: only a step the reservation did not foresee (a larger value than the plan's, two
    calls of one plan pending at once) allocates, and only once.
    """

    def __init__(self, pin: bool):
        self.pin = pin
        self.buffers: list[torch.Tensor] = []
        self.free: list[torch.Tensor] = []
        self.allocations = 0  # buffers made so far

    def reserve(self, sizes: Sequence[int]) -> None:
        """Make the buffers of `sizes` now (before the step that needs them)."""
        for n in sizes:
            self.free.append(self._make(n))

    def _make(self, nbytes: int) -> torch.Tensor:
        with host_buffers():  # counted by the probes only while they hold a copy (`host_buffer_used`)
            buf = torch.empty(max(1, nbytes), dtype=torch.uint8, pin_memory=self.pin)
        self.buffers.append(buf)
        self.allocations += 1
        return buf

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A buffer of at least `nbytes` bytes, taken out of the pool until `release`."""
        fits = [b for b in self.free if b.numel() >= nbytes]
        if fits:
            buf = min(fits, key=lambda b: b.numel())
            self.free = [b for b in self.free if b is not buf]
            return buf
        return self._make(nbytes)

    def release(self, buf: torch.Tensor) -> None:
        self.free.append(buf)


class TransferChannel:
    """Copies values between a device and host memory; one per plan (its pool and copy stream persist)."""

    def __init__(self, reserve: Sequence[int] = ()):
        self.reserve = list(reserve)  # host buffers to make before the first CUDA transfer (`buffer_sizes`)
        self.pool: HostPool | None = None
        self.streams: dict[torch.device, Any] = {}

    def prepare(self, device: torch.device) -> None:
        """Before a step on `device`: on CUDA, the pinned buffers the plan needs, made on the first step only
        (between steps, not while ops run), and the copy stream."""
        if device.type == "cuda":
            self._cuda_pool()
            self._stream(device)

    def _cuda_pool(self) -> HostPool:
        if self.pool is None:
            self.pool = HostPool(pin=True)
            self.pool.reserve(self.reserve)
        return self.pool

    def discard(self, copy: HostCopy) -> None:
        """A host copy that will not be prefetched (a step that failed): its pool buffer goes back."""
        if copy.buffer is not None and self.pool is not None:
            if copy.done is not None:
                copy.done.synchronize()  # the copy into it may still run
            host_buffer_free(copy.buffer.untyped_storage())
            self.pool.release(copy.buffer)

    def _stream(self, device: torch.device) -> Any:
        if device not in self.streams:
            self.streams[device] = torch.cuda.Stream(device)
        return self.streams[device]

    def offload(self, value: Any) -> HostCopy:
        """Start copying `value` to host memory; the caller then drops its device references.

        CPU: done when this returns. CUDA: the copy stream first waits for the compute stream
        (which made the value), and each device storage is marked used by the copy stream, so
        freeing it now is safe: the allocator reuses the memory only once the copy has read it.
        """
        spec, leaves, storages = _storages(value)
        if not storages:
            raise RuntimeError("cannot offload a value without tensors")
        device = storages[0].device
        sizes = [s.nbytes() for s in storages]
        extents, at = [], 0
        for n in sizes:
            extents.append((at, n))
            at += n
        if device.type != "cuda":
            with host_allocations():  # the probes count it as host memory, never as device memory
                host = torch.empty(at, dtype=torch.uint8, device="cpu")
            for storage, (start, n) in zip(storages, extents, strict=True):
                host[start : start + n].copy_(_bytes_of(storage))
            return HostCopy(spec, leaves, extents, host, device)
        pool = self._cuda_pool()
        buffer = pool.acquire(at)
        host = buffer[:at]
        stream = self._stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for storage, (start, n) in zip(storages, extents, strict=True):
                source = _bytes_of(storage)
                host[start : start + n].copy_(source, non_blocking=True)
                source.record_stream(stream)  # not reused by the allocator before this copy has read it
        done = torch.cuda.Event()
        done.record(stream)
        host_buffer_used(buffer.untyped_storage(), at)
        return HostCopy(spec, leaves, extents, host, device, buffer, done)

    def prefetch(self, copy: HostCopy) -> tuple[Any, Any]:
        """Start copying `copy` back to its device: (the value, an event to wait on before reading it, or None).

        The device memory is allocated now, on the compute stream, as the simulator charges it
        from the prefetch on. CUDA: the copy stream waits for the compute stream first (the
        new block may be one compute freed while its last kernels still run), and the pool
        buffer goes back at once: the next copy into it runs on the same stream, after this one.
        """
        device = copy.device
        fresh = [torch.empty(n, dtype=torch.uint8, device=device) for _, n in copy.extents]
        event = None
        if device.type != "cuda":
            for dst, (start, n) in zip(fresh, copy.extents, strict=True):
                dst.copy_(copy.host[start : start + n])
        else:
            stream = self._stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for dst, (start, n) in zip(fresh, copy.extents, strict=True):
                    dst.copy_(copy.host[start : start + n], non_blocking=True)
                    dst.record_stream(stream)
            event = torch.cuda.Event()
            event.record(stream)
            assert copy.buffer is not None and self.pool is not None  # set by a CUDA offload
            host_buffer_free(copy.buffer.untyped_storage())
            self.pool.release(copy.buffer)
        tensors = []
        for leaf in copy.leaves:
            if not isinstance(leaf, _Leaf):
                tensors.append(leaf)
                continue
            t = torch.empty(0, dtype=leaf.dtype, device=device)
            t.set_(fresh[leaf.storage].untyped_storage(), leaf.offset, leaf.size, leaf.stride)
            if leaf.requires_grad:
                t.requires_grad_(True)
            tensors.append(t)
        del fresh
        return tree_unflatten(tensors, copy.spec), event


class _Saved:
    """The graph's handle on one tensor a recorded stage saved (a `saved_tensors_hooks` pack result).

    It holds a detached alias: a stage output saved by its own node would otherwise hold that
    node through its `grad_fn`, a reference cycle that keeps the storage past its backward.
    """

    __slots__ = ("arriving", "stage", "tensor", "version")

    def __init__(self, tensor: torch.Tensor, stage: int):
        self.tensor: torch.Tensor | None = tensor  # None while its storage is on the host
        self.version = tensor_version(tensor)  # autograd checks no version through hooks: we do
        self.arriving: tuple[Any, torch.device] | None = None  # CUDA: (event, device) of its prefetch
        self.stage = stage


def _unpack(handle: Any) -> Any:
    """The device tensor behind a handle, once its prefetch has copied it (CUDA: the reading stream waits)."""
    if not isinstance(handle, _Saved):
        return handle
    t = handle.tensor
    if t is None:
        raise RuntimeError(
            f"executor bug: stage {handle.stage}'s backward reads what it saved while that is on the host "
            f"(no PrefetchSaved {handle.stage} before B {handle.stage})"
        )
    if handle.arriving is not None:
        event, device = handle.arriving
        torch.cuda.current_stream(device).wait_event(event)  # the engine's stream for this node
    if tensor_version(t) != handle.version:
        raise RuntimeError(
            f"one of the variables needed for gradient computation has been modified by an inplace operation: "
            f"a tensor stage {handle.stage} saved is at version {tensor_version(t)}; expected version "
            f"{handle.version} instead"
        )
    return t


class SavedPart:
    """What the graph of one recorded stage (`Fe k`) saved, behind handles, and the part of it that can move.

    `with part.recording(): out = stage(inp)` records the stage under `saved_tensors_hooks`: each
    saved tensor but parameters and buffers (`fixed`, kept as they are) becomes a handle.
    `settle(a_k, a_{k+1})` then keeps only the handles whose storage can move: not `a_k`'s nor
    `a_{k+1}`'s (the memory model holds those on their own), on the stage's device (that of
    `a_{k+1}`), and held by the handles alone
    (a storage something else holds, a module's cache, would stay on the device: moving it
    frees nothing). `nbytes`, those storages' bytes, is the chain's `offloadable[k]`: the
    profiler and the executor both get it from here, so they agree to the byte.
    """

    def __init__(self, stage: int, fixed: Iterable[torch.Tensor] = ()):
        self.stage = stage
        self.fixed = {storage_id(t.untyped_storage()) for t in fixed if t.layout == torch.strided}
        self.handles: list[_Saved] = []
        self.nbytes = 0

    def recording(self) -> Any:
        """The hooks to record the stage's forward under.

        The graph keeps the pack hook as long as it lives; it reaches the part through a weak
        reference, or the part's handles would outlive their saved tensors' release in the backward.
        """
        part = weakref.ref(self)

        def pack(t: torch.Tensor) -> Any:
            alive = part()
            return t if alive is None else alive._pack(t)

        return torch.autograd.graph.saved_tensors_hooks(pack, _unpack)

    def _pack(self, t: torch.Tensor) -> Any:
        if (
            t.layout != torch.strided
            or t.device.type == "meta"
            or type(t) not in (torch.Tensor, torch.nn.Parameter)  # a subclass: its data may lie elsewhere
            or t.is_conj()  # lazy conjugate and negative views: the channel rebuilds size, strides and dtype only
            or t.is_neg()
            or storage_id(t.untyped_storage()) in self.fixed
        ):
            return t  # a leaf (parameter, buffer) or a tensor the channel cannot move: saved as it is
        handle = _Saved(t.detach(), self.stage)
        self.handles.append(handle)
        return handle

    def settle(self, inputs: Any, outputs: Any) -> int:
        """Keep the handles that can move, right after the forward, with `inputs` (a_k) and `outputs` (a_{k+1})
        still held; returns their storages' bytes (`nbytes`)."""
        values = [t for t in tree_leaves((outputs, inputs)) if _strided(t)]
        stay = {storage_id(t.untyped_storage()) for t in values}
        device = values[0].device if values else None  # the stage's device: a CPU index tensor beside CUDA ones stays
        groups: dict[int, list[_Saved]] = {}
        for h in self.handles:
            assert h.tensor is not None  # nothing moved yet
            groups.setdefault(storage_id(h.tensor.untyped_storage()), []).append(h)
        moving: list[_Saved] = []
        nbytes = 0
        for key, handles in groups.items():
            tensor = handles[0].tensor
            assert tensor is not None
            storage = tensor.untyped_storage()
            # one reference per handle, one for `storage` itself: nothing else holds it
            if key in stay or storage.device != device or storage_use_count(storage) != len(handles) + 1:
                continue
            moving += handles
            nbytes += storage_nbytes(storage, tensor)  # a traced profile's: a sum of storage sizes (size_trace.py)
        self.handles = moving
        self.nbytes = nbytes
        return nbytes

    def take(self) -> tuple[torch.Tensor, ...]:
        """The tensors to move; the handles let go of them (the caller then holds the only references)."""
        for h in self.handles:
            assert h.tensor is not None
            if tensor_version(h.tensor) != h.version:
                _unpack(h)  # raises autograd's in-place error, as plain training would at the backward
        tensors = tuple(h.tensor for h in self.handles if h.tensor is not None)
        for h in self.handles:
            h.tensor = None
        return tensors

    def give(self, tensors: Sequence[torch.Tensor], event: Any, device: torch.device) -> None:
        """The prefetched tensors back into their handles; the part lets go of the handles, so the graph alone
        holds them and its backward frees each as plain autograd frees a saved tensor."""
        for h, t in zip(self.handles, tensors, strict=True):
            h.tensor = t
            h.version = tensor_version(t)
            h.arriving = None if event is None else (event, device)
        self.handles = []


def _strided(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.layout == torch.strided


@dataclass
class Transfers:
    """One step's transfers: the values and saved parts on the host, and the prefetched values compute must
    wait for (a prefetched saved part's handles carry their own event)."""

    channel: TransferChannel
    on_host: dict[int, HostCopy] = field(default_factory=dict)
    arriving: dict[int, tuple[Any, torch.device]] = field(default_factory=dict)  # k: (event, device) of a_k's prefetch
    saved_on_host: dict[int, tuple[SavedPart, HostCopy | None]] = field(default_factory=dict)
    moved: dict[int, int] = field(default_factory=dict)  # per stage: bytes its last OffloadSaved moved

    def offload(self, k: int, value: Any) -> None:
        if k in self.on_host:
            raise RuntimeError(f"executor bug: a_{k} is already on the host")
        self.on_host[k] = self.channel.offload(value)

    def prefetch(self, k: int) -> Any:
        copy = self.on_host.pop(k, None)
        if copy is None:
            raise RuntimeError(f"executor bug: {Op(OpKind.PREFETCH, k).label} without a value on the host")
        device = copy.device
        value, event = self.channel.prefetch(copy)
        del copy  # CPU: the host copy goes now
        if event is not None:
            self.arriving[k] = (event, device)
        return value

    def offload_saved(self, k: int, part: SavedPart) -> None:
        """`OffloadSaved k`: the storages `part` settled on go to the host; no device reference stays."""
        if k in self.saved_on_host:
            raise RuntimeError(f"executor bug: stage {k}'s saved part is already on the host")
        tensors = part.take()
        copy = self.channel.offload(tensors) if tensors else None
        del tensors  # the last device references: the storages are freed (CUDA: once the copy has read them)
        self.saved_on_host[k] = (part, copy)
        self.moved[k] = 0 if copy is None else copy.nbytes

    def prefetch_saved(self, k: int) -> None:
        """`PrefetchSaved k`: the saved part back on the device, views as they were, in the graph's handles."""
        if k not in self.saved_on_host:
            raise RuntimeError(f"executor bug: {Op(OpKind.PREFETCH_SAVED, k).label} without a saved part on the host")
        part, copy = self.saved_on_host.pop(k)
        if copy is None:
            return
        device = copy.device
        tensors, event = self.channel.prefetch(copy)
        del copy  # CPU: the host copy goes now
        part.give(tensors, event, device)

    def wait(self, k: int, saved: bool = False) -> None:
        """`Wait k` (`WaitSaved k`): the offload of a_k (of stage k's saved part) has ended before the next op runs,
        so the allocator may reuse its device memory (docs/memory-model.md, "Debts"). CPU: copies are done when
        issued. CUDA: the host waits for the copy's event, as compute idles in the model."""
        if saved:
            entry = self.saved_on_host.get(k)
            copy = None if entry is None else entry[1]
        else:
            copy = self.on_host.get(k)
        if copy is not None and copy.done is not None:
            copy.done.synchronize()

    def ready(self, k: int) -> None:
        """Compute is about to read `a_k`: make it wait for the prefetch still copying it (CUDA)."""
        arriving = self.arriving.pop(k, None)
        if arriving is not None:
            event, device = arriving
            torch.cuda.current_stream(device).wait_event(event)

    @property
    def host_bytes(self) -> int:
        """Bytes of the values and saved parts on the host now."""
        parts = sum(c.nbytes for _, c in self.saved_on_host.values() if c is not None)
        return sum(c.nbytes for c in self.on_host.values()) + parts

    def clear(self) -> None:
        """The step is over: nothing should be on the host (a valid plan prefetches all); after a failed step,
        the pool buffers still held go back."""
        for copy in self.on_host.values():
            self.channel.discard(copy)
        for _, saved in self.saved_on_host.values():
            if saved is not None:
                self.channel.discard(saved)
        self.on_host.clear()
        self.saved_on_host.clear()
        self.arriving.clear()


def measure_bandwidth(
    device: torch.device | str, nbytes: int = 64 * 2**20, repeats: int = 5, *, warmup: int = 1
) -> float:
    """Bytes/s of the transfer channel on `device`: the slower of device->host and host->device, median of
    `repeats` timed copies of `nbytes` bytes each (CUDA: pinned host memory, timed with events).

    The planner prices an offload and a prefetch at one bandwidth; the slower direction keeps
    the price safe for both.
    """
    device = torch.device(device)
    if repeats < 1 or nbytes < 1:
        raise ValueError(f"repeats and nbytes must be >= 1, got repeats={repeats}, nbytes={nbytes}")
    cuda = device.type == "cuda"
    if cuda:
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        with torch.cuda.device(device):  # events and copies on that device's current stream
            return _timed_copies(device, nbytes, repeats, warmup, cuda)
    return _timed_copies(device, nbytes, repeats, warmup, cuda)


def _timed_copies(device: torch.device, nbytes: int, repeats: int, warmup: int, cuda: bool) -> float:
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    directions = ((host, on_device), (on_device, host))  # (destination, source): device->host, host->device
    rates = []
    for dst, src in directions:
        seconds = []
        for i in range(warmup + repeats):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                dst.copy_(src, non_blocking=True)
                end.record()
                end.synchronize()
                elapsed = start.elapsed_time(end) / 1e3
            else:
                begin = time.perf_counter()
                dst.copy_(src)
                elapsed = time.perf_counter() - begin
            if i >= warmup:
                seconds.append(elapsed)
        rates.append(nbytes / max(statistics.median(seconds), 1e-9))
    return min(rates)
