"""The step pipeline: stages + sample + budget -> profile -> Chain -> plan -> Plan -> runner.

Plain functions, in the order a first training call runs them. Each takes the previous
one's output and knows nothing of the ones after it: `profile` measures the stages on the
sample and returns numbers (a `Profile` holding the `Chain`); `plan_chain` sees only the
`Chain` and a byte budget; `runner` sees only the stages and the `Plan`. `prepare` runs the
three in a row and returns an `Entry`, what `PlanCache` keeps per call signature: a chain's
`ChainState` (lightning_rotor/chain_state.py) makes each new signature's entry through it.

A chain found inside a module's forward (module-level discovery) leaves part of the forward
outside the chain; `measure_outside` measures what that part holds and `charge_outside`
charges it to the chain, so the budget bounds the whole step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from lightning_rotor._torch_compat import tree_flatten, tree_map, tree_unflatten
from lightning_rotor.chain import Chain
from lightning_rotor.engine import HandOver, tensors_of
from lightning_rotor.execute import PlanRunner
from lightning_rotor.memory import Excluded, MemoryProbe, storage_bytes
from lightning_rotor.ops import forward_counts
from lightning_rotor.planner import Plan, plan
from lightning_rotor.profile import LOSS_HELD, Profile, profile_chain
from lightning_rotor.stages import SideInputs, side_inputs
from lightning_rotor.transfer_waits import with_release_waits

if TYPE_CHECKING:
    from lightning_rotor.discovery.modules import ModuleRun

__all__ = [
    "Entry",
    "Outside",
    "charge_outside",
    "measure_outside",
    "plan_chain",
    "prepare",
    "profile",
    "run_stages",
    "runner",
]

LossFn = Callable[[Any], torch.Tensor]


class Outside(NamedTuple):
    """What a module-level chain's step holds outside the chain (`measure_outside`), in bytes."""

    before: int  # kept by the forward from before the run, beside the run's input
    tail: int  # peak of the rest of the forward, the loss and their backward above what is alive after the run
    # the loss value and its seed gradient, held to the end of the step, with the gradients that wait as long: a tied
    # parameter's part from after the run (`waiting_gradients`), the run's input's part from after the run
    # (NOTE: [the outside gradient of the run's input])
    loss_value: int = LOSS_HELD


@dataclass
class Entry:
    """The profile, plan and runner of one call signature."""

    profile: Profile
    plan: Plan
    runner: PlanRunner

    @property
    def chain(self) -> Chain:
        return self.profile.chain

    @property
    def runs(self) -> list[int]:
        """How many times each stage runs forward in one step (more than 1: recomputed)."""
        return forward_counts(self.plan.ops, self.chain.length)


def profile(
    stages: Sequence[nn.Module],
    sample: Any,
    *,
    names: Sequence[str] | None = None,
    repeats: int = 5,
    warmup: int = 0,
    loss_fn: LossFn | None = None,
    loss_tmp: int | None = None,
    outside: Outside | tuple[int, int] | None = None,
    progress: Callable[[int, int, float], None] | None = None,
    timed: bool = True,
    options: bool = False,
    offload: bool = False,
    flops: bool = False,
    allocator: bool = True,
) -> Profile:
    """Measure `stages` on `sample` (the chain input `a_0`): times, sizes, transients.

    `loss_fn` is measured on the chain output (default: a cross-entropy stand-in); `loss_tmp`
    bytes are charged instead when given. `outside` (a module-level chain): what the rest of
    the forward and the caller's loss cost, measured by `measure_outside` (which took `loss_fn`),
    charged as the chain's loss instead of measuring one on the chain output (`charge_outside`).
    `timed=False`: sizes only, times 0 (a new shape's times are derived, lightning_rotor/shapes.py).
    `options`: measure each stage's option "sac" too (`profile_chain`); `offload`: each stage's
    `offloadable` bytes too; `flops`: each stage's forward FLOPs too (`Profile.flops`); `allocator=False`: on CUDA,
    tensor accounting's figures alone (NOTE: [sizes on CUDA], lightning_rotor/allocator.py).
    """
    loss: int | LossFn | None = loss_tmp if loss_tmp is not None else loss_fn
    if outside is not None:
        loss = LOSS_HELD  # placeholder bytes: charge_outside sets the loss from `outside`
    sides = side_inputs(stages)
    with side_leaves(sides) as leaves:
        measured = profile_chain(
            stages,
            sample,
            names=names,
            repeats=repeats,
            warmup=warmup,
            loss_tmp=loss,
            progress=progress,
            timed=timed,
            options=options and not leaves,  # an option reruns its stage in a backward, without the side values
            offload=offload,
            flops=flops,
            allocator=allocator,
        )
    if outside is not None:
        measured.chain = charge_outside(measured.chain, outside, loss_tmp)
    measured.chain = charge_side_gradients(measured.chain, leaves)
    return measured


@contextmanager
def side_leaves(sides: SideInputs | None) -> Iterator[list[torch.Tensor]]:
    """While profiling, the stages read leaves of their own in place of the side inputs: each stage's backward
    stops there, as the executor's does at its `EnterStage` (NOTE: [side inputs] in lightning_rotor/execute.py)."""
    leaves = [t.detach().requires_grad_(True) for t in sides.tensors()] if sides is not None else []
    if sides is None or not leaves:
        yield []
        return
    sides.bind(leaves)
    try:
        yield leaves
    finally:
        sides.bind(None)


def charge_side_gradients(chain: Chain, sides: Sequence[torch.Tensor]) -> Chain:
    """The side inputs' gradient, summed across the stages' backwards and held from the first to the end of the
    step, charged with the loss value, which is held over the same ops (docs/memory-model.md, "Side inputs")."""
    extra = sum(t.numel() * t.element_size() for t in sides)
    return dataclasses.replace(chain, loss_value=chain.loss_value + extra) if extra else chain


def charge_outside(chain: Chain, outside: Outside | tuple[int, int], loss_tmp: int | None = None) -> Chain:
    """A module-level chain charged with the rest of the forward (`Outside`, docs/memory-model.md,
    "A module-level chain"): what the forward keeps from before the run, with the chain input
    (`B 0`'s transient shifted so that `δ_0` stays `a_0`'s size);
    the forward after the run, the caller's loss and their backward down to `δ_L`, as the
    chain's loss (at least `loss_tmp` bytes when the caller gave them).

    The tail was measured with `a_L` held throughout, so it stands for a kept `a_L` and, at most
    `s_L` bytes too high, for a plain one. The gradient the code after the run sends to the run's
    input is held with the loss value, to the end of the step.
    """
    outside = Outside(*outside)
    s_l = chain.out_size[-1]
    tail_tmp = max(outside.tail - s_l, -s_l)
    if loss_tmp is not None:
        tail_tmp = max(tail_tmp, loss_tmp)
    return dataclasses.replace(
        chain,
        input_size=chain.input_size + outside.before,
        # B 0 makes δ_0 of a_0's size, not of what is kept beside it: the same peak, from a larger s_0
        bwd_tmp=[chain.bwd_tmp[0] - outside.before, *chain.bwd_tmp[1:]],
        loss_tmp=tail_tmp,
        loss_tmp_kept=tail_tmp,
        # with the gradients that wait as long (`Outside.loss_value`); where the run's input's part from after the
        # run is δ_L itself (an add hands both the same tensor), δ_L is charged twice until B L-1, the safe side
        loss_value=outside.loss_value,
    )


def plan_chain(chain: Chain, budget: int, slots: int | None = None) -> Plan:
    """The fastest schedule of `chain` within `budget` bytes (raises `InfeasibleBudget` below its minimum); with
    offloading, an offload's release waits for its copy wherever the times alone made it (transfer_waits.py), so
    the plan holds its peak however fast its ops and copies run."""
    chosen = plan(chain, budget, slots=slots)
    return dataclasses.replace(chosen, ops=with_release_waits(chain, chosen.ops))


def runner(
    stages: Sequence[nn.Module],
    chain: Chain,
    chosen: Plan,
    names: Sequence[str] | None = None,
    *,
    early_stop: bool = True,
    sides: SideInputs | None = None,
    input_uses: Sequence[int] = (),
) -> PlanRunner:
    """What runs `chosen` on the stages: an autograd Function per call. `early_stop`, `input_uses`: see
    `PlanRunner`; `sides`: the stages' side inputs (default: those of `stages`, when a `Stages`)."""
    return PlanRunner(
        stages,
        chosen.ops,
        names,
        in_free=chain.in_free,
        sizes=chain.sizes,
        offloadable=chain.offloadable,
        early_stop=early_stop,
        sides=sides if sides is not None else side_inputs(stages),
        input_uses=input_uses,
    )


def prepare(
    stages: Sequence[nn.Module],
    sample: Any,
    budget: int | Callable[[Chain], int],
    *,
    names: Sequence[str] | None = None,
    slots: int | None = None,
    adjust: Callable[[Profile], Profile] | None = None,
    build: Callable[[Profile, Plan], Entry] | None = None,
    **settings: Any,
) -> Entry:
    """The whole pipeline on one call signature: profile, plan within `budget`, runner.

    `budget`: bytes, or a function of the profiled chain giving bytes (a fraction of its
    no-recomputation peak, a share of a budget over several chains). `adjust`: the profile as it is
    planned (a later shape's times derived from the first's, the transfer bandwidth: `ChainState`).
    `build`: the entry of the profile and its plan (default: `runner`'s; `PlanCache.build` for a
    cache's settings). `settings` go to `profile`.
    """
    measured = profile(stages, sample, names=names, **settings)
    if adjust is not None:
        measured = adjust(measured)
    nbytes = budget(measured.chain) if callable(budget) else budget
    chosen = plan_chain(measured.chain, nbytes, slots)
    if build is not None:
        return build(measured, chosen)
    return Entry(measured, chosen, runner(stages, measured.chain, chosen, names, input_uses=measured.input_uses))


def run_stages(stages: Iterable[nn.Module], value: Any) -> Any:
    """The chain's forward as written: each stage on the previous one's output."""
    for stage in stages:
        value = stage(value)
    return value


def measure_outside(
    module: nn.Module,
    run: ModuleRun,
    stages: Iterable[nn.Module],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    loss_fn: LossFn | None = None,
) -> Outside:
    """What a module-level chain's budget must also hold besides its stages: see `Outside`.

    One forward with the blocks run without grad and the rest recorded, the caller's loss
    (`profile.caller_loss`: `loss_fn` of the output, else the loss the output carries, else a
    cross-entropy stand-in), then its backward down to the run's output `a_L` (handed over as the
    executor hands it: `δ_L` is made, as in training) and the call's inputs, taken as leaves of their own.
    As in a step `loss_fn(model(x), y).backward()`, only the loss is held into the backward, not
    the output (a step that keeps the logits holds them on top, as anything `training_step`
    keeps). `a_L` is held throughout. Parameters' `.grad` are set aside meanwhile and put back
    untouched, buffers, the RNG stream and autocast's weight-cast cache too (`profile.Untouched`).
    """
    from lightning_rotor.profile import LossInput, Untouched, caller_loss, grads_aside, leaves_reached

    # NOTE: [gradients stored by autograd]: only the measuring backward stores a gradient of `module`'s here
    # (`Untouched` and `grads_aside` set `.grad` outside the probe or to what it was, None), so hooks tell the
    # probe which `.grad` to read instead of every parameter's before every op
    exclude = Excluded(module, by_autograd=True)
    probe = MemoryProbe(exclude, record_curve=True)
    seen: dict[str, int] = {}
    held: list[Any] = []  # a_0 and a_L, held to the end
    # what the graph before the run (and the side inputs') accumulates into, and the stages' parameters
    before_leaves: list[torch.Tensor] = [p for stage in stages for p in stage.parameters() if p.requires_grad]
    waits = Waits(probe)  # when the measuring backward made and stored each waiting gradient

    def blocks_without_grad(value: Any) -> Any:
        probe.mark("run")  # sweeps first: what died since the last op (temporaries of the code before) is not kept
        # the run's input and side inputs may be the caller's own tensors, made before the probe (a decoder wrapped
        # on its own gets the encoder output as an argument, which its blocks keep): counted once, held to the end
        probe.track(value, *run.tensors())
        seen["before"] = probe.current - storage_bytes(value)
        before_leaves.extend(leaves_reached([*tensors_of(value), *run.tensors()]))
        _catch_input_grad(value, seen)
        with torch.no_grad():
            out = run_stages(stages, value)
        # a_L handed on as the executor hands it over (`HandOver`): requiring grad, written in place if the
        # code after the run does, its gradient δ_L caught; held with a_0 (and the graph before the run)
        flat, spec = tree_flatten(out)
        end = LossInput([t.detach() for t in flat if isinstance(t, torch.Tensor)])  # no view: written in place
        held.extend((value, list(end.tensors), end))
        token = torch.empty(0, requires_grad=True)
        handed = iter(HandOver.apply(end, token))  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        out = tree_unflatten([next(handed) if isinstance(t, torch.Tensor) else t for t in flat], spec)
        probe.reset_peak()
        seen["after"], seen["after_ops"] = probe.current, probe.ops
        return out

    # copies of the caller's tensors as leaves of their own: the backward stops at them, not in the caller's graph
    args, kwargs = tree_map(own_leaf, (args, kwargs))
    devices = [t.device for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    run.install(blocks_without_grad)
    try:
        with Untouched([module], devices), exclude, probe:
            output = module(*args, **kwargs)
            loss = caller_loss(output, loss_fn)
            del output  # the caller holds the loss into the backward, not the output
            seen["value"] = 2 * storage_bytes(loss)  # the value and the gradient backward seeds it with
            waiting = waiting_leaves(leaves_reached([loss]), before_leaves)
            seen["value"] += sum(t.numel() * t.element_size() for t in waiting)
            waits.watch(waiting)
            if loss.requires_grad:
                with grads_aside(loss):  # parameters outside `module` (a loss_fn's): their .grad is the caller's
                    loss.backward()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
            del loss
    finally:
        run.uninstall()
        held.clear()
        waits.remove()
    after = seen.get("after", probe.peak)
    tail = waits.peak(seen.get("after_ops", len(probe.curve)), after) - after
    return Outside(max(0, seen.get("before", 0)), max(0, tail), seen.get("value", LOSS_HELD))


def _catch_input_grad(value: Any, seen: dict[str, int]) -> None:
    """Add to `seen["value"]` (the loss value's bytes, held to the end of the step) those of the gradient the code
    after the run sends to the run's input.

    NOTE: [the outside gradient of the run's input] a run's input used again after the run
    (`y = blocks(h); return y + h`) gets a gradient from the code after the run before the chain's
    backward starts (its nodes are newer than the run's); it waits in the buffer of the node that
    made `h` until the chain hands back δ_0, through every `B k`. Here the blocks run without grad,
    so what reaches `h` is that gradient alone; measured as it arrives (the node that made `h` then
    runs at once, which training does only after the chain).
    """

    def catch(grad: torch.Tensor) -> None:
        seen["value"] = seen.get("value", LOSS_HELD) + storage_bytes(grad)

    for t in tensors_of(value):
        if t.requires_grad:
            t.register_hook(catch)  # type: ignore[no-untyped-call]  # torch leaves it unannotated


def waiting_leaves(after: Sequence[torch.Tensor], before: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The leaves both the code after the run and the code before it or a stage use (a tied embedding and LM head).

    NOTE: [gradients waiting for the chain] plain autograd holds the part of such a leaf's gradient made
    after the run in the accumulator's input buffer until the other part comes, i.e. through the chain's
    whole backward, as the loss value is held. A stage's parameter waits too: the executor's autograd
    Function takes every trainable stage parameter as an input (`PlanRunner._parameters`), so the
    accumulator waits for that Function's backward, the chain's last op.
    """
    earlier = {id(t) for t in before}
    return [t for t in after if id(t) in earlier and t.requires_grad]


class Waits:
    """When a measuring backward makes and stores each waiting gradient (NOTE: [gradients waiting for the chain]).

    The measurement stores it as `.grad` at once (nothing of the chain sends it a part there), so
    the probe stops counting it; in training it waits, through the rest of the tail's backward too.
    `peak` is the measured peak as training has it: each gradient held from the moment it is made,
    and the accumulator's own ops (a copy to the parameter's layout), which training runs only
    after the chain's backward, left out.
    """

    def __init__(self, probe: MemoryProbe) -> None:
        self.probe = probe
        # leaf id: (ops run when its gradient reached the accumulator, bytes), until it is stored
        self.made: dict[int, tuple[int, int]] = {}
        self.spans: list[tuple[int, int, int]] = []  # (ops run when made, ops run when stored, bytes)
        self.handles: list[Any] = []

    def watch(self, leaves: Iterable[torch.Tensor]) -> None:
        for t in leaves:
            self.handles.append(t.register_hook(partial(self._made, id(t))))  # type: ignore[no-untyped-call]
            stored = partial(self._stored, id(t))
            self.handles.append(t.register_post_accumulate_grad_hook(stored))  # type: ignore[no-untyped-call]

    def _made(self, key: int, grad: torch.Tensor) -> None:
        self.made[key] = (self.probe.ops, storage_bytes(grad))

    def _stored(self, key: int, _: torch.Tensor) -> None:
        if key in self.made:
            made, nbytes = self.made.pop(key)
            self.spans.append((made, self.probe.ops, nbytes))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def peak(self, start: int, floor: int) -> int:
        """The largest bytes alive after an op from op `start` on (at least `floor`), had each gradient waited."""
        curve, peak = self.probe.curve, floor
        for i in range(start, len(curve)):
            if not any(made <= i < stored for made, stored, _ in self.spans):
                peak = max(peak, curve[i] + sum(nbytes for _, stored, nbytes in self.spans if stored <= i))
        return peak


def own_leaf(value: Any) -> Any:
    """A copy of a caller's tensor, cut from its graph, requiring grad as it did (anything else as it is).

    A copy, not an alias: a forward that writes into its input (`x.mul_(2)` first) would otherwise
    write into the caller's tensor a second time on the call that measures, before the step's own run.
    """
    if not isinstance(value, torch.Tensor):
        return value
    return value.detach().clone().requires_grad_(value.requires_grad)
