"""Measure a chain: per-stage times, sizes and transients on the real sample input.

`profile_chain` runs every stage (found by a discovery step, `lightning_rotor.stages`)
on the sample input and fills a `Chain` exactly as
docs/memory-model.md defines each field:

- `out_size`: bytes of the storages of `a_{k+1}`;
- `saved_size`: bytes alive after `F_k` with grad recording, `a_{k+1}` plus the
  graph's saved tensors, not `a_k` nor parameters (`MemoryProbe` accounting);
- `fwd_tmp`: peak above what is alive after `F_k` run recording its graph
  (`Fe`); `fwd_tmp_nograd`: the same for `F_k` run without grad (`Fn`, `Fc`).
  They differ where a stage saves for backward what is otherwise transient
  (attention scores); one figure for both would overcharge one mode;
- `bwd_tmp`: peak during the backward of `F_k` above the inputs of the
  backward and `δ_k` (the probe never counts parameter gradients once stored);
- on CUDA, transients are also read from the caching allocator, which sees
  kernel workspaces, and the larger figure is kept;
- `loss_tmp`: the loss is the caller's; give it as a function of the output
  to have it measured, or bytes; by default a softmax cross-entropy over the
  last dimension is measured (`proxy_loss`), in the caller's autocast state;
- `input_size`: bytes of `a_0`, plus `LOSS_HELD` for the caller's loss value,
  which stays alive through the whole backward (the model has no other place
  for it).

Times are medians of repeated runs after warm-up, on the current thread
count. Profiling leaves no trace: parameters, `.grad`, buffers and the RNG
stream are as they were.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from lightning_rotor.chain import Chain
from lightning_rotor.memory import MemoryProbe, storage_bytes

LOSS_SLACK = 64  # bytes for the loss's scalars while it is differentiated
LOSS_HELD = 64  # bytes of the caller's loss value, alive through the whole backward; charged with a_0


class InplaceError(RuntimeError):
    """A stage modified its input in place, which would corrupt a kept checkpoint."""


# -- values (a tensor or a nested tuple of tensors) -----------------------------------------
def tensors_of(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def differentiable(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def detach_value(value: Any, requires_grad: bool) -> Any:
    """Aliases of `value` cut from any graph, as leaves that require grad when asked and possible."""

    def leaf(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        d = t.detach()
        if requires_grad and differentiable(d):
            d.requires_grad_(True)
        return d

    return tree_map(leaf, value)


class no_cast_cache:
    """Run a stage without autocast's weight-cast cache.

    The cache keeps low-precision copies of parameters alive until the outermost
    autocast region exits, which no stage's measurement could charge. Without it,
    each cast lives exactly as long as the graph that saved it (and is measured
    with the stage); the values are the same casts, so results are identical.
    """

    def __enter__(self) -> None:
        self.enabled = torch.is_autocast_cache_enabled()
        torch.set_autocast_cache_enabled(False)

    def __exit__(self, *exc: Any) -> None:
        torch.set_autocast_cache_enabled(self.enabled)


def versions(value: Any) -> list[int]:
    return [t._version for t in tensors_of(value)]


def check_inplace(before: list[int], value: Any, k: int, name: str) -> None:
    if versions(value) != before:
        raise InplaceError(
            f"stage {k} ({name}) modified its input in place, which would corrupt a kept checkpoint; "
            "make the operation out-of-place or put it in the same stage as the module before it"
        )


def passed_through(inp: Any, out: Any) -> int:
    """Bytes of a tuple output's storages that are input tensors returned as they are (carried skips).

    A single-tensor output is left alone: it counts in full, as before.
    """
    if isinstance(out, torch.Tensor):
        return 0
    ins = {id(t) for t in tensors_of(inp)}
    return storage_bytes([t for t in tensors_of(out) if id(t) in ins])


def backward_pairs(outputs: Any, grads: Sequence[torch.Tensor | None]) -> tuple[list, list]:
    """(tensors, grads) of the outputs that carry a graph and received a gradient."""
    outs, gs = [], []
    for t, g in zip(tensors_of(outputs), grads, strict=True):
        if t.requires_grad and g is not None:
            outs.append(t)
            gs.append(g)
    return outs, gs


# -- profiling ------------------------------------------------------------------------------
@dataclass
class Profile:
    """A measured chain plus how it was measured."""

    chain: Chain
    seconds: float  # wall time of profiling
    fwd_spread: list[float] = field(default_factory=list)  # (max - min) / median of each stage's runs
    bwd_spread: list[float] = field(default_factory=list)
    repeats: int = 0
    threads: int = 0

    @property
    def spread(self) -> float:
        """Worst relative spread of any stage's timing runs (noise of the measurement)."""
        return max(self.fwd_spread + self.bwd_spread, default=0.0)


def proxy_loss(output: Any) -> torch.Tensor:
    """The loss measured when the caller's is unknown: softmax cross-entropy over the last dim.

    It is the common classification and language-model loss, and among the hungrier
    ones (log-probabilities in float32 even under autocast, and their gradient).
    One-dimensional outputs get a squared error instead.
    """
    total = None
    for t in tensors_of(output):
        if not differentiable(t):
            continue
        if t.dim() >= 2:
            flat = t.reshape(-1, t.shape[-1])
            part = F.cross_entropy(flat, torch.zeros(flat.shape[0], dtype=torch.long, device=t.device))
        else:
            part = F.mse_loss(t, torch.zeros_like(t))
        total = part if total is None else total + part
    if total is None:
        raise TypeError("the chain output has no floating-point tensor to take a loss of")
    return total


def measure_loss_tmp(output: Any, loss_fn: Callable[[Any], torch.Tensor] = proxy_loss) -> int:
    """Bytes above `a_L` and `δ_L` while `loss_fn(a_L)` runs forward and backward, plus `LOSS_SLACK`."""
    out = detach_value(output, True)
    leaves = [t for t in tensors_of(out) if t.requires_grad]
    with MemoryProbe() as probe:
        probe.track(out)
        loss = loss_fn(out)
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
        probe.track(grads)
        del loss, grads
    return max(0, probe.peak - 2 * storage_bytes(output)) + LOSS_SLACK


def synchronize(device: torch.device) -> None:
    """Wait for queued device work, so wall-clock times measure it (a no-op off CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _AllocatorWatch:
    """On CUDA, the caching allocator's view of a block: (peak, end) bytes above its start.

    It sees kernel workspaces, which tensor accounting cannot; the profiler keeps
    the larger of the two figures. Elsewhere it reports nothing.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.on = device.type == "cuda"
        self.base = 0

    def start(self) -> None:
        if self.on:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)

    def stop(self) -> tuple[int, int]:
        if not self.on:
            return 0, 0
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - self.base
        return peak, torch.cuda.memory_allocated(self.device) - self.base


def _median_spread(samples: list[float]) -> tuple[float, float]:
    med = statistics.median(samples)
    return med, (max(samples) - min(samples)) / med if med > 0 else 0.0


class _Untouched:
    """Keep profiling invisible: buffers restored, `.grad` put back, RNG forked."""

    def __init__(self, stages: Sequence[nn.Module], device: torch.device):
        self.buffers = [b for s in stages for b in s.buffers()]
        self.params = [p for s in stages for p in s.parameters()]
        self.devices = [device] if device.type == "cuda" else []

    def __enter__(self) -> _Untouched:
        with torch.no_grad():
            self.saved_buffers = [b.clone() for b in self.buffers]
        self.saved_grads = [p.grad for p in self.params]
        self.rng = torch.random.fork_rng(devices=self.devices)
        self.rng.__enter__()
        return self

    def clear_grads(self) -> None:
        for p in self.params:
            p.grad = None

    def restore_buffers(self) -> None:
        with torch.no_grad():
            for b, s in zip(self.buffers, self.saved_buffers, strict=True):
                b.copy_(s)

    def __exit__(self, *exc: Any) -> None:
        self.restore_buffers()
        for p, g in zip(self.params, self.saved_grads, strict=True):
            p.grad = g
        self.rng.__exit__(*exc)


def profile_chain(
    stages: Sequence[nn.Module],
    sample: Any,
    *,
    names: Sequence[str] | None = None,
    repeats: int = 3,
    warmup: int = 1,
    loss_tmp: int | Callable[[Any], torch.Tensor] | None = None,
    progress: Callable[[int, int, float], None] | None = None,
) -> Profile:
    """Measure `stages` on `sample` (the chain input `a_0`); see the module docstring.

    `progress(stages_done, stages, seconds)` is called after each stage, for a progress line.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    names = list(names) if names is not None else [f"stage{k}" for k in range(len(stages))]
    inputs = tensors_of(sample)
    if not inputs:
        raise TypeError("the chain input must be a tensor or a tuple of tensors")
    device = inputs[0].device
    exclude = list(stages)
    start = time.perf_counter()
    names_of_fields = ("out_size", "saved_size", "fwd_time", "bwd_time", "fwd_tmp", "fwd_tmp_nograd", "bwd_tmp")
    fields: dict[str, list] = {f: [] for f in names_of_fields}
    fwd_spread, bwd_spread = [], []
    needs_grad = any(t.requires_grad for t in inputs)
    watch = _AllocatorWatch(device)
    value = sample
    with _Untouched(stages, device) as untouched:
        for k, stage in enumerate(stages):
            grad_in = needs_grad if k == 0 else True

            def forward(record: bool, stage=stage, k=k, value=value, grad_in=grad_in) -> tuple[Any, Any]:
                inp = detach_value(value, grad_in and record)
                before = versions(value)
                with torch.set_grad_enabled(record), no_cast_cache():
                    out = stage(inp)
                check_inplace(before, value, k, names[k])
                return inp, out

            # memory without grad recording (Fn / Fc)
            with MemoryProbe(exclude) as probe:
                probe.track(value)  # a_k is held before the stage runs; only what comes after counts
                watch.start()
                _, out = forward(False)
                peak, end = watch.stop()
                probe.mark("after")
            out_size = storage_bytes(out)
            tmp_nograd = max(probe.peak - probe.current, peak - end)
            untouched.restore_buffers()
            # memory with grad recording (Fe), then its backward (B)
            with MemoryProbe(exclude) as probe:
                probe.track(value)
                base = probe.current
                watch.start()
                inp, out = forward(True)
                peak, end = watch.stop()
                probe.mark("after")
                fwd_tmp = max(probe.peak - probe.current, peak - end)
                # an output aliasing a_k still counts, except tensors passed through unchanged (a skip
                # carried across the stage): they are a_k's, held beside ā_{k+1} from Fe k to B k
                saved_size = max(probe.current - base, out_size - passed_through(inp, out), end)
                grads = [torch.ones_like(t) if t.requires_grad else None for t in tensors_of(out)]
                outs, gs = backward_pairs(out, grads)
                bwd_tmp = 0
                if outs:
                    probe.reset_peak()
                    before_backward = probe.current
                    untouched.clear_grads()
                    watch.start()
                    with torch.autocast(device.type, enabled=False):
                        torch.autograd.backward(outs, gs)
                    peak, _ = watch.stop()
                    del outs, gs, grads
                    bwd_tmp = max(0, probe.peak - before_backward - storage_bytes(value), peak - storage_bytes(value))
                    untouched.clear_grads()
                del inp, out
            untouched.restore_buffers()
            # times
            fwd_samples, bwd_samples = [], []
            for run in range(warmup + repeats):
                synchronize(device)
                t0 = time.perf_counter()
                inp, out = forward(True)
                synchronize(device)
                t1 = time.perf_counter()
                outs, gs = backward_pairs(out, [torch.ones_like(t) for t in tensors_of(out)])
                if outs:
                    synchronize(device)
                    t2 = time.perf_counter()
                    with torch.autocast(device.type, enabled=False):
                        torch.autograd.backward(outs, gs)
                    synchronize(device)
                    t3 = time.perf_counter()
                else:
                    t2 = t3 = 0.0
                untouched.clear_grads()
                untouched.restore_buffers()
                if run >= warmup:
                    fwd_samples.append(t1 - t0)
                    bwd_samples.append(t3 - t2)
                del inp, out, outs, gs
            fwd_time, fs = _median_spread(fwd_samples)
            bwd_time, bs = _median_spread(bwd_samples)
            fwd_spread.append(fs)
            bwd_spread.append(bs)
            for name, v in zip(
                names_of_fields,
                (out_size, saved_size, fwd_time, bwd_time, fwd_tmp, tmp_nograd, bwd_tmp),
                strict=True,
            ):
                fields[name].append(v)
            # the next stage's sample input
            with torch.no_grad(), no_cast_cache():
                value = stage(value)
            untouched.restore_buffers()
            if progress is not None:
                progress(k + 1, len(stages), time.perf_counter() - start)
    if loss_tmp is None or callable(loss_tmp):
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            loss_bytes = measure_loss_tmp(value, loss_tmp or proxy_loss)
    else:
        loss_bytes = int(loss_tmp)
    chain = Chain(input_size=storage_bytes(sample) + LOSS_HELD, loss_tmp=loss_bytes, names=names, **fields)
    seconds = time.perf_counter() - start
    threads = torch.get_num_threads()
    return Profile(chain, seconds, fwd_spread, bwd_spread, repeats=repeats, threads=threads)
