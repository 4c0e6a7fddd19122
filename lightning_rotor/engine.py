"""How stages are run, for the profiler and the executor alike.

Both must run a stage the same way, or the profile would measure another program
than the plan runs: stage values and their in-place checks, stage inputs entering
through `EnterStage`, the chain output handed to the loss through `HandOver`, and
backwards run from output edges that free each gradient once consumed. This module
imports neither profile.py nor execute.py.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from lightning_rotor._torch_compat import (
    is_accumulate_grad,
    is_node_of,
    run_backward,
    storage_use_count,
    tensor_version,
    tree_flatten,
    tree_map,
    tree_unflatten,
    view_base,
)
from lightning_rotor.memory import storage_emptied


class InplaceError(RuntimeError):
    """A stage modified its input in place, which would corrupt a kept checkpoint."""


# -- values (a tensor or a nested tuple of tensors) -----------------------------------------
def tensors_of(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):  # the common case, without pytree's cost (the executor calls this per op)
        return [value]
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def differentiable(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def value_device(value: Any) -> torch.device:
    return tensors_of(value)[0].device


def detach_value(value: Any, requires_grad: bool) -> Any:
    """Aliases of `value` cut from any graph, as leaves that require grad when asked and possible."""

    def leaf(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        d = t.detach()
        if requires_grad and differentiable(d):
            d.requires_grad_(True)
        return d

    return leaf(value) if isinstance(value, torch.Tensor) else tree_map(leaf, value)


def versions(value: Any) -> list[int]:
    return [tensor_version(t) for t in tensors_of(value)]


def check_inplace(before: list[int], value: Any, k: int, name: str) -> None:
    """Refuse a stage that wrote into its input (`before`: `versions(value)` before it ran)."""
    if versions(value) != before and k == 0:  # no stage before it to join (lightning_rotor/discovery/graph.py)
        raise InplaceError(
            f"stage 0 ({name}) writes in place into the chain input, which rotor keeps to run the stage again "
            "from, and no stage comes before it to share the write with; make that operation out-of-place "
            "(e.g. ReLU(inplace=False), x = x + 1) or run it before the chain"
        )
    if versions(value) != before:
        raise InplaceError(
            f"stage {k} ({name}) modified its input in place, which would corrupt a kept checkpoint; "
            "make the operation out-of-place or put it in the same stage as the module before it"
        )


# -- entering a stage -------------------------------------------------------------------------
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


def _compact(grad: torch.Tensor | None) -> torch.Tensor | None:
    """A copy of `grad` when it is a view that keeps a larger storage alive (see `compact_gradients`).

    `grad` is None where no gradient reaches the input (the engine calls the hook all the same): nothing to copy.
    """
    if (
        grad is None
        or grad.layout != torch.strided
        or grad.untyped_storage().nbytes() <= grad.numel() * grad.element_size()
    ):
        return None
    return grad.clone()


def compact_gradients(value: Any, carried: Sequence[bool] | None = None) -> Any:
    """Make every gradient that reaches a tensor of stage input `value` hold only its own bytes; returns `value`.

    NOTE: [compact stage-input gradients] the memory model holds δ_k as `s_k` bytes from `B k` on.
    A gradient made as a slice of a larger one (the backward of `torch.cat` gives each input a
    narrow view of the output's gradient, as for a U-Net skip) keeps the whole storage alive
    instead, as long as δ_k is held. A tensor hook copies such a gradient into a tensor of its own
    when it reaches the stage input, and the view goes with the engine's buffer. The copy is part of
    `B k`: the profiler runs stages with the same hooks, so `bwd_tmp` measures it.

    The copy has other strides than the view (no gaps), and a backward that reduces over it
    (BatchNorm's) rounds otherwise for another layout: a copy handed to the node that made the
    tensor would change the gradients. So `carried` (per tensor of `value`) limits the hooks to
    the tensors the stage below passed on from its own input, whose gradient is held across
    stages (a skip carried down); a gradient that goes to the node that made its tensor, within
    the same engine call, stays the view plain autograd hands it (see `compact_uncovered` for a
    held δ_k).
    """
    tensors = tensors_of(value)
    for t, c in zip(tensors, [True] * len(tensors) if carried is None else carried, strict=True):
        if c and t.requires_grad:
            t.register_hook(_compact)
    return value


def compact_uncovered(grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """δ_k with each view copied to a tensor of its own where δ_k's views do not cover their storage.

    A δ_k held by the executor between `B k` and `B k-1` must hold `s_k` bytes (NOTE: [compact
    stage-input gradients]); but where the views of one storage are together the whole storage
    (`torch.cat` of two stage-input tensors: each gets a slice of its gradient) they already hold
    no more, and handing on the views as they are keeps the layouts plain autograd hands on.
    """
    covered: dict[int, set[tuple[int, tuple[int, ...], tuple[int, ...]]]] = {}
    for g in grads:
        if g is not None and g.layout == torch.strided:
            key = (int(g.storage_offset()), tuple(g.size()), tuple(g.stride()))
            covered.setdefault(g.untyped_storage().data_ptr(), set()).add(key)
    out: list[torch.Tensor | None] = []
    for g in grads:
        if g is None or g.layout != torch.strided:
            out.append(g)
            continue
        storage = g.untyped_storage()
        views = covered[storage.data_ptr()]
        held = sum(_numel(size) for _, size, _ in views) * g.element_size()
        out.append(g.clone() if storage.nbytes() > held else g)
    return out


def _numel(size: tuple[int, ...]) -> int:
    n = 1
    for d in size:
        n *= d
    return n


def carried_through(inp: Any, out: Any) -> list[bool]:
    """Per tensor of a stage's output `out`: is it its input `inp` (a tensor of it or a view), passed on?"""
    storages = {t.untyped_storage().data_ptr() for t in tensors_of(inp) if t.layout == torch.strided}
    return [t.layout == torch.strided and t.untyped_storage().data_ptr() in storages for t in tensors_of(out)]


class EnterStage(torch.autograd.Function):
    """Give a stage its input through a graph node that keeps nothing, and catch the input's gradient.

    NOTE: [EnterStage keeps nothing] a leaf input would be held, storage and all, by its
    gradient accumulator as long as the stage's graph lives. Through this node the stage's
    graph keeps only what it saves, so once the executor lets go of `a_k` after the last
    forward of stage `k`, the rest of `a_k` is freed, as in plain training (chain version 3,
    `in_free`). `slot` receives the gradients (one per tensor, None where none came).
    """

    @staticmethod
    def forward(ctx: Any, slot: list, dummy: torch.Tensor, *tensors: torch.Tensor) -> tuple:
        ctx.slot = slot
        ctx.set_materialize_grads(False)
        outs = tuple(t.view_as(t) for t in tensors)
        ctx.mark_non_differentiable(*[t for t in outs if not differentiable(t)])
        return outs

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple:
        ctx.slot.extend(grads)
        return (None, None, *[None] * len(grads))


class InputParts:
    """The gradients that stage 0's graph sends to its input node, one part per edge, in arrival order.

    NOTE: [a run's input gradient in parts] plain autograd sums a tensor's gradient in the
    buffer of the node that made it, one part per use, in the order the uses' backwards run: a
    module-level run's input `h`, used twice in the first stage and once after the run
    (`y = blocks(h); return y + h`), gets `(g + p1) + p2`, `g` from the use after the run first
    (its node is newer than the run's, so it runs first). Summed in stage 0's graph, δ_0 would
    make it `g + (p1 + p2)`, which differs in the last bits. So the parts are taken out of stage
    0's graph before they reach its input node (a post-hook on each node with an edge to it, in
    the order those nodes run and their edges are numbered) and handed back one per edge of the
    autograd node that ends the chain, which passes the input once per part: the engine adds them
    to `h`'s buffer in that order, as plain autograd does. Each part is held as a tensor of its
    own until then (a use too many charges `s_0` bytes more, which the profiler measures).
    """

    def __init__(self, roots: Sequence[Any], targets: Sequence[tuple[Any, int]]):
        # targets: the input's edges, one per tensor (EnterStage's inputs in the executor, the leaves'
        # accumulators when profiled)
        self.parts: list[list[torch.Tensor]] = [[] for _ in targets]  # per target, in arrival order
        self.consumers = _consumers(roots, {(id(node), nr): j for j, (node, nr) in enumerate(targets)})

    @property
    def uses(self) -> list[int]:
        """Per target: how many edges of the graph lead to it."""
        uses = [0] * len(self.parts)
        for _, edges in self.consumers:
            for _, j in edges:
                uses[j] += 1
        return uses

    def install(self) -> list[Any]:
        """Hook the consumers; returns the handles to remove after the backward."""
        return [node.register_hook(functools.partial(self._take, edges)) for node, edges in self.consumers]

    def _take(self, edges: list[tuple[int, int]], grad_inputs: Sequence[torch.Tensor | None], *_: Any) -> tuple:
        out = list(grad_inputs)
        for i, j in edges:
            grad = out[i]
            if grad is not None:
                # a tensor of its own on the storage: the backward's freeing (`_FreeConsumed`) sees it held
                self.parts[j].append(_alias(grad) if grad.layout == torch.strided else grad)
                out[i] = None
        return tuple(out)


def _consumers(roots: Sequence[Any], targets: dict[tuple[int, int], int]) -> list[tuple[Any, list[tuple[int, int]]]]:
    """The nodes of the graph above `roots` with edges to `targets` ((id(node), input) -> index), as
    (node, [(edge index, target index)]); the walk stops at the targets' nodes."""
    ends = {node_id for node_id, _ in targets}
    found, seen, stack = [], set(), [n for n in roots if n is not None]
    while stack:
        node = stack.pop()
        if id(node) in ends or node in seen:
            continue
        seen.add(node)
        nexts = node.next_functions
        edges = [(i, targets[id(n), nr]) for i, (n, nr) in enumerate(nexts) if (id(n), nr) in targets]
        if edges:
            found.append((node, edges))
        stack.extend(n for n, _ in nexts if n is not None)
    return found


def enter_stage(
    value: Any, slot: list, dummy: torch.Tensor, wanted: Sequence[bool] | None = None, *, compact: bool = True
) -> Any:
    """`value` with each tensor passed through `EnterStage`; `slot` gets their gradients.

    `wanted`: per tensor of `value`, whether it gets a gradient (the rest enter detached, as
    tensors that do not require grad); all by default. `compact`: see `compact_gradients`.
    """
    flat, spec = tree_flatten(value)
    tensors = [t for t in flat if isinstance(t, torch.Tensor)]
    wanted = [True] * len(tensors) if wanted is None else list(wanted)
    picked = [t.detach() for t, w in zip(tensors, wanted, strict=True) if w]
    entered = iter(EnterStage.apply(slot, dummy, *picked) if picked else ())
    if compact:
        entered = iter(compact_gradients(tuple(entered)))
    take = iter(wanted)
    return tree_unflatten(
        [(next(entered) if next(take) else t.detach()) if isinstance(t, torch.Tensor) else t for t in flat], spec
    )


# -- the loss boundary ------------------------------------------------------------------------
class LossEnd(Protocol):
    """The two sides of `HandOver`: what the loss gets, and where its gradients go."""

    def hand_over(self) -> list[torch.Tensor]: ...

    def receive(self, grads: tuple[torch.Tensor | None, ...]) -> torch.Tensor | None: ...


class HandOver(torch.autograd.Function):
    """Give tensors to a loss as outputs of a graph node that keeps nothing, and catch their gradients.

    `HandOver.apply(end, edge)`: the outputs are `end.hand_over()`; their gradients (None where
    none came) go to `end.receive`, whose result is `edge`'s gradient. The executor hands the
    chain output over this way; the profiler measures the loss through the same node, which
    charges the loss what it costs when the caller writes `loss_fn(model(x), y)`.

    NOTE: [handing over outside the inputs] the tensors come from `end`, not as inputs of the
    Function: an input returned as an output becomes a view of it, which holds the input alive
    and is a second owner of its storage (the loss could then not free it).
    """

    @staticmethod
    def forward(ctx: Any, end: LossEnd, edge: torch.Tensor) -> tuple:
        tensors = end.hand_over()
        ctx.end = end
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(*[t for t in tensors if not differentiable(t)])
        return tuple(tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple:
        return None, ctx.end.receive(grads)


# -- backwards from output edges --------------------------------------------------------------
def backward_pairs(outputs: Any, grads: Sequence[torch.Tensor | None]) -> tuple[list, list]:
    """(tensors, grads) of the outputs that carry a graph and received a gradient."""
    outs, gs = [], []
    for t, g in zip(tensors_of(outputs), grads, strict=True):
        if t.requires_grad and g is not None:
            outs.append(t)
            gs.append(g)
    return outs, gs


def output_edges(outputs: Any) -> list[GradientEdge | None]:
    """Where each output tensor's gradient enters the graph (None: no graph).

    Backpropagating from the edges instead of the tensors lets the caller drop the
    output values first: their storage is freed unless the graph saved it, as plain
    autograd frees an output nothing needs (Megatron's output deallocation, done by
    reference counting instead of by hand).
    """
    return [get_gradient_edge(t) if t.requires_grad else None for t in tensors_of(outputs)]


def backward_from_edges(
    edges: Sequence[GradientEdge | None],
    grads: Sequence[torch.Tensor | None],
    *,
    free_grads: bool = False,
    done_at: Sequence[GradientEdge | None] = (),
    when_done: Callable[[], None] | None = None,
) -> None:
    """Backpropagate `grads` from output `edges` (see `output_edges`); nothing when no edge has a gradient.

    `free_grads`: free each gradient once the node receiving it has run (NOTE: [freeing consumed
    gradients]). `done_at`: edges where the stages below the one receiving `grads` begin, in order,
    when one call runs several stages' backwards; `when_done` is called at the first of them.
    """
    roots, gs = [], []
    for e, g in zip(edges, grads, strict=True):
        if e is not None and g is not None:
            roots.append(e)
            gs.append(unviewed(g) if free_grads else g)
    del grads
    if not roots:
        return
    handles = []
    if free_grads:
        # NOTE: [freeing consumed gradients] the engine frees a gradient between nodes of one
        # backward; held until the whole stage's backward returns, δ_{k+1} would outlive what the
        # memory model charges. Only gradients the caller owns alone are freed: a storage anything
        # else references is left alone, and so is a gradient a receiver keeps (below). A gradient
        # its receiver passed on as a view is freed at the first stage boundary (`done_at`) where
        # nothing uses the view any more; one passed on as the very same tensor is left to the engine.
        receivers: dict[int, tuple[Any, list[torch.Tensor]]] = {}
        shared: dict[int, int] = {}
        for g in gs:
            if g.layout == torch.strided:
                ptr = g.untyped_storage().data_ptr()
                shared[ptr] = shared.get(ptr, 0) + 1
        for e, g in zip(roots, gs, strict=True):
            # NOTE: [receivers that keep the gradient] a leaf's accumulator stores it as `.grad` and `EnterStage`
            # catches it as δ of the stage input (a stage passing a tensor of its input on untouched, such as a
            # U-Net skip, hands EnterStage the root gradient itself). The engine and the slot hold the same
            # tensor, which adds no reference to the storage, so it would look consumed and owned: it stays.
            # A gradient given to several roots is still needed after the first has run: it stays too.
            if _keeps_gradient(e.node) or g.layout != torch.strided:
                continue
            if shared[g.untyped_storage().data_ptr()] > 1:
                continue
            receivers.setdefault(id(e.node), (e.node, []))[1].append(g)
        consumed: set[int] = set()  # ids of gradients whose receiver ran and did not pass them on unchanged
        handles = [node.register_hook(_FreeConsumed(owned, consumed)) for node, owned in receivers.values()]
        if done_at:  # only a call running several stages' backwards has a later point to free at
            later = _FreeRest([g for _, owned in receivers.values() for g in owned], consumed, when_done)
            handles += [e.node.register_prehook(later) for e in done_at if e is not None]
    try:
        run_backward(roots, gs)  # NOTE: [the engine itself] (lightning_rotor/_torch_compat.py)
    finally:
        for h in handles:
            h.remove()


def _keeps_gradient(node: Any) -> bool:
    """Does this graph node keep the gradient it receives (see NOTE: [receivers that keep the gradient])?"""
    return is_accumulate_grad(node) or is_node_of(node, EnterStage)


def unviewed(grad: torch.Tensor) -> torch.Tensor:
    """`grad` as a tensor of its own on the same storage, when it is a view (of the tensor it was made from).

    A view keeps its base tensor alive, and with it a second reference to the storage,
    so the gradient would not look owned by the caller alone and could not be freed
    once consumed (the loss's gradient often arrives as a view, e.g. through a reshape).
    Only the view's own reference to the base goes; a base held elsewhere keeps the storage.
    """
    if view_base(grad) is None or grad.layout != torch.strided:
        return grad
    return _alias(grad)


def own_alias(grad: torch.Tensor | None) -> torch.Tensor | None:
    """A tensor of its own on `grad`'s storage (same offset, size and strides); non-strided ones as they are."""
    if grad is None or grad.layout != torch.strided:
        return grad
    return _alias(grad)


def _alias(grad: torch.Tensor) -> torch.Tensor:
    return grad.new_empty(0).set_(grad.untyped_storage(), grad.storage_offset(), grad.size(), grad.stride())


def _free_owned(tensors: Sequence[torch.Tensor], passed: set[int]) -> list[torch.Tensor]:
    """Empty the storage of each tensor only it references (and that is not in `passed`, by storage).

    Returns the tensors whose storage is still held elsewhere (a view passed on may die later).
    """
    held = []
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes() == 0:
            continue
        if storage.data_ptr() not in passed and storage_use_count(storage) == 2:
            storage.resize_(0)  # only this tensor and `storage` itself referenced it
            storage_emptied(storage)
        else:
            held.append(t)
    return held


class _FreeConsumed:
    """Node post-hook: free the storage of gradients the node has consumed, when only they hold it."""

    def __init__(self, tensors: list[torch.Tensor], consumed: set[int]):
        self.tensors = tensors
        self.consumed = consumed

    def __call__(self, grad_inputs: Sequence[torch.Tensor | None], *_: Any) -> None:
        # a node may pass a gradient on as it is (an add, a view): then the next nodes still need it
        passed = {g.untyped_storage().data_ptr() for g in grad_inputs if isinstance(g, torch.Tensor)}
        self.consumed.update(id(t) for t in self.tensors if not any(g is t for g in grad_inputs))
        _free_owned(self.tensors, passed)
        self.tensors = []


class _FreeRest:
    """Node pre-hook where each stage below the one that received the gradients begins: free those held alone.

    Only gradients whose receiver has run and did not pass them on as the very same tensor:
    the engine may hold any other for a node still to run. A gradient passed on as a view stays
    while the view lives (it is the next stage's δ); a later stage boundary frees it once the
    view is gone. A gradient whose receiver has not run yet waits for a later boundary: where the stage
    above passed its input on unchanged, the first boundary is the receiver itself (freed there, it was
    kept to the end of the call: 1 KiB over the budget). `then` runs once, at the first boundary.
    """

    def __init__(self, tensors: list[torch.Tensor], consumed: set[int], then: Callable[[], None] | None):
        self.tensors = tensors
        self.consumed = consumed
        self.then = then

    def __call__(self, grad_outputs: Sequence[torch.Tensor | None]) -> None:
        passed = {g.untyped_storage().data_ptr() for g in grad_outputs if isinstance(g, torch.Tensor)}
        _then, self.then = self.then, None
        # only consumed gradients are ours to free; one whose receiver has not run yet waits for a later
        # boundary (the first boundary is the receiver itself where the stage above passed its input through)
        waiting = [t for t in self.tensors if id(t) not in self.consumed]
        ready = [t for t in self.tensors if id(t) in self.consumed]
        self.tensors = waiting + _free_owned(ready, passed)
        if _then is not None:
            _then()
