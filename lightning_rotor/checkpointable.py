"""`Checkpointable`: a module that trains within an activation-memory budget.

An `nn.Sequential` is a chain as it stands; any other module's chain is
discovered on its first training call (`discover=`: "auto", "graph",
"modules"; docs/discovery.md), and the module's own forward runs in eval mode
and under `no_grad`.

On the first training forward for an input signature (shapes, dtypes, devices,
autocast state) it profiles the stages on that very input, plans the fastest
schedule within `mem_limit`, and from then on executes the plan
(`lightning_rotor.pipeline`; the plans per signature live in a `PlanCache`).
Eval mode and `torch.no_grad()` run the plain module.

Each signature gets its own bytes (`lightning_rotor.shapes`, docs/checkpointable.md,
"Changing shapes"): a fraction is taken of each shape's own no-recomputation peak, bytes
hold at every shape, the automatic budget of `mem_limit=None` is device memory on CUDA
and no recomputation elsewhere (`lightning_rotor.shared_budget.Budget`). `budget` is the
bytes of the signature that ran last.

Several calls before one backward (`D(real) + D(fake)`) share the budget: each call is
planned against what the step's pending calls leave (lightning_rotor/calls.py).

`measure_step()` measures one step's activation memory (`lightning_rotor.measure`).
"""

from __future__ import annotations

import inspect
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_rotor import own_checkpointing, pipeline
from lightning_rotor._torch_compat import active_ddp_reduced, tree_flatten
from lightning_rotor.budget import BudgetError, MemLimit, format_bytes, parse_host_limit, parse_offload, resolve_budget
from lightning_rotor.cache import PlanCache, plan_key, signature
from lightning_rotor.calls import Call, InfeasibleStep, StepCalls, describe, step_minimum
from lightning_rotor.chain import Chain
from lightning_rotor.compile import compile_stages, stage_compiler, train_eagerly, unwrap_compiled
from lightning_rotor.discretize import check_slots
from lightning_rotor.huggingface import without_kv_cache
from lightning_rotor.measure import StepMeasurement
from lightning_rotor.memory import CudaMemoryProbe, MemoryProbe
from lightning_rotor.ops import is_no_recompute
from lightning_rotor.pipeline import Entry
from lightning_rotor.planner import InfeasibleBudget, Plan, min_feasible_budget
from lightning_rotor.profile import Profile
from lightning_rotor.shapes import (
    bucketed,
    check_buckets,
    derived_times,
    feasible_for_shape,
    input_dims,
    predicted_chain,
    size_axis,
    stage_flops,
)
from lightning_rotor.sharded import refuse_fsdp2
from lightning_rotor.shared_budget import AUTO_MARGIN, Budget, auto_total
from lightning_rotor.simulate import no_recompute_peak
from lightning_rotor.stages import Stages, sequential_stages
from lightning_rotor.symbolic_sizes import ShapeLaws
from lightning_rotor.tables import stage_text

if TYPE_CHECKING:
    from lightning_rotor.discovery import Discovery

__all__ = ["Checkpointable", "Entry", "InfeasibleBudget", "InfeasibleStep", "StepMeasurement", "auto_budget"]


def auto_budget(device: torch.device, parameters: Iterable[nn.Parameter] = ()) -> int | None:
    """The budget used when `mem_limit=None` in bytes on CUDA; None elsewhere, meaning the no-recompute peak."""
    return auto_total(device, parameters)


class Checkpointable(nn.Module):
    """A module (an nn.Sequential, or any module whose chain is discovered) trained within `mem_limit` bytes.

    `discover`: how a module that is not a plain nn.Sequential becomes a chain, on its first
    training call: "auto" (default), "graph" (torch.fx, the whole forward is the chain),
    "modules" (a run of sibling blocks; the rest of the forward runs as written), or
    "sequential". `checkpoint_modules`: block classes kept whole in one stage each.

    `mem_limit`: None (automatic, see the module docstring), bytes (`int`), a size
    (`"6GiB"`), or a fraction of the no-recomputation peak (`0.5`, `"50%"`).
    `slots`: the planner's memory precision (None: automatic). `loss_fn`: the caller's loss as a
    function of the output, measured on the first call (default: a softmax cross-entropy over the
    last dimension); `loss_tmp`: what the loss costs in bytes, charged instead of measuring.
    `repeats`: timing rounds when profiling (at most; from 3 on, fewer once profiling has taken
    10 plain steps), `warmup`: untimed runs per stage before them (the memory runs warm up already).

    After the first training forward: `.chain`, `.plan`, `.profile`, `.summary()`,
    `.profile_seconds`; `.entries` holds one profile and plan per input signature.
    `state_dict()` keys are the wrapped module's.

    `derive_shapes`: a later input shape is profiled for sizes only, its times derived from the
    first shape's by FLOP counts (lightning_rotor/shapes.py; compiled stages: every shape is timed);
    False times every shape.
    `predict_shapes`: a later shape that differs from measured ones in one size (a sequence length, say)
    gets no run at all: it is planned on a chain bounding its own from above, made from the measured
    shapes' chains, and measured only when that bound cannot meet its budget; `.predicted` maps those
    shapes' plan keys to the sizes they came from (lightning_rotor/shapes.py: what the bound rests on).
    `fit_shapes` (on by default): a later shape along one size axis of three measured ones gets no run when its
    sizes follow from theirs, exactly (lightning_rotor/symbolic_sizes.py: their traced profiles, every size a sum
    of storages' sizes, each storage's dimensions affine in the size); its times are derived as `derive_shapes`
    derives them; `.fitted` maps those shapes' plan keys to the measured sizes they came from.
    `shape_buckets`: fewer plans, e.g. `{1: [64, 128, 256]}`: an input of length `n` along dimension 1
    runs the plan of the smallest bucket `>= n` (the input itself is not padded; lightning_rotor/shapes.py).

    `options`: also profile each stage's option "sac" (record only matmul, convolution and attention
    outputs, recompute the rest in the backward; chain version 5) so the planner may choose it per stage
    and position; off by default: it adds profiling time and changes plans (docs/checkpointable.md).

    `compile`: True or a dict of torch.compile arguments compiles each stage; a module given as
    `torch.compile(m)` is discovered on `m` and its stages compiled with its options (docs/compile.md).

    `offload`: also move kept stage inputs to host memory while they wait (chain version 6): False
    (default), True (the host<->device bandwidth is measured once, when the first signature is
    profiled), or the bandwidth as bytes/s (`12e9`) or a rate (`"12GB/s"`, `"500MB/s"`). The planner
    reads it from the chain (`chain.bandwidth`). `host_limit`: the most host memory the copies may
    hold at once, in bytes or a size (`"2GiB"`); None: no limit.

    `early_stop` (default False): where the plan keeps a stage's input and recomputes the stage right
    before its backward, the recomputation stops once the backward's tensors are made, as torch's
    non-reentrant checkpoint does (never more memory than the plan; docs/memory-model.md). Off by
    default: the checkpoint's per-tensor hooks cost more than the skipped tail on small blocks (a GPT
    64 wide: 1.46x plain against 1.23x without), while on real blocks it pays (Qwen2 at Hugging Face's
    own peak: 0.95x Hugging Face's time against 0.99x without).
    """

    # Rotor's own attributes, all kept in `_rotor` (`RotorState`), apart from the wrapped module's names
    _rotor: RotorState
    module: nn.Module  # the wrapped module (its children, parameters and buffers are this module's registries)
    plain_module: nn.Module  # what eval mode and no_grad run (compiled when asked)
    compiler: Callable[[nn.Module], nn.Module] | None  # compiles each stage (None: stages run eagerly)
    stages: Stages | None  # set by _set_stages

    def __init__(
        self,
        module: nn.Module,
        mem_limit: MemLimit = None,
        *,
        stages: Stages | None = None,
        discover: str | None = None,
        checkpoint_modules: Iterable[type[nn.Module]] | None = None,
        slots: int | None = None,
        loss_tmp: int | None = None,
        loss_fn: Callable[[Any], torch.Tensor] | None = None,
        repeats: int = 5,
        warmup: int = 0,
        fallback_plain: bool = False,
        compile: bool | dict[str, Any] | None = None,
        derive_shapes: bool = True,
        predict_shapes: bool = False,
        fit_shapes: bool = True,
        shape_buckets: dict[int, list[int]] | None = None,
        options: bool = False,
        offload: bool | int | float | str = False,
        host_limit: int | str | None = None,
        early_stop: bool = False,
    ):
        object.__setattr__(self, "_rotor", RotorState())  # before any attribute: see `__setattr__`
        compiled = None
        if isinstance(module, nn.Module):  # torch.compile(m): stages of m, compiled alike (compile.py)
            module, compiled = unwrap_compiled(module)
        compiler = stage_compiler(compile, compiled)
        discover, types = _check_settings(module, stages, discover, checkpoint_modules)
        own_budget = Budget(mem_limit)  # bad budgets fail here, with the accepted forms
        check_slots(slots)
        offload_setting, host_bytes = check_offload(offload, host_limit)
        self.shape_buckets = check_buckets(shape_buckets)
        super().__init__()
        _share_registries(self, module)
        state = self._rotor
        state.module, state.compiler = module, compiler
        state.plain_module = compiler(module) if compiler else module
        self.training = module.training  # the wrapped module's mode; `train()` sets both
        self.discover = None if discover == "sequential" else discover  # None: the stages are known
        self._join_in_place = discover == "sequential"  # before the first profile (`join_in_place`)
        self.checkpoint_modules = types
        self.discovery: Discovery | None = None
        self.outside: dict[str, pipeline.Outside] = {}  # module-level chains: per call signature (measure_outside)
        self._outside_now: pipeline.Outside | None = None
        self.fallback_plain = fallback_plain  # no chain found: warn once and run the module's forward as written
        # under DDP: a parameter shared by two stages is refused (`shared_parameters`), and the plan's backward
        # alone calls the parameters' accumulators (NOTE: [no parameter edges under DDP] in execute.py). Found on
        # each training call inside a DistributedDataParallel's forward (`_under_ddp`); True forces it.
        self.distributed = False
        self._ddp_seen: tuple[int, Stages | None, bool] | None = None  # `_under_ddp`: (DDP's id, stages, answer)
        self._untied: Stages | None = None  # the stages found free of tied weights under DDP
        self.on_discovered: Callable[[Checkpointable], None] | None = None  # called once the stages are found
        self.no_chain = ""  # why no chain was found, when falling back
        self.mem_limit = mem_limit
        self.slots = slots
        self.loss_tmp, self.loss_fn = _loss_settings(loss_tmp, loss_fn)
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
            raise ValueError(f"repeats must be an integer >= 1, got {repeats!r}")
        self.repeats = repeats
        self.derive_shapes = derive_shapes
        self.predict_shapes = bool(predict_shapes)
        self.predicted: dict[str, tuple[int, ...]] = {}  # plan key -> the measured sizes its chain came from
        # measured shapes, as (family, input shapes, chain, its no-recomputation peak)
        self._measured_shapes: list[tuple[str, tuple[tuple[int, ...], ...], Chain, int]] = []
        self._peak_floors: dict[str, int] = {}  # plan key of a predicted shape -> a lower bound of its own peak
        self.fit_shapes = bool(fit_shapes)
        self.fitted: dict[str, tuple[int, ...]] = {}  # plan key -> the measured sizes its chain's sizes came from
        self._laws = ShapeLaws()  # measured shapes' traced sizes (lightning_rotor/symbolic_sizes.py)
        self.options = bool(options)
        self.offload = offload  # as given; `bandwidth` is what it resolves to (bytes/s, measured once for True)
        self.host_limit = host_bytes
        self._offload_setting = offload_setting
        self.bandwidth: float | None = offload_setting if isinstance(offload_setting, float) else None
        self._timed: tuple[Chain, list[int]] | None = None  # a timed shape's chain and stage FLOPs (derive_shapes)
        self.warmup = warmup
        self.budget: int | None = None  # bytes of the signature that ran last (each shape has its own)
        self._first: tuple[int, int] | None = None  # the first shape's (bytes, no-recomputation peak)
        self._shapes: dict[str, str] = {}  # per plan key: its input's shapes, for messages
        self._own_budget = own_budget  # what mem_limit= resolves with, unless shared
        self.shared: Budget | None = None  # set by whoever splits one budget over several chains
        self.shared_name = ""
        self.boxed: Callable[[Checkpointable, tuple, dict], Any] | None = None  # set while step_outside measures
        self.last_entry: Entry | None = None  # the entry the latest call ran
        self.calls = StepCalls()  # this step's pending calls (lightning_rotor/calls.py)
        self._structures: dict[tuple[str, ...], list[int]] = {}  # steps seen: signatures -> budgets first run
        self._to_grow: list[tuple[str, ...]] = []  # steps of several calls a shared budget is not split for yet
        self.last_measurement: StepMeasurement | None = None
        self._measurement: StepMeasurement | None = None
        # called as (stages done, stages, seconds) while a new input signature is profiled
        self.on_profile_progress: Callable[[int, int, float], None] | None = None
        self.early_stop = early_stop
        self._params_of: tuple[Stages | None, list[nn.Parameter]] | None = None  # `_stage_parameters`
        self.own_checkpointing: list[tuple[str, nn.Module]] = []  # modules whose own flag rotor turned off
        self._own_note = ""  # what rotor did with the model's own checkpointing, told with the first plan
        self._model_note: list[str] = [""]  # the same for several chains of one model, shared: the first plan tells
        self._own_peak = 0  # the peak a step with the module's own checkpointing on measured (`_measure_own`)
        self._modes: list[bool] | None = None  # every module's `training` flag at the last training call
        self._all_modules: list[nn.Module] = []  # the wrapped module's modules, listed once (`_check_modes`)
        self._set_stages(sequential_stages(module) if discover == "sequential" else stages)

    def _set_stages(self, stages: Stages | None) -> None:
        """The chain's stages (None until discovered; compiled when asked) and an empty plan cache for them."""
        if stages is not None:
            self._take_own_checkpointing()
        stages = compile_stages(stages, self.compiler) if stages is not None else None
        self._rotor.stages = stages
        self.stage_names = list(stages.names) if stages is not None else []
        self.plan_cache = PlanCache(stages, stages.names, self.slots, self.early_stop) if stages is not None else None

    @property
    def entries(self) -> dict[str, Entry]:
        """Per plan key (input signature): the profile and the plan for the whole budget."""
        return self.plan_cache.entries if self.plan_cache is not None else {}

    # -- the wrapped Sequential's container API ---------------------------------------------------
    def __bool__(self) -> bool:
        return True  # a module, even where the wrapped one has no len()

    def __len__(self) -> int:
        return len(self.module)

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self.module)

    def __getitem__(self, index: int | slice) -> nn.Module:
        """The wrapped Sequential's module at `index` (a slice gives an nn.Sequential, as Sequential does)."""
        return self.module[index]

    # -- the forward ------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Train within the budget; eval mode and `no_grad` run the wrapped module's own forward.

        A plain `nn.Sequential` passes one value from stage to stage, so there `rotor(a, b)`
        means the chain input `(a, b)`, at every budget and in eval mode. Any other module
        is called as written (`rotor(idx, targets=None)`); its chain is discovered on the
        first training call (`discover=`, docs/discovery.md).
        """
        if self.boxed is not None:  # the step outside the chains being measured (lightning_rotor/step_outside.py)
            return self.boxed(self, args, kwargs)
        if torch.compiler.is_compiling() and self.training and torch.is_grad_enabled():
            return train_eagerly(self, *args, **kwargs)  # a graph break: rotor's step runs eagerly (compile.py)
        if self.training and torch.is_grad_enabled():
            if not self.entries:  # before the first plan, in either order of Checkpointable and fully_shard
                refuse_fsdp2(self.module)  # docs/sharded.md
            self._check_modes()
        if self.stages is not None and self.discovery is None:  # an nn.Sequential, or stages given
            if kwargs:
                raise TypeError(f"a chain of stages takes its input positionally, got keyword(s) {sorted(kwargs)}")
            if not args:
                raise TypeError("Checkpointable needs the chain input: call it with one tensor or several")
            value = args[0] if len(args) == 1 else args
            if not self.training or not torch.is_grad_enabled():
                return self.plain_module(value)
            self._measure_own((value,), {})
            return self._run(value, lambda: self.module(value))
        if not self.training or not torch.is_grad_enabled() or self.no_chain:
            return self.plain_module(*args, **kwargs)  # the user's forward, as written (traced code freezes `training`)
        args, kwargs = without_kv_cache(self.module, args, kwargs)  # Hugging Face: no KV cache in training
        self._measure_own(args, kwargs)
        found = self.discovery
        if found is None:
            from lightning_rotor.discovery import DiscoveryError

            try:
                found = self.discover_on(*args, **kwargs)
            except DiscoveryError as err:
                if not self.fallback_plain:
                    raise
                self.no_chain = str(err)
                warnings.warn(f"rotor: {type(self.module).__name__} runs without checkpointing: {err}", stacklevel=2)
                return self.module(*args, **kwargs)
        if found.graph is not None:  # the whole forward is the chain
            bound = inspect.signature(self.module.forward).bind(*args, **kwargs)
            bound.apply_defaults()
            value = found.graph.chain_input(dict(bound.arguments))
            return self._run(value, lambda: self.module(*args, **kwargs))
        run = found.run  # a run of blocks is the chain; the rest of the forward runs as written around it
        key = signature((args, kwargs))
        derive = key not in self.outside and self.fit_shapes and self._timed is not None and self._first is not None
        # a call whose chain follows from measured calls' needs no measure of the code around its run
        derived = self._laws.call(self._family((args, kwargs)), input_dims((args, kwargs)), derive)
        if key not in self.outside and not derived:
            with self._laws.tracing_outside(self.fit_shapes, (args, kwargs)) as note:
                self.outside[key] = note(
                    pipeline.measure_outside(self.module, run, self.stages, args, kwargs, self.loss_fn)
                )
        self._outside_now = self.outside.get(key)
        run.install(lambda value: self._run(value, lambda: pipeline.run_stages(self.stages, value)))
        try:
            return self.module(*args, **kwargs)
        finally:
            run.uninstall()
            self._laws.call_done()

    def _check_modes(self) -> None:
        """A module's `training` flag changed since the chain was found and profiled (a frozen block unfrozen):
        traced code holds the old flag and the plans its memory, so the chain is found and profiled again."""
        if not self._all_modules:
            self._all_modules = list(self.module.modules())
        modes = [m.training for m in self._all_modules]
        if self._modes is not None and modes != self._modes and self.entries:
            if self.discovery is not None:
                self.discovery = None
                self._set_stages(None)
            elif self.stages is not None:
                self.plan_cache = PlanCache(self.stages, self.stages.names, self.slots, self.early_stop)
            self.last_entry, self.outside, self._timed, self._measured_shapes = None, {}, None, []
            self._laws = ShapeLaws()
        self._modes = modes

    def _join_in_place_on(self, value: Any) -> None:
        """A Sequential's leaves that write into their input in place join the stage before, seen on `value`."""
        from lightning_rotor.discovery import join_in_place

        self._join_in_place = False
        joined = join_in_place(self.stages, value)
        if joined is not self.stages:
            self._set_stages(joined)

    def discover_on(self, *args: Any, **kwargs: Any) -> Discovery:
        """Find the chain on a call's arguments now (the first training call does it otherwise).

        Raises `DiscoveryError` (or `ValueBranch`, naming file and line) when no chain is found.
        """
        from lightning_rotor.discovery import discover_chain

        if self.discover is None:
            raise RuntimeError("this Checkpointable was given its stages; there is nothing to discover")
        self._take_own_checkpointing()
        try:
            with own_checkpointing.checkpoint_calls() as calls:
                found = discover_chain(self.module, args, self.discover, self.checkpoint_modules, sample_kwargs=kwargs)
        except BaseException:
            self.restore_own_checkpointing()  # no chain: the module runs as written, its own checkpointing on
            self._own_note = ""
            raise
        if calls:
            self._note_checkpoint_calls(calls, found.kind)
        self.discovery = found
        self._set_stages(found.stages)
        hook, self.on_discovered = self.on_discovered, None
        if hook is not None:  # e.g. plans saved in a checkpoint, restored now that the stages are known
            hook(self)
        return found

    # -- the model's own checkpointing (lightning_rotor/own_checkpointing.py) ---------------------
    def _take_own_checkpointing(self) -> None:
        """Turn off the wrapped module's own `gradient_checkpointing` flags: rotor plans the whole chain."""
        found = own_checkpointing.flagged(self.module)
        if not found:
            return
        own_checkpointing.turn_off(found)
        self.hold_own_checkpointing(found, own_checkpointing.turned_off(type(self.module).__name__, found))

    def _measure_own(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Before the first plan, where the module has its own checkpointing flags (on, or turned off by rotor and
        turned on again meanwhile): one step of it as the user has it, measured, for the warning to compare."""
        if self.entries or self._own_peak:
            return
        held, found = self.own_checkpointing, own_checkpointing.flagged(self.module)
        if held or found:
            with own_checkpointing.turned_on(held):
                self._own_peak = own_checkpointing.measured_peak(self.module, args, kwargs, self.loss_fn)

    def hold_own_checkpointing(self, found: list[tuple[str, nn.Module]], note: str | list[str]) -> None:
        """Flags turned off for this chain (`restore_own_checkpointing` turns them back on), and what to tell
        with its first plan: a list is one note shared by several chains of one model (lightning/wrap.py),
        told by whichever plans first (a chain that finds none, and runs as written, leaves it to the others)."""
        self.own_checkpointing += found
        if isinstance(note, list):
            self._model_note = note
        else:
            self._own_note = note

    def _note_checkpoint_calls(self, calls: list[str], kind: str) -> None:
        where = calls[0] + (f" and {len(calls) - 1} more" if len(calls) > 1 else "")
        if kind == "graph":
            did = "graph discovery traced through them: rotor's plan replaces them"
        else:
            did = f"{kind} discovery runs the forward as written: they stay, nested in rotor's plan"
            did += " (discover='graph' replaces them)"
        self._own_note = f"{type(self.module).__name__}'s forward calls torch.utils.checkpoint ({where}); {did}"

    def restore_own_checkpointing(self) -> None:
        """Turn the wrapped module's own checkpointing flags back on, where rotor turned them off."""
        own_checkpointing.turn_on(self.own_checkpointing)
        self.own_checkpointing = []

    def _tell_own_checkpointing(self, budget: int, chain: Chain) -> None:
        note = self._own_note or self._model_note[0]
        if note:
            share = self.shared_name if self.shared is not None and len(self.shared.names) > 1 else ""
            warnings.warn(own_checkpointing.warning(note, budget, chain, share, self._own_peak), stacklevel=5)
            self._own_note = self._model_note[0] = ""

    def _run(self, value: Any, plain_call: Callable[[], Any]) -> Any:
        """The chain on its input `a_0`: profile and plan if new, then the plan (or `plain_call`).

        The plan is made against what this step's pending calls leave of the budget
        (NOTE: [Several calls per step] in lightning_rotor/calls.py).
        """
        trainable = [p.requires_grad for p in self._stage_parameters()]
        if not any(trainable) and not any(
            t.requires_grad for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)
        ):
            return plain_call()  # every stage frozen: no backward through the chain, nothing to checkpoint
        distributed = self.distributed or self._under_ddp()
        if distributed and self._untied is not self.stages:  # before any profile or optimizer step
            self._refuse_tied_under_ddp()
            self._untied = self.stages
        sample = bucketed(value, self.shape_buckets) if self.shape_buckets else value  # the plan's shape
        key = plan_key(sample, trainable, side=self._side_outputs())
        primary = self._entry_for(key, sample)
        alone = not self.calls.alive()
        if alone:  # the step's bytes: its first call's shape's (docs/checkpointable.md, "Changing shapes")
            self.budget = primary.plan.budget
        entry, call, peak = self._call_entry(key, primary, value)
        self.last_entry = entry
        measurement = self._measurement
        # after another call of the step, plain autograd would hold this call's parameter gradients until the
        # earlier call's backward (one accumulator per parameter waits for both): run the plan instead
        plain = alone and is_no_recompute(entry.plan.ops) and self.compiler is None  # compiled: stages as planned
        if plain and measurement is None:
            output = plain_call()  # no recomputation: plain autograd frees exactly as the plan does
            self.calls.add(call, peak, output)
            return output
        entry.runner.parameter_edges = not distributed  # NOTE: [no parameter edges under DDP] (execute.py)
        if measurement is not None:
            entry.runner.probe = measurement.started(entry)
        try:
            output = entry.runner(value)
        finally:
            entry.runner.probe = None
        self.calls.add(call, peak, output)
        return output

    # -- profile and plan (lightning_rotor/pipeline.py) -------------------------------------------
    def prepare_for(self, value: Any) -> Entry:
        """The profile and plan for `value`'s signature, made now if new (no training step runs):
        the plan of a call alone in its step, at the whole budget.

        Raises `InfeasibleBudget` (with the smallest feasible budget) when the budget is too small.
        """
        if self.stages is None:
            raise RuntimeError("the chain is not discovered yet: run one training forward (or discover_on) first")
        sample = bucketed(value, self.shape_buckets) if self.shape_buckets else value
        trainable = [p.requires_grad for p in self._stage_parameters()]
        return self._entry_for(plan_key(sample, trainable, side=self._side_outputs()), sample)

    def _entry_for(self, key: str, value: Any) -> Entry:
        """The whole-budget entry of plan key `key`, profiled and planned if new."""
        entry = self.entries.get(key)
        if entry is None and self._join_in_place:  # part of preparing, before the first profile, never in a step
            self._join_in_place_on(value)
        if entry is None:
            self._shapes[key] = describe(value)
            entry = self.plan_cache.add(key, self._prepare(value, key))
        self.last_entry = entry
        return entry

    def _prepare(self, value: Any, key: str) -> Entry:
        if self.distributed:
            self._refuse_tied_under_ddp()
        if self.fit_shapes and self._timed is not None and self._first is not None:  # exact: before a bound
            fitted = self._fitted_entry(value, key)
            if fitted is not None:
                return fitted
        if self.predict_shapes and self._first is not None:
            predicted = self._predicted_entry(value, key)
            if predicted is not None:
                return predicted
        outside = self._outside_now if self.discovery is not None and self.discovery.run is not None else None
        # compiled stages are timed at every shape: an eval-mode count would compile graphs of its own
        flops = stage_flops(self.stages, value) if self.derive_shapes and self.compiler is None else None
        derive = flops is not None and self._timed is not None
        with self._laws.tracing(self.fit_shapes, value, outside) as trace:
            measured = pipeline.profile(
                self.stages, value, names=self.stage_names, repeats=self.repeats, warmup=self.warmup,
                loss_fn=self.loss_fn, loss_tmp=self.loss_tmp, outside=outside, progress=self.on_profile_progress,
                timed=not derive, options=self.options, offload=self._offload_setting is not None,
            )  # fmt: skip
        measured.chain = self._laws.add(self._family(value), input_dims(value), trace, measured.chain, flops)
        if derive:  # sizes measured, times from the timed shape's by FLOPs (lightning_rotor/shapes.py)
            measured.chain = derived_times(*self._timed, measured.chain, flops)  # type: ignore[misc]
            measured.repeats, measured.round_seconds = 0, []
        elif flops is not None and self._timed is None:
            self._timed = (measured.chain, flops)
        if self._offload_setting is not None:  # the planner reads the bandwidth from the chain (version 6)
            measured.chain = measured.chain.with_transfer(self._bandwidth_for(measured.chain, value), self.host_limit)
        if self._first is None:  # the first shape: the budget as given becomes bytes
            device = next(t.device for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))
            self.budget = self._budget_of(measured.chain, device)
            self._first = (self.budget, no_recompute_peak(measured.chain))
            nbytes = self.budget
            self._tell_own_checkpointing(nbytes, measured.chain)
        else:
            nbytes = self._shape_bytes(key, measured.chain, self._budget(), *self._first)
        if self.predict_shapes:
            chain = measured.chain
            self._measured_shapes.append((self._family(value), input_dims(value), chain, no_recompute_peak(chain)))
        return self.plan_cache.build(measured, pipeline.plan_chain(measured.chain, nbytes, self.slots))

    def _family(self, value: Any) -> str:
        """The plan key of `value` with each tensor's shape left out: inputs whose chains may be interpolated."""
        return plan_key(
            value, [p.requires_grad for p in self._stage_parameters()], shapes=False, side=self._side_outputs()
        )

    def _predicted_entry(self, value: Any, key: str) -> Entry | None:
        """The entry of a shape of a measured family, planned on a chain bounding its own (`shapes.predicted_chain`)
        at its budget (a fraction of a lower estimate of its peak), or None: measure it
        (no measured shape along one size axis, or the bound cannot meet the budget)."""
        start = time.perf_counter()
        family, dims = self._family(value), input_dims(value)
        axes: dict[tuple[tuple[int, int], ...], list[tuple[int, Chain, int]]] = {}
        for their_family, their_dims, chain, peak in self._measured_shapes:
            found = size_axis(their_dims, dims) if their_family == family else None
            if found is not None:
                axes.setdefault(found[0].coords, []).append((found[1], chain, peak))
        if len(axes) != 1 or self._first is None:
            return None  # none measured along one axis, or several axes: no single size to bound by
        ((coords, points),) = axes.items()
        x = dims[coords[0][0]][coords[0][1]]
        predicted = predicted_chain(points, x, len(coords))
        if predicted is None:
            return None
        chain, floor = predicted
        nbytes = self._budget().for_shape(chain, *self._first, fraction_of=floor)
        if nbytes < min_feasible_budget(chain):
            return None  # the bound is too loose here for this budget: measure the shape
        chosen = pipeline.plan_chain(chain, nbytes, self.slots)
        self.predicted[key] = tuple(sorted(size for size, _, _ in points))
        self._peak_floors[key] = floor
        return self.plan_cache.build(Profile(chain, seconds=time.perf_counter() - start), chosen)

    def _fitted_entry(self, value: Any, key: str) -> Entry | None:
        """The entry of a shape whose sizes follow from measured shapes' traced profiles (`symbolic_sizes.ShapeLaws`),
        its times derived by FLOPs, planned at its budget as if measured; None: measure it."""
        start = time.perf_counter()
        found = self._laws.chain_for(self._family(value), input_dims(value))
        if isinstance(found, str) or self._timed is None or self._first is None:
            return None
        # FLOPs only scale times: counted where the law has none, else the timed shape's (times as its)
        flops = found[2] or stage_flops(self.stages, value) or list(self._timed[1])
        chain = derived_times(*self._timed, found[0], flops)
        if self._offload_setting is not None:
            chain = chain.with_transfer(self._bandwidth_for(chain, value), self.host_limit)
        nbytes = self._shape_bytes(key, chain, self._budget(), *self._first)
        self.fitted[key] = found[1]
        chosen = pipeline.plan_chain(chain, nbytes, self.slots)
        return self.plan_cache.build(Profile(chain, seconds=time.perf_counter() - start), chosen)

    def _bandwidth_for(self, chain: Chain, value: Any) -> float:
        """The transfer bandwidth in bytes/s: as given, or measured once on the chain input's device,
        with copies the size of the largest stage input (between 1 MiB and 256 MiB)."""
        if self.bandwidth is None:
            from lightning_rotor.offload import measure_bandwidth

            device = next(t.device for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))
            nbytes = min(max(max(chain.sizes[1 : chain.length], default=0), 2**20), 2**28)
            self.bandwidth = measure_bandwidth(device, nbytes)
        return self.bandwidth

    def _shape_bytes(self, key: str, chain: Chain, rule: Budget, first: int, first_need: int) -> int:
        """The bytes of a later shape (`Budget.for_shape`); below its smallest feasible budget a byte
        budget raises `InfeasibleShape` and the others plan at the smallest (`shapes.feasible_for_shape`)."""
        nbytes = rule.for_shape(chain, first, first_need, self._peak_floors.get(key))
        shape = self._shapes.get(key, "of a saved signature")
        return feasible_for_shape(nbytes, min_feasible_budget(chain), shape, isinstance(rule.value, int))

    def _budget_of(self, chain: Chain, device: torch.device) -> int:
        """This chain's bytes: the whole budget alone, or its share of one budget over several chains."""
        budget = self._budget()
        return budget.bytes_for(chain, device, self.parameters(), self.shared_name, self._new_share, self._busy)

    def _budget(self) -> Budget:
        return self.shared if self.shared is not None else self._own_budget

    def _busy(self) -> bool:
        """Whether a call of this step is pending (a budget shared with other chains waits to split again)."""
        return bool(self.calls.alive())

    def _side_outputs(self) -> tuple[str, ...]:
        """What a module-level chain's stages record and carry besides the hidden state (side_outputs.py)."""
        run = self.discovery.run if self.discovery is not None else None
        return (run.side or ()) if run is not None else ()

    def _stage_parameters(self) -> list[nn.Parameter]:
        """The stages' parameters in order (found once per set of stages)."""
        cached = self._params_of
        if cached is None or cached[0] is not self.stages:
            cached = self._params_of = (self.stages, [p for stage in self.stages for p in stage.parameters()])
        return cached[1]

    # -- several calls per step (lightning_rotor/calls.py) -------------------------------------
    def _call_entry(self, key: str, primary: Entry, value: Any) -> tuple[Entry, Call, int]:
        """The entry this call runs: planned against the budget less what pending calls hold.

        Raises `InfeasibleStep` when the call cannot fit in what is left, before it runs.
        """
        plans = self.plan_cache
        prefix = self.calls.begin()
        for step in self.calls.take_finished():
            structure = tuple(sig for sig, _ in step)
            if structure not in self._structures and len(structure) > 1:
                self._to_grow.append(structure)
            self._structures.setdefault(structure, [b for _, b in step])
        if self._to_grow and self._grow_share(self._to_grow[-1]):
            self._to_grow.clear()
        budget, held = self.budget, self.calls.held()
        what = f"call {len(prefix) + 1} of this step (input {describe(value)})"
        if self._no_recompute():  # an automatic CPU budget: nothing is recomputed, however many calls
            chosen = budget
        else:
            chosen = self.budget_for_call(prefix, key, budget - held)
            if chosen < plans.smallest(key) and self._grow_share((*prefix, key)):
                budget = self.budget
                chosen = self.budget_for_call(prefix, key, budget - held)
            if chosen < plans.smallest(key):
                need = step_minimum((*prefix, key), plans.smallest_of((*prefix, key)), plans.figures)
                shared = self.shared_name if self.shared is not None and len(self.shared.names) > 1 else ""
                self.calls.refused(key)
                raise InfeasibleStep(what, budget, held, plans.smallest(key), need, shared)
        entry = primary if chosen == budget else plans.entry_at(key, chosen)
        pending, backward_peak = plans.call_figures(key, chosen)
        call = Call(key, len(prefix), chosen, pending, backward_peak, budget, what)
        return entry, call, entry.plan.peak

    def budget_for_call(self, prefix: tuple[str, ...], key: str, available: int) -> int:
        """The budget of the next call after `prefix` (signatures of the step's calls so far)."""
        position = len(prefix)
        wanted = []
        for structure, tried in self._structures.items():
            if len(structure) > position and structure[: position + 1] == (*prefix, key):
                budgets = self.plan_cache.learned_budgets(structure, self.budget, tried)
                if budgets is not None:
                    wanted.append(budgets[position])
        if wanted:
            return min(min(wanted), available)
        if position == 0 and self._structures:
            return available  # a new input signature: steps so far tell nothing, plan for the whole budget
        return min(self.plan_cache.smallest(key), available)  # the first step, or a call more: hold the least

    def _grow_share(self, structure: tuple[str, ...]) -> bool:
        """Under a budget shared with other chains, a share that fits a step of `structure`'s calls
        (`Budget.grow`). Only while the other chains hold nothing pending: their shares may
        shrink. Returns whether the share was asked for."""
        shared, plans = self.shared, self.plan_cache
        if shared is None or len(shared.names) < 2 or self._no_recompute() or shared.others_busy(self.shared_name):
            return False
        smallest = step_minimum(structure, plans.smallest_of(structure), plans.figures)
        peaks = {sig: no_recompute_peak(self.entries[sig].chain) for sig in structure}
        need = step_minimum(structure, peaks, plans.figures)
        share = shared.grow(self.shared_name, smallest, need)
        if self._first is None or share != self._first[0]:
            self._new_share(share)
        return True

    def _no_recompute(self) -> bool:
        """An automatic budget off CUDA means no recomputation (module docstring), for every call."""
        return self._budget().no_recompute

    @property
    def step_limit(self) -> int:
        """The bytes a training step of this chain may hold, all its calls together: the budget, or under
        an automatic budget off CUDA (no recomputation) the step's predicted peak when larger."""
        budget = self.budget or 0
        return max(budget, self.calls.step_peak) if self._no_recompute() else budget

    # -- what was planned -----------------------------------------------------------------------
    def _entry(self) -> Entry:
        """The whole-budget entry of the last signature (`last_entry` is the one the latest call ran)."""
        if self.last_entry is None:
            raise RuntimeError("nothing is planned yet: run one training forward first")
        return next((e for e in self.entries.values() if e.profile is self.last_entry.profile), self.last_entry)

    @property
    def entry(self) -> Entry:
        """The profile and whole-budget plan of the last signature: what a call alone in its step runs."""
        return self._entry()

    @property
    def chain(self) -> Chain:
        return self._entry().chain

    @property
    def plan(self) -> Plan:
        return self._entry().plan

    @property
    def profile(self) -> Profile:
        return self._entry().profile

    @property
    def profile_seconds(self) -> float:
        """Wall time spent profiling, all signatures together."""
        return sum(e.profile.seconds for e in self.entries.values())

    def automatic_budget_note(self) -> str | None:
        """What an automatic budget (`mem_limit=None`) became for the last signature, and why, in one line
        (None for a budget given, or before the first plan): the bytes chosen are no bare figure to users."""
        if self._budget().value is not None or self.last_entry is None:
            return None
        chosen = self._entry().plan
        nbytes = f"automatic budget {format_bytes(chosen.budget)} ({chosen.budget} bytes)"
        if self._no_recompute():
            device = next((p.device.type for p in self.parameters()), "cpu")
            return (
                f"{nbytes}: no device memory limit on {device} (only CUDA memory bounds an automatic budget), so "
                "each input shape gets its own no-recomputation peak: nothing is recomputed"
            )
        return (
            f"{nbytes}: {AUTO_MARGIN:.0%} of the free CUDA memory less the parameter gradients and optimizer "
            f"states to come; {chosen.recomputed_stages} stage(s) recomputed"
        )

    def summary(self) -> str:
        """A readable table of the stages and the plan for the last signature (`tables.stage_text`)."""
        return stage_text(self._entry())

    # -- budgets and saved plans ------------------------------------------------------------------
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
        first = resolve_budget(own.value, no_recompute_peak(entries[0][1].chain))
        self._replan_shapes(first, own if self.shared is None else self.shared)
        self.mem_limit, self._own_budget = mem_limit, own

    def _new_share(self, share: int) -> None:
        """A shared budget gave this chain `share` bytes at its first shape: every shape planned again."""
        if not self.entries:
            self.budget = share
            return
        self._replan_shapes(share, self._budget())

    def _replan_shapes(self, first: int, rule: Budget) -> None:
        """Every saved shape planned again: `first` bytes for the first one, the others by `rule`
        (`Budget.for_shape`); raises before anything changes when a shape cannot meet its budget."""
        entries = list(self.entries.items())
        first_key, first_need = entries[0][0], no_recompute_peak(entries[0][1].chain)

        def bytes_of(key: str, chain: Chain) -> int:
            return first if key == first_key else self._shape_bytes(key, chain, rule, first, first_need)

        replanned = self.plan_cache.replanned(bytes_of)
        self.budget, self._first = first, (first, first_need)
        self.plan_cache.forget_call_plans()
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
        self.plan_cache.load_state_dict(state)
        if state.get("budget") is not None:
            self.budget = int(state["budget"])
            first = next(iter(self.entries.values()), None)
            self._first = None if first is None else (self.budget, no_recompute_peak(first.chain))

    def restore_plans(self, state: dict[str, Any]) -> None:
        """`load_plan_state`, then plan again where the budget now resolves to other bytes than the saved
        ones (this chain's share of a shared budget, or a changed `mem_limit`), as a first step would.

        A budget that cannot be met raises `InfeasibleBudget`, with the previous plans put back.
        """
        saved = state.get("entries") or []
        if not saved:
            return
        expected = None
        if self.shared is None and self.mem_limit is not None:  # the user's budget now, as on the first signature
            expected = resolve_budget(self.mem_limit, no_recompute_peak(Chain.from_dict(saved[0]["chain"])))
        before = dict(self.entries), self.budget
        self.load_plan_state(state)
        try:
            if self.shared is not None:  # one budget over several chains: this chain's share, as on a first batch
                device = next((p.device for p in self.parameters()), torch.device("cpu"))
                share = self._budget_of(Chain.from_dict(saved[0]["chain"]), device)
                if share != self.budget:
                    self._new_share(share)
            elif expected is not None and self.budget != expected:
                self.replan(self.mem_limit)
        except InfeasibleBudget:
            self.plan_cache.entries, self.budget = before
            self.plan_cache.forget_call_plans()
            raise

    # -- measuring a step (lightning_rotor/measure.py) ---------------------------------------------
    def measure_step(self, probe: MemoryProbe | CudaMemoryProbe | None = None) -> StepMeasurement:
        """A context manager measuring the activation memory of the step run inside it.

        `probe`: what measures (default: tensor accounting of this module's activations on CPU,
        the allocator on CUDA); give a wider `MemoryProbe` to count the whole training step.
        """
        if probe is None:
            device = next((p.device for p in self.parameters()), torch.device("cpu"))
            probe = CudaMemoryProbe(device) if device.type == "cuda" else MemoryProbe(self, record_curve=True)
        return StepMeasurement(probe, self._watch_measurement, self._measured)

    def _watch_measurement(self, measurement: StepMeasurement | None) -> None:
        self._measurement = measurement

    def _measured(self, measurement: StepMeasurement) -> None:
        self.last_measurement = measurement
        entry = measurement.entry
        key = next((k for k, e in self.entries.items() if e is entry), None) if entry is not None else None
        if key in self.predicted and entry is not None and measurement.chain_peak > entry.plan.budget:
            self._unpredict(key, measurement.chain_peak, entry.plan.budget)
        if key in self.fitted and entry is not None and measurement.chain_peak > entry.plan.budget:
            self._unfit(key, measurement.chain_peak, entry.plan.budget)

    def _unfit(self, key: str, peak: int, budget: int) -> None:
        """A shape whose sizes were derived measured above its budget: its stages did not run the ops the measured
        shapes ran, so every derived shape is forgotten (measured when next met) and no more are derived."""
        warnings.warn(
            f"rotor: input shape {self._shapes.get(key, key)} had its sizes fitted from measured shapes' but "
            f"measured {format_bytes(peak)} above its budget {format_bytes(budget)}: this model's stages do not "
            "run the same ops at every size (lightning_rotor/symbolic_sizes.py); every shape is "
            "measured from now on",
            stacklevel=3,
        )
        for fitted in self.fitted:
            self.plan_cache.entries.pop(fitted, None)
        self.plan_cache.forget_call_plans()
        self.fitted.clear()
        self.fit_shapes = False

    def _unpredict(self, key: str, peak: int, budget: int) -> None:
        """A predicted shape measured above its budget: its bound was wrong for this model, so every predicted
        shape is forgotten (measured when next met) and no more are predicted; one warning says so."""
        warnings.warn(
            f"rotor: input shape {self._shapes.get(key, key)} was planned from a bound of measured shapes' chains "
            f"but measured {format_bytes(peak)} above its budget {format_bytes(budget)}: this model's memory does "
            "not grow as predict_shapes assumes (lightning_rotor/shapes.py); every shape is measured from now on",
            stacklevel=3,
        )
        for predicted in self.predicted:
            self.plan_cache.entries.pop(predicted, None)
        self.plan_cache.forget_call_plans()
        self.predicted.clear()
        self._peak_floors.clear()
        self.predict_shapes = False

    # -- DDP ------------------------------------------------------------------------------------
    def shared_parameters(self) -> dict[str, list[str]]:
        """Parameters whose gradient several stages add to (tied weights), by name, with their users.

        The executor runs each stage's backward on its own, so such a parameter's gradient is
        accumulated once per stage; DDP all-reduces it at the first, and the others are missed.
        A stage of a module-level run shares also with the forward outside the run.
        """
        names = {id(p): n for n, p in self.module.named_parameters(remove_duplicate=True)}
        users: dict[int, list[str]] = {}
        inside: set[int] = set()
        for name, stage in zip(self.stage_names, self.stages, strict=True):
            for p in {id(p) for p in stage.parameters()}:
                users.setdefault(p, []).append(name)
                inside.add(p)
        if self.discovery is not None and self.discovery.run is not None:
            staged = {id(m) for stage in self.stages for m in stage.modules()}
            for module in self.module.modules():
                if id(module) in staged or any(id(m) in staged for m in module.children()):
                    continue
                for p in module.parameters(recurse=False):
                    if id(p) in inside:
                        users[id(p)].append("(outside the run)")
        return {names.get(p, "?"): u for p, u in users.items() if len(u) > 1}

    def _under_ddp(self) -> bool:
        """Does this call run inside the forward of a DistributedDataParallel whose reducer waits for the
        chain's parameters? Asked on every training call (a model may be wrapped after its first steps),
        worked out once per DDP and set of stages.

        Plain torch DDP under torchrun, with no Lightning strategy to set `distributed`, is found here.
        """
        active = active_ddp_reduced()
        if active is None:
            return False
        seen = self._ddp_seen
        if seen is not None and seen[0] == active[0] and seen[1] is self.stages:
            return seen[2]
        reduced = {id(p) for p in active[1]}
        under = any(id(p) in reduced for p in self._stage_parameters())
        self._ddp_seen = (active[0], self.stages, under)
        return under

    def _refuse_tied_under_ddp(self) -> None:
        shared = self.shared_parameters()
        if shared:
            name, users = next(iter(shared.items()))
            raise RuntimeError(
                f"rotor under DDP: parameter {name!r} is used by stages {', '.join(users)} (tied weights); "
                "DDP would all-reduce its gradient after the first stage's backward and miss the rest. "
                "Untie it, or train this model with DDP without rotor"
            )

    # -- nn.Module --------------------------------------------------------------------------------
    def _apply(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Checkpointable:
        """`.to()`, `.double()`, ...: a discovered graph chain is found again on the next training call.

        Its stages read the module's own buffers through copies of the references taken at
        discovery; a conversion replaces buffer tensors, so those references would be stale.
        """
        self.module._apply(fn, *args, **kwargs)  # its registries are ours (`_share_registries`)
        if self.discovery is not None and self.discovery.graph is not None:
            self.discovery = None
            self._set_stages(None)
            self.last_entry = None
        self.outside = {}  # measured in the old dtype or device
        if self.plan_cache is not None:
            self.plan_cache.forget_call_plans()
        return self

    def train(self, mode: bool = True) -> Checkpointable:
        """The wrapped module's own `train(mode)` (its flag too, not only its children's: its forward reads it)."""
        self.module.train(mode)
        self.training = mode
        return self

    def extra_repr(self) -> str:
        stages = len(self.stages) if self.stages is not None else f"found on the first call ({self.discover})"
        offload = f", offload={self.offload!r}" if self._offload_setting is not None else ""
        return f"stages={stages}, mem_limit={self.mem_limit!r}{offload}"

    # -- rotor's attributes apart from the user's names (docs/checkpointable.md, "Your module's names") --
    def __getattr__(self, name: str) -> Any:
        """Rotor's attribute `name`, else the wrapped module's child, parameter or buffer of that name."""
        state = self.__dict__.get("_rotor")
        if state is not None and name in state.__dict__:
            return state.__dict__[name]
        return super().__getattr__(name)

    def __setattr__(self, name: str, value: Any) -> None:
        """A plain value is rotor's (kept in `_rotor`, whatever the wrapped module names); a module or a tensor
        is the user's, registered in the wrapped module's registries as nn.Module does; nn.Module's own stay."""
        state = self.__dict__.get("_rotor")
        if state is None or name in self.__dict__ or isinstance(value, (nn.Module, torch.Tensor)):
            super().__setattr__(name, value)
            return
        state.__dict__[name] = value
        if not hasattr(type(self), name):  # read fast from now on, by every Checkpointable (`RotorAttribute`)
            setattr(type(self), name, RotorAttribute(name))

    def __delattr__(self, name: str) -> None:
        state = self.__dict__.get("_rotor")
        if state is not None and name in state.__dict__:
            delattr(state, name)
        else:
            super().__delattr__(name)


def check_offload(offload: Any, host_limit: Any) -> tuple[str | float | None, int | None]:
    """(None: off, "measure", or bytes/s; host limit in bytes or None) from `offload=` and `host_limit=`.

    Bad values fail when the module is made, in one line that says what is accepted (the parsers
    the strategies and YAML use too, lightning_rotor/budget.py), not at the first training step.
    """
    rate = False if offload is None else parse_offload(offload)
    setting: str | float | None = None if rate is False else "measure" if rate is True else float(rate)
    if host_limit is None:
        return setting, None
    try:
        nbytes = parse_host_limit(host_limit)
    except BudgetError as err:
        raise ValueError(
            f"host_limit={host_limit!r} is not a size: give bytes or a size with a unit ('2GiB', '512MB', "
            f"8000000000), not a fraction ({err})"
        ) from None
    if setting is None:
        raise ValueError(f"host_limit={host_limit!r} bounds offloaded copies; give offload= too, or leave it out")
    return setting, nbytes


def _check_settings(
    module: nn.Module, stages: Stages | None, discover: str | None, checkpoint_modules: Iterable[type] | None
) -> tuple[str | None, tuple[type[nn.Module], ...] | None]:
    """The discovery method (None: stages given) and the block types `Checkpointable` uses, or one clear error."""
    from lightning_rotor.discovery import DISCOVER_METHODS

    if not isinstance(module, nn.Module):
        raise TypeError(f"Checkpointable wraps an nn.Module, got {type(module).__name__}")
    if stages is not None and not isinstance(stages, Stages):
        raise TypeError(f"stages must be a lightning_rotor.Stages, got {type(stages).__name__}")
    if discover is not None and discover not in DISCOVER_METHODS:
        raise ValueError(f"discover={discover!r} is not a discovery method; use one of {', '.join(DISCOVER_METHODS)}")
    if stages is not None and discover is not None:
        raise ValueError("give stages= (found already) or discover= (found on the first training call), not both")
    types = tuple(checkpoint_modules) if checkpoint_modules else None
    if types is not None and not all(isinstance(t, type) and issubclass(t, nn.Module) for t in types):
        raise TypeError(f"checkpoint_modules must be nn.Module classes, got {list(checkpoint_modules or [])!r}")
    plain_sequential = isinstance(module, nn.Sequential) and type(module).forward is nn.Sequential.forward
    if stages is not None:
        return None, types
    if discover is None or (discover == "auto" and plain_sequential and types is None):
        discover = "sequential" if plain_sequential and types is None else "auto"
    if discover == "sequential" and not plain_sequential:
        raise TypeError(
            f"discover='sequential' needs a plain nn.Sequential, got {type(module).__name__}; "
            "use discover='auto', 'graph' or 'modules'"
        )
    return discover, types


class RotorState:
    """A `Checkpointable`'s own attributes (settings, stages, plans, budgets), in one plain object.

    Kept apart from nn.Module's registries, which are the wrapped module's: no name the user's model
    uses for a child, parameter or buffer (`shared`, `budget`, `plan`, ...) can meet one of rotor's.
    """

    def __getstate__(self) -> dict[str, Any]:
        """Copies and pickles leave out a step measurement in progress (its probe holds storage handles)."""
        return {**self.__dict__, "_measurement": None}


class RotorAttribute:
    """A `Checkpointable` class attribute reading rotor's attribute `name` from `_rotor` (a dict lookup, not
    nn.Module's `__getattr__` after a failed lookup); where this instance has none, the wrapped module's
    child, parameter or buffer of that name is read, as nn.Module does."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        try:
            return obj.__dict__["_rotor"].__dict__[self.name]
        except KeyError:
            return nn.Module.__getattr__(obj, self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        type(obj).__setattr__(obj, self.name, value)


for _name in ("module", "plain_module", "compiler", "stages"):  # written to `_rotor` directly (modules among them)
    setattr(Checkpointable, _name, RotorAttribute(_name))


_REGISTRIES = ("_parameters", "_buffers", "_non_persistent_buffers_set", "_modules")


def _share_registries(owner: nn.Module, module: nn.Module) -> None:
    """`owner`'s children, parameters and buffers are `module`'s: the same dicts, so the same objects under
    the same names (`state_dict` keys, `parameters()`), whatever those names are; nothing is re-registered."""
    for registry in _REGISTRIES:
        object.__setattr__(owner, registry, module.__dict__[registry])


def _loss_settings(loss_tmp: Any, loss_fn: Callable[[Any], torch.Tensor] | None) -> tuple[int | None, Any]:
    """(`loss_tmp` bytes, `loss_fn`); a function given as `loss_tmp=` (deprecated in 0.2.0) moves to `loss_fn=`."""
    if callable(loss_tmp):
        warnings.warn(
            "Checkpointable(loss_tmp=<function>) is deprecated since 0.2.0: give the loss as loss_fn=; "
            "loss_tmp= takes bytes",
            DeprecationWarning,
            stacklevel=3,
        )
        loss_tmp, loss_fn = None, loss_tmp if loss_fn is None else loss_fn
    if loss_tmp is not None and loss_fn is not None:
        raise ValueError("give loss_fn= (the loss, measured) or loss_tmp= (its bytes), not both")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be a function of the output, got {type(loss_fn).__name__}")
    if loss_tmp is not None and (isinstance(loss_tmp, bool) or not isinstance(loss_tmp, int)):
        raise TypeError(f"loss_tmp must be bytes (an int), got {loss_tmp!r}; give a loss function as loss_fn=")
    return loss_tmp, loss_fn
