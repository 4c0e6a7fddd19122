"""`ChainState`: one chain's plans and budgets, apart from the nn.Module that routes its calls.

A `Checkpointable` routes each training call to its chain; everything rotor learns about the
chain lives here, in a plain object (no nn.Module, no forward):

- the chain itself: its discovery (`discover`), its stages, what a module-level chain's step holds
  outside it (`outside`), found again when a module's `training` flag changes (`check_modes`);
- the plan entries, one per plan key (`PlanCache`), each made through `pipeline.prepare`:
  profile, the budget of the new shape, plan, runner;
- the budget of each input shape (a fraction of its own no-recomputation peak, bytes held at every
  shape: lightning_rotor/shapes.py), its share of a budget shared with other chains (`Budget`, which
  tells this object its new share through `ShareHolder`), and the step's bytes;
- shapes planned without a run: on a chain bounding theirs (`predict_shapes`, shapes.py) or with sizes
  fitted from measured shapes (`fit_shapes`, symbolic_sizes.py), and forgotten when a step measures
  above their budget;
- replanning for a new budget or share, and the plans saved in checkpoints and loaded back;
- the per-call budgets of several calls in one step (`calls.StepBudget`, which reads this object
  through `StepChain`), and a training call's run: chain state -> step budget -> runner (`run`).

`Checkpointable` reads and writes these through class attributes of the same names (`ck.budget`,
`ck.plan`, `ck.replan(...)`: `rotor_state.ChainAttribute`); nothing here calls back into it.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import torch
from torch import nn

from lightning_rotor import pipeline, sharded
from lightning_rotor._torch_compat import tree_flatten
from lightning_rotor.allocator import AllocatorExcess, reads_allocator
from lightning_rotor.budget import MemLimit, format_bytes, resolve_budget
from lightning_rotor.cache import PlanCache, plan_key, signature
from lightning_rotor.calls import Call, StepBudget, StepCalls, describe, step_minimum
from lightning_rotor.chain import Chain
from lightning_rotor.compile import compile_stages
from lightning_rotor.ddp_checks import DdpWatch, refuse_tied, shared_parameters
from lightning_rotor.loss_watch import (
    LossBytes,
    LossOverBudget,
    LossPerByte,
    LossWatch,
    raised_chain,
    settle_watches,
    watched,
)
from lightning_rotor.measure import StepMeasurement
from lightning_rotor.ops import is_no_recompute
from lightning_rotor.own_checkpointing import OwnCheckpointing, checkpoint_calls
from lightning_rotor.pipeline import Entry, LossFn
from lightning_rotor.planner import InfeasibleBudget, Plan, min_feasible_budget
from lightning_rotor.profile import Profile
from lightning_rotor.shapes import (
    Buckets,
    ShapeTimes,
    bucketed,
    derived_times,
    feasible_for_shape,
    input_dims,
    predicted_chain,
    size_axis,
    stage_flops,
)
from lightning_rotor.shared_budget import AUTO_MARGIN, Budget
from lightning_rotor.simulate import no_recompute_peak
from lightning_rotor.size_trace import StorageNumbers, untraced
from lightning_rotor.stages import Stages
from lightning_rotor.symbolic_sizes import ShapeLaws
from lightning_rotor.tables import stage_text

if TYPE_CHECKING:
    from lightning_rotor.config import RotorConfig
    from lightning_rotor.discovery import Discovery

__all__ = ["CallInput", "ChainState"]


class CallInput(NamedTuple):
    """A training call's input as its chain plans it."""

    key: str  # its plan key (`cache.plan_key`)
    sample: Any  # the input as planned: bucketed when `shape_buckets` is set (lightning_rotor/shapes.py)
    trainable: list[bool]  # the stage parameters' `requires_grad`, in order
    side: tuple[str, ...]  # what a module-level chain's stages record besides the hidden state (side_outputs.py)

    def family(self) -> str:
        """The plan key with each tensor's shape left out: inputs whose chains may be interpolated."""
        return plan_key(self.sample, self.trainable, shapes=False, side=self.side)


class ChainState:
    """One chain's plan entries, per-shape budgets, shape prediction, replanning and saved plans
    (see the module docstring). `module`: the wrapped module (its parameters: the automatic budget counts
    the gradients to come); `own`: its own-checkpointing hand-off, told with the first plan."""

    def __init__(self, module: nn.Module, own_budget: Budget, own: OwnCheckpointing) -> None:
        self.module, self.own = module, own
        # settings, as `Checkpointable` was given them
        self.mem_limit: MemLimit = None
        self._own_budget = own_budget  # what mem_limit= resolves with, unless shared
        self.shared: Budget | None = None  # set by whoever splits one budget over several chains
        self.shared_name = ""
        self.slots: int | None = None
        self.early_stop = False
        self.repeats, self.warmup = 5, 0
        self.loss_fn: LossFn | None = None
        self.loss_tmp: int | None = None
        self._loss_per_byte: LossPerByte | None = None  # a real loss's excess, carried to later shapes
        self._loss_watched: set[str] = set()  # plan keys whose first step measured the caller's real loss
        self.options = False
        self.offload: bool | int | float | str = False  # as given; `bandwidth` is what it resolves to
        self._offload_setting: str | float | None = None  # None: off, "measure", or bytes/s
        self.host_limit: int | None = None
        self.bandwidth: float | None = None  # bytes/s (measured once for offload=True)
        self.derive_shapes, self.predict_shapes, self.fit_shapes = True, False, True
        self.shape_buckets: Buckets | None = None
        self.compiler: Callable[[nn.Module], nn.Module] | None = None  # compiles each stage (None: run eagerly)
        # under DDP: a parameter shared by two stages is refused (`shared_parameters`), and the plan's backward
        # alone calls the parameters' accumulators (NOTE: [no parameter edges under DDP] in execute.py). Found on
        # each training call inside a DistributedDataParallel's forward (`ddp_checks.DdpWatch`); True forces it.
        self.distributed = False
        self.sharded: bool | None = None  # FSDP2 units inside (lightning_rotor/sharded.py); None: not asked yet
        self._ddp = DdpWatch()  # whether a call runs inside DDP's forward, and the stages found untied under it
        # called as (stages done, stages, seconds) while a new input signature is profiled
        self.on_profile_progress: Callable[[int, int, float], None] | None = None
        # the chain and its plans
        self.discovery: Discovery | None = None  # how the chain was found (None: stages given, or not found yet)
        self.stages: Stages | None = None
        self.stage_names: list[str] = []
        self.join_in_place = False  # a Sequential's in-place leaves join the stage before, on the first input
        self.plan_cache: PlanCache | None = None
        self._params_of: tuple[Stages | None, list[nn.Parameter]] | None = None  # `stage_parameters`
        self.outside: dict[str, pipeline.Outside] = {}  # module-level chains: per call signature (measure_outside)
        self.outside_now: pipeline.Outside | None = None  # this call's
        self._modes: list[bool] | None = None  # every module's `training` flag at the last training call
        self._all_modules: list[nn.Module] = []  # the wrapped module's modules, listed once (`check_modes`)
        self.budget: int | None = None  # bytes of the signature that ran last (each shape has its own)
        self._first: tuple[int, int] | None = None  # the first shape's (bytes, no-recomputation peak)
        self._shapes: dict[str, str] = {}  # per plan key: its input's shapes, for messages
        self._timed: tuple[Chain, list[int]] | None = None  # a timed shape's chain and stage FLOPs (derive_shapes)
        self._times = ShapeTimes()  # derived times checked on timed steps (`step_timed`; which: the plan cache's)
        self._calls = 0  # this chain's calls in the step so far
        self.predicted: dict[str, tuple[int, ...]] = {}  # plan key -> the measured sizes its chain came from
        # measured shapes, as (family, input shapes, chain, its no-recomputation peak)
        self._measured_shapes: list[tuple[str, tuple[tuple[int, ...], ...], Chain, int]] = []
        self._peak_floors: dict[str, int] = {}  # plan key of a predicted shape -> a lower bound of its own peak
        self.fitted: dict[str, tuple[int, ...]] = {}  # plan key -> the measured sizes its chain's sizes came from
        self._laws = ShapeLaws()  # measured shapes' traced sizes (lightning_rotor/symbolic_sizes.py)
        self._excesses: dict[str, list[AllocatorExcess]] = {}  # per family, on CUDA: NOTE: [sizes on CUDA]
        self.step = StepBudget()  # this step's calls and the steps seen (lightning_rotor/calls.py)
        self.last_entry: Entry | None = None  # the entry the latest call ran
        self.last_measurement: StepMeasurement | None = None
        self._measurement: StepMeasurement | None = None  # the step being measured, if any

    def take_settings(
        self,
        config: RotorConfig,
        compiler: Callable[[nn.Module], nn.Module] | None,
        shared: Budget | None,
        shared_name: str,
        distributed: bool,
    ) -> None:
        """The chain's settings, checked once by `RotorConfig`; `shared`: one budget over several chains."""
        offload_setting, host_bytes = config.transfer()
        self.mem_limit = cast(MemLimit, config.mem_limit)  # a per-chain mapping is refused by `Budget` before this
        self.slots, self.early_stop = config.slots, config.early_stop
        self.repeats, self.warmup = config.repeats, config.warmup
        self.loss_fn, self.loss_tmp = config.loss_fn, config.loss_tmp
        self.options, self.offload, self.host_limit = config.options, config.offload, host_bytes
        self._offload_setting = offload_setting
        self.bandwidth = offload_setting if isinstance(offload_setting, float) else None
        self.derive_shapes, self.predict_shapes = config.derive_shapes, config.predict_shapes
        buckets = config.shape_buckets  # checked and sorted by `RotorConfig`
        self.fit_shapes = config.fit_shapes
        self.shape_buckets = None if buckets is None else {dim: tuple(sizes) for dim, sizes in buckets.items()}
        self.compiler, self.shared, self.shared_name, self.distributed = compiler, shared, shared_name, distributed

    def __getstate__(self) -> dict[str, Any]:
        """Copies and pickles leave out a step measurement in progress (its probe holds storage handles)."""
        return {**self.__dict__, "_measurement": None}

    # -- the chain ----------------------------------------------------------------------------------
    def set_stages(self, stages: Stages | None) -> None:
        """The chain's stages (None until discovered; compiled when asked) and an empty plan cache for them;
        the module's own checkpointing flags turned off (rotor plans the whole chain)."""
        if stages is not None:
            self.own.take(self.module)
            stages = compile_stages(stages, self.compiler)
        self.stages = stages
        self.stage_names = list(stages.names) if stages is not None else []
        self._new_plans()

    def _new_plans(self) -> None:
        stages = self.stages
        self.plan_cache = None if stages is None else PlanCache(_seq(stages), stages.names, self.slots, self.early_stop)

    def discover(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], method: str, types: tuple[type[nn.Module], ...] | None
    ) -> Discovery:
        """Find the chain in the module on a call's arguments (`discovery.discover_chain`, `method`, block `types`),
        the module's own checkpointing turned off first and back on where no chain is found.

        Raises `DiscoveryError` (or `ValueBranch`, naming file and line) when no chain is found.
        """
        self.own.take(self.module)
        if self.sharded:  # FSDP2: "auto" finds stages that call the fully_shard'ed blocks
            method = sharded.discovery_method(self.module, method)
        try:
            with checkpoint_calls() as calls:
                found = self._discover_chain(args, kwargs, method, types, calls)
            if self.sharded:  # FSDP2: a chain its hooks cannot run under, refused in one line
                sharded.check_discovered(self.module, found.kind, calls)
        except BaseException:
            self.own.restore()  # no chain: the module runs as written, its own checkpointing on
            self.own.note = ""
            raise
        if calls:
            self.own.note_calls(type(self.module).__name__, calls, found.kind)
        self.discovery = found
        self.set_stages(found.stages)
        return found

    def _discover_chain(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], method: str, types: Any, calls: list[str]
    ) -> Discovery:
        """`discovery.discover_chain`; under FSDP2 a forward calling torch.utils.checkpoint is refused in FSDP2's
        one line (discover='graph', the way out elsewhere, is none there)."""
        from lightning_rotor.discovery import discover_chain

        try:
            return discover_chain(self.module, args, method, types, sample_kwargs=kwargs)
        except NotImplementedError:
            if self.sharded and calls:
                sharded.check_discovered(self.module, "modules", calls)
            raise

    def check_modes(self) -> None:
        """A module's `training` flag changed since the chain was found and profiled (a frozen block unfrozen):
        traced code holds the old flag and the plans its memory, so the chain is found and profiled again."""
        if not self._all_modules:
            self._all_modules = list(self.module.modules())
        modes = [m.training for m in self._all_modules]
        if self._modes is not None and modes != self._modes and self.entries:
            self.forget_profiles()
        self._modes = modes

    def forget_profiles(self) -> None:
        """Every profile and plan forgotten (a module's `training` flag changed): a discovered chain is found
        again (traced code holds the old flag), every shape measured again when next met."""
        if self.discovery is not None:
            self.discovery = None
            self.set_stages(None)
        self._new_plans()
        self.last_entry, self.outside, self._timed, self._measured_shapes = None, {}, None, []
        self._times = ShapeTimes()
        self._laws, self._excesses = ShapeLaws(), {}

    def converted(self) -> None:
        """The module's tensors were converted (`.to()`, `.double()`): a graph chain is found again on the next
        training call (its stages hold references to the old buffers), what was measured outside it too."""
        if self.discovery is not None and self.discovery.graph is not None:
            self.discovery = None
            self.set_stages(None)
            self.last_entry = None
        self.outside = {}  # measured in the old dtype or device
        if self.plan_cache is not None:
            self.plan_cache.forget_call_plans()

    def stage_parameters(self) -> list[nn.Parameter]:
        """The stages' parameters in order (found once per set of stages)."""
        cached = self._params_of
        if cached is None or cached[0] is not self.stages:
            cached = self._params_of = (self.stages, [p for stage in self.stages or () for p in stage.parameters()])
        return cached[1]

    def side_outputs(self) -> tuple[str, ...]:
        """What a module-level chain's stages record and carry besides the hidden state (side_outputs.py)."""
        run = self.discovery.run if self.discovery is not None else None
        return (run.side or ()) if run is not None else ()

    def shared_parameters(self) -> dict[str, list[str]]:
        """Parameters whose gradient several stages add to (tied weights), by name, with their users
        (`ddp_checks.shared_parameters`: what DDP would miss)."""
        return shared_parameters(self.module, self.stage_names, self.stages or [], self.discovery)

    def measure_outside(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """What a module-level chain's step holds outside the chain on this call (its run of blocks found),
        measured once per call signature (`pipeline.measure_outside`) in a trace its profile goes on with, or not
        at all where the call's chain follows from measured calls' (`symbolic_sizes.ShapeLaws.call`); the call
        ends with `call_done`."""
        run = self.discovery.run if self.discovery is not None else None
        assert run is not None and self.stages is not None
        key, call_args = signature((args, kwargs)), (args, kwargs)
        traced = self.fit_shapes and not self.sharded  # FSDP2: each rank's figures max-reduced, not traced
        derive = key not in self.outside and traced and self._timed is not None and self._first is not None
        derive = derive and not self._times.retime  # a shape to time runs whole: what is around it measured too
        family = plan_key(call_args, [p.requires_grad for p in self.stage_parameters()], False, self.side_outputs())
        derived = self._laws.call(family, input_dims(call_args), derive)
        if key not in self.outside and not derived:
            with self._laws.tracing_outside(traced) as note:
                with sharded.outside_fsdp(self.module, bool(self.sharded)):  # FSDP2: none of its hooks fire
                    measured = pipeline.measure_outside(self.module, run, self.stages, args, kwargs, self.loss_fn)
                self.outside[key] = note(measured)
        self.outside_now = self.outside.get(key)

    def _outside(self) -> pipeline.Outside | None:
        """What a module-level chain's step holds outside the chain, for this call (`pipeline.measure_outside`)."""
        return self.outside_now if self.discovery is not None and self.discovery.run is not None else None

    @property
    def entries(self) -> dict[str, Entry]:
        """Per plan key (input signature): the profile and the plan for the whole budget."""
        return self.plan_cache.entries if self.plan_cache is not None else {}

    @property
    def plans(self) -> PlanCache:
        if self.plan_cache is None:
            raise RuntimeError("the chain is not discovered yet: run one training forward (or discover_on) first")
        return self.plan_cache

    @property
    def calls(self) -> StepCalls:
        """This step's pending calls (lightning_rotor/calls.py)."""
        return self.step.calls

    def call_input(self, value: Any, trainable: list[bool] | None = None) -> CallInput:
        """`value` as this chain plans it (`trainable`: the stage parameters' flags, when known); before its
        signature's first plan, a Sequential's leaves that write into their input in place joined to the stage
        before, and the stages checked for tied weights under DDP."""
        if trainable is None:
            trainable = [p.requires_grad for p in self.stage_parameters()]
        sample = bucketed(value, self.shape_buckets) if self.shape_buckets else value  # the plan's shape
        side = self.side_outputs()
        call = CallInput(plan_key(sample, trainable, side=side), sample, trainable, side)
        if call.key not in self.entries:
            if self.join_in_place and self.stages is not None:  # preparing, before the first profile, never in a step
                from lightning_rotor.discovery import join_in_place

                self.join_in_place = False
                with sharded.outside_fsdp(self.module, bool(self.sharded)):
                    joined = join_in_place(self.stages, call.sample)
                if joined is not self.stages:
                    self.set_stages(joined)
            if self.distributed:
                refuse_tied(self.shared_parameters())
        return call

    # -- a training call: chain state -> step budget -> runner ---------------------------------------
    def run(self, value: Any, plain_call: Callable[[], Any]) -> Any:
        """A training call of the chain on its input `value`: its signature's entry (profiled and planned if new),
        its budget in the step (NOTE: [Several calls per step] in lightning_rotor/calls.py), then its runner, or
        `plain_call` where plain autograd frees as the plan does, or where every stage and the input are frozen
        (no backward through the chain: nothing to checkpoint)."""
        parameters = self.stage_parameters()
        trainable = [p.requires_grad for p in parameters]
        if not any(trainable) and not any(
            t.requires_grad for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)
        ):
            return plain_call()
        # inside DDP's forward (NOTE: [no parameter edges under DDP] in execute.py): tied weights refused first
        distributed = self.distributed or self._ddp.under_ddp(self.stages, parameters)
        if distributed and self._ddp.untied is not self.stages:  # before any profile or optimizer step
            refuse_tied(self.shared_parameters())
            self._ddp.untied = self.stages
        settle_watches()  # a window left by the last backward: off the stack before a new shape's profile runs
        called = self.call_input(value, trainable)
        entry, call, peak, alone = self.call_entry(called, value)
        measurement = self._measurement
        watch = self._loss_watch(called.key)
        # after another call of the step, plain autograd would hold this call's parameter gradients until the
        # earlier call's backward (one accumulator per parameter waits for both): run the plan instead
        plain = alone and is_no_recompute(entry.plan.ops) and self.compiler is None  # compiled: stages as planned
        if plain and measurement is None:
            output = plain_call()  # no recomputation: plain autograd frees exactly as the plan does
            output = output if watch is None else watched(output, watch)  # autograd.grad etc. stay plain
        else:
            entry.runner.parameter_edges = not distributed
            entry.runner.loss_watch = watch
            if measurement is not None:
                entry.runner.probe = measurement.started(entry)
            try:
                output = entry.runner(value)
            finally:
                entry.runner.probe = None
        self.step.calls.add(call, peak, output)
        return output

    def _loss_watch(self, key: str) -> LossWatch | None:
        """A watch of the caller's real loss for the first step of `key`, where the stand-in was charged
        (lightning_rotor/loss_watch.py); a window still open sees a chain call, which is no loss. A module-level
        chain charges what its code around the run measured (`pipeline.charge_outside`), or what a derived call's
        chain follows from measured calls' (symbolic_sizes.py), the stand-in never: no window there. Any window
        before was settled as the call began (`run`)."""
        module_level = self.discovery is not None and self.discovery.run is not None
        given = self.loss_fn is not None or self.loss_tmp is not None or module_level
        if key in self._loss_watched or given or self.sharded:  # FSDP2: one plan on every rank, as profiled
            return None
        self._loss_watched.add(key)
        return LossWatch(partial(self._real_loss, key))

    def _real_loss(self, key: str, real: LossBytes) -> None:
        """The real loss of `key`'s first step measured: where it holds more than charged, its chain charges it
        and it is planned again (every shape, where it is the first), or the step is refused in one line. A budget
        of the first shape's own peak (a fraction, or none on the CPU) is of the peak with the real loss; bytes
        stay bytes."""
        entry = self.entries.get(key)
        chain = None if entry is None or self._first is None else raised_chain(entry.chain, real)
        if chain is None or entry is None or self._first is None:
            return
        self._loss_per_byte = LossPerByte.of(real, entry.chain.out_size[-1]).max(self._loss_per_byte)
        before, entry.profile.chain = entry.profile.chain, chain
        try:
            if key == next(iter(self.entries)):  # the first shape: the others' bytes follow its own
                self._replan_shapes(self._budget_of(chain, entry.runner.token_device), self.budget_rule())
            else:
                self._replan_shape(key, entry)
        except InfeasibleBudget as err:  # as it was, and this key's next step measured and refused again
            entry.profile.chain = before
            self._loss_watched.discard(key)
            raise LossOverBudget(err.budget, err.min_feasible) from None

    def _replan_shape(self, key: str, entry: Entry) -> None:
        """A later shape's chain changed: it alone is planned again, at its bytes (`_shape_bytes`); the other shapes'
        bytes follow the first shape's, not this one's, so their plans stand. Raises `InfeasibleBudget` before
        anything changes when it cannot meet them."""
        assert self._first is not None
        nbytes = self._shape_bytes(key, entry.chain, self.budget_rule(), *self._first)
        replanned = self.plans.build(entry.profile, pipeline.plan_chain(entry.chain, nbytes, self.slots))
        self.entries[key] = replanned
        self.plans.forget_call_plans()
        if self.last_entry is entry:
            self.last_entry = replanned
            if self._calls == 1:  # the step's bytes are its first call's shape's (`call_entry`)
                self.budget = replanned.plan.budget

    def call_entry(self, call: CallInput, value: Any) -> tuple[Entry, Call, int, bool]:
        """The entry a training call on `value` runs, its `Call` (pending until its backward), its plan's peak and
        whether it is alone in its step: its signature's whole-budget entry, made now if new, then its budget in
        the step (`StepBudget`)."""
        primary = self.entry_for(call)
        alone = not self.step.calls.alive()
        if alone:  # the step's bytes: its first call's shape's (docs/checkpointable.md, "Changing shapes")
            self.budget = primary.plan.budget
        self._calls = 1 if alone else self._calls + 1
        entry, pending, peak = self.step.call_entry(self, call.key, primary, value)
        self.last_entry = entry
        return entry, pending, peak, alone

    def prepare_for(self, value: Any) -> Entry:
        """The profile and plan for `value`'s signature, made now if new (no training step runs):
        the plan of a call alone in its step, at the whole budget.

        Raises `InfeasibleBudget` (with the smallest feasible budget) when the budget is too small.
        """
        if self.stages is None:
            raise RuntimeError("the chain is not discovered yet: run one training forward (or discover_on) first")
        settle_watches()  # as at a training call: no window of the last backward over the profile
        return self.entry_for(self.call_input(value))

    def entry_for(self, call: CallInput) -> Entry:
        """The whole-budget entry of `call`'s plan key, profiled and planned if new."""
        entry = self.entries.get(call.key)
        if entry is None:
            self._shapes[call.key] = describe(call.sample)
            with sharded.outside_fsdp(self.module, bool(self.sharded)):  # FSDP2: the profiler fires none of its hooks
                entry = self.plans.add(call.key, self._prepare(call))
        self.last_entry = entry
        return entry

    def _prepare(self, call: CallInput) -> Entry:
        retime = self._times.retime.pop(call.key, False)  # its times derived before proved wrong: time it
        if not retime and self.fit_shapes and self._timed is not None and self._first is not None:  # exact: first
            fitted = self._fitted_entry(call)
            if fitted is not None:
                return fitted
        if not retime and self.predict_shapes and self._first is not None:
            predicted = self._predicted_entry(call)
            if predicted is not None:
                return predicted
        stages, value = self.stages, call.sample
        assert stages is not None
        # compiled stages are timed at every shape. FLOPs are counted in the profile's walk (NOTE: [FLOPs counted in the
        # walk], lightning_rotor/profile.py), no pass of their own: whether to derive is known before it
        counted = self.derive_shapes and self.compiler is None
        derive = counted and self._timed is not None and not retime
        traced = self.fit_shapes and not self.sharded  # sizes as sums of storages' (lightning_rotor/size_trace.py)
        with self._laws.tracing(traced, self._outside(), (call.family(), input_dims(value))) as trace:
            return pipeline.prepare(
                _seq(stages), value, partial(self._new_shape_bytes, call), names=self.stage_names,
                slots=self.slots, adjust=partial(self._adjusted, call, trace, counted, derive), build=self.plans.build,
                repeats=self.repeats, warmup=self.warmup, loss_fn=self.loss_fn, loss_tmp=self.loss_tmp,
                outside=self._outside(), progress=self.on_profile_progress, timed=not derive, options=self.options,
                offload=self._offload_setting is not None, flops=counted, allocator=trace is None,
            )  # fmt: skip

    def _adjusted(
        self, call: CallInput, trace: StorageNumbers | None, counted: bool, derive: bool, measured: Profile
    ) -> Profile:
        """A new shape's profile as planned: its traced sizes recorded (`ShapeLaws.add`, the trace ended: the rest
        is planning), under FSDP2 the same figures on every rank, times derived from the timed shape's by FLOPs
        (lightning_rotor/shapes.py), the transfer bandwidth in its chain (version 6: the planner reads it).

        `counted`: the profile counted FLOPs in its walk; where its counter failed, `stage_flops` counts them; where
        that fails too, a derived shape's times scale by output sizes alone (its steps check them, `ShapeTimes`)."""
        value = call.sample
        flops = self._profile_flops(measured, counted, value)
        measured.chain = self._laws.add(call.family(), input_dims(value), trace, measured.chain, flops)
        if trace is not None and reads_allocator(value):
            measured.chain = self._allocator_charged(call, measured.chain)
        if self.sharded:  # FSDP2: the same figures on every rank, with what FSDP2 gathers (lightning_rotor/sharded.py)
            assert self.stages is not None
            measured.chain = sharded.rank_chain(measured.chain, list(self.stages), self.stage_names, self.module)
        if derive:
            assert self._timed is not None
            by = flops if flops is not None else [0] * measured.chain.length  # 0: scaled by output sizes
            measured.chain = derived_times(*self._times.nearest(by, self._timed), measured.chain, by)
            measured.repeats, measured.round_seconds = 0, []  # derived: `PlanCache.add` records it
        elif flops is not None:
            self._timed = self._timed or (measured.chain, flops)
            self._times.timed.append((measured.chain, flops))
        if self._offload_setting is not None:
            measured.chain = measured.chain.with_transfer(self._bandwidth_for(measured.chain, value), self.host_limit)
        measured.chain = self._loss_carried(measured.chain)
        return measured

    def _allocator_charged(self, call: CallInput, chain: Chain) -> Chain:
        """A traced CUDA shape's chain (tensor accounting's figures: its law's) charged what the caching allocator
        holds above them, measured by a sizes-only profile with the allocator's figures (NOTE: [sizes on CUDA])."""
        assert self.stages is not None
        stages, value = _seq(self.stages), call.sample
        with untraced():  # the traced profile's trace is still open: its planning comes next
            allocator = pipeline.profile(stages, value, names=self.stage_names, timed=False, loss_tmp=0,
                                         options=self.options, offload=self._offload_setting is not None)  # fmt: skip
        excess = AllocatorExcess.between(allocator.chain, chain)
        self._excesses.setdefault(call.family(), []).append(excess)
        return excess.charged(chain)

    def _profile_flops(self, measured: Profile, counted: bool, value: Any) -> list[int] | None:
        """The stages' forward FLOPs at a profiled shape: counted in its walk, or by `stage_flops` where the walk's
        counter failed (NOTE: [FLOPs counted in the walk]); None where not counted."""
        if measured.flops is not None or not counted or self.stages is None:
            return measured.flops
        return stage_flops(_seq(self.stages), value)

    def _loss_carried(self, chain: Chain) -> Chain:
        """A new shape's chain charged, at its own `a_L`, what an earlier shape's real loss held beyond the stand-in
        (`LossPerByte`): its first step measures it in turn (NOTE: [the real loss])."""
        if self._loss_per_byte is None:
            return chain
        return raised_chain(chain, self._loss_per_byte.at(chain.out_size[-1])) or chain

    def _new_shape_bytes(self, call: CallInput, chain: Chain) -> int:
        """The bytes of a newly profiled shape: the budget as given for the first, `_shape_bytes` for the others."""
        if self._first is None:  # the first shape: the budget as given becomes bytes
            device = next(t.device for t in tree_flatten(call.sample)[0] if isinstance(t, torch.Tensor))
            nbytes = self.budget = self._budget_of(chain, device)
            self._first = (nbytes, no_recompute_peak(chain))
            self.own.tell(nbytes, chain, self.share_name(), stacklevel=8)  # at forward
        else:
            nbytes = self._shape_bytes(call.key, chain, self.budget_rule(), *self._first)
        if self.predict_shapes:
            self._measured_shapes.append((call.family(), input_dims(call.sample), chain, no_recompute_peak(chain)))
        return nbytes

    # -- shapes planned without a run (lightning_rotor/shapes.py, symbolic_sizes.py) --------------------
    def _predicted_entry(self, call: CallInput) -> Entry | None:
        """The entry of a shape of a measured family, planned on a chain bounding its own (`shapes.predicted_chain`)
        at its budget (a fraction of a lower estimate of its peak), or None: measure it
        (no measured shape along one size axis, or the bound cannot meet the budget)."""
        start = time.perf_counter()
        family, dims = call.family(), input_dims(call.sample)
        axes: dict[tuple[tuple[int, int], ...], list[tuple[int, Chain, int]]] = {}
        for their_family, their_dims, chain, peak in self._measured_shapes:
            found = size_axis(their_dims, dims) if their_family == family else None
            if found is not None:
                axes.setdefault(found[0].coords, []).append((found[1], chain, peak))
        if len(axes) != 1 or self._first is None:
            return None  # none measured along one axis, or several axes: no single size to bound by
        ((coords, points),) = axes.items()
        predicted = predicted_chain(points, dims[coords[0][0]][coords[0][1]], len(coords))
        if predicted is None:
            return None
        chain, floor = predicted
        chain = self._loss_carried(chain)
        nbytes = self.budget_rule().for_shape(chain, *self._first, fraction_of=floor)
        if nbytes < min_feasible_budget(chain):
            return None  # the bound is too loose here for this budget: measure the shape
        chosen = pipeline.plan_chain(chain, nbytes, self.slots)
        self.predicted[call.key] = tuple(sorted(size for size, _, _ in points))
        self._peak_floors[call.key] = floor
        return self.plans.build(Profile(chain, seconds=time.perf_counter() - start), chosen)

    def _fitted_entry(self, call: CallInput) -> Entry | None:
        """The entry of a shape whose sizes follow from measured shapes' traced profiles (`symbolic_sizes.ShapeLaws`),
        its times derived by FLOPs, planned at its budget as if measured; None: measure it."""
        start = time.perf_counter()
        found = self._laws.chain_for(call.family(), input_dims(call.sample))
        if isinstance(found, str) or self._timed is None or self._first is None or self.stages is None:
            return None
        sizes = found[0]
        if reads_allocator(call.sample):  # the allocator's excess of the nearest measured shape
            excesses = self._excesses.get(call.family(), [])
            if not excesses:
                return None
            sizes = min(excesses, key=lambda e: e.distance(sizes)).charged(sizes)
        # FLOPs only scale times: counted where the law has none, else the timed shape's (times as its)
        flops = found[2] or stage_flops(_seq(self.stages), call.sample) or list(self._timed[1])
        chain = derived_times(*self._times.nearest(flops, self._timed), sizes, flops)
        if self._offload_setting is not None:
            chain = chain.with_transfer(self._bandwidth_for(chain, call.sample), self.host_limit)
        chain = self._loss_carried(chain)
        nbytes = self._shape_bytes(call.key, chain, self.budget_rule(), *self._first)
        self.fitted[call.key] = found[1]
        chosen = pipeline.plan_chain(chain, nbytes, self.slots)
        return self.plans.build(Profile(chain, seconds=time.perf_counter() - start), chosen)

    def step_timed(self, seconds: float) -> None:
        """A training step took `seconds` of wall time, neither profiling nor measured (`RotorCallback`): where
        this chain ran once in it, a shape whose times were derived by FLOPs and whose steps prove them wrong
        (`shapes.ShapeTimes.step`) is forgotten, to be profiled with timing rounds when next met; one warning
        says so. Not in a distributed run: each rank would decide on its own clock."""
        entry = self.last_entry
        if entry is None or self._calls != 1 or torch.distributed.is_available() and torch.distributed.is_initialized():
            return
        key = next((k for k, e in self.entries.items() if e is entry), None)
        derived = key in self.plans.times_derived
        off = self._times.step(key, derived, seconds, entry.plan.time) if key is not None else None
        if key is None or off is None:
            return
        self.plans.forget(key)
        self.plans.forget_call_plans()
        self.fitted.pop(key, None)
        self.predicted.pop(key, None)
        self._peak_floors.pop(key, None)
        if len(self._times.retimed) == 1:
            warnings.warn(
                f"rotor: input shape {self._shapes.get(key, key)} took {off:.1f}x the time its plan predicts (its "
                "times derived from another shape's by FLOPs) on several steps: it is timed when next met "
                "(lightning_rotor/shapes.py, ShapeTimes)",
                stacklevel=2,
            )

    @property
    def retimed(self) -> dict[str, float]:
        """Plan keys of shapes whose derived times training steps proved wrong, with how far off they were."""
        return self._times.retimed

    def call_done(self) -> None:
        """A module-level chain's call ended (`measure_outside`)."""
        self._laws.call_done()

    def measured(self, measurement: StepMeasurement) -> None:
        """A measured step ended (`StepMeasurement`): a shape planned without a run that measured above its
        budget is forgotten with every other such shape. Its key is found by its profile, which a plan made again
        in the step (its real loss charged: `_real_loss`) keeps."""
        self.last_measurement = measurement
        entry = measurement.entry
        if entry is None or measurement.chain_peak <= entry.plan.budget:
            return
        key = next((k for k, e in self.entries.items() if e.profile is entry.profile), None)
        if key in self.predicted:
            self._unplanned(key, measurement.chain_peak, entry.plan.budget, predicted=True)
        if key in self.fitted:
            self._unplanned(key, measurement.chain_peak, entry.plan.budget, predicted=False)

    def watch(self, measurement: StepMeasurement | None) -> None:
        """The step being measured (`StepMeasurement`), or None once it ends."""
        self._measurement = measurement

    def _unplanned(self, key: str, peak: int, budget: int, predicted: bool) -> None:
        """A shape planned on a bound (`predicted`) or with fitted sizes measured above its budget: the bound,
        or the derived sizes' premise, was wrong for this model, so every such shape is forgotten (measured when next
        met) and no more are made; one warning says so."""
        shape = self._shapes.get(key, key)
        above = f"measured {format_bytes(peak)} above its budget {format_bytes(budget)}"
        if predicted:
            told = (
                f"rotor: input shape {shape} was planned from a bound of measured shapes' chains but {above}: this "
                "model's memory does not grow as predict_shapes assumes (lightning_rotor/shapes.py)"
            )
        else:
            told = (
                f"rotor: input shape {shape} had its sizes fitted from measured shapes' but {above}: this model's "
                "stages do not run the same ops at every size (lightning_rotor/symbolic_sizes.py)"
            )
        warnings.warn(f"{told}; every shape is measured from now on", stacklevel=3)
        made = self.predicted if predicted else self.fitted
        for planned in made:
            self.plans.entries.pop(planned, None)
        self.plans.forget_call_plans()
        made.clear()
        if predicted:
            self._peak_floors.clear()
            self.predict_shapes = False
        else:
            self.fit_shapes = False

    # -- the budget of each shape, and its share (lightning_rotor/shared_budget.py) ------------------------
    def _bandwidth_for(self, chain: Chain, value: Any) -> float:
        """The transfer bandwidth in bytes/s: as given, or measured once on the chain input's device,
        with copies the size of the largest stage input (between 1 MiB and 256 MiB)."""
        if self.bandwidth is None:
            from lightning_rotor.offload import measure_bandwidth

            device = next(t.device for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))
            nbytes = min(max(max(chain.sizes[1 : chain.length], default=0), 2**20), 2**28)
            self.bandwidth = measure_bandwidth(device, nbytes)
            if self.sharded:  # FSDP2: one plan for every rank, on the slowest rank's link (lightning_rotor/sharded.py)
                self.bandwidth = sharded.slowest_on_ranks(self.bandwidth)
        return self.bandwidth

    def _shape_bytes(self, key: str, chain: Chain, rule: Budget, first: int, first_need: int) -> int:
        """The bytes of a later shape (`Budget.for_shape`); below its smallest feasible budget a byte
        budget raises `InfeasibleShape` and the others plan at the smallest (`shapes.feasible_for_shape`)."""
        nbytes = rule.for_shape(chain, first, first_need, self._peak_floors.get(key))
        shape = self._shapes.get(key, "of a saved signature")
        return feasible_for_shape(nbytes, min_feasible_budget(chain), shape, isinstance(rule.value, int))

    def _budget_of(self, chain: Chain, device: torch.device) -> int:
        """This chain's bytes: the whole budget alone, or its share of one budget over several chains."""
        return self.budget_rule().bytes_for(chain, device, self.module.parameters(), self.shared_name, self)

    def budget_rule(self) -> Budget:
        """The budget object this chain's bytes come from: shared with other chains, or its own."""
        return self.shared if self.shared is not None else self._own_budget

    def share_name(self) -> str:
        """This chain's name where it shares a budget with other chains, else "" (for messages)."""
        return self.shared_name if self.shared is not None and len(self.shared.names) > 1 else ""

    def busy(self) -> bool:
        """Whether a call of this step is pending (a budget shared with other chains waits to split again)."""
        return bool(self.step.calls.alive())

    def new_share(self, share: int) -> None:
        """A shared budget gave this chain `share` bytes at its first shape: every shape planned again."""
        if not self.entries:
            self.budget = share
            return
        self._replan_shapes(share, self.budget_rule())

    def no_recompute(self) -> bool:
        """An automatic budget off CUDA means no recomputation (docs/checkpointable.md), for every call."""
        return self.budget_rule().no_recompute

    def grow_share(self, structure: tuple[str, ...]) -> bool:
        """Under a budget shared with other chains, a share that fits a step of `structure`'s calls
        (`Budget.grow`). Only while the other chains hold nothing pending: their shares may
        shrink. Returns whether the share was asked for."""
        shared, plans = self.shared, self.plans
        if shared is None or len(shared.names) < 2 or self.no_recompute() or shared.others_busy(self.shared_name):
            return False
        smallest = step_minimum(structure, plans.smallest_of(structure), plans.figures)
        peaks = {sig: no_recompute_peak(self.entries[sig].chain) for sig in structure}
        need = step_minimum(structure, peaks, plans.figures)
        share = shared.grow(self.shared_name, smallest, need)
        if self._first is None or share != self._first[0]:
            self.new_share(share)
        return True

    def budget_for_call(self, prefix: tuple[str, ...], key: str, available: int) -> int:
        """The budget of the next call after `prefix` (signatures of the step's calls so far)."""
        return self.step.budget_for_call(self.plans, prefix, key, available, self.budget)

    @property
    def step_limit(self) -> int:
        """The bytes a training step of this chain may hold, all its calls together: the budget, or under
        an automatic budget off CUDA (no recomputation) the step's predicted peak when larger."""
        return self.step.step_limit(self.budget, self.no_recompute())

    # -- what was planned -------------------------------------------------------------------------------
    @property
    def entry(self) -> Entry:
        """The profile and whole-budget plan of the last signature: what a call alone in its step runs
        (`last_entry` is the one the latest call ran)."""
        if self.last_entry is None:
            raise RuntimeError("nothing is planned yet: run one training forward first")
        last = self.last_entry
        return next((e for e in self.entries.values() if e.profile is last.profile), last)

    @property
    def chain(self) -> Chain:
        return self.entry.chain

    @property
    def plan(self) -> Plan:
        return self.entry.plan

    @property
    def profile(self) -> Profile:
        return self.entry.profile

    @property
    def profile_seconds(self) -> float:
        """Wall time spent profiling, all signatures together."""
        return sum(e.profile.seconds for e in self.entries.values())

    def summary(self) -> str:
        """A readable table of the stages and the plan for the last signature (`tables.stage_text`)."""
        return stage_text(self.entry)

    def automatic_budget_note(self) -> str | None:
        """What an automatic budget (`mem_limit=None`) became for the last signature, and why, in one line
        (None for a budget given, or before the first plan): the bytes chosen are no bare figure to users."""
        if self.budget_rule().value is not None or self.last_entry is None:
            return None
        chosen = self.entry.plan
        nbytes = f"automatic budget {format_bytes(chosen.budget)} ({chosen.budget} bytes)"
        if self.no_recompute():
            device = next((p.device.type for p in self.module.parameters()), "cpu")
            return (
                f"{nbytes}: no device memory limit on {device} (only CUDA memory bounds an automatic budget), so "
                "each input shape gets its own no-recomputation peak: nothing is recomputed"
            )
        return (
            f"{nbytes}: {AUTO_MARGIN:.0%} of the free CUDA memory less the parameter gradients and optimizer "
            f"states to come; {chosen.recomputed_stages} stage(s) recomputed"
        )

    # -- budgets and saved plans --------------------------------------------------------------------------
    def replan(self, mem_limit: int | float | str) -> None:
        """Plan every saved chain again for `mem_limit` (profiles are kept; planning is cheap).

        Raises `InfeasibleBudget` before changing anything when some chain cannot meet it.
        A fraction is taken of the first chain's no-recomputation peak, as on a first step.
        """
        own = Budget(mem_limit)
        entries = list(self.entries.items())
        if not entries:
            self.mem_limit, self.budget, self._first, self._own_budget = mem_limit, None, None, own
            return
        # (None, an automatic budget, raises in `resolve_budget` as it parses it: a replan takes a budget)
        first = resolve_budget(mem_limit if own.value is None else own.value, no_recompute_peak(entries[0][1].chain))
        self._replan_shapes(first, own if self.shared is None else self.shared)
        self.mem_limit, self._own_budget = mem_limit, own

    def _replan_shapes(self, first: int, rule: Budget) -> None:
        """Every saved shape planned again: `first` bytes for the first one, the others by `rule`
        (`Budget.for_shape`); raises before anything changes when a shape cannot meet its budget."""
        entries = list(self.entries.items())
        first_key, first_need = entries[0][0], no_recompute_peak(entries[0][1].chain)

        def bytes_of(key: str, chain: Chain) -> int:
            return first if key == first_key else self._shape_bytes(key, chain, rule, first, first_need)

        replanned = self.plans.replanned(bytes_of)
        self.budget, self._first = first, (first, first_need)
        self.plans.forget_call_plans()
        for key, entry in entries:
            self.entries[key] = replanned[key]
            if self.last_entry is entry:
                self.last_entry = replanned[key]

    def plan_state(self) -> dict[str, Any]:
        """Profiles and plans as plain data, for checkpoints (`load_plan_state` reads it back)."""
        if self.plan_cache is None:
            return {"budget": self.budget, "stage_names": [], "fingerprints": [], "entries": []}
        first = self._first[0] if self._first is not None else self.budget  # the first shape's bytes
        return {"budget": first, **self.plan_cache.state_dict()}

    def load_plan_state(self, state: dict[str, Any]) -> None:
        """Reuse saved profiles and plans: inputs with a saved signature skip profiling.

        The saved stages must be these stages (same names, module types, parameter
        and buffer shapes and dtypes, see `cache.stage_fingerprints`): a plan made for
        another model would break the budget. On any mismatch nothing is loaded and
        a one-line ValueError says why; the module then profiles on its next forward.
        """
        if self.plan_cache is None:
            raise ValueError("saved plan state cannot load before the chain is found (no stages yet); nothing loaded")
        self.plan_cache.load_state_dict(state)  # shapes saved with derived times are checked on steps again
        if state.get("budget") is not None:
            self.budget = int(state["budget"])
            first = next(iter(self.entries.values()), None)
            self._first = None if first is None else (self.budget, no_recompute_peak(first.chain))

    def restore_plans(self, state: dict[str, Any]) -> None:
        """`load_plan_state`, then plan again where the budget now resolves to other bytes than the saved
        ones (this chain's share of a shared budget, or a changed `mem_limit`), as a first step would.

        A budget that cannot be met raises `InfeasibleBudget`, with the previous plans put back.
        """
        saved: Sequence[dict[str, Any]] = state.get("entries") or []
        if not saved:
            return
        expected = None
        if self.shared is None and self.mem_limit is not None:  # the user's budget now, as on the first signature
            expected = resolve_budget(self.mem_limit, no_recompute_peak(Chain.from_dict(saved[0]["chain"])))
        before = dict(self.entries), self.budget
        self.load_plan_state(state)
        try:
            if self.shared is not None:  # one budget over several chains: this chain's share, as on a first batch
                device = next((p.device for p in self.module.parameters()), torch.device("cpu"))
                share = self._budget_of(Chain.from_dict(saved[0]["chain"]), device)
                if share != self.budget:
                    self.new_share(share)
            elif expected is not None and self.budget != expected and self.mem_limit is not None:
                self.replan(self.mem_limit)
        except InfeasibleBudget:
            self.plans.entries, self.budget = before
            self.plans.forget_call_plans()
            raise


def _seq(stages: Stages) -> Sequence[nn.Module]:
    """`stages` as the sequence of modules it reads as (`len`, iteration, `[k]`), for functions typed so."""
    return cast("Sequence[nn.Module]", stages)
