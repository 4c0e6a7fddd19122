"""Run a plan's ops on real tensors, freeing every value when the memory model says.

`PlanRunner(stages, ops)(a_0) -> a_L` runs one training step as two autograd nodes (NOTE: [a step
in two Functions]), with the stage plumbing the profiler measures with (lightning_rotor/engine.py).

Parameter gradients accumulate into `.grad` through ordinary `backward` calls
on each stage's graph, as in unwrapped training. Recomputed stages draw the
random numbers of their first run (CPU and CUDA) from private generators, never
rewinding the process-wide one (lightning_rotor/rng.py), re-enter the autocast
state of the original forward, and do not update BatchNorm statistics or other
buffers a second time. Where the plan keeps a stage input until the stage's backward and records
the stage just before it, the recomputation stops early, as torch's non-reentrant checkpoint does
(NOTE: [early-stopping recomputation]).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import replace
from typing import Any, Protocol

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.utils.checkpoint import checkpoint
from typing_extensions import assert_never

from lightning_rotor._torch_compat import (
    backward_is_full,
    has_post_accumulate_grad_hooks,
    is_norm,
    tensor_version,
    tree_flatten,
    tree_unflatten,
)
from lightning_rotor.compile import rewinds
from lightning_rotor.engine import (
    HandOver,
    InputParts,
    backward_from_edges,
    carried_through,
    check_inplace,
    compact_gradients,
    compact_uncovered,
    detach_value,
    differentiable,
    enter_stage,
    no_cast_cache,
    output_edges,
    own_alias,
    tensors_of,
    versions,
)
from lightning_rotor.loss_watch import LossWatch, off_this_node
from lightning_rotor.offload import SavedPart, TransferChannel, Transfers, buffer_sizes
from lightning_rotor.ops import Op, OpKind, OpNote, annotate, check_frozen_prefix, parse_ops, recomputed_stage_set
from lightning_rotor.rng import GeneratorWatch, RecordRandom, ReplayFrom, ReplayRandom, Rewind, alone
from lightning_rotor.selective import run_selective
from lightning_rotor.stages import SideInputs

# NOTE: [a step in two Functions]
# Two autograd Functions carry one training step:
#
# - `_Tail` runs the forward ops (everything before `Loss`) and returns an empty
#   token; its backward runs the backward part of the plan (recomputations and
#   `B L-1 … B 0`) and returns `δ_0` to the chain input (in parts where stage 0
#   uses it several times: NOTE: [a run's input gradient in parts], engine.py).
# - `HandOver` (lightning_rotor/engine.py) turns the token into the chain output
#   `a_L` for the caller's loss; its backward only stores `δ_L` for `_Tail`
#   (`_Output.receive`).
#
# The split matters for memory: autograd keeps a Function's incoming gradients
# alive until its backward returns, so one Function receiving `δ_L` would hold it
# through the whole backward phase, which the memory model does not allow. Here
# the engine lets go of `δ_L` as soon as `HandOver` has stored it, and the
# plan drops it at `B L-1`.

# NOTE: [side inputs]
# Stages may read tensors besides their input that require grad, the same for every stage (a decoder
# block's encoder output: `SideInputs`, lightning_rotor/stages.py). Each stage's backward must stop at
# them (the caller's graph behind them is backpropagated once, after the chain) and their gradient
# must be the sum plain autograd makes, bitwise: plain autograd adds every contribution, in the order
# the engine makes them (the last stage's first), into one buffer. So `_Tail` takes the side tensors
# as inputs and returns their gradient; a recorded stage reads them through an `EnterStage` of its
# own, and `B k` is seeded with the sum so far as one more root into that node: the engine runs the
# graph root first, so the sum is in the node's buffer before stage k's contributions are added to it,
# one by one, as in plain autograd. Joined backwards (several stages' contributions in one buffer each)
# and reruns inside a backward (early stop, options) are not used with side inputs.


class OpMarks(Protocol):
    """What the runner asks of a probe (`memory.MemoryProbe`, `memory.CudaMemoryProbe`): count the tensors that
    existed before the step (the chain input), and remember the bytes alive after each op under its label."""

    def track(self, *tensors: Any) -> None: ...

    def mark(self, label: str) -> None: ...


_JOINED = "joined"  # a stage's entry when its input is a_k straight from stage k-1's graph


class _Caught(list):
    """The gradients `EnterStage` caught for a stage input: one per entered tensor of it."""

    def __init__(self, wanted: list[bool], compact: bool = True):
        super().__init__()
        self.wanted = wanted  # per tensor of the input: entered (gets a gradient) or passed detached
        self.compact = compact  # δ_k is held: views that do not cover their storage are copied (`compact_uncovered`)

    def deltas(self) -> list[torch.Tensor | None]:
        """δ_k, one entry per tensor of the stage input (None: no gradient, or no path reached it).

        The slot lets go of them: a gradient caught as a view (of δ_{k+1}, through a view's backward)
        would otherwise be a second owner of its storage, which then could not be freed once consumed.
        """
        grads = list(self) or [None] * sum(self.wanted)
        self.clear()
        caught = iter(compact_uncovered(grads) if self.compact else grads)
        del grads
        return [next(caught) if w else None for w in self.wanted]


class _Autocast:
    """The autocast state of the original forward, to re-enter when recomputing."""

    def __init__(self) -> None:
        types = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
        self.state = [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in types]

    def enter(self, stack: ExitStack) -> None:
        for device_type, enabled, dtype in self.state:
            if torch.is_autocast_enabled(device_type) == enabled and (
                not enabled or torch.get_autocast_dtype(device_type) == dtype
            ):
                continue  # already in that state: entering it again only costs time on short stages
            stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled))


class _Step:
    """Everything one training step holds: values, graphs, gradients, RNG states."""

    def __init__(self, runner: PlanRunner, value: Any, probe: OpMarks | None):
        self.runner = runner
        self.probe = probe
        self.plain: dict[int, Any] = {0: value}  # a_k without graph
        self.graph: dict[int, tuple[Any, Any]] = {}  # ā_k: (leaf input of F_{k-1}, output a_k)
        self.released: dict[int, list] = {}  # ā_k whose value was let go: the output edges to backpropagate from
        self.grads: dict[int, list] = {}  # δ_k, one entry per tensor of a_k
        self.ran: set[int] = set()
        self.rng: dict[int, Any] = {}  # per recomputed stage: states before each random op, or a GeneratorWatch
        self.mutated: dict[int, list[Any]] = {}  # per recomputed stage: (buffer, version), then the changed buffers
        self.autocast = _Autocast()
        self.input_requires_grad = [t.requires_grad for t in tensors_of(value)]
        cuda = {t.device for t in tensors_of(value) if t.device.type == "cuda"}
        self.rng_devices = [torch.device("cpu"), *sorted(cuda, key=str)]
        self.joined: set[int] = set()  # stages fed a_k from stage k-1's graph: B k and B k-1 run in one call
        self.joined_edges: dict[int, list] = {}  # where δ_k enters stage k-1's graph, to mark B k (with a probe)
        self.carried: dict[int, list[bool]] = {}  # per recorded a_k: which tensors stage k-1 passed on from its input
        self.dummy = torch.empty(0, device=runner.token_device, requires_grad=True)  # EnterStage's graph edge
        # values offloaded to host memory and prefetched back (chain version 6); None: the plan moves none
        self.transfers = Transfers(runner.channel) if runner.channel is not None else None
        self.saved_parts: dict[int, SavedPart] = {}  # recorded stages whose saved part an OffloadSaved moves next
        # side inputs (NOTE: [side inputs]): the call's side tensors (detached), per recorded stage the tensors it
        # read in their place (and the slot catching their gradient), and their gradient summed so far
        self.sides: list[torch.Tensor] = []
        self.side_entries: dict[int, tuple[list[Any], Sequence[torch.Tensor]]] = {}
        self.side_grads: list[torch.Tensor | None] = []
        self.input_node: tuple[Any, int] | None = None  # EnterStage's node of a_0 for B 0, and its inputs
        # per tensor of a_0: its gradient in parts, one per use in stage 0 (NOTE: [a run's input gradient in parts])
        self.input_parts: list[list[torch.Tensor]] | None = None

    def mark_label(self, label: str) -> None:
        if self.probe is not None:
            self.probe.mark(label)

    def mark(self, op: Op) -> None:
        self.mark_label(op.label)

    # -- forward ops ----------------------------------------------------------------------
    def _input(self, k: int, kind: OpKind) -> Any:
        if self.transfers is not None:
            self.transfers.ready(k)  # a prefetched a_k: compute waits for its copy (CUDA)
        if k in self.plain:
            return self.plain[k]
        if kind is not OpKind.FN and k in self.graph:
            return self.graph[k][1]
        raise RuntimeError(f"executor bug: a_{k} is not held for {kind.value} {k}")

    def _kept_input(self, k: int, src: Any) -> tuple[Any, Any]:
        """(entry, input) for a stage whose input `a_k` the plan keeps beyond this forward.

        NOTE: [stage inputs enter through EnterStage] not as leaves: a leaf's accumulator
        stores a gradient whose strides differ from the leaf's as a copy in the leaf's layout
        (autograd's layout contract), so `B k-1` would start from a gradient laid out otherwise
        than plain autograd passes it on (a transpose after BatchNorm: its backward rounds
        differently). `EnterStage` catches the gradient as it comes.
        """
        if 0 < k <= self.runner.frozen:  # a_F after a frozen prefix: no gradient wanted, as in plain autograd
            inp = detach_value(src, False)
            return inp, inp
        tensors = tensors_of(src)
        if k == 0:  # the caller's input: a gradient only where it requires one, passed back as it comes
            wanted = [w and differentiable(t) for w, t in zip(self.input_requires_grad, tensors, strict=True)]
        else:
            wanted = [differentiable(t) for t in tensors]
        entry = _Caught(wanted, compact=k > 0)  # the chain input's δ_0 goes back as it came
        with torch.enable_grad():
            inp = enter_stage(src, entry, self.dummy, wanted, compact=False)
        if k == 0:  # the node B 0's parts of δ_0 are taken before (`InputParts`)
            entered = [t for t in tensors_of(inp) if t.requires_grad]
            self.input_node = (get_gradient_edge(entered[0]).node, len(entered)) if entered else None
        return entry, inp

    @contextmanager
    def _stage_run(self, k: int, remember: bool) -> Iterator[None]:
        """Around every forward of stage k: a recomputed stage's first run is remembered (its random draws,
        its buffers), every later run replays it (`_replay`); `remember`: this stage is recomputed."""
        stage = self.runner.stages[k]
        first = k not in self.ran
        with ExitStack() as stack:
            stack.enter_context(no_cast_cache())
            if first:
                self.ran.add(k)
                if remember:
                    self._remember(k, stage, stack)
            else:
                self._replay(k, stage, stack)
            yield
        if first and remember:
            self._find_mutated(k, stage)
            self._learn_quiet(k)

    def forward_nograd(self, k: int, forget: bool) -> None:
        """`Fn k` (`forget`: a_k goes after, never a_0) and `Fc k`: a_{k+1} held plain, no graph."""
        stage, name = self.runner.stages[k], self.runner.names[k]
        src = self._input(k, OpKind.FN if forget else OpKind.FC)
        with self._stage_run(k, k in self.runner.recomputed):
            before = versions(src)
            with torch.no_grad(), self._sides(k, record=False):
                out = stage(src)
            self.plain[k + 1] = out
            check_inplace(before, src, k, name)
        if forget and k != 0:
            del self.plain[k]

    def record(self, k: int, last: bool, pack: bool) -> None:
        """`Fe k`: ā_{k+1} held with stage k's graph. `last`: stage k's last forward before `B k` (k >= 1);
        `pack`: an `OffloadSaved k` moves what it saves (recorded behind handles, `SavedPart`).

        After the last forward, the executor lets go of `a_k`: the stage's graph holds
        what it saved, the rest is freed (chain version 3, `in_free`). A recorded `a_k`
        whose backward runs right after `B k` (`B k-1` follows it) feeds stage k as it
        is, joining the two graphs for one backward call; any other input reaches the
        stage through `EnterStage`, which keeps nothing.
        """
        stage, name = self.runner.stages[k], self.runner.names[k]
        src = self._input(k, OpKind.FE)
        with self._stage_run(k, k in self.runner.recomputed):
            before = versions(src)
            recorded = k not in self.plain
            last = last and (recorded or self.runner.releases_plain(k))
            entry, inp = self._record_entry(k, src, last, recorded)
            with torch.enable_grad(), self._sides(k, record=True):
                if inp is None:
                    assert isinstance(entry, _Caught)  # only a caught entry enters the stage here
                    inp = enter_stage(src, entry, self.dummy, entry.wanted, compact=False)
                out = self._record_packed(k, inp, src) if pack else stage(inp)
            self.carried[k + 1] = carried_through(inp, out)
            del inp
            self.graph[k + 1] = (entry, out)
            if last:
                self._let_go_input(k, entry, recorded)
            check_inplace(before, src, k, name)

    def record_option(self, k: int) -> None:
        """`Fs k:1` (chain version 5): stage k recorded by option 1 (sac, `run_selective`); its graph keeps
        a_k to rerun the stage in `B k`, so nothing is let go."""
        stage, name = self.runner.stages[k], self.runner.names[k]
        src = self._input(k, OpKind.FS)
        with self._stage_run(k, k in self.runner.recomputed):
            before = versions(src)
            entry, inp = self._kept_input(k, src)
            with torch.enable_grad(), self._sides(k, record=True):
                out = run_selective(stage, inp, self._redraw(k), name)
            self.carried[k + 1] = carried_through(inp, out)
            del inp
            self.graph[k + 1] = (entry, out)
            check_inplace(before, src, k, name)

    def _record_entry(self, k: int, src: Any, last: bool, recorded: bool) -> tuple[Any, Any]:
        """(entry, input) of `Fe k`; input None: `EnterStage` makes it inside the recording."""
        if not last:
            return self._kept_input(k, src)
        if k == self.runner.frozen > 0:  # a_F: no gradient wanted; nothing but stage F's graph keeps it
            return _Caught([False] * len(tensors_of(src))), detach_value(src, False)
        if recorded and k in self.runner.joinable:
            inp = compact_gradients(src, self.carried.get(k))
            self.joined.add(k)
            self.joined_edges[k] = output_edges(src)  # where δ_k enters stage k-1: B k is done
            return _JOINED, inp
        return _Caught([differentiable(t) for t in tensors_of(src)]), None  # EnterStage's slot: δ_k lands here

    def _record_packed(self, k: int, inp: Any, src: Any) -> Any:
        """Record stage k with what it saves behind handles, for the `OffloadSaved k` that moves it."""
        stage = self.runner.stages[k]
        part = SavedPart(k, [*stage.parameters(), *stage.buffers()])
        with part.recording():
            out = stage(inp)
        part.settle(src, out)  # a_k still held: what can move is settled now, as when profiled
        self.saved_parts[k] = part
        return out

    def _let_go_input(self, k: int, entry: Any, recorded: bool) -> None:
        """After stage k's last forward: a recorded a_k keeps its graph node, not its value; a plain one goes."""
        if not recorded:
            del self.plain[k]
            return
        entry_k, value = self.graph[k]
        if value is not None:
            if entry is not _JOINED:  # joined: B k-1 runs inside B k's call, from no edges of its own
                self.released[k] = output_edges(value)
            self.graph[k] = (entry_k, None)

    @contextmanager
    def _sides(self, k: int, record: bool) -> Iterator[None]:
        """Stage k reads the side inputs through `EnterStage` when recorded (its backward stops there and the
        slot catches their gradient, NOTE: [side inputs]), detached otherwise; the call's own ones afterwards."""
        sides = self.runner.sides
        if sides is None or not self.sides:  # no side input requires grad in this call
            yield
            return
        values: Sequence[torch.Tensor] = self.sides
        if record:
            slot: list = []
            values = enter_stage(tuple(self.sides), slot, self.dummy, compact=False)
            self.side_entries[k + 1] = (slot, values)
        sides.bind(values)
        try:
            yield
        finally:
            sides.bind(None)

    def _side_roots(self, k: int) -> tuple[list, list, list]:
        """(edges, gradients, slot) that seed `B k` with the side inputs' gradient summed so far (NOTE: [side
        inputs]): each enters stage k's `EnterStage` first, so stage k's contributions are added to it in order."""
        if k + 1 not in self.side_entries:
            return [], [], []
        slot, values = self.side_entries.pop(k + 1)
        edges = [get_gradient_edge(v) if g is not None else None for v, g in zip(values, self.side_grads, strict=True)]
        return edges, list(self.side_grads), slot

    def early_forward(self, k: int) -> None:
        """`Fc k` that also records stage k for `B k`, which then recomputes it with early stop.

        NOTE: [early-stopping recomputation] where the plan runs `Fc k`, keeps `a_k` until
        `B k` and runs `Fe k` just before `B k` (Hugging Face's schedule at its own peak), the
        stage runs here under torch's non-reentrant checkpoint: its graph keeps handles, not
        tensors (parameters aside), and `a_k`, which the plan holds anyway. `a_{k+1}` goes on
        detached; only its gradient edges stay (`released`). `Fe k` is then skipped, and `B k`
        backpropagates from those edges: torch reruns the stage only until every tensor its
        backward needs is made again (the tail after the last saving op does not run), with
        rotor's own random-number replay, autocast state and buffer protection (`_replay`).
        Only applied where `a_k` is kept whole by the plan through `B k` (`PlanRunner.early`).
        """
        stage, name = self.runner.stages[k], self.runner.names[k]
        src = self._input(k, OpKind.FC)
        with self._stage_run(k, remember=True):  # an early stage is recomputed: its Fe k follows
            before = versions(src)
            entry, inp = self._kept_input(k, src)
            flat, spec = tree_flatten(inp)
            del inp

            def run(*leaves: Any) -> Any:
                return stage(tree_unflatten(list(leaves), spec))

            with torch.enable_grad():
                out = checkpoint(
                    run,
                    *flat,
                    use_reentrant=False,
                    preserve_rng_state=False,  # rotor replays the draws itself (`_replay`), never rewinding
                    context_fn=lambda: (nullcontext(), self._recomputing(k)),
                )
            del flat, run
            self.graph[k + 1] = (entry, None)
            self.released[k + 1] = output_edges(out)
            self.plain[k + 1] = detach_value(out, False)
            del out
            check_inplace(before, src, k, name)

    @contextmanager
    def _recomputing(self, k: int) -> Iterator[None]:
        """Where torch's checkpoint reruns stage k inside `B k`: as any recomputation of it (`_replay`)."""
        with ExitStack() as stack:
            stack.enter_context(no_cast_cache())
            self._replay(k, self.runner.stages[k], stack)
            yield

    # -- transfers (chain version 6) ---------------------------------------------------------------
    def offload(self, k: int) -> None:
        """`Offload k`: a_k goes to host memory; the executor keeps no device reference to it.

        A graph of stage k recorded from the plain a_k would keep (part of) it on the device,
        which the memory model does not charge once a_k is offloaded: such a plan is refused.
        """
        assert self.transfers is not None  # set whenever the plan has transfers
        if k not in self.plain:
            raise RuntimeError(f"executor bug: a_{k} is not held plain for {Op(OpKind.OFFLOAD, k).label}")
        if k + 1 in self.graph:
            raise RuntimeError(
                f"{Op(OpKind.OFFLOAD, k).label}: stage {k}'s recorded graph may keep a_{k} on the device; "
                f"offload a_{k} before recording stage {k} (Fe {k}) or after its backward"
            )
        self.transfers.offload(k, self.plain.pop(k))

    def prefetch(self, k: int) -> None:
        """`Prefetch k`: a_k is a device value again (bitwise equal, same layout), plain; compute waits for it."""
        assert self.transfers is not None  # set whenever the plan has transfers
        self.plain[k] = self.transfers.prefetch(k)

    def offload_saved(self, k: int) -> None:
        """`OffloadSaved k`: what `Fe k` saved, but for parameters, buffers and a_k's and a_{k+1}'s storages,
        goes to host memory; the graph keeps handles only, the executor nothing."""
        assert self.transfers is not None  # set whenever the plan has transfers
        part = self.saved_parts.pop(k, None)
        if part is None:
            raise RuntimeError(f"executor bug: {Op(OpKind.OFFLOAD_SAVED, k).label} without Fe {k} recorded for it")
        self.transfers.offload_saved(k, part)

    def prefetch_saved(self, k: int) -> None:
        """`PrefetchSaved k`: the saved part back on the device, in the graph's handles; `B k`'s nodes wait for
        its copy when they unpack it (CUDA), so `B k+1` before it overlaps the copy."""
        assert self.transfers is not None  # set whenever the plan has transfers
        self.transfers.prefetch_saved(k)

    def wait(self, op: Op, saved: bool) -> None:
        """`Wait k` / `WaitSaved k`: the offload of a_k (of stage k's saved part) has ended before the next op,
        so its device memory may be reused (docs/memory-model.md, "Debts"); CUDA: the host waits for the copy."""
        if self.transfers is None:
            raise RuntimeError(f"executor bug: {op.label} in a plan without transfers")
        assert op.stage is not None  # waits name a stage
        self.transfers.wait(op.stage, saved=saved)

    def _redraw(self, k: int) -> Any:
        """How an `Fs k` rerun inside its backward replays the stage's random draws: as a recomputation of
        stage k would (the first run's record), or None when the stage runs once (run_selective records)."""
        if k not in self.rng:
            return None
        record = self.rng[k]  # a list filled in place by the first run's RecordRandom, or a GeneratorWatch
        if isinstance(record, GeneratorWatch):
            return ReplayFrom(record)
        return ReplayRandom(record, self.runner.names[k])

    def _remember(self, k: int, stage: nn.Module, stack: ExitStack) -> None:
        """Before a recomputed stage's first run: how to replay its random numbers (lightning_rotor/rng.py)."""
        if k in self.runner.quiet or alone() or rewinds(stage):  # no mode now, rewind on the replay (rng.py)
            self.rng[k] = GeneratorWatch(self.rng_devices)
        else:
            self.rng[k] = stack.enter_context(RecordRandom()).states
        self.mutated[k] = [(b, tensor_version(b)) for b in self.runner.plain_buffers(k)]

    def _learn_quiet(self, k: int) -> None:
        record = self.rng[k]
        if isinstance(record, GeneratorWatch):
            if record.moved():
                self.runner.quiet.discard(k)  # it drew (or another thread did): record it from the next step
            else:
                self.rng[k] = []
                self.runner.quiet.add(k)
        elif not record:
            self.runner.quiet.add(k)  # drew nothing: from the next step, no mode on its first run

    def _find_mutated(self, k: int, stage: nn.Module) -> None:
        self.mutated[k] = [b for b, v in self.mutated[k] if tensor_version(b) != v]

    def _replay(self, k: int, stage: nn.Module, stack: ExitStack) -> None:
        """Recompute exactly as the first run: same RNG, same autocast, buffers untouched."""
        record = self.rng[k]  # the default generators are never rewound
        if isinstance(record, GeneratorWatch):
            stack.enter_context(Rewind(record) if alone() or rewinds(stage) else ReplayFrom(record))
        elif record:
            stack.enter_context(ReplayRandom(record, self.runner.names[k]))
        self.autocast.enter(stack)
        norms = [m for m in self.runner.norms(k) if m.training and m.track_running_stats]
        if norms:
            for m in norms:
                m.track_running_stats = False
            stack.callback(_restore_tracking, norms)
        if self.mutated.get(k):
            with torch.no_grad():
                saved = [b.clone() for b in self.mutated[k]]
            stack.callback(_restore_buffers, self.mutated[k], saved)

    # -- loss boundary ----------------------------------------------------------------------
    def take_output(self) -> Any:
        """Hand `a_L` to the caller: a plain one leaves the plan, one with graph stays for `B L-1`."""
        length = self.runner.length
        if self.graph.get(length, (None, None))[1] is not None:
            # the plan keeps only the graph: a_L lives as long as the caller's loss (or the graph) needs it
            inp, out = self.graph[length]
            self.released[length] = output_edges(out)
            self.graph[length] = (inp, None)
            return detach_value(out, False)
        return detach_value(self.plain.pop(length), False)

    # -- backward ops ---------------------------------------------------------------------
    def backward_op(self, k: int) -> int:
        """Run `B k`, and with it `B k-1 … B j` when those stages' graphs are joined: one engine call.

        Returns how many `B` ops ran.
        """
        run = [k]
        while run[-1] in self.joined:
            self.joined.discard(run[-1])
            run.append(run[-1] - 1)
        bottom = run[-1]
        entry, out = self.graph.pop(k + 1)
        edges = self.released.pop(k + 1, None)
        if edges is None:
            edges = output_edges(out)
        del out  # the value of a_{k+1} goes before the backward: only what the graph saved stays
        for j in run[1:]:  # joined below: their outputs were let go when the stage above ran (no edges kept)
            entry, out = self.graph.pop(j + 1)
            del out
        hooks, unmarked, mark_top = self._mark_done(run)
        parts = self._input_parts(edges if k == 0 else self.joined_edges.get(1, [])) if bottom == 0 else None
        if parts is not None:
            hooks += parts.install()
        # δ_{k+1} goes once the node receiving it has run, or at the latest when B k is done (δ_L too)
        done_at = [e for i in run[:-1] for e in self.joined_edges.get(i, [])]  # each boundary below B k
        side_edges, side_grads, slot = self._side_roots(k)
        try:
            backward_from_edges(
                [*edges, *side_edges],
                [*self.grads.pop(k + 1), *side_grads],
                free_grads=True,
                done_at=done_at,
                when_done=mark_top,
            )
        finally:
            for handle in hooks:
                handle.remove()
        del side_grads
        if slot:  # the sums, one per side tensor (None where nothing reached it: the sum so far stays)
            self.side_grads = [new if new is not None else old for new, old in zip(slot, self.side_grads, strict=True)]
        del slot
        for label in unmarked:  # only with a probe (`_mark_done`)
            self.mark_label(label)
        del edges
        if isinstance(entry, _Caught):
            self.grads[bottom] = entry.deltas()  # caught by EnterStage
            if parts is not None:
                self.input_parts = _in_parts(entry.wanted, self.grads[bottom], parts.parts)
        else:
            self.grads[bottom] = [t.grad if t.requires_grad else None for t in tensors_of(entry)]
        del entry
        for j in run:
            self.joined_edges.pop(j, None)
            if j != 0:
                self.plain.pop(j, None)
        return len(run)

    def _input_parts(self, edges: Sequence[Any]) -> InputParts | None:
        """Where the chain input is used more than once in stage 0: its gradient's parts, taken as they come
        from stage 0's graph at `edges` (NOTE: [a run's input gradient in parts]); else None (δ_0 is summed)."""
        entered, self.input_node = self.input_node, None
        if entered is None or max(self.runner.input_uses, default=1) < 2:
            return None
        node, count = entered
        return InputParts([e.node for e in edges if e is not None], [(node, i) for i in range(count)])

    def _mark_done(self, run: list[int]) -> tuple[list, list, Any]:
        """With a probe marking ops, inside one engine call for `B k … B j`: mark `B i` when δ_i
        reaches stage i-1's graph. Returns the hook handles, the marks still to make after the
        call (no graph below `B i`), and the mark of `B k` (made once δ_{k+1} is freed).
        """
        probe = self.probe
        if len(run) == 1 or probe is None:
            return [], [], None
        handles: list[Any] = []
        pending: list[str] = []

        def mark_until(label: str) -> None:
            while label in pending:  # marks stay in op order: any skipped come first
                probe.mark(pending.pop(0))

        for i in run[:-1]:
            label = Op(OpKind.B, i).label
            pending.append(label)
            if i != run[0]:
                handles += [
                    e.node.register_prehook(lambda *_, label=label: mark_until(label))
                    for e in self.joined_edges.get(i, [])
                    if e is not None
                ]
        top = Op(OpKind.B, run[0]).label
        return handles, pending, lambda: mark_until(top)

    def run(self, notes: Sequence[OpNote]) -> None:
        """Run the ops of `notes` in order (a `B k` may run the `B` ops after it too: joined backwards)."""
        i = 0
        while i < len(notes):
            i += self.run_op(notes, i)

    def run_op(self, notes: Sequence[OpNote], i: int) -> int:
        """Run op `i` of `notes` by its kind and flags (`ops.annotate`), mark it; returns how many ops ran."""
        note = notes[i]
        op, kind = note.op, note.kind
        k = -1 if op.stage is None else op.stage  # -1: the loss, which has no stage
        if note.early:  # an Fc with early-stopping recomputation, or the Fe it makes unneeded (B k reruns it)
            if kind is OpKind.FC:
                self.early_forward(k)
            self.mark(op)
            return 1
        match kind:
            case OpKind.FN | OpKind.FC:
                self.forward_nograd(k, forget=kind is OpKind.FN)
            case OpKind.FE:
                self.record(k, note.last, note.pack)
            case OpKind.FS:
                if op.option != 1:
                    raise RuntimeError(f"executor has no rule for op {op.label}: option 1 (sac) is the only one")
                self.record_option(k)
            case OpKind.B:
                if self.transfers is not None:
                    self.transfers.ready(k)
                done = self.backward_op(k)
                self.mark(notes[i + done - 1].op)  # the last B of a joined run (the others were marked inside the call)
                return done
            case OpKind.OFFLOAD:
                self.offload(k)
            case OpKind.PREFETCH:
                self.prefetch(k)
            case OpKind.OFFLOAD_SAVED:
                self.offload_saved(k)
            case OpKind.PREFETCH_SAVED:
                self.prefetch_saved(k)
            case OpKind.WAIT | OpKind.WAIT_SAVED:
                self.wait(op, saved=kind is OpKind.WAIT_SAVED)
            case OpKind.LOSS:  # Loss splits the plan in PlanRunner
                raise RuntimeError(f"executor has no rule for op {op.label} here")
            case _:
                assert_never(kind)
        self.mark(op)
        return 1

    def clear(self) -> None:
        self.plain.clear()
        self.graph.clear()
        self.released.clear()
        self.joined.clear()
        self.joined_edges.clear()
        self.carried.clear()
        self.grads.clear()
        self.rng.clear()
        self.saved_parts.clear()
        self.side_entries.clear()
        self.side_grads = []
        self.sides = []
        self.input_node = None
        self.input_parts = None
        if self.transfers is not None:
            self.transfers.clear()
        self.probe = None


def _check_plan(ops: list[Op], length: int) -> int:
    """Raise ValueError unless `ops` is a plan of a chain of `length` stages; returns its frozen prefix's length.

    Stages without a B op are a frozen prefix 0 … F-1 (chain version 4): Fn ops, first, once each.
    """
    if ops.count(Op(OpKind.LOSS)) != 1:
        raise ValueError("a plan has exactly one Loss op")
    frozen = length - sum(1 for op in ops if op.kind is OpKind.B)
    if sorted(op.stage for op in ops if op.kind is OpKind.B and op.stage is not None) != list(range(frozen, length)):
        raise ValueError(
            f"the plan does not fit a chain of {length} stages: it needs one B op per stage "
            "after a frozen prefix, whose stages run first as Fn 0 … Fn F-1 and never again"
        )
    check_frozen_prefix(ops, frozen)
    return frozen


def check_offload_saved(notes: Sequence[OpNote]) -> None:
    """Raise ValueError for an `OffloadSaved k` whose stage's latest forward is no `Fe k` (an `Fs`, `Fc`, `Fn`,
    or none): the executor moves only what an `Fe` recorded behind handles."""
    for note in notes:
        if note.kind is OpKind.OFFLOAD_SAVED and not note.moves:
            raise ValueError(f"{note.op.label} must follow the Fe {note.op.stage} whose recorded graph it moves")


def early_stage(stage: nn.Module) -> bool:
    """Can stage k run with early-stopping recomputation where the plan allows it (`ops.early_pairs`)?

    NOTE: [early-stopping recomputation] (`_Step.early_forward`). Compiled stages (replayed by rewinding,
    compile.py) and stages with BatchNorm or InstanceNorm (rerun without running statistics, which saves fewer
    tensors than torch's checkpoint recorded) keep `Fe k`. The memory then never exceeds the plan's: `B k`
    holds `a_k`, `δ_{k+1}` and what the rerun saves (a part of what `Fe k` saves).
    """
    return not rewinds(stage) and not any(is_norm(m) for m in stage.modules())


def _plain_buffers(stage: nn.Module) -> list[torch.Tensor]:
    norms = {id(b) for m in stage.modules() if is_norm(m) for b in m.buffers()}
    return [b for b in stage.buffers() if id(b) not in norms]


def _restore_tracking(norms: list[Any]) -> None:
    for m in norms:
        m.track_running_stats = True


def _restore_buffers(buffers: list[torch.Tensor], saved: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for b, s in zip(buffers, saved, strict=True):
            b.copy_(s)


UNSUPPORTED_BACKWARD = (
    "rotor runs the chain's backward itself and accumulates parameter gradients into .grad, so "
    "torch.autograd.grad, backward(inputs=...) and create_graph=True are not supported while the plan "
    "recomputes; call loss.backward() (or use a budget at which nothing is recomputed)"
)
SECOND_BACKWARD = (
    "rotor's recomputing chain can be backpropagated only once per forward (retain_graph=True does not keep "
    "it); run the forward again for another backward"
)


def _check_backward_call(step: _Step | None) -> _Step:
    """Refuse, before any gradient is written, a backward the plan cannot serve as plain autograd would.

    `autograd.grad` and `backward(inputs=...)` (the engine then only wants some
    gradients: `backward_is_full()` is False) would get nothing back or
    gradients in `.grad` of every parameter; `create_graph=True` (grad mode on
    in backward) would get gradients without graph.
    """
    if step is None:
        raise RuntimeError(SECOND_BACKWARD)
    if not backward_is_full() or torch.is_grad_enabled():
        raise RuntimeError(UNSUPPORTED_BACKWARD)
    return step


def _stash_grads(params: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Take the stored `.grad` of `params` away for the plan's backward (see `_add_stashed`)."""
    stashed = [(p, p.grad) for p in params if p.grad is not None]
    for p, _ in stashed:
        p.grad = None
    return stashed


def _add_stashed(stashed: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Add the step's gradient of each tied parameter into its stored `.grad` at once, as autograd does.

    NOTE: [tied parameters accumulate once] plain autograd sums every contribution of one
    backward to a parameter in the engine's buffer, then adds the sum to a stored `.grad`:
    `g + (a + b)`. The plan runs each stage's backward on its own, so a parameter used by two
    stages (a tied embedding and LM head) would get `(g + b) + a`, which differs in the last
    bits (gradient accumulation over micro-batches). With `.grad` taken away for the plan's
    backward, the stages sum into a fresh gradient, which is added to the stored one here.
    """
    with torch.no_grad():
        for p, stored in stashed:
            fresh = p.grad
            if fresh is not None:
                if stored.is_sparse or fresh.is_sparse:
                    stored = stored + fresh
                else:
                    stored.add_(fresh)
            p.grad = stored


def _in_parts(
    wanted: list[bool], direct: list[torch.Tensor | None], taken: list[list[torch.Tensor]]
) -> list[list[torch.Tensor]]:
    """Per tensor of a_0: the parts of its gradient in arrival order. A gradient EnterStage caught came
    first (a root of the backward call: stage 0 passed its input on as an output); then those `taken`
    (one list per entered tensor)."""
    entered = iter(taken)
    out = []
    for w, g in zip(wanted, direct, strict=True):
        parts = next(entered) if w else []
        out.append(parts if g is None else [g, *parts])
    return out


def _spread(parts: list[torch.Tensor], slots: int) -> list[torch.Tensor | None]:
    """`parts` over `slots` edges, None where none came; parts beyond the slots (a stage 0 using its input
    more often than when profiled) are summed into the last one."""
    if len(parts) > slots:
        rest = parts[slots - 1]
        for p in parts[slots:]:
            rest = rest + p
        parts = [*parts[: slots - 1], rest]
    return [*parts, *[None] * (slots - len(parts))]


class _Tail(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, step: _Step, spec: Any, dummy: torch.Tensor, uses: tuple[int, ...], n_sides: int, *args: Any
    ) -> torch.Tensor:
        # args: the chain input's leaves, each `uses` times (an edge per part of its gradient, NOTE: [a run's
        # input gradient in parts]), the side inputs (NOTE: [side inputs]), then the stages' parameters
        # (edges only, see `_check_backward_call`)
        n_inputs = sum(uses)
        inputs, ctx.n_params = args[:n_inputs], len(args) - n_inputs - n_sides
        step.sides = [t.detach() for t in args[n_inputs : n_inputs + n_sides]]
        step.side_grads = [None] * n_sides
        leaves = [inputs[i] for i in itertools.accumulate(uses[:-1], initial=0)]
        step.plain[0] = tree_unflatten(leaves, spec)
        runner = step.runner
        step.run(runner.forward_notes)
        ctx.step = step
        ctx.uses = uses
        ctx.is_tensor = [isinstance(t, torch.Tensor) for t in leaves]
        return torch.empty(0, device=dummy.device)

    @staticmethod
    def backward(ctx, token_grad: torch.Tensor) -> tuple:
        step: _Step = ctx.step
        off_this_node()  # the plan's backward runs under no loss window (compiled stages as compiled)
        stashed = _stash_grads(step.runner.shared_parameters())
        try:
            runner = step.runner
            step.run(runner.backward_notes)
            delta = step.grads.pop(step.runner.frozen)
            if step.runner.frozen:  # B F made no gradient: the chain input does not require grad
                delta = [None] * sum(ctx.is_tensor)
            parts = iter(step.input_parts or [[] if g is None else [g] for g in delta])
            del delta
            side_grads = step.side_grads
        finally:
            _add_stashed(stashed)
            step.clear()
            del ctx.step
        deltas: list[torch.Tensor | None] = []
        for is_tensor, n in zip(ctx.is_tensor, ctx.uses, strict=True):
            deltas += _spread(next(parts), n) if is_tensor else [None] * n
        return (None, None, None, None, None, *deltas, *side_grads, *[None] * ctx.n_params)


class _Output:
    """The step's end of `HandOver` (the head of the chain): `a_L` to the caller's loss, `δ_L` back to the plan."""

    def __init__(self, step: _Step):
        self.step: _Step | None = step  # None once δ_L came: the plan's backward runs once per forward
        self.spec: Any = None
        self.watch: LossWatch | None = None  # the caller's real loss, measured on a plan's first step

    def hand_over(self) -> list[torch.Tensor]:
        assert self.step is not None  # handed over once, before any backward
        flat, self.spec = tree_flatten(self.step.take_output())
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        if len(tensors) != len(flat):
            raise TypeError("the chain output must be a tensor or a (nested) tuple of tensors")
        self.watch, self.step.runner.loss_watch = self.step.runner.loss_watch, None
        if self.watch is not None:
            self.watch.start(tensors)
        return tensors

    def receive(self, grads: tuple[torch.Tensor | None, ...]) -> torch.Tensor:
        step = _check_backward_call(self.step)
        self.step = None
        watch, self.watch = self.watch, None
        if watch is not None:  # before the plan's backward: a replan or a refusal comes first
            watch.finish(grads)
        # a tensor of our own on each gradient's storage: the engine may hand the very same tensor to another
        # node too (an add of two calls' outputs), which then counts as a second owner and keeps it from being freed
        step.grads[step.runner.length] = [own_alias(g) for g in grads]
        step.mark(Op(OpKind.LOSS))
        return torch.empty(0, device=step.runner.token_device)  # the token's gradient: `_Tail.backward` runs


class PlanRunner:
    """Executes one plan on `stages`; call it like the chain: `runner(a_0) -> a_L`.

    Set `probe` (a `MemoryProbe`) before a call to have it marked after every op,
    which gives the measured memory curve of the step, op by op. `in_free`: the
    chain's figures (`Chain.in_free`), so that a plain stage input is let go exactly
    when the chain says (see `releases_plain`). `sizes`: the chain's `s_0 … s_L`, and `offloadable`: the
    chain's bytes per stage that `OffloadSaved k` moves, from which a plan that offloads reserves its
    host buffers once (`offload.buffer_sizes`). `input_uses`: per tensor of the chain input, how many
    edges of stage 0's graph take it (`Profile.input_uses`), its gradient's parts handed back one per edge.
    """

    def __init__(
        self,
        stages: Sequence[nn.Module],
        ops: Sequence,
        names: Sequence[str] | None = None,
        *,
        in_free: Sequence[int] | None = None,
        sizes: Sequence[int] | None = None,
        offloadable: Sequence[int] | None = None,
        early_stop: bool = True,
        sides: SideInputs | None = None,
        input_uses: Sequence[int] = (),
    ):
        self.stages = list(stages)
        self.sides = sides  # tensors every stage reads besides its input (NOTE: [side inputs])
        self.length = len(self.stages)
        self.names = list(names) if names is not None else [f"stage{k}" for k in range(self.length)]
        self.ops = ops = parse_ops(ops)
        self.frozen = _check_plan(ops, self.length)
        split = ops.index(Op(OpKind.LOSS))
        self.forward_ops = ops[:split]
        self.backward_ops = ops[split + 1 :]
        self.recomputed = recomputed_stage_set(ops)
        self.in_free = None if in_free is None else list(in_free)
        # Offload k / Prefetch k (chain version 6): one channel per plan, its host buffers reserved from the sizes
        self.channel: TransferChannel | None = None
        if any(op.kind.is_transfer for op in ops):
            reserve = buffer_sizes(ops, sizes, offloadable or ()) if sizes is not None else ()
            self.channel = TransferChannel(reserve)
        notes = annotate(ops, self.length, self.in_free)
        check_offload_saved(notes)
        # Fc k recorded under torch's checkpoint, Fe k skipped, B k recomputes with early stop; B k then B k-1
        # at once: a recorded a_k may feed stage k as it is, joining the graphs (both off with side inputs)
        early = {n.op.stage for n in notes if n.early} if early_stop else set()
        early = {k for k in early if k is not None and early_stage(self.stages[k])}
        self._notes = [replace(n, early=n.early and n.op.stage in early) for n in notes]
        self._side_notes = [replace(n, early=False, joins=False) for n in notes]
        self._with_sides(False)
        # per tensor of a_0: how many edges of stage 0's graph use it (`Profile.input_uses`; none given: 1 each)
        self.input_uses = list(input_uses)
        self.quiet: set[int] = set()  # recomputed stages whose last recorded first run drew no random number
        self.probe: OpMarks | None = None
        self.loss_watch: LossWatch | None = None  # set for one call: its hand-over measures the caller's loss
        self.token_device = torch.device("cpu")
        self._norms: dict[int, list[Any]] = {}
        self._all_params: list[torch.Tensor] | None = None
        self._shared: list[torch.Tensor] | None = None
        # off under DDP: the plan's backward alone calls the accumulators (NOTE: [no parameter edges under DDP])
        self.parameter_edges = True
        self._plain_buffers: dict[int, list[torch.Tensor]] = {}

    def _with_sides(self, on: bool) -> None:
        """Early stops and joined backwards, unless this call has side inputs (NOTE: [side inputs]): then each
        stage's backward is seeded with their gradient so far, and no stage reruns inside a backward (where the
        side values bound to it are gone); an option (`Fs`), which always does, is refused."""
        if on and any(op.kind is OpKind.FS for op in self.ops):
            raise ValueError("a chain with side inputs has no stage options: an Fs op reruns its stage in a backward")
        notes = self._side_notes if on else self._notes
        split = len(self.forward_ops)
        self.forward_notes = notes[:split]
        self.backward_notes = notes[split + 1 :]
        self.early = {n.op.stage for n in notes if n.early}
        self.joinable = {n.op.stage for n in notes if n.joins}

    def releases_plain(self, k: int) -> bool:
        """Does a plain `a_k` go after stage k's last forward? As the chain says (`in_free[k] > 0`).

        A recorded `a_k` is always let go: what its two graphs keep stays, which is what
        `in_free` leaves out. A plain one has no graph of stage k-1 to keep a part the
        chain counts as kept, so it goes only when the chain releases it; without a chain
        it always goes (more freed than any chain charges, never less).
        """
        if k < self.frozen or k == 0:  # a frozen stage's input, and the caller's a_0, stay to the end
            return False
        if k == self.frozen:  # a_F goes where the chain says that stage F's graph keeps none of it
            return self.in_free is not None and self.in_free[k] > 0
        return self.in_free is None or self.in_free[k] > 0

    def norms(self, k: int) -> list[Any]:
        """Stage k's normalization modules with running statistics (found once: replays are per op); typed
        Any: no public base class covers BatchNorm and InstanceNorm (`is_norm`), whose flags a replay sets."""
        if k not in self._norms:
            self._norms[k] = [m for m in self.stages[k].modules() if is_norm(m)]
        return self._norms[k]

    def plain_buffers(self, k: int) -> list[torch.Tensor]:
        """Stage k's buffers outside normalization modules (found once)."""
        if k not in self._plain_buffers:
            self._plain_buffers[k] = _plain_buffers(self.stages[k])
        return self._plain_buffers[k]

    def _parameters(self) -> list[torch.Tensor]:
        """The stages' trainable parameters, once each: graph edges that let `autograd.grad` reach the plan.

        The engine calls a parameter's accumulator once more through such an edge
        (with no gradient), which would run its post-accumulate-grad hooks twice;
        parameters with such hooks are left out (`autograd.grad` of those alone
        is then not detected).

        NOTE: [no parameter edges under DDP] DDP's reducer marks a parameter ready from a hook on its
        accumulator (C++, invisible from Python), and every call of the accumulator counts, a call without a
        gradient too. The plan's backward already called it once, so the edge would mark the parameter a
        second time ("marked as ready twice"), unless that backward happened to mark the model's last
        parameter (the reducer then stops listening until the next step: one chain, nothing trainable before
        it). With `parameter_edges` off (a call inside DDP's forward, `ddp_checks.DdpWatch`, or `distributed`)
        each accumulator runs once per step, as in plain DDP, and `autograd.grad` of the chain's parameters
        alone is not detected (DDP's reducer waits for every parameter's gradient anyway).
        """
        if not self.parameter_edges:
            return []
        params, _ = self._walk_parameters()
        return [p for p in params if p.requires_grad and not has_post_accumulate_grad_hooks(p)]

    def shared_parameters(self) -> list[torch.Tensor]:
        """Trainable parameters used by more than one stage (tied weights)."""
        _, shared = self._walk_parameters()
        return [p for p in shared if p.requires_grad]

    def _walk_parameters(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The stages' parameters once each, and those several stages use: the module walk once (requires_grad
        and hooks are read every step)."""
        if self._all_params is not None and self._shared is not None:
            return self._all_params, self._shared
        users: dict[int, int] = {}
        params: dict[int, torch.Tensor] = {}
        for stage in self.stages:
            for p in {id(p): p for p in stage.parameters()}.values():
                users[id(p)] = users.get(id(p), 0) + 1
                params[id(p)] = p
        self._all_params = list(params.values())
        self._shared = [params[i] for i, n in users.items() if n > 1]
        return self._all_params, self._shared

    def _input_slots(self, flat: list[Any]) -> tuple[int, ...]:
        """Per entry of the flat chain input: how many times `_Tail` takes it, one edge per part of its gradient
        (its uses in stage 0 where it requires grad, else 1; NOTE: [a run's input gradient in parts])."""
        uses = iter(self.input_uses if self.frozen == 0 else ())
        slots = []
        for t in flat:
            n = next(uses, 1) if isinstance(t, torch.Tensor) else 1
            slots.append(max(1, n) if isinstance(t, torch.Tensor) and t.requires_grad else 1)
        return tuple(slots)

    def __call__(self, value: Any) -> Any:
        flat, spec = tree_flatten(value)
        if not any(isinstance(t, torch.Tensor) for t in flat):
            raise TypeError("the chain input must be a tensor or a (nested) tuple of tensors")
        device = next(t.device for t in flat if isinstance(t, torch.Tensor))
        self.token_device = device
        if self.channel is not None:
            self.channel.prepare(device)  # CUDA: the plan's pinned host buffers, made once, before any op runs
        step = _Step(self, value, self.probe)
        if step.probe is not None:
            step.probe.track(value)
        dummy = torch.empty(0, device=device, requires_grad=True)
        sides = self.sides.tensors() if self.sides is not None else []
        self._with_sides(bool(sides))
        slots = self._input_slots(flat)
        args = itertools.chain.from_iterable([t] * n for t, n in zip(flat, slots, strict=True))
        token = _Tail.apply(step, spec, dummy, slots, len(sides), *args, *sides, *self._parameters())
        end = _Output(step)
        outputs = HandOver.apply(end, token)
        return tree_unflatten(list(outputs), end.spec)
