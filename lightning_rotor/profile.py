"""Measure a chain: per-stage times, sizes and transients on the real sample input.

`profile_chain` runs every stage (found by a discovery step, `lightning_rotor.stages`) on the
sample input, as the executor runs it (lightning_rotor/engine.py), and fills a `Chain` (see
NOTE: [what each field measures]). Profiling leaves no trace on training (`Untouched`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import statistics
import time
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import get_gradient_edge

from lightning_rotor._torch_compat import (
    GlobalFlops,
    StorageWeakRef,
    TorchDispatchMode,
    accumulated_leaf,
    storage_use_count,
    tree_flatten,
    tree_unflatten,
)
from lightning_rotor.chain import Chain, StageOption, StageProfile
from lightning_rotor.engine import (
    HandOver,
    InputParts,
    backward_from_edges,
    backward_pairs,
    check_inplace,
    compact_gradients,
    detach_value,
    differentiable,
    enter_stage,
    no_cast_cache,
    output_edges,
    tensors_of,
    value_device,
    versions,
)
from lightning_rotor.memory import Excluded, MemoryProbe, storage_bytes, storage_key, storage_nbytes
from lightning_rotor.offload import SavedPart
from lightning_rotor.selective import EXPENSIVE_OPS, run_selective
from lightning_rotor.twins import python_backward, stage_key, value_structure

# NOTE: [what each field measures] profile_chain fills a `Chain` exactly as docs/memory-model.md
# defines each field:
# - `out_size`: bytes of the storages of `a_{k+1}`;
# - `saved_size`: bytes alive after `F_k` with grad recording beside `a_k`: `a_{k+1}`
#   plus the graph's saved tensors, not `a_k` nor parameters (`MemoryProbe`
#   accounting); an output that is a view of `a_k`, or tensors of `a_k` passed
#   through, add nothing (`ā_{k+1}` is only ever held beside `a_k`);
# - `out_free`: bytes freed when the output values are dropped and the graph kept
#   (what the graph does not save), as the executor does before `B k`;
# - `in_free`: bytes of `a_k` that neither `F_{k-1}`'s graph nor `F_k`'s keeps, freed
#   when the executor lets go of `a_k` after stage k's last forward (0 for `a_0`);
# - `fwd_tmp`: peak above what is alive after `F_k` run recording its graph
#   (`Fe`); `fwd_tmp_nograd`: the same for `F_k` run without grad (`Fn`, `Fc`).
#   They differ where a stage saves for backward what is otherwise transient
#   (attention scores); one figure for both would overcharge one mode;
# - `bwd_tmp` (signed): the peak of the backward of `F_k`, run as the executor
#   runs it (values released, backpropagated from the output edges, `δ_{k+1}`
#   freed once consumed below the last stage), above `cur - out_free + s_k`;
#   measured with parameter gradients absent and already stored, the larger kept;
# - on CUDA, transients are also read from the caching allocator, which sees
#   kernel workspaces, and the larger figure is kept;
# - `loss_tmp`, `loss_tmp_kept` (signed): the loss is the caller's; give it as a
#   function of the output to have it measured, or bytes; by default a softmax
#   cross-entropy over the last dimension is measured (`proxy_loss`), in the
#   caller's autocast state, on a plain `a_L` handed over and on one kept alive;
# - `frozen`: the stages before the first one that needs a backward (the input does not
#   require grad and nothing of their output does); they are measured once, as `Fn`, and
#   the first stage after them gets its input without grad, as plain autograd gives it;
# - `input_size`: bytes of `a_0`; `loss_value`: the loss value and its seed gradient,
#   held from the end of the loss to the end of the step (`LOSS_HELD` bytes when the
#   loss is given as bytes);
# - `offloadable` (only when profiled with `offload=True`): per stage, the bytes of the storages
#   the recorded `Fe k` saved that `OffloadSaved k` moves, found by `offload.SavedPart` in the
#   recorded measurement run, exactly as the executor finds them.
#
# NOTE: [stage times]
# Times are taken in rounds over the whole chain, on the current thread count:
# each stage's fastest run, scaled so that the stages add up to the median round
# (`stage_times`). Profiling leaves no trace: parameters, `.grad` (the very
# tensors, unchanged), buffers and the RNG stream are as they were (`Untouched`).

LOSS_HELD = 64  # bytes of the caller's loss value when the loss is not measured (given as bytes)


# -- profiling ------------------------------------------------------------------------------
@dataclass
class Profile:
    """A measured chain plus how it was measured."""

    chain: Chain
    seconds: float  # wall time of profiling
    fwd_spread: list[float] = field(default_factory=list)  # (max - min) / median of each stage's runs
    bwd_spread: list[float] = field(default_factory=list)
    repeats: int = 0  # timing rounds run
    threads: int = 0
    round_seconds: list[float] = field(default_factory=list)  # per round: the sum of every stage's F and B
    # per tensor of a_0: how many edges of stage 0's graph take it (empty: not measured), so that the executor
    # hands its gradient back in as many parts (NOTE: [a run's input gradient in parts], engine.py)
    input_uses: list[int] = field(default_factory=list)
    twins: dict[int, int] = field(default_factory=dict)  # a stage that took a twin's figures: that twin's index
    # per stage, its forward's FLOPs, counted in the walk (`flops=True`, NOTE: [FLOPs counted in the walk]); None:
    # not asked, or the counter failed where the stage did not
    flops: list[int] | None = None

    @property
    def spread(self) -> float:
        """Worst relative spread of any stage's timing runs (noise of the measurement)."""
        return max(self.fwd_spread + self.bwd_spread, default=0.0)

    @property
    def step_spread(self) -> float:
        """Relative spread of the rounds' plain step times (all stages' F and B): the noise a plan sees."""
        return _spread(self.round_seconds) if self.round_seconds else 0.0


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


def output_loss(output: Any) -> torch.Tensor | None:
    """The loss a model's output carries, when its forward computed one: a Hugging Face
    `ModelOutput`'s `.loss` (set when `labels` are passed), or a mapping's `"loss"`; else None.

    A tensor that does not require grad (no labels, or no graph) is no loss to backpropagate from.
    """
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.requires_grad and differentiable(loss):
        return loss
    return None


def caller_loss(output: Any, loss_fn: Callable[[Any], torch.Tensor] | None = None) -> torch.Tensor:
    """The loss a training step backpropagates from, for measuring: the first that applies of
    the caller's `loss_fn`, the loss the output carries (`output_loss`), a stand-in (`proxy_loss`).

    The output's own loss is already in the measured forward: a stand-in over its other
    tensors (logits) would charge a second loss no step computes (issue 17).
    """
    if loss_fn is not None:
        return loss_fn(output)
    own = output_loss(output)
    return own if own is not None else proxy_loss(output)


def leaves_reached(roots: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The leaves (parameters, inputs that require grad) a backward from `roots` accumulates into, once each."""
    leaves, seen, todo = [], set(), [t.grad_fn for t in roots]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        leaf = accumulated_leaf(node)
        if leaf is not None:
            leaves.append(leaf)
        todo.extend(next_node for next_node, _ in node.next_functions)
    return leaves


@contextlib.contextmanager
def grads_aside(root: torch.Tensor) -> Iterator[None]:
    """Set aside `.grad` of every leaf a backward from `root` reaches; put the very tensors back after.

    For a measuring backward through code that is not a stage (a caller's loss), whose
    parameters `Untouched` does not know.
    """
    leaves = leaves_reached([root])
    saved = [t.grad for t in leaves]
    for t in leaves:
        t.grad = None
    try:
        yield
    finally:
        for t, g in zip(leaves, saved, strict=True):
            t.grad = g


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while profiling, on again after (if it was).

    NOTE: [cyclic garbage in profiles] a tensor kept by a reference cycle (a stage that keeps notes on its
    activations in objects that refer to each other) dies when the collector runs, and it runs after so
    many allocations since its last run: with it on, a stage's figures depended on what the process ran
    before (a fwd_tmp_nograd of 8 KiB in one process, 40 KiB in another). Off, such garbage dies only at
    `collect_young()`, at the end of each measured run: charged to the transient of the op that made it,
    in every process alike.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def collect_young() -> None:
    """Free the reference cycles made since the last collection (NOTE: [cyclic garbage in profiles]): the
    youngest generation only, cheap, as nothing was collected since the run began."""
    gc.collect(0)


class LossInput:
    """The measured loss's end of `HandOver`: a copy of `a_L` to hand over, and `δ_L` once it comes."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.tensors = tensors
        self.grads: tuple[torch.Tensor | None, ...] | None = None

    def hand_over(self) -> list[torch.Tensor]:
        tensors, self.tensors = self.tensors, []  # the node keeps nothing: only the loss holds them
        return tensors

    def receive(self, grads: tuple[torch.Tensor | None, ...]) -> None:
        self.grads = grads


def _loss_peak(output: Any, loss_fn: Callable[[Any], torch.Tensor], keep: bool) -> tuple[int, int]:
    """(peak bytes, loss value bytes) of `loss_fn` on a fresh copy of `a_L`, `a_L` and `δ_L` included.

    The loss value bytes count the value and the gradient `backward()` seeds it with:
    the caller holds both until its backward returns.

    The copy is handed to the loss and dropped (`keep=False`, a plain `a_L`), or kept
    alive throughout (`keep=True`, an `a_L` whose storage a stage's graph also holds).
    """
    flat, spec = tree_flatten(output)
    copies = [t.detach().clone() if isinstance(t, torch.Tensor) else t for t in flat]
    with MemoryProbe() as probe:
        probe.track(copies)
        end = LossInput([t for t in copies if isinstance(t, torch.Tensor)])
        kept = list(end.tensors) if keep else None
        del copies
        dummy = torch.empty(0, requires_grad=True)
        handed = iter(HandOver.apply(end, dummy))
        holder = [tree_unflatten([next(handed) if isinstance(t, torch.Tensor) else t for t in flat], spec)]
        del handed
        loss = loss_fn(holder.pop())
        value_bytes = 2 * storage_bytes(loss)  # the value and the gradient backward seeds it with, both held to the end
        with grads_aside(loss):  # a loss with parameters of its own: their .grad is the caller's
            loss.backward()
        probe.track(end.grads)
        del loss, kept, end
    return probe.peak, value_bytes


def measure_loss_tmp(output: Any, loss_fn: Callable[[Any], torch.Tensor] = proxy_loss) -> tuple[int, int, int]:
    """(`loss_tmp`, `loss_tmp_kept`, loss value bytes): the loss's peak above `a_L` and `δ_L`.

    `loss_tmp` hands a plain `a_L` to the loss, which may free it before its backward
    (cross-entropy keeps its log-probabilities, not its input); `loss_tmp_kept` keeps
    `a_L` alive throughout, as when a stage's graph also saved it. Both are signed, and
    include the loss value only where it exists at the peak (a peak in the loss's forward
    comes before it). The loss value then stays alive to the end of the step: the chain's
    `loss_value`, held from the end of `Loss` on.
    """
    size = storage_bytes(output)
    (plain, value), (kept, _) = (_loss_peak(output, loss_fn, keep) for keep in (False, True))
    plain, kept = plain - 2 * size, kept - 2 * size
    return max(-size, plain), max(-size, plain, kept), value


def synchronize(device: torch.device) -> None:
    """Wait for queued device work, so wall-clock times measure it (a no-op off CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _AllocatorWatch:
    """On CUDA, the caching allocator's view of a block: (peak, end) bytes above its start.

    It sees kernel workspaces, which tensor accounting cannot; the profiler keeps
    the larger of the two figures. Elsewhere it reports nothing.
    """

    def __init__(self, device: torch.device, on: bool = True):
        self.device = device
        self.on = on and device.type == "cuda"
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


def _spread(samples: list[float]) -> float:
    """(max - min) / median: how far apart the timed runs were."""
    med = statistics.median(samples)
    return (max(samples) - min(samples)) / med if med > 0 else 0.0


PROFILE_STEPS = 6  # profiling stops adding timing rounds once it has taken this many plain steps
MIN_ROUNDS = 2  # timing rounds run whatever the time: two, to tell a stalled run from a steady one
AGREE = 0.1  # a stage's two fastest runs agree within this fraction of the faster (NOTE: [settled timing])
AGREE_ROUND = 0.01  # or within this fraction of the median round (a stage too short to time that finely)


def _stage_forward(
    stage: nn.Module, value: Any, grad_in: bool, k: int, name: str, record: bool, selective: bool = False
) -> tuple[Any, Any]:
    """(input leaf, output) of stage `k` run on a detached `value`, recording its graph when `record`
    (`selective`: recording option "sac", as the executor runs `Fs k:1`).

    The executor enters stage inputs through `EnterStage` instead; a leaf's accumulator may copy
    `δ_k`, which charges `B k` more than the executor holds, the safe side (docs/memory-model.md,
    "Stage inputs enter through `EnterStage`"). Gradients are compacted as the executor compacts them.
    """
    inp = detach_value(value, grad_in and record)
    if k > 0 and grad_in and record:
        compact_gradients(inp)
    before = versions(value)
    try:
        with torch.set_grad_enabled(record), no_cast_cache():
            out = run_selective(stage, inp) if selective else stage(inp)
    except RuntimeError:
        if record and grad_in:  # torch refuses an in-place write into a leaf: name the stage as the executor would
            _refuse_write_into_input(stage, value, before, k, name)
        raise
    check_inplace(before, value, k, name)
    return inp, out


def _refuse_write_into_input(stage: nn.Module, value: Any, before: list[int], k: int, name: str) -> None:
    """Raise `InplaceError` where a stage writes into its input: run without a graph on a view of `value`, whose
    version counter it shares, so the write shows (the run then fails anyway, so its side effects do not matter)."""
    with contextlib.suppress(RuntimeError), torch.no_grad():
        stage(detach_value(value, False))
    check_inplace(before, value, k, name)


def _timed_run(
    forward: Callable[[bool], tuple[Any, Any]], device: torch.device, untouched: Untouched
) -> tuple[float, float]:
    """Seconds of one `Fe` and of its `B` (0 without a graph), run as the executor runs them."""
    synchronize(device)
    t0 = time.perf_counter()
    inp, out = forward(True)
    synchronize(device)
    t1 = time.perf_counter()
    held = [out]
    del out
    bwd = _timed_backward(held, device, untouched)
    del inp
    return t1 - t0, bwd


def _timed_backward(held: list[Any], device: torch.device, untouched: Untouched) -> float:
    """Seconds of `B k` from the output in `held` (emptied here: the output values go first, as the executor runs
    `B k`, so profiling stays within it), then the stages' gradients and buffers put back."""
    outs, gs = backward_pairs(held[0], [torch.ones_like(t) for t in tensors_of(held[0])])
    edges = output_edges(outs)
    held.clear()
    del outs
    bwd = 0.0
    if edges:
        synchronize(device)
        t0 = time.perf_counter()
        with torch.autocast(device.type, enabled=False):
            backward_from_edges(edges, gs, free_grads=True)
        synchronize(device)
        bwd = time.perf_counter() - t0
    del edges, gs
    untouched.clear_grads()
    untouched.restore_buffers()
    return bwd


def _timed_run_frozen(forward: Callable[[bool], tuple[Any, Any]], device: torch.device, untouched: Untouched) -> float:
    """Seconds of one forward without grad of a frozen stage."""
    synchronize(device)
    t0 = time.perf_counter()
    forward(False)
    synchronize(device)
    seconds = time.perf_counter() - t0
    untouched.restore_buffers()
    return seconds


def _timed_rounds(
    stages: Sequence[nn.Module],
    sample: Any,
    needs_grad: bool,
    names: Sequence[str],
    device: torch.device,
    untouched: Untouched,
    repeats: int,
    start: float,
    frozen: int,
    selective: dict[int, list[float]] | None = None,
    first: tuple[list[float], list[float]] | None = None,
) -> tuple[list[list[float]], list[list[float]]]:
    """Per stage, the forward and backward seconds of each round (`repeats` at most).

    `selective`: stages whose option "sac" is timed too, in the same round after their `Fe`;
    each gets its runs appended as (forward, backward) pairs, flat. `first`: each stage's first sample, taken in
    the walk (NOTE: [the first timing sample in the walk]): it counts as the first round.

    A round times every stage's `Fe` and `B` once, in chain order, each on its input made
    anew without grad: a burst of load then slows one run of every stage of a round, not
    every run of one stage (which would make that stage look dear and change the plan). Rounds stop early, after
    `MIN_ROUNDS`, once the times are settled (`_settled`) or profiling has taken `PROFILE_STEPS` plain steps (the
    median round) in all.
    """
    fwd: list[list[float]] = [[] for _ in stages] if first is None else [[f] for f in first[0]]
    bwd: list[list[float]] = [[] for _ in stages] if first is None else [[b] for b in first[1]]
    totals: list[float] = [] if first is None else [sum(f + b for f, b in zip(*first, strict=True))]
    for _ in range(repeats - len(totals)):
        value = sample
        for k, stage in enumerate(stages):
            forward = functools.partial(_stage_forward, stage, value, needs_grad if k <= frozen else True, k, names[k])
            if k < frozen:  # a frozen stage runs once, without grad, and has no backward (chain version 4)
                f, b = _timed_run_frozen(forward, device, untouched), 0.0
            else:
                f, b = _timed_run(forward, device, untouched)
                if selective is not None and k in selective:
                    selective[k].extend(_timed_run(functools.partial(forward, selective=True), device, untouched))
            fwd[k].append(f)
            bwd[k].append(b)
            if k + 1 < len(stages):  # the next input, made after B k: profiling never holds more than B k does
                with torch.no_grad(), no_cast_cache():
                    value = stage(value)
                untouched.restore_buffers()
        del value, forward
        totals.append(sum(f[-1] + b[-1] for f, b in zip(fwd, bwd, strict=True)))
        if len(totals) >= MIN_ROUNDS and (
            _settled(fwd, bwd, statistics.median(totals))
            or time.perf_counter() - start > (PROFILE_STEPS - 1) * statistics.median(totals)
        ):
            break
    return fwd, bwd


CUDA_WARMUP_ROUNDS = 0  # untimed rounds before timing rounds, on CUDA only: off (NOTE: [warm timing rounds on CUDA])


def _warm_up_rounds(
    stages: Sequence[nn.Module],
    sample: Any,
    needs_grad: bool,
    names: Sequence[str],
    device: torch.device,
    untouched: Untouched,
    rounds: int,
    start: float,
    frozen: int,
    selective: dict[int, list[float]],
) -> None:
    """On CUDA, up to `CUDA_WARMUP_ROUNDS` rounds run as the timing rounds run them (they stop as those do, once
    two are settled), their times dropped.

    NOTE: [warm timing rounds on CUDA] on a GPU the memory runs take longer than `PROFILE_STEPS` rounds, so
    profiling stops after `MIN_ROUNDS` (two) timing rounds. Whatever is still cold in the first of them (cuDNN's
    first calls, the caching allocator's blocks, clocks) was suspected of ResNet conv stages profiling about 1.5x
    their steady time on an H200. `benchmarks/cuda_stage_times.py` measured it (docs/gpu_check_h200.md, "Conv stage
    times"): in a fresh process's first profile, a training's case, one warm-up round made the ratio worse (1.50x
    to 1.61x, 1.52x to 1.63x), and the gap is mostly each stage timed alone, without its neighbours' overlap. So
    `CUDA_WARMUP_ROUNDS` is 0: the rounds are kept for that script's comparison. Off CUDA nothing runs."""
    if device.type != "cuda" or rounds == 0 or CUDA_WARMUP_ROUNDS == 0:
        return
    spare: dict[int, list[float]] = {k: [] for k in selective}  # the options' kernels warmed too
    _timed_rounds(stages, sample, needs_grad, names, device, untouched, CUDA_WARMUP_ROUNDS, start, frozen, spare)


def _settled(fwd: list[list[float]], bwd: list[list[float]], round_seconds: float) -> bool:
    """Whether another timing round is unlikely to change a stage's time: every stage's two fastest forward runs,
    and two fastest backward runs, agree within `AGREE` of the faster or `AGREE_ROUND` of a round.

    NOTE: [settled timing] a stage's time is its fastest run (`stage_times`), wrong only where every run of it
    was stalled; two runs, in two rounds, that agree are either both steady or stalled alike, which a burst of
    load on a shared machine rarely does. Profiling ran three rounds whatever they showed, and went on up to
    `repeats` while it had taken fewer than ten plain steps (`PROFILE_STEPS`, now six): ten plain steps on a quiet
    machine too, where two rounds agree; on a loaded one the rounds go on, within the six."""
    for runs in fwd + bwd:
        faster, slower = sorted(runs)[:2]
        if slower - faster > max(AGREE * faster, AGREE_ROUND * round_seconds):
            return False
    return True


def stage_times(fwd: list[list[float]], bwd: list[list[float]]) -> tuple[list[float], list[float]]:
    """Per stage (forward, backward) seconds from timing rounds: each stage's fastest run, scaled to the median round.

    The fastest run of a stage is the one no stall or burst of load slowed: stage against
    stage, these decide the plan, and no stalled run can. One common factor (which does not
    change the planner's choice) makes them add up to the median round, so the predicted
    step keeps the load the whole chain met while profiling, and one stalled round of three
    does not decide it.
    """
    f_min, b_min = [min(runs) for runs in fwd], [min(runs) for runs in bwd]
    scale = _round_scale(fwd, bwd)
    return [t * scale for t in f_min], [t * scale for t in b_min]


def _round_scale(fwd: list[list[float]], bwd: list[list[float]]) -> float:
    """The common factor `stage_times` applies to each stage's fastest run (1 without times)."""
    fastest = sum(min(runs) for runs in fwd) + sum(min(runs) for runs in bwd)
    return statistics.median(round_totals(fwd, bwd)) / fastest if fastest > 0 else 1.0


def round_totals(fwd: list[list[float]], bwd: list[list[float]]) -> list[float]:
    """Per timing round, the seconds of every stage's forward and backward: a plain step."""
    return [sum(f[r] + b[r] for f, b in zip(fwd, bwd, strict=True)) for r in range(len(fwd[0]) if fwd else 0)]


class Untouched:
    """Keep profiling invisible to training: `.grad` set aside, buffers restored, RNG forked, no cast cached.

    On entry each parameter's `.grad` is set aside (`None`), so a profiling backward stores
    gradients of its own instead of adding into the caller's (gradient accumulation,
    `zero_grad(set_to_none=False)`); on exit the very same tensors are put back, unchanged.
    A buffer a profiling run changed in place (BatchNorm's running statistics) gets its value
    back; the others are not written, so a graph that saved one stays valid. Autocast's
    weight-cast cache is off inside: a cast cached by a measured forward would be the one the
    step's forward then reuses, its backward node older, and a weight used both cast and uncast
    (T5's and BART's tied embedding) would sum its gradient in another order than plain training.
    """

    def __init__(self, modules: Sequence[nn.Module], devices: Sequence[torch.device] = ()):
        self.params = list({id(p): p for m in modules for p in m.parameters()}.values())
        self.buffers = list({id(b): b for m in modules for b in m.buffers()}.values())
        self.devices = sorted({d for d in devices if d.type == "cuda"}, key=str)

    def __enter__(self) -> Untouched:
        self.saved_grads = [p.grad for p in self.params]
        self.clear_grads()
        with torch.no_grad():
            self.saved_buffers = [b.clone() for b in self.buffers]
        self.rng = torch.random.fork_rng(devices=self.devices)
        self.rng.__enter__()
        self.casts = no_cast_cache()
        self.casts.__enter__()
        return self

    def clear_grads(self) -> None:
        for p in self.params:
            p.grad = None

    def restore_buffers(self) -> None:
        with torch.no_grad():
            for b, saved in zip(self.buffers, self.saved_buffers, strict=True):
                # by value: batch_norm updates its running statistics without bumping their version
                if not torch.equal(b, saved):
                    b.copy_(saved)

    def __exit__(self, *exc: Any) -> None:
        try:
            self.restore_buffers()
            for p, g in zip(self.params, self.saved_grads, strict=True):
                p.grad = g
        finally:
            self.casts.__exit__(*exc)
            self.rng.__exit__(*exc)


@dataclass(frozen=True, eq=False)
class _Context:
    """What every measurement of one profile shares: how it measures, and what it was asked to measure."""

    sample: Any  # the chain input a_0, held by the caller throughout
    exclude: Excluded  # the stages' parameters and buffers, found once: not activations
    watch: _AllocatorWatch
    untouched: Untouched
    device: torch.device
    needs_grad: bool  # the chain input requires grad
    options: bool = False  # measure option "sac" of each stage (chain version 5)
    offload: bool = False  # measure each stage's offloadable bytes (chain version 6)
    warmup: int = 0  # untimed runs of each stage after its memory runs
    timed: bool = False  # the first timing sample of each stage taken in the walk (NOTE: [the first timing sample...])
    twins: bool = True  # a stage of a measured one's structure may take its figures (NOTE: [twin stages])
    counter: GlobalFlops | None = None  # counts FLOPs in each no-grad run (NOTE: [FLOPs counted in the walk])


@dataclass(frozen=True, eq=False)
class _StageRun:
    """Stage `k` on its sample input `a_k` (`value`), run as the executor runs it (`forward`)."""

    stage: nn.Module
    k: int
    name: str
    value: Any
    grad_in: bool  # a_k enters requiring grad (not a_0 that does not, nor a_F after a frozen prefix)

    def forward(self, record: bool, selective: bool = False) -> tuple[Any, Any]:
        """(input leaf, output) of the stage, recording its graph when `record` (`_stage_forward`)."""
        return _stage_forward(self.stage, self.value, self.grad_in, self.k, self.name, record, selective)

    @functools.cached_property
    def key(self) -> Hashable:
        """The structure of the stage and of its input: what a twin shares (NOTE: [twin stages]), what a FLOP count
        stands for (NOTE: [FLOPs counted in the walk])."""
        return stage_key(self.stage, self.value)

    @property
    def input_parts(self) -> bool:
        """Stage 0 with an input that requires grad: its input gradient's parts are measured (`_measure_recorded`)."""
        return self.k == 0 and self.grad_in


@dataclass(frozen=True)
class _Recorded:
    """Figures of one measured `Fe k` then `B k` (`_measure_recorded`)."""

    fwd_tmp: int
    saved: int  # bytes the recording leaves alive beside a_k: ā_{k+1}
    out_free: int  # bytes freed when the output values are dropped and the graph kept
    bwd_peak: int  # the backward's peak above a_k
    out_kept: list[bool]  # per tensor of a_{k+1}: its storage outlives the value (the graph keeps it, or it is a_k's)
    offloadable: int  # bytes `OffloadSaved k` moves (0 unless measured)
    dense: bool  # every tensor of a_{k+1} is contiguous
    input_uses: list[int]  # per tensor of a_k, the edges of the stage's graph that take it (only with input_parts)
    forward: _Forward | None = None  # what its `Fe` did, op by op (with `fingerprint`: NOTE: [twin stages])


def _measure_recorded(
    run: _StageRun,
    ctx: _Context,
    accumulate: bool,
    *,
    selective: bool = False,
    offload: bool = False,
    dense_delta: bool = False,
    fingerprint: bool = False,
) -> _Recorded:
    """One stage run `Fe` (`selective`: `Fs k:1`) then `B`, measured. `offload`: record the forward behind
    handles, as the executor records an `Fe k` whose saved part moves, to find the offloadable bytes.

    `run.input_parts` (stage 0, its input requiring grad): input uses, per tensor of `a_k`, how many edges of the
    stage's graph take it; where one is used more than once, its gradient's parts are held apart, as the
    executor holds them (NOTE: [a run's input gradient in parts], engine.py), so the backward peak charges them.

    NOTE: [the layout of δ_{k+1}] δ_{k+1} is made in the output's own layout, or, with
    `dense_delta`, contiguous: the layout the stage above hands back depends on its backward (a
    loss that reshapes a transposed `a_L` hands back a contiguous δ_L), and a backward whose
    first op needs another layout copies δ_{k+1} (a transpose, then a Linear's reshape). Output
    dense: every tensor of `a_{k+1}` is contiguous, so that both layouts are one.

    The backward runs as the executor runs it: δ_{k+1} made, the output values dropped
    (only the graph's own saved tensors keep their storage), then backpropagation from
    the output edges, δ_{k+1} freed once consumed, as the executor does below the last stage.
    `accumulate`: parameter gradients already stored (zeros), so new ones are added into them,
    as from the second step without `zero_grad(set_to_none=True)`. `fingerprint`: what the forward did, op by op,
    is kept too (`_Forward`, NOTE: [twin stages]).
    """
    ctx.untouched.clear_grads()
    if accumulate:
        for p in run.stage.parameters():
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    a_k = storage_bytes(run.value)
    with MemoryProbe(ctx.exclude, record_curve=fingerprint, record_ops=fingerprint) as probe:
        probe.track(run.value)
        base = probe.current
        held, fwd_tmp, saved, offloadable = _record_forward(run, ctx, probe, selective, offload)
        forward = _Forward.of(probe, held, fwd_tmp, saved, offloadable) if fingerprint else None
        out_free, bwd_peak, out_kept, dense, uses = _backward_recorded(run, ctx, probe, held, dense_delta, a_k)
        forward = forward.left(probe.current - base) if forward is not None else None  # after its backward
    ctx.untouched.clear_grads()
    ctx.untouched.restore_buffers()
    return _Recorded(fwd_tmp, saved, out_free, bwd_peak, out_kept, offloadable, dense, uses, forward)


def _forward_only(run: _StageRun, ctx: _Context) -> tuple[_Forward, Any]:
    """`Fe k` alone, measured as the first recorded run measures it, op by op (NOTE: [twin stages]), and its
    output's values, cut from its graph, which is dropped: no backward. No run on `a_k` comes after it (a twin
    takes its twin's first timing samples): profiling holds no more than `B k` does."""
    ctx.untouched.clear_grads()
    with MemoryProbe(ctx.exclude, record_curve=True, record_ops=True) as probe:
        probe.track(run.value)
        base = probe.current
        held, fwd_tmp, saved, offloadable = _record_forward(run, ctx, probe, False, ctx.offload)
        forward = _Forward.of(probe, held, fwd_tmp, saved, offloadable)
        out = detach_value(held[1], False)
        held.clear()
        collect_young()
        probe.mark("dropped")
        # what outlives its graph beside its output's own storages: held by the stage itself
        forward = forward.left(probe.current - base - _own_bytes(out, run.value))
    ctx.untouched.clear_grads()
    ctx.untouched.restore_buffers()
    return forward, out


def _storage_keys(value: Any) -> set[int]:
    """The storages of `value`'s strided tensors."""
    return {storage_key(t) for t in tensors_of(value) if t.layout == torch.strided}


def _own_bytes(out: Any, value: Any) -> int:
    """Bytes of the storages of `out` that are not `value`'s."""
    keys = _storage_keys(value)
    return storage_bytes([t for t in tensors_of(out) if t.layout == torch.strided and storage_key(t) not in keys])


def _record_forward(
    run: _StageRun, ctx: _Context, probe: MemoryProbe, selective: bool, offload: bool
) -> tuple[list[Any], int, int, int]:
    """`Fe k` inside `probe`: ([input leaf, output], fwd_tmp, bytes left alive beside a_k, offloadable bytes)."""
    base = probe.current
    ctx.watch.start()
    held, offloadable = _run_recorded(run, selective, offload)
    peak, end = ctx.watch.stop()
    collect_young()
    probe.mark("after")
    fwd_tmp = max(probe.peak - probe.current, peak - end)
    # what the recording leaves alive beside a_k: an output that is a view of a_k, or tensors of
    # a_k passed through unchanged (a carried skip), add nothing, since ā_{k+1} is only ever held
    # beside a_k (Fe k to B k); their storage is a_k's, so releasing the output never frees them
    saved = max(probe.current - base, end)
    return held, fwd_tmp, saved, offloadable


def _run_recorded(run: _StageRun, selective: bool, offload: bool) -> tuple[list[Any], int]:
    """([input leaf, output], offloadable bytes) of the stage run recording its graph.

    NOTE: [the graph alone holds the handles] with `offload`, the forward records behind a `SavedPart`, made and
    dropped here, as the executor makes its own: once settled, only the graph holds the handles, so the measured
    backward frees each saved tensor as the executor's does. A `SavedPart` still referenced anywhere during the
    backward (a caller's variable, the keyword dict of a `functools.partial` call) would keep every handle's
    tensor alive to its end: a GPT block's `bwd_tmp` then read 28,672 bytes instead of 16,448.
    """
    if not offload:
        return list(run.forward(True, selective)), 0
    part = SavedPart(run.k, [*run.stage.parameters(), *run.stage.buffers()])
    with part.recording():
        held = list(run.forward(True, selective))
    return held, part.settle(run.value, held[1])  # with a_k and a_{k+1} held, as the executor settles it


def _backward_recorded(
    run: _StageRun, ctx: _Context, probe: MemoryProbe, held: list[Any], dense_delta: bool, a_k: int
) -> tuple[int, int, list[bool], bool, list[int]]:
    """`B k` inside `probe`, from `held` ([input leaf, output], emptied here, so that nothing the caller holds
    keeps them): (out_free, backward peak above a_k, output kept, output dense, input uses)."""
    outs = tensors_of(held[1])
    dense = all(t.is_contiguous() for t in outs)
    grads = [_delta_like(t, dense_delta) if t.requires_grad else None for t in outs]
    del outs
    edges = output_edges(held[1])
    parts = _input_parts(held[0], edges) if run.input_parts else None
    uses = parts.uses if parts is not None else []
    hooks = parts.install() if parts is not None and max(uses, default=1) > 1 else []
    probe.mark("with δ")
    with_delta = probe.current
    refs = [StorageWeakRef(t.untyped_storage()) if t.layout == torch.strided else None for t in tensors_of(held[1])]
    del held[1]  # the executor keeps the edges, not the values
    out_kept = [ref is None or not ref.expired() for ref in refs]  # by the graph (or a view of a_k)
    del refs
    probe.reset_peak()
    out_free = with_delta - probe.current
    ctx.watch.start()
    with torch.autocast(value_device(run.value).type, enabled=False):
        backward_from_edges(edges, grads, free_grads=True)
    alloc_peak, _ = ctx.watch.stop()
    for hook in hooks:
        hook.remove()
    del edges, grads, hooks
    held.clear()  # the input leaf, and the gradient accumulated into it
    collect_young()
    probe.mark("after backward")
    bwd_peak = max(probe.peak - a_k, probe.current - a_k, with_delta - out_free - a_k + alloc_peak)
    del parts  # held until here: the executor holds them until the chain's backward returns
    return out_free, bwd_peak, out_kept, dense, uses


def _stage_figures(recorded: list[_Recorded], out_size: int, s_k: int) -> tuple[int, int, int, int]:
    """(fwd_tmp, saved_size, out_free, bwd_tmp) of a way of recording a stage, from its measured runs.

    `out_free` is the least any run freed and `bwd_tmp` the largest backward: B k peaks at
    cur - out_free + s_k + bwd_tmp (docs/memory-model.md, part 2), cur holding a_k, ā_{k+1} (saved_size)
    and δ_{k+1} (out_size); for k = 0, s_0 also carries the loss value (charged with a_0).
    """
    fwd_tmp, saved_size = recorded[0].fwd_tmp, recorded[0].saved
    out_free = min(r.out_free for r in recorded)
    held_at_b = saved_size + out_size - out_free
    bwd_tmp = max(-s_k, max(r.bwd_peak - held_at_b - s_k for r in recorded))
    return fwd_tmp, saved_size, out_free, bwd_tmp


def _input_parts(inp: Any, edges: list[Any]) -> InputParts:
    """The parts of the gradient of each tensor of stage 0's input (leaves here), taken from the graph at `edges`."""
    targets = [(get_gradient_edge(t).node, 0) if t.requires_grad else (None, -1) for t in tensors_of(inp)]
    return InputParts([e.node for e in edges if e is not None], targets)


def _delta_like(t: torch.Tensor, contiguous: bool) -> torch.Tensor:
    """A stand-in gradient of `t`: in `t`'s layout, or contiguous (NOTE: [the layout of δ_{k+1}])."""
    if contiguous:
        return torch.ones(t.shape, dtype=t.dtype, device=t.device)
    return torch.ones_like(t)


class _OpKinds(TorchDispatchMode):
    """Which kinds of op a run dispatches: ones option "sac" saves, and others it recomputes (views aside)."""

    def __init__(self) -> None:
        super().__init__()
        self.saved = self.recomputed = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in EXPENSIVE_OPS:
            self.saved = True
        elif not getattr(func, "is_view", False):
            self.recomputed = True
        return func(*args, **(kwargs or {}))


def _option_runs(run: _StageRun, ctx: _Context) -> list[_Recorded] | None:
    """Option "sac" of a stage (chain version 5), measured as its `Fe` is (`_measure_recorded`); None where it
    cannot help: the stage runs no op the policy saves, or none it recomputes (`_option` makes its figures)."""
    kinds = _OpKinds()
    with torch.no_grad(), no_cast_cache(), kinds:
        run.stage(run.value)
    ctx.untouched.restore_buffers()
    if not (kinds.saved and kinds.recomputed):
        return None
    return [_measure_recorded(run, ctx, accumulate, selective=True) for accumulate in (False, True)]


def _option(recorded: list[_Recorded] | None, s_k: int, out_size: int) -> StageOption | None:
    """Option "sac" from its measured runs (`_option_runs`), times 0 (the timing rounds fill them)."""
    if recorded is None:
        return None
    fwd_tmp, saved_size, out_free, bwd_tmp = _stage_figures(recorded, out_size, s_k)
    return StageOption(saved_size, 0.0, 0.0, fwd_tmp, bwd_tmp, out_free, name="sac")


def _use_counts(tensors: list[torch.Tensor]) -> list[int]:
    return [storage_use_count(t.untyped_storage()) if t.layout == torch.strided else 0 for t in tensors]


def _entered_run(
    stage: nn.Module, value: Any, grad_in: bool, timing: tuple[torch.device, Untouched] | None
) -> tuple[list[bool], float, float]:
    """(per tensor of `a_k`: does the graph of `Fe k` keep its storage (or the output share it)?, seconds of
    `Fe k`, seconds of `B k`); with `timing`, the run timed as a timing round times it (`_timed_run`, its backward
    too), else no backward, times 0.

    The stage gets `a_k` through `EnterStage`, as from the executor after its last forward
    (`grad_in=False`: detached, as `a_F` after a frozen prefix, which needs no gradient);
    the storage's reference count with the graph alive tells whether anything beyond our
    own `a_k` holds it. No copy is made, so profiling holds no more than one stage's run.

    NOTE: [the first timing sample in the walk] a timed profile's first sample of each stage is taken in the walk,
    on the walk's `a_k`, by the run that tells whether the graph keeps `a_k` (the figures as before: the same run,
    timed, then its backward); the timing rounds after the walk add the other samples. That run's forward and
    the next input's forward of one round are saved. It is timed through `EnterStage`, as the executor runs it."""
    tensors = tensors_of(value)
    before = _use_counts(tensors)
    dummy = torch.empty(0, device=value_device(value), requires_grad=True)
    if timing is not None:
        synchronize(timing[0])
    t0 = time.perf_counter()
    with torch.enable_grad(), no_cast_cache():
        out = stage(enter_stage(value, [], dummy, None if grad_in else [False] * len(tensors)))
    if timing is not None:
        synchronize(timing[0])
    fwd = time.perf_counter() - t0
    collect_young()
    kept = [a > b for a, b in zip(_use_counts(tensors), before, strict=True)]
    held = [out]
    del out
    if timing is None:
        return kept, 0.0, 0.0
    return kept, fwd, _timed_backward(held, *timing)


def _released_whole(value: Any, new: list[bool], kept_before: list[bool], kept_after: list[bool]) -> int:
    """`in_free[k]`: bytes of `a_k`'s own storages when neither graph keeps any of them, else 0.

    All or nothing: the executor lets go of a plain `a_k` whole or keeps it whole
    (PlanRunner.releases_plain), and must never free less than the chain says.
    """
    storages: dict[int, tuple[int, bool]] = {}
    for t, own, a, b in zip(tensors_of(value), new, kept_before, kept_after, strict=True):
        if t.layout != torch.strided or not own:
            continue
        key = storage_key(t)
        nbytes, kept = storages.get(key, (storage_nbytes(t.untyped_storage(), t), False))
        storages[key] = (nbytes, kept or a or b)
    if not storages or any(kept for _, kept in storages.values()):
        return 0
    return sum(nbytes for nbytes, _ in storages.values())


def _measure_frozen(run: _StageRun, ctx: _Context) -> tuple[StageProfile, Any] | None:
    """A stage of the frozen prefix: (its record, its output) when it needs no backward, else None.

    Its time comes from the timing rounds, as every stage's (`_timed_rounds`).

    The stage runs with grad enabled, as plain training runs it: when nothing of its output
    requires grad (no parameter requires grad, none captured either) autograd recorded
    nothing, and the stage costs what `Fn k` costs; its backward figures are 0 and unused
    (chain version 4). Otherwise it is the first stage that needs a backward, measured as usual.
    Its `out_size` counts only storages that are not the chain input's (`ctx.sample`, held anyway):
    a frozen `Flatten` of `a_0` adds nothing to the bytes held.
    """
    with MemoryProbe(ctx.exclude) as probe:
        probe.track(run.value)
        ctx.watch.start()
        before = versions(run.value)
        with torch.enable_grad(), no_cast_cache():
            out = run.stage(run.value)
        check_inplace(before, run.value, run.k, run.name)
        peak, end = ctx.watch.stop()
        collect_young()
        probe.mark("after")
    if any(t.requires_grad for t in tensors_of(out)):
        del out
        ctx.untouched.restore_buffers()
        return None
    tmp = max(probe.peak - probe.current, peak - end)
    ctx.untouched.restore_buffers()
    size = _own_bytes(out, ctx.sample)
    return StageProfile(size, size, 0.0, 0.0, tmp, 0, fwd_tmp_nograd=tmp, name=run.name), out


@dataclass(eq=False)
class _Walk:
    """Where profiling stands along the chain: the records so far, and the next stage's sample input."""

    value: Any  # a_k, made without grad by the stages before it
    own: list[bool] = field(default_factory=list)  # per tensor of a_k: a storage of its own, not one of a_{k-1}'s
    output_kept: list[bool] = field(default_factory=list)  # per tensor of a_k: kept by the graph of F_{k-1}
    frozen: int = 0  # stages so far that need no backward (chain version 4): a prefix
    records: list[StageProfile] = field(default_factory=list)
    input_uses: list[int] = field(default_factory=list)  # per tensor of a_0: the edges of stage 0's graph that take it
    # a timed profile's first sample per stage (NOTE: [the first timing sample in the walk]): forward, backward
    fwd: list[float] = field(default_factory=list)
    bwd: list[float] = field(default_factory=list)
    options: dict[int, list[float]] = field(default_factory=dict)  # per stage with option "sac": its (Fs, B) sample
    twins: dict[Hashable, list[_Twin]] = field(default_factory=dict)  # measured stages by structure (NOTE: [twin ...])
    twin_of: dict[int, int] = field(default_factory=dict)  # a stage that took a twin's figures: that twin
    kept: dict[int, list[bool]] = field(default_factory=dict)  # per stage run entered: what its graph kept of a_k
    flops: list[int] | None = None  # per stage measured, its forward's FLOPs (NOTE: [FLOPs counted in the walk])
    counted: dict[Hashable, int] = field(default_factory=dict)  # FLOPs by structure of stage and input
    stage_flops: int = 0  # the stage being measured's, appended by `advance`

    def timed(self, seconds: tuple[float, float]) -> None:
        self.fwd.append(seconds[0])
        self.bwd.append(seconds[1])

    def advance(self, record: StageProfile, out: Any, output_kept: list[bool] | None) -> None:
        """Stage k measured (`record`): its output `out` is the next stage's input (`output_kept` None: none kept)."""
        self.records.append(record)
        if self.flops is not None:
            self.flops.append(self.stage_flops)
        keys = _storage_keys(self.value)
        self.own = [t.layout == torch.strided and storage_key(t) not in keys for t in tensors_of(out)]
        self.output_kept = [False] * len(self.own) if output_kept is None else output_kept
        self.value = out


def _profile_stage(stage: nn.Module, k: int, name: str, walk: _Walk, ctx: _Context) -> None:
    """Measure stage `k` on `walk.value` and walk on to its output (NOTE: [what each field measures])."""
    if walk.frozen == k and not ctx.needs_grad and not any(p.requires_grad for p in stage.parameters()):
        frozen_run = _StageRun(stage, k, name, walk.value, False)
        found = _counted(frozen_run, walk, ctx, functools.partial(_measure_frozen, frozen_run, ctx), _is_found)
        if found is not None:  # nothing of it requires grad: a frozen stage, its output the next input
            if ctx.timed:
                walk.timed((_timed_run_frozen(frozen_run.forward, ctx.device, ctx.untouched), 0.0))
            walk.advance(*found, None)
            walk.frozen += 1
            return
    # the first stage after the frozen prefix gets its input as plain autograd does: without grad
    run = _StageRun(stage, k, name, walk.value, ctx.needs_grad if k <= walk.frozen else True)
    record, output_kept, out = _measure_stage(run, walk, ctx)
    walk.advance(record, out, output_kept)


def _is_found(found: tuple[StageProfile, Any] | None) -> bool:
    return found is not None


def _measure_stage(run: _StageRun, walk: _Walk, ctx: _Context) -> tuple[StageProfile, list[bool], Any]:
    """Stage k's record, times 0 (the timing rounds fill them), per tensor of a_{k+1}: kept by its graph, and
    a_{k+1}, the next stage's sample input.

    NOTE: [the no-grad run comes last] its output is the next stage's input, made without grad as before by a
    separate forward after the stage's other runs: one forward fewer per stage, and no more held. That forward
    drew from the RNG stream one run later, so a stage with dropout hands on other values than before: the
    same sizes (`benchmarks/plan_dump.py` unchanged); a stage whose sizes follow its input's values (routing)
    is measured on another sample, as valid as the one before."""
    key = _twin_key(run, walk, ctx)
    found = _twin_of(run, walk, ctx, key)
    if found is not None:
        return _twin_record(run, walk, ctx, *found)
    first = _measure_recorded(run, ctx, False, offload=ctx.offload, fingerprint=key is not None)
    recorded = _measure_recorded_runs(run, ctx, first)
    if run.k == 0:
        walk.input_uses = recorded[0].input_uses
    for _ in range(ctx.warmup):  # untimed, before the stage's first timing sample (the memory runs warm up too)
        _timed_run(run.forward, ctx.device, ctx.untouched)
    in_free = _in_free(run, walk, ctx)  # measured after the in-place check of the runs above; timed, a first sample
    option_runs = _option_runs(run, ctx) if ctx.options else None
    out_size, fwd_tmp_nograd, out = _counted(run, walk, ctx, functools.partial(_measure_nograd, run, ctx))
    s_k = walk.records[run.k - 1].out_size if 0 < run.k <= walk.frozen else storage_bytes(run.value)  # a_F: beside a_0
    fwd_tmp, saved_size, out_free, bwd_tmp = _stage_figures(recorded, out_size, s_k)
    option = _option(option_runs, s_k, out_size)
    record = StageProfile(
        out_size=out_size,
        saved_size=saved_size,
        fwd_time=0.0,
        bwd_time=0.0,
        fwd_tmp=fwd_tmp,
        bwd_tmp=bwd_tmp,
        fwd_tmp_nograd=fwd_tmp_nograd,
        out_free=out_free,
        in_free=in_free,
        options=(option,) if option is not None and option.saved_size < saved_size else (),
        offloadable=recorded[0].offloadable,
        name=run.name,
    )
    _time_option(run, walk, ctx, record)
    output_kept = [any(kept) for kept in zip(*(r.out_kept for r in recorded), strict=True)]
    if key is not None and first.forward is not None and first.forward.stands_for_backward:
        twin = _Twin(run.k, first.forward, record, output_kept, walk.kept.get(run.k), value_structure(out))
        walk.twins.setdefault(key, []).append(twin)
    return record, output_kept, out


def _time_option(run: _StageRun, walk: _Walk, ctx: _Context, record: StageProfile) -> None:
    """In a timed profile, a stage's option's first sample, as a round times it after `Fe k`."""
    if ctx.timed and record.options:
        walk.options[run.k] = list(
            _timed_run(functools.partial(run.forward, selective=True), ctx.device, ctx.untouched)
        )


# NOTE: [twin stages] A stage whose structure (lightning_rotor/twins.py: module types, modes, hooks, parameters' and
# buffers' metadata, a discovered stage's graph up to names) and input's structure (its tensors' metadata) are those
# of a stage measured before in this profile, and whose recorded forward (`Fe k` alone, under the probe) runs the
# same ops as that stage's first recorded run did, with the same bytes alive after each and the same figures
# (`_Forward`), takes that stage's figures instead of running for them: its backward, the run accumulating into
# stored gradients, the one with a contiguous δ, the no-grad run's transient and output size, the option's. What
# rests on it: a graph recorded by the same ops on tensors of the same sizes runs the same backward, so the other
# runs hold the same bytes too. Not where the graph holds a custom autograd Function (its backward is Python code,
# which may branch on what the forward does not show): that stage's first recorded run, its backward included, is
# measured and compared in full, as any stage's, and is never a twin's. Its own `in_free` is its own (the stage
# before differs), of what its twin's graph kept of its input, and its output (the next stage's input) is its
# forward's, cut from its graph, where it has the structure its twin's `Fn` output had (else a plain `Fn` run makes
# it). In a timed profile its first timing samples are its twin's (the timing rounds take its own): no run on `a_k`
# beside `a_{k+1}`, so profiling holds no more than `B k` does. Not for stage 0 (its input is the caller's), the
# frozen prefix, nor a stage that ran an op whose output's shape follows values (`nonzero`, `.item()`, a mask or
# index: routing, whose bytes differ from block to block). A stage with a hook of its own (one that keeps an output)
# or a branch on its index that changes what it holds differs in its structure or its forward, and is measured in
# full.
@dataclass(frozen=True)
class _Forward:
    """What a stage's `Fe` did under the probe (NOTE: [twin stages]): each op and the bytes alive after it, its
    figures, plain ints (compared without recording a guard of a traced profile, NOTE: [storage sizes traced])."""

    ops: tuple[Any, ...]
    curve: tuple[int, ...]
    figures: tuple[int, int, int]  # fwd_tmp, bytes left alive beside a_k, offloadable bytes
    dense: bool  # every tensor of its output contiguous
    python_nodes: bool  # a custom autograd Function in its graph: a Python backward, which the forward does not show
    data_dependent: bool  # an op's output shape followed its inputs' values (`MemoryProbe.data_dependent`)
    leftover: int = 0  # bytes alive once its graph is gone (after its backward, or dropped): kept by the stage itself

    @staticmethod
    def of(probe: MemoryProbe, held: list[Any], fwd_tmp: int, saved: int, offloadable: int) -> _Forward:
        end = next(ops for label, ops, _ in reversed(probe.marks) if label == "after")
        outputs = tensors_of(held[1])
        return _Forward(
            ops=tuple((probe.op_log or [])[:end]),
            curve=tuple(int(c) for c in probe.curve[:end]),
            figures=(int(fwd_tmp), int(saved), int(offloadable)),
            dense=all(t.is_contiguous() for t in outputs),
            python_nodes=python_backward(outputs),
            data_dependent=probe.data_dependent,
        )

    def left(self, nbytes: int) -> _Forward:
        return dataclasses.replace(self, leftover=int(nbytes))

    @property
    def stands_for_backward(self) -> bool:
        """Whether a twin's forward equal to this one also runs this one's backward: not through Python code, nor
        with sizes that followed values (routing: its twin's are no guide)."""
        return not self.python_nodes and not self.data_dependent


@dataclass(frozen=True)
class _Twin:
    """A measured stage another may take figures from (NOTE: [twin stages])."""

    k: int
    forward: _Forward  # what its first recorded run's forward did
    record: StageProfile
    output_kept: list[bool]
    kept: list[bool] | None  # what its graph kept of its input (`_entered_run`)
    out_structure: Hashable  # its output's, as `Fn` made it (`twins.value_structure`)


def _twin_of(run: _StageRun, walk: _Walk, ctx: _Context, key: Hashable | None) -> tuple[_Twin, Any] | None:
    """The stage measured before whose figures this one takes, and this one's output: its forward, run alone under
    the probe, did what that stage's did, op by op (NOTE: [twin stages]); None where no stage of its structure was
    measured, or none agrees (the forward run here is then spent)."""
    twins = walk.twins.get(key, []) if key is not None else []
    if not twins:
        return None
    forward, out = _forward_only(run, ctx)
    twin = next((t for t in twins if t.forward == forward), None) if forward.stands_for_backward else None
    return (twin, out) if twin is not None else None


def _twin_key(run: _StageRun, walk: _Walk, ctx: _Context) -> Hashable | None:
    """The structure a twin of this stage shares (NOTE: [twin stages]); None where twins are not looked for."""
    if not ctx.twins or run.k == 0 or run.k <= walk.frozen or not run.grad_in:
        return None
    return run.key  # its own `in_free` follows the stage before


def _twin_record(
    run: _StageRun, walk: _Walk, ctx: _Context, twin: _Twin, out: Any
) -> tuple[StageProfile, list[bool], Any]:
    """Stage k's record from its twin's (NOTE: [twin stages]): its own `in_free` and name, its twin's first timing
    samples (no run on `a_k` beside `a_{k+1}`); its output `out`, from its forward, where it is as `Fn k` would hand
    it, else from `Fn k`."""
    record = dataclasses.replace(twin.record, in_free=_in_free(run, walk, ctx, twin), name=run.name)
    if ctx.timed:
        walk.timed((walk.fwd[twin.k], walk.bwd[twin.k]))
        if twin.k in walk.options:
            walk.options[run.k] = list(walk.options[twin.k])
    has_count = ctx.counter is None or walk.flops is None or run.key in walk.counted
    if has_count and out is not None and value_structure(out) == twin.out_structure:
        _counted(run, walk, ctx, lambda: None)  # its twin's count
    else:
        out = None  # gone before `Fn k` runs: profiling holds no more than `B k` does
        out = _counted(run, walk, ctx, lambda: run.forward(False)[1])
        ctx.untouched.restore_buffers()
    walk.twin_of[run.k] = twin.k
    return record, twin.output_kept, out


def _measure_nograd(run: _StageRun, ctx: _Context) -> tuple[int, int, Any]:
    """(out_size, fwd_tmp_nograd, output): the stage run without grad recording (`Fn`, `Fc`)."""
    with MemoryProbe(ctx.exclude) as probe:
        probe.track(run.value)  # a_k is held before the stage runs; only what comes after counts
        ctx.watch.start()
        out = run.forward(False)[1]
        peak, end = ctx.watch.stop()
        collect_young()
        probe.mark("after")
    ctx.untouched.restore_buffers()
    return storage_bytes(out), max(probe.peak - probe.current, peak - end), out


# NOTE: [FLOPs counted in the walk] Each stage's forward FLOPs (`shapes.derived_times` scales a timed shape's times
# by their ratio between shapes) are counted in the walk's run of the stage without grad, which runs anyway (`Fn k`,
# a frozen stage's run, a twin's plain `Fn`): no forward of their own. The counter (`GlobalFlops`, a dispatch mode) is
# entered before the memory probe, so that it sits below it: the probe sees each op first, exactly as it does alone,
# and its call of the op reaches the counter, which counts it, or runs its decomposition within itself, unseen by
# the probe (the probe sees the op and its output, as before). Entered after the probe, it would hand the probe the
# decomposed ops instead. A stage of the structure of one counted before, on an input of the same structure, runs
# uncounted and takes its count. The stages run in their own mode, as training runs them, and `shapes.stage_flops`
# (a shape no profile measured) counts them the same way, so that the counts of a chain compare. The separate pass
# before this one ran them in eval mode: the same counts where no counted op (a matmul, a convolution, attention)
# follows `training`, not where attention dropout picks another kernel (on CPU, with dropout the math path, whose
# matmuls torch counts; without, the CPU flash kernel, which it counts nothing for: a GPT-2 block at batch 4,
# length 124 and width 64 counts 64.5 MFLOP, 48.8 in eval mode). FLOPs only scale times; a module that draws
# its path at random in training (LayerDrop) gets a count of the path drawn, as its step does.
# A counter that fails where the stage does not (a formula refusing an argument) leaves the profile without counts
# (`Profile.flops` None) and the run is measured again, uncounted.
_Found = TypeVar("_Found")


def _counted(
    run: _StageRun,
    walk: _Walk,
    ctx: _Context,
    measure: Callable[[], _Found],
    keep: Callable[[_Found], bool] = lambda _: True,
) -> _Found:
    """`measure()`, a run of the stage without grad (under the probe), its FLOPs counted outside the probe (NOTE:
    [FLOPs counted in the walk]); `keep(found)` False: the count stands for no stage (a frozen run that needs grad)."""
    counter = ctx.counter
    if counter is None or walk.flops is None:
        return measure()
    key = run.key
    if key in walk.counted:
        walk.stage_flops = walk.counted[key]
        return measure()
    try:
        with counter:
            found = measure()
    except Exception:  # the stage's own error, raised again below, or the counter's: counts given up
        ctx.untouched.restore_buffers()
        walk.flops = None
    else:
        walk.stage_flops = int(counter.get_total_flops())
        if keep(found):
            walk.counted[key] = walk.stage_flops
        return found
    return measure()


def _in_free(run: _StageRun, walk: _Walk, ctx: _Context, twin: _Twin | None = None) -> int:
    """What letting go of a_k after its stage's last forward frees (a_0 is the caller's: never); a twin's graph keeps
    of a_k what its twin's kept (NOTE: [twin stages])."""
    k, value = run.k, run.value
    if k > walk.frozen:
        # at most what every way of recording stage k-1 lets go of (options' out_free too)
        before = walk.records[k - 1]
        kept = twin.kept if twin is not None else None
        kept = kept if kept is not None else _kept_timed(run, walk, ctx, grad_in=True)
        in_free = min(
            before.out_free,
            *(o.out_free for o in before.options),
            _released_whole(value, walk.own, walk.output_kept, kept),
        )
    elif k == walk.frozen > 0:  # a_F: no graph made it; it goes after Fe F unless stage F's graph keeps it
        in_free = _released_whole(value, walk.own, walk.output_kept, _kept_timed(run, walk, ctx, grad_in=False))
    else:
        if ctx.timed:  # no run tells what a_k's graph keeps: the first timing sample on its own
            walk.timed(_timed_run(run.forward, ctx.device, ctx.untouched))
        return 0
    ctx.untouched.restore_buffers()
    return in_free


def _kept_timed(run: _StageRun, walk: _Walk, ctx: _Context, grad_in: bool) -> list[bool]:
    """What the graph of `Fe k` keeps of `a_k` (`_entered_run`); in a timed profile, the run timed too, the stage's
    first sample (NOTE: [the first timing sample in the walk])."""
    kept, fwd, bwd = _entered_run(run.stage, run.value, grad_in, (ctx.device, ctx.untouched) if ctx.timed else None)
    walk.kept[run.k] = kept
    if ctx.timed:
        walk.timed((fwd, bwd))
    return kept


def _measure_recorded_runs(run: _StageRun, ctx: _Context, first: _Recorded) -> list[_Recorded]:
    """`Fe k` then `B k`, measured once with no parameter gradient stored yet (`first`: autograd stores a fresh one
    as `.grad`), once accumulating into stored ones (a real transient), and where the output is not contiguous once
    more with a contiguous δ_{k+1} (NOTE: [the layout of δ_{k+1}]); `_stage_figures` keeps the larger backward,
    as either may happen in training. The offloadable bytes are found in the first run."""
    recorded = [first, _measure_recorded(run, ctx, True)]
    if not first.dense:  # a non-contiguous output: its δ may come back contiguous too, measured so
        recorded.append(_measure_recorded(run, ctx, False, dense_delta=True))
    return recorded


def _loss_figures(
    value: Any, loss_tmp: int | Callable[[Any], torch.Tensor] | None, device: torch.device
) -> tuple[int, int, int]:
    """(loss_tmp, loss_tmp_kept, loss_value) of the chain output `value`: measured, or given as bytes."""
    if loss_tmp is None or callable(loss_tmp):
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            return measure_loss_tmp(value, loss_tmp or proxy_loss)
    return int(loss_tmp), int(loss_tmp), LOSS_HELD


def _timed_records(
    records: list[StageProfile], fwd: list[list[float]], bwd: list[list[float]], selective: dict[int, list[float]]
) -> list[StageProfile]:
    """The records with the times of the timing rounds (NOTE: [stage times]); an option's from its own runs."""
    fwd_time, bwd_time = stage_times(fwd, bwd)
    scale = _round_scale(fwd, bwd)  # option runs share the stages' clock: fastest run, same factor
    timed = []
    for k, record in enumerate(records):
        runs = selective.get(k)
        options = record.options
        if runs:
            f, b = min(runs[0::2]) * scale, min(runs[1::2]) * scale
            options = tuple(dataclasses.replace(o, fwd_time=f, bwd_time=b) for o in options)
        timed.append(dataclasses.replace(record, fwd_time=fwd_time[k], bwd_time=bwd_time[k], options=options))
    return timed


def _walk_chain(
    stages: Sequence[nn.Module],
    names: list[str],
    ctx: _Context,
    progress: Callable[[int, int, float], None] | None,
    start: float,
) -> _Walk:
    """Every stage measured in chain order, each on the output of the one before (made without grad)."""
    walk = _Walk(ctx.sample, flops=[] if ctx.counter is not None else None)
    for k, stage in enumerate(stages):
        _profile_stage(stage, k, names[k], walk, ctx)
        if progress is not None:
            progress(k + 1, len(stages), time.perf_counter() - start)
    if walk.frozen == len(stages):
        raise ValueError(
            "no stage of the chain needs a backward: the input does not require grad and no "
            "parameter of any stage does; there is nothing to checkpoint"
        )
    return walk


def profile_chain(
    stages: Sequence[nn.Module],
    sample: Any,
    *,
    names: Sequence[str] | None = None,
    repeats: int = 5,
    warmup: int = 0,
    loss_tmp: int | Callable[[Any], torch.Tensor] | None = None,
    progress: Callable[[int, int, float], None] | None = None,
    timed: bool = True,
    options: bool = False,
    offload: bool = False,
    twins: bool = True,
    flops: bool = False,
    allocator: bool = True,
) -> Profile:
    """Measure `stages` on `sample` (the chain input `a_0`); see NOTE: [what each field measures].

    `options`: also measure each stage's option "sac" (chain version 5, `_option_runs`) and keep it where it saves
    fewer bytes than recording all; its times come from the same timing rounds. `offload`: also measure each
    stage's `offloadable` bytes (chain version 6), what `OffloadSaved k` moves.

    `progress(stages_done, stages, seconds)` is called after each stage, for a progress line. `timed=False` measures
    sizes only: no timing rounds, every time 0 (a new shape's times are derived, lightning_rotor/shapes.py).
    `twins=False` measures every stage in full, none taking a twin's figures (NOTE: [twin stages]).
    `flops=True` counts each stage's forward FLOPs in the walk, `Profile.flops` (NOTE: [FLOPs counted in the walk]).
    `allocator=False`: on CUDA, tensor accounting's figures alone, not the caching allocator's where larger (a traced
    profile: NOTE: [sizes on CUDA], lightning_rotor/allocator.py).
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    names = list(names) if names is not None else [f"stage{k}" for k in range(len(stages))]
    inputs = tensors_of(sample)
    if not inputs:
        raise TypeError("the chain input must be a tensor or a tuple of tensors")
    device = inputs[0].device
    start = time.perf_counter()
    needs_grad = any(t.requires_grad for t in inputs)
    collect_young()  # garbage of what ran before dies now, not inside a measured run
    with collector_paused(), Untouched(stages, [device]) as untouched:
        walks = timed and device.type != "cuda"  # the walk times a first sample, not on CUDA (NOTE: [the first ...])
        # NOTE: [gradients stored by autograd]: no measured run sets a `.grad`; the hooks only while they run
        with Excluded(stages, by_autograd=True) as exclude:
            ctx = _Context(
                sample, exclude, _AllocatorWatch(device, allocator), untouched, device, needs_grad, options, offload,
                warmup, walks, twins, GlobalFlops() if flops else None,
            )  # fmt: skip
            walk = _walk_chain(stages, names, ctx, progress, start)
        loss = _loss_figures(walk.value, loss_tmp, device)
        walk.value = None  # a_L: the timing rounds hold no more than B k does
        selective = {k: walk.options.get(k, []) for k, record in enumerate(walk.records) if record.options}
        rounds = repeats if timed else 0
        first = (walk.fwd, walk.bwd) if walks else None
        _warm_up_rounds(stages, sample, needs_grad, names, device, untouched, rounds, start, walk.frozen, selective)
        fwd, bwd = _timed_rounds(
            stages, sample, needs_grad, names, device, untouched, rounds, start, walk.frozen, selective, first
        )
        if not timed:
            fwd, bwd = [[0.0] for _ in stages], [[0.0] for _ in stages]
    # the loss value lives from the end of the loss to the end of the step (chain version 3: loss_value)
    chain = Chain.from_stages(
        _timed_records(walk.records, fwd, bwd, selective),
        input_size=storage_bytes(sample),
        loss_tmp=loss[0],
        loss_tmp_kept=loss[1],
        loss_value=loss[2],
        frozen=walk.frozen,
    )
    return Profile(
        chain,
        time.perf_counter() - start,
        [_spread(runs) for runs in fwd],
        [_spread(runs) for runs in bwd],
        repeats=len(fwd[0]) if fwd else 0,
        threads=torch.get_num_threads(),
        round_seconds=round_totals(fwd, bwd),
        input_uses=walk.input_uses,
        twins=walk.twin_of,
        flops=walk.flops,
    )
