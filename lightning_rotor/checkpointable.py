"""`Checkpointable`: a module that trains within an activation-memory budget.

An `nn.Sequential` is a chain as it stands; any other module's chain is
discovered on its first training call (`discover=`: "auto", "graph",
"modules"; docs/discovery.md), and the module's own forward runs in eval mode
and under `no_grad`.

On the first training forward for an input signature (shapes, dtypes, devices,
autocast state) it profiles the stages on that very input, plans the fastest
schedule within `mem_limit`, and from then on executes the plan. Eval mode and
`torch.no_grad()` run the plain module.

The budget is resolved to bytes once, on the first signature planned (a
fraction is taken of that signature's no-recomputation peak), and the same
bytes bound every later signature: a smaller last batch gets its own plan
within the same budget.

Several calls before one backward (`D(real) + D(fake)`) share the budget: each call is
planned against what the step's pending calls leave (lightning_rotor/calls.py).

Automatic budget (`mem_limit=None`): on CUDA, 90% of the memory free when the
plan is made minus what the first optimizer step will still allocate (a
gradient and two optimizer states per trainable parameter); on the CPU, the
no-recomputation peak: nothing is recomputed, since free RAM says nothing about
what training may use (`lightning_rotor.shared_budget`).

Measuring a step (for the Lightning callback, tests and benchmarks)::

    with ckpt.measure_step() as m:      # enter before the forward
        loss = loss_fn(ckpt(x), y)
        loss.backward()                 # leave after the backward
    m.peak          # activation bytes: exact tensor accounting on CPU, allocator on CUDA
    m.curve         # [(op label, bytes alive after the op)] for the plan's ops
    m.predicted     # the simulator's bytes after each op, same order

Only that step pays for the probe; other steps run without it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from lightning_rotor.budget import format_bytes, parse_budget, resolve_budget
from lightning_rotor.calls import (
    Call,
    InfeasibleStep,
    StepCalls,
    call_figures,
    describe,
    step_budgets,
    step_minimum,
)
from lightning_rotor.chain import Chain
from lightning_rotor.compile import compile_stages, stage_compiler, train_eagerly, unwrap_compiled
from lightning_rotor.discretize import check_slots
from lightning_rotor.execute import PlanRunner
from lightning_rotor.memory import CudaMemoryProbe, MemoryProbe, storage_bytes
from lightning_rotor.ops import forward_counts, is_no_recompute
from lightning_rotor.planner import InfeasibleBudget, Plan, min_feasible_budget, plan
from lightning_rotor.profile import Profile, profile_chain
from lightning_rotor.shared_budget import SharedBudget, auto_total
from lightning_rotor.simulate import no_recompute_peak, simulate
from lightning_rotor.stages import Stages, sequential_stages

if TYPE_CHECKING:
    from lightning_rotor.discovery import Discovery

__all__ = ["Checkpointable", "Entry", "InfeasibleBudget", "InfeasibleStep", "StepMeasurement", "auto_budget"]

def auto_budget(device: torch.device, parameters: Iterable[nn.Parameter] = ()) -> int | None:
    """The budget used when `mem_limit=None` in bytes on CUDA; None elsewhere, meaning the no-recompute peak."""
    return auto_total(device, parameters)


def stage_fingerprints(stages: list[nn.Module]) -> list[str]:
    """A short digest per stage of its module types and parameter/buffer names, shapes and dtypes.

    Cheap (no forward); it tells a saved plan of this very chain from one of
    another model whose stage count or names happen to match.
    """
    prints = []
    for stage in stages:
        parts = [type(m).__qualname__ for m in stage.modules()]
        tensors = [*stage.named_parameters(), *stage.named_buffers()]
        parts += [f"{n}:{tuple(t.shape)}:{t.dtype}" for n, t in tensors]
        prints.append(hashlib.sha1(repr(parts).encode()).hexdigest()[:16])
    return prints


def signature(value: Any) -> str:
    """What makes a new profile necessary: shapes, dtypes, devices, grad flags, autocast (a string key)."""
    flat, spec = tree_flatten(value)
    leaves = tuple(
        (tuple(t.shape), t.dtype, str(t.device), t.requires_grad) if isinstance(t, torch.Tensor) else repr(t)
        for t in flat
    )
    autocast = tuple(
        (d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
        for d in ("cpu", "cuda")
        if d == "cpu" or torch.cuda.is_available()
    )
    return repr((str(spec), leaves, autocast))


@dataclass
class Entry:
    """The profile, plan and runner of one input signature."""

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


class StepMeasurement:
    """Measured activation memory of one training step (see `Checkpointable.measure_step`)."""

    def __init__(self, owner: Checkpointable, device: torch.device,
                 probe: MemoryProbe | CudaMemoryProbe | None = None):
        self.owner = owner
        self.device = device
        self.probe: MemoryProbe | CudaMemoryProbe | None  # None once the step is measured
        if probe is not None:
            self.probe = probe
        elif device.type == "cuda":
            self.probe = CudaMemoryProbe(device)
        else:
            self.probe = MemoryProbe(owner, record_curve=True)
        self.entry: Entry | None = None
        self.peak = 0  # the whole measured block
        self.chain_peak = 0  # while this chain's ops ran (the figure of a per-chain plot)
        self.curve: list[tuple[str, int]] = []
        self.op_peaks: list[int] = []
        self.start_op = 0  # the probe's op count when the chain's first op began

    @property
    def is_open(self) -> bool:
        """True between `__enter__` and `__exit__`: the owner's training steps are being measured."""
        return self.owner._measurement is self

    def __enter__(self) -> StepMeasurement:
        self.probe.__enter__()
        self.owner._measurement = self
        return self

    def __exit__(self, *exc: Any) -> None:
        self.owner._measurement = None
        probe, self.probe = self.probe, None  # plain figures only from here: the module stays copyable
        probe.__exit__(*exc)
        if exc[0] is not None:
            return  # the step failed (e.g. InfeasibleBudget): let its error through untouched
        self.peak = probe.peak
        marks = getattr(probe, "marks", [])
        self.curve = [(label, nbytes) for label, _, nbytes in marks]
        if isinstance(probe, MemoryProbe):
            ends = [i for _, i, _ in marks]
            starts = [self.start_op, *ends[:-1]][: len(ends)]
            curve = probe.curve
            spans = zip(starts, ends, marks, strict=True)
            self.op_peaks = [max(curve[s:e], default=nbytes) for s, e, (_, _, nbytes) in spans]
        self.chain_peak = max(self.op_peaks or [nbytes for _, nbytes in self.curve], default=0)
        self.owner.last_measurement = self

    @property
    def predicted(self) -> list[int]:
        """The simulator's bytes after each op of the measured plan."""
        if self.entry is None:
            return []
        return simulate(self.entry.chain, self.entry.plan.ops).curve

    @property
    def predicted_peak(self) -> int:
        return self.entry.plan.peak if self.entry is not None else 0


class Checkpointable(nn.Module):
    """A module (an nn.Sequential, or any module whose chain is discovered) trained within `mem_limit` bytes.

    `discover`: how a module that is not a plain nn.Sequential becomes a chain, on its first
    training call: "auto" (default), "graph" (torch.fx, the whole forward is the chain),
    "modules" (a run of sibling blocks; the rest of the forward runs as written), or
    "sequential". `checkpoint_modules`: block classes kept whole in one stage each.

    `mem_limit`: None (automatic, see the module docstring), bytes (`int`), a size
    (`"6GiB"`), or a fraction of the no-recomputation peak (`0.5`, `"50%"`).
    `slots`: the planner's memory precision (None: automatic). `loss_tmp`: what the caller's loss
    costs: bytes, or the loss as a function of the output, to be measured (default:
    a softmax cross-entropy over the last dimension is measured). `repeats`: timing rounds
    when profiling (at most; from 3 on, fewer once profiling has taken 10 plain steps), `warmup`:
    untimed runs per stage before them (the memory runs warm up already).

    After the first training forward: `.chain`, `.plan`, `.profile`, `.summary()`,
    `.profile_seconds`; `.entries` holds one profile and plan per input signature.
    `state_dict()` keys are the wrapped module's.

    `compile`: True or a dict of torch.compile arguments compiles each stage; a module given as
    `torch.compile(m)` is discovered on `m` and its stages compiled with its options (docs/compile.md).
    """

    def __init__(
        self,
        module: nn.Module,
        mem_limit: int | float | str | None = None,
        *,
        stages: Stages | None = None,
        discover: str | None = None,
        checkpoint_modules: Iterable[type[nn.Module]] | None = None,
        slots: int | None = None,
        loss_tmp: int | Callable[[Any], torch.Tensor] | None = None,
        repeats: int = 5,
        warmup: int = 0,
        fallback_plain: bool = False,
        compile: bool | dict[str, Any] | None = None,
    ):
        from lightning_rotor.discovery import HOWS

        if not isinstance(module, nn.Module):
            raise TypeError(f"Checkpointable wraps an nn.Module, got {type(module).__name__}")
        module, compiled = unwrap_compiled(module)  # torch.compile(m): stages of m, compiled alike (compile.py)
        compiler = stage_compiler(compile, compiled)
        if stages is not None and not isinstance(stages, Stages):
            raise TypeError(f"stages must be a lightning_rotor.Stages, got {type(stages).__name__}")
        if discover is not None and discover not in HOWS:
            raise ValueError(f"discover={discover!r} is not a discovery method; use one of {', '.join(HOWS)}")
        if stages is not None and discover is not None:
            raise ValueError("give stages= (found already) or discover= (found on the first training call), not both")
        types = tuple(checkpoint_modules) if checkpoint_modules else None
        if types is not None and not all(isinstance(t, type) and issubclass(t, nn.Module) for t in types):
            raise TypeError(f"checkpoint_modules must be nn.Module classes, got {list(checkpoint_modules)!r}")
        plain_sequential = isinstance(module, nn.Sequential) and type(module).forward is nn.Sequential.forward
        if stages is None and discover is None:
            discover = "sequential" if plain_sequential and types is None else "auto"
        if discover == "auto" and plain_sequential and types is None:
            discover = "sequential"
        if discover == "sequential" and not plain_sequential:
            raise TypeError(f"discover='sequential' needs a plain nn.Sequential, got {type(module).__name__}; "
                            "use discover='auto', 'graph' or 'modules'")
        super().__init__()
        if mem_limit is not None:
            parse_budget(mem_limit)  # bad budgets fail here, with the accepted forms
        check_slots(slots)
        if discover == "sequential":
            stages = sequential_stages(module)
        stages = compile_stages(stages, compiler) if stages is not None else None
        for name, child in module._modules.items():  # every entry, repeats too: state_dict keys stay the module's
            if child is not None:
                self.add_module(name, child)
        for name, param in module._parameters.items():  # the module's own parameters and buffers, same objects
            if param is not None:
                self.register_parameter(name, param)
        for name, buf in module._buffers.items():
            if buf is not None:
                self.register_buffer(name, buf, persistent=name not in module._non_persistent_buffers_set)
        object.__setattr__(self, "module", module)  # not registered: state_dict keys stay the module's
        object.__setattr__(self, "stages", stages)  # None until the first training call when discovering
        object.__setattr__(self, "compiler", compiler)  # compiles each stage (None: stages run eagerly)
        object.__setattr__(self, "plain_module", compiler(module) if compiler else module)  # eval and no_grad
        self.discover = None if discover == "sequential" else discover  # None: the stages are known
        self._join_in_place = discover == "sequential"  # on the first training call (`join_in_place`)
        self.checkpoint_modules = types
        self.discovery: Discovery | None = None
        self.outside: dict[str, tuple[int, int]] = {}  # module-level chains: per call signature, see _measure_outside
        self._outside_now: tuple[int, int] | None = None
        self.fallback_plain = fallback_plain  # no chain found: warn once and run the module's forward as written
        self.distributed = False  # set under DDP: a parameter shared by two stages is refused (`shared_parameters`)
        self.on_discovered: Callable[[Checkpointable], None] | None = None  # called once the stages are found
        self.no_chain = ""  # why no chain was found, when falling back
        self.stage_names = list(stages.names) if stages is not None else []
        self.mem_limit = mem_limit
        self.slots = slots
        self.loss_tmp = loss_tmp
        self.repeats = repeats
        self.warmup = warmup
        self.budget: int | None = None  # bytes, fixed by the first signature planned
        self.shared: SharedBudget | None = None  # set by whoever splits one budget over several chains
        self.shared_name = ""
        self.entries: dict[str, Entry] = {}  # per signature: the plan for the whole budget
        self.last_entry: Entry | None = None  # the entry the latest call ran
        self.calls = StepCalls()  # this step's pending calls (lightning_rotor/calls.py)
        self._structures: dict[tuple[str, ...], list[int]] = {}  # steps seen: signatures -> budgets first run
        self._auto_none = False  # mem_limit=None resolved to "no recomputation" (not on CUDA)
        self._to_grow: list[tuple[str, ...]] = []  # steps of several calls a shared budget is not split for yet
        self._forget_call_plans()
        self.last_measurement: StepMeasurement | None = None
        self._measurement: StepMeasurement | None = None
        # called as (stages done, stages, seconds) while a new input signature is profiled
        self.on_profile_progress: Callable[[int, int, float], None] | None = None

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
        if torch.compiler.is_compiling() and self.training and torch.is_grad_enabled():
            return train_eagerly(self, *args, **kwargs)  # a graph break: rotor's step runs eagerly (compile.py)
        if self.stages is not None and self.discovery is None:  # an nn.Sequential, or stages given
            if kwargs:
                raise TypeError(f"a chain of stages takes its input positionally, got keyword(s) {sorted(kwargs)}")
            if not args:
                raise TypeError("Checkpointable needs the chain input: call it with one tensor or several")
            value = args[0] if len(args) == 1 else args
            if not self.training or not torch.is_grad_enabled():
                return self.plain_module(value)
            if self._join_in_place:
                self._join_in_place_on(value)
            return self._run(value, lambda: self.module(value))
        if not self.training or not torch.is_grad_enabled() or self.no_chain:
            return self.plain_module(*args, **kwargs)  # the user's forward, as written (traced code freezes `training`)
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
        if found.graph is not None:
            bound = _bind_call(self.module, args, kwargs)
            value = found.graph.chain_input(bound)
            return self._run(value, lambda: self.module(*args, **kwargs))
        run = found.run
        key = signature((args, kwargs))
        if key not in self.outside:
            self.outside[key] = self._measure_outside(args, kwargs)
        self._outside_now = self.outside[key]
        run.install(lambda value: self._run(value, lambda: _run_stages(self.stages, value)))
        try:
            return self.module(*args, **kwargs)
        finally:
            run.uninstall()

    def _join_in_place_on(self, value: Any) -> None:
        """A Sequential's leaves that write into their input in place join the stage before, seen on `value`."""
        from lightning_rotor.discovery import join_in_place

        self._join_in_place = False
        joined = join_in_place(self.stages, value)
        if joined is not self.stages:
            object.__setattr__(self, "stages", joined)
            self.stage_names = list(joined.names)

    def _measure_outside(self, args: tuple, kwargs: dict[str, Any]) -> tuple[int, int]:
        """What a module-level chain's budget must also hold: (bytes the forward keeps from before the run,
        peak bytes of the rest of the forward, a loss and their backward above what is alive after the run).

        One forward with the blocks run without grad and the rest recorded, a cross-entropy
        stand-in for the caller's loss (`profile.proxy_loss`) and its backward down to the run's
        output and the call's inputs, taken as leaves of their own; parameters' `.grad` are set
        aside meanwhile and put back untouched, buffers and the RNG stream too (`profile.Untouched`).
        """
        from lightning_rotor.profile import Untouched, proxy_loss

        run = self.discovery.run
        probe = MemoryProbe(self.module)
        seen: dict[str, int] = {}

        def blocks_without_grad(value: Any) -> Any:
            seen["before"] = probe.current - storage_bytes(value)
            with torch.no_grad():
                out = _run_stages(self.stages, value)
            probe.reset_peak()
            seen["after"] = probe.current
            return out

        # the caller's tensors as leaves of their own: the backward stops at them, not in the caller's graph
        args, kwargs = tree_map(_own_leaf, (args, kwargs))
        devices = [t.device for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        run.install(blocks_without_grad)
        try:
            with Untouched([self.module], devices), probe:
                output = self.module(*args, **kwargs)
                loss = proxy_loss(output)
                if loss.requires_grad:
                    loss.backward()
                del output, loss
        finally:
            run.uninstall()
        return max(0, seen.get("before", 0)), max(0, probe.peak - seen.get("after", probe.peak))

    def discover_on(self, *args: Any, **kwargs: Any) -> Discovery:
        """Find the chain on a call's arguments now (the first training call does it otherwise).

        Raises `DiscoveryError` (or `ValueBranch`, naming file and line) when no chain is found.
        """
        from lightning_rotor.discovery import discover_chain

        if self.discover is None:
            raise RuntimeError("this Checkpointable was given its stages; there is nothing to discover")
        found = discover_chain(self.module, args, self.discover, self.checkpoint_modules, sample_kwargs=kwargs)
        self.discovery = found
        object.__setattr__(self, "stages", compile_stages(found.stages, self.compiler))
        self.stage_names = list(found.stages.names)
        hook, self.on_discovered = self.on_discovered, None
        if hook is not None:  # e.g. plans saved in a checkpoint, restored now that the stages are known
            hook(self)
        return found

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
        key = self._plan_key(value, trainable)
        primary = self._entry_for(key, value)
        alone = not self.calls.alive()
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
        if measurement is not None:
            if measurement.entry is None:  # the step's first call: its marks start here
                measurement.start_op = getattr(measurement.probe, "ops", 0)
            measurement.entry = entry
            entry.runner.probe = measurement.probe
        try:
            output = entry.runner(value)
        finally:
            entry.runner.probe = None
        self.calls.add(call, peak, output)
        return output

    # -- several calls per step (lightning_rotor/calls.py) -------------------------------------
    def _call_entry(self, key: str, primary: Entry, value: Any) -> tuple[Entry, Call, int]:
        """The entry this call runs: planned against the budget less what pending calls hold.

        Raises `InfeasibleStep` when the call cannot fit in what is left, before it runs.
        """
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
            if chosen < self._smallest(key) and self._grow_share((*prefix, key)):
                budget = self.budget
                chosen = self.budget_for_call(prefix, key, budget - held)
            if chosen < self._smallest(key):
                need = step_minimum((*prefix, key), self._smallest_of((*prefix, key)), self._figures)
                shared = self.shared_name if self.shared is not None and len(self.shared.names) > 1 else ""
                self.calls.refused(key)
                raise InfeasibleStep(what, budget, held, self._smallest(key), need, shared)
        entry = primary if chosen == budget else self._entry_at(key, chosen)
        pending, backward_peak = self._call_figures(key, chosen)
        call = Call(key, len(prefix), chosen, pending, backward_peak, budget, what)
        return entry, call, entry.plan.peak

    def budget_for_call(self, prefix: tuple[str, ...], key: str, available: int) -> int:
        """The budget of the next call after `prefix` (signatures of the step's calls so far)."""
        position = len(prefix)
        wanted = []
        for structure, tried in self._structures.items():
            if len(structure) > position and structure[: position + 1] == (*prefix, key):
                budgets = self._learned_budgets(structure, tried)
                if budgets is not None:
                    wanted.append(budgets[position])
        if wanted:
            return min(min(wanted), available)
        if position == 0 and self._structures:
            return available  # a new input signature: steps so far tell nothing, plan for the whole budget
        return min(self._smallest(key), available)  # the first step, or a call more: hold the least, leave the most

    def _learned_budgets(self, structure: tuple[str, ...], tried: list[int]) -> list[int] | None:
        cache_key = (structure, self.budget)
        if cache_key not in self._step_budgets:
            if any(sig not in self.entries for sig in structure):
                return None
            self._step_budgets[cache_key] = step_budgets(structure, self.budget, self._smallest_of(structure),
                                                         self._figures, tried)
        return self._step_budgets[cache_key]

    def _grow_share(self, structure: tuple[str, ...]) -> bool:
        """Under a budget shared with other chains, a share that fits a step of `structure`'s calls
        (`SharedBudget.grow`). Only while the other chains hold nothing pending: their shares may
        shrink. Returns whether the share was asked for."""
        shared = self.shared
        if shared is None or len(shared.names) < 2 or self._no_recompute():
            return False
        if any(member is not self and getattr(member, "calls", None) is not None and member.calls.alive()
               for member in shared.members.values()):
            return False
        smallest = step_minimum(structure, self._smallest_of(structure), self._figures)
        peaks = {sig: no_recompute_peak(self.entries[sig].chain) for sig in structure}
        need = step_minimum(structure, peaks, self._figures)
        share = shared.grow(self.shared_name, smallest, need)
        if share != self.budget:
            self.replan(share)
        return True

    def _no_recompute(self) -> bool:
        """An automatic budget off CUDA means no recomputation (module docstring), for every call."""
        if self.shared is not None:
            return self.shared.value is None and self.shared.auto_bytes is None
        return self.mem_limit is None and self._auto_none

    def _smallest(self, key: str) -> int:
        if key not in self._smallest_bytes:
            self._smallest_bytes[key] = min_feasible_budget(self.entries[key].chain)
        return self._smallest_bytes[key]

    def _smallest_of(self, keys: Iterable[str]) -> dict[str, int]:
        return {k: self._smallest(k) for k in keys}

    def _plan_at(self, key: str, budget: int) -> Plan:
        primary = self.entries[key]
        if budget == primary.plan.mem_limit:
            return primary.plan
        if (key, budget) not in self._plans:
            self._plans[(key, budget)] = plan(primary.chain, budget, slots=self.slots)
        return self._plans[(key, budget)]

    def _call_figures(self, key: str, budget: int) -> tuple[int, int]:
        """(bytes held while pending, peak of the backward part) of the plan for `key` at `budget` (once)."""
        if (key, budget) not in self._held:
            self._held[(key, budget)] = call_figures(self.entries[key].chain, self._plan_at(key, budget).ops)
        return self._held[(key, budget)]

    def _figures(self, key: str, budget: int) -> tuple[int, int, float]:
        """(bytes held while pending, peak, seconds) of the plan for `key` at `budget` (planned if new)."""
        chosen = self._plan_at(key, budget)
        return self._call_figures(key, budget)[0], chosen.peak, chosen.time

    def _entry_at(self, key: str, budget: int) -> Entry:
        if (key, budget) not in self._call_entries:
            primary, chosen = self.entries[key], self._plan_at(key, budget)
            runner = PlanRunner(self.stages, chosen.ops, self.stage_names, in_free=primary.chain.in_free)
            self._call_entries[(key, budget)] = Entry(primary.profile, chosen, runner)
        return self._call_entries[(key, budget)]

    def _forget_call_plans(self) -> None:
        """Plans of calls after others are made again (the budget or the profiles changed)."""
        self._plans, self._call_entries, self._step_budgets, self._smallest_bytes = {}, {}, {}, {}
        self._held: dict[tuple[str, int], tuple[int, int]] = {}

    def prepare_for(self, value: Any) -> Entry:
        """The profile and plan for `value`'s signature, made now if new (no training step runs):
        the plan of a call alone in its step, at the whole budget.

        Raises `InfeasibleBudget` (with the smallest feasible budget) when the budget is too small.
        """
        if self.stages is None:
            raise RuntimeError("the chain is not discovered yet: run one training forward (or discover_on) first")
        return self._entry_for(self._plan_key(value), value)

    def _entry_for(self, key: str, value: Any) -> Entry:
        """The whole-budget entry of plan key `key` (`_plan_key(value)`), profiled and planned if new."""
        entry = self.entries.get(key)
        if entry is None:
            entry = self.entries[key] = self._prepare(value)
        self.last_entry = entry
        return entry

    def _stage_parameters(self) -> list[nn.Parameter]:
        """The stages' parameters in order (found once per set of stages)."""
        cached = getattr(self, "_params_of", None)
        if cached is None or cached[0] is not self.stages:
            cached = self._params_of = (self.stages, [p for stage in self.stages for p in stage.parameters()])
        return cached[1]

    def _plan_key(self, value: Any, trainable: list[bool] | None = None) -> str:
        """The input's signature, and which stage parameters are frozen when some are.

        Freezing or unfreezing parameters changes what the stages save and the frozen prefix
        (chain version 4), so a plan is made for each pattern: unfreezing layers mid-training
        profiles and plans again. With every parameter trainable the key is the signature alone.
        `trainable`: the stage parameters' `requires_grad`, when the caller has read them already.
        """
        key = signature(value)
        flags = [p.requires_grad for p in self._stage_parameters()] if trainable is None else trainable
        if all(flags):
            return key
        return f"{key} requires_grad={''.join('1' if f else '0' for f in flags)}"

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

    def _prepare(self, value: Any) -> Entry:
        if self.distributed:
            shared = self.shared_parameters()
            if shared:
                name, users = next(iter(shared.items()))
                raise RuntimeError(
                    f"rotor under DDP: parameter {name!r} is used by stages {', '.join(users)} (tied weights); "
                    "DDP would all-reduce its gradient after the first stage's backward and miss the rest. "
                    "Untie it, or train this model with DDP without rotor"
                )
        profile = profile_chain(
            self.stages, value, names=self.stage_names, repeats=self.repeats, warmup=self.warmup,
            loss_tmp=self.loss_tmp, progress=self.on_profile_progress,
        )
        if self.discovery is not None and self.discovery.run is not None and self._outside_now is not None:
            # a module-level chain: the rest of the forward is charged too, kept bytes with the input and
            # the forward after the run, the loss and their backward as the chain's loss
            before, tail = self._outside_now
            chain = profile.chain
            tail_tmp = tail - chain.out_size[-1]
            profile.chain = dataclasses.replace(
                chain, input_size=chain.input_size + before, loss_tmp=max(chain.loss_tmp, tail_tmp),
                loss_tmp_kept=max(chain.loss_tmp_kept, tail_tmp),
            )
        if self.budget is None:
            device = next(t.device for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))
            if self.shared is not None:  # one budget for several chains, split by need
                self.budget = self.shared.share(self.shared_name, self, profile.chain, device, self.parameters())
            elif self.mem_limit is None:
                total = auto_budget(device, self.parameters())
                self._auto_none = total is None
                self.budget = no_recompute_peak(profile.chain) if total is None else total
            else:
                self.budget = resolve_budget(self.mem_limit, no_recompute_peak(profile.chain))
        chosen = plan(profile.chain, self.budget, slots=self.slots)
        runner = PlanRunner(self.stages, chosen.ops, self.stage_names, in_free=profile.chain.in_free)
        return Entry(profile, chosen, runner)

    # -- what was planned -----------------------------------------------------------------------
    def _entry(self) -> Entry:
        """The whole-budget entry of the last signature (`last_entry` is the one the latest call ran)."""
        if self.last_entry is None:
            raise RuntimeError("nothing is planned yet: run one training forward first")
        return next((e for e in self.entries.values() if e.profile is self.last_entry.profile), self.last_entry)

    @property
    def step_limit(self) -> int:
        """The bytes a training step of this chain may hold, all its calls together: the budget, or under
        an automatic budget off CUDA (no recomputation) the step's predicted peak when larger."""
        budget = self.budget or 0
        return max(budget, self.calls.step_peak) if self._no_recompute() else budget

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

    def plan_state(self) -> dict[str, Any]:
        """Profiles and plans as plain data, for checkpoints (`load_plan_state` reads it back)."""
        if self.stages is None:
            return {"budget": self.budget, "stage_names": [], "fingerprints": [], "entries": []}
        return {
            "budget": self.budget,
            "stage_names": list(self.stage_names),
            "fingerprints": stage_fingerprints(self.stages),
            "entries": [
                {
                    "signature": key,
                    "chain": e.chain.to_dict(),
                    "plan": e.plan.to_dict(),
                    "profile_seconds": e.profile.seconds,
                    "fwd_spread": e.profile.fwd_spread,
                    "bwd_spread": e.profile.bwd_spread,
                    "repeats": e.profile.repeats,
                    "round_seconds": e.profile.round_seconds,
                    "threads": e.profile.threads,
                }
                for key, e in self.entries.items()
            ],
        }

    def load_plan_state(self, state: dict[str, Any]) -> None:
        """Reuse saved profiles and plans: inputs with a saved signature skip profiling.

        The saved stages must be these stages (same names, module types, parameter
        and buffer shapes and dtypes, see `stage_fingerprints`): a plan made for
        another model would break the budget. On any mismatch nothing is loaded and
        a one-line ValueError says why; the module then profiles on its next forward.
        """
        self._check_saved_stages(state)
        entries = {}
        for item in state.get("entries", []):
            chain = Chain.from_dict(item["chain"])
            if chain.length != len(self.stages) or list(chain.names) != list(self.stage_names):
                raise ValueError(
                    f"saved plan is for a chain of {chain.length} stages {list(chain.names)[:4]}..., but this module "
                    f"has {len(self.stages)} stages {list(self.stage_names)[:4]}...; nothing loaded"
                )
            profile = Profile(
                chain,
                float(item.get("profile_seconds", 0.0)),
                list(item.get("fwd_spread", [])),
                list(item.get("bwd_spread", [])),
                repeats=int(item.get("repeats", 0)),
                round_seconds=[float(t) for t in item.get("round_seconds", [])],
                threads=int(item.get("threads", 0)),
            )
            saved = Plan.from_dict(item["plan"])
            runner = PlanRunner(self.stages, saved.ops, self.stage_names, in_free=chain.in_free)
            entries[str(item["signature"])] = Entry(profile, saved, runner)
        if state.get("budget") is not None:
            self.budget = int(state["budget"])
        self.entries.update(entries)
        self._forget_call_plans()

    def _check_saved_stages(self, state: dict[str, Any]) -> None:
        names, prints = state.get("stage_names"), state.get("fingerprints")
        if names is None or prints is None:
            raise ValueError("saved plan state has no stage fingerprints (an older release made it); nothing loaded")
        if list(names) != list(self.stage_names):
            raise ValueError(f"saved plan is for stages {list(names)[:4]}..., but this module has "
                             f"{list(self.stage_names)[:4]}...; nothing loaded")
        ours = stage_fingerprints(self.stages)
        differ = [n for n, a, b in zip(self.stage_names, prints, ours, strict=True) if a != b]
        if differ:
            raise ValueError(f"saved plan is for other stages: {', '.join(differ[:4])} differ in module types or "
                             "parameter/buffer shapes or dtypes; nothing loaded")

    def measure_step(self, probe: MemoryProbe | CudaMemoryProbe | None = None) -> StepMeasurement:
        """A context manager measuring the activation memory of the step run inside it.

        `probe`: what measures (default: tensor accounting of this module's activations on CPU,
        the allocator on CUDA); give a wider `MemoryProbe` to count the whole training step.
        """
        device = next((p.device for p in self.parameters()), torch.device("cpu"))
        return StepMeasurement(self, device, probe)

    def replan(self, mem_limit: int | float | str) -> None:
        """Plan every saved chain again for `mem_limit` (profiles are kept; planning is cheap).

        Raises `InfeasibleBudget` before changing anything when some chain cannot meet it.
        A fraction is taken of the first chain's no-recomputation peak, as on a first step.
        """
        parse_budget(mem_limit)
        entries = list(self.entries.items())
        if not entries:
            self.mem_limit, self.budget = mem_limit, None
            return
        budget = resolve_budget(mem_limit, no_recompute_peak(entries[0][1].chain))
        chosen = {key: plan(entry.chain, budget, slots=self.slots) for key, entry in entries}
        self.mem_limit, self.budget, self._auto_none = mem_limit, budget, False
        self._forget_call_plans()
        for key, entry in entries:
            self.entries[key] = Entry(entry.profile, chosen[key], PlanRunner(self.stages, chosen[key].ops,
                                                                             self.stage_names,
                                                                             in_free=entry.chain.in_free))
            if self.last_entry is entry:
                self.last_entry = self.entries[key]

    def summary(self) -> str:
        """A readable table of the stages and the plan for the last signature."""
        entry = self._entry()
        chain, chosen, runs = entry.chain, entry.plan, entry.runs
        width = max(len(n) for n in chain.names)
        lines = [
            f"{'stage':<{width}}  {'out':>10}  {'saved':>10}  {'fwd ms':>8}  {'bwd ms':>8}  runs",
        ]
        for k in range(chain.length):
            lines.append(
                f"{chain.names[k]:<{width}}  {format_bytes(chain.out_size[k]):>10}  "
                f"{format_bytes(chain.saved_size[k]):>10}  {chain.fwd_time[k] * 1e3:8.3f}  "
                f"{chain.bwd_time[k] * 1e3:8.3f}  {runs[k]}{' (recomputed)' if runs[k] > 1 else ''}"
                f"{' (frozen)' if k < chain.frozen else ''}"
            )
        base = chain.no_recompute_time()
        lines.append(
            f"budget {format_bytes(chosen.mem_limit)}, predicted peak {format_bytes(chosen.peak)}, "
            f"predicted step {chosen.time * 1e3:.3f} ms ({chosen.time / base:.2f}x no recomputation)"
            if base > 0
            else f"budget {format_bytes(chosen.mem_limit)}, predicted peak {format_bytes(chosen.peak)}"
        )
        prof = entry.profile
        noise = (f"plain step spread {prof.step_spread:.0%} over {prof.repeats} rounds (one stage's up to "
                 f"{prof.spread:.0%}; times are medians)" if prof.round_seconds
                 else f"timing spread up to {prof.spread:.0%} over {prof.repeats} runs")
        lines.append(f"profiling took {prof.seconds:.3f} s ({prof.seconds / max(chosen.time, 1e-12):.0f} "
                     f"predicted steps), {noise}")
        return "\n".join(lines)

    def _apply(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Checkpointable:
        """`.to()`, `.double()`, ...: a discovered graph chain is found again on the next training call.

        Its stages read the module's own buffers through copies of the references taken at
        discovery; a conversion replaces buffer tensors, so those references would be stale.
        """
        self.module._apply(fn, *args, **kwargs)  # its children are ours; its own tensors are registered here too
        for name in self._parameters:
            self._parameters[name] = self.module._parameters[name]
        for name in self._buffers:
            self._buffers[name] = self.module._buffers[name]
        if self.discovery is not None and self.discovery.graph is not None:
            self.discovery = None
            object.__setattr__(self, "stages", None)
            self.stage_names, self.entries, self.last_entry = [], {}, None
        self.outside = {}  # measured in the old dtype or device
        self._forget_call_plans()
        return self

    def extra_repr(self) -> str:
        stages = len(self.stages) if self.stages is not None else f"found on the first call ({self.discover})"
        return f"stages={stages}, mem_limit={self.mem_limit!r}"

    def __getstate__(self) -> dict[str, Any]:
        """Copies and pickles leave out a step measurement in progress (its probe holds storage handles)."""
        state = dict(self.__dict__)
        state["_measurement"] = None
        return state


def _bind_call(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    import inspect

    bound = inspect.signature(module.forward).bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _own_leaf(value: Any) -> Any:
    """A tensor cut from the caller's graph, requiring grad as it did (anything else as it is)."""
    if not isinstance(value, torch.Tensor):
        return value
    return value.detach().requires_grad_(value.requires_grad)


def _run_stages(stages: Stages, value: Any) -> Any:
    for stage in stages:
        value = stage(value)
    return value
