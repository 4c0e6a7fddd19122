"""`Checkpointable`: a module that trains within an activation-memory budget.

An `nn.Sequential` is a chain as it stands; any other module's chain is discovered on its
first training call (`discover=`: "auto", "graph", "modules"; docs/discovery.md), and the
module's own forward runs in eval mode and under `no_grad`.

This module routes calls: forward → route (the chain's input, or the module's forward with the
chain installed in it) → chain state → step budget → runner. The chain's plans, one per input
signature, its per-shape budgets, replanning and saved plans live in its `ChainState`
(lightning_rotor/chain_state.py), made through `pipeline.prepare` on the first training call of a
signature; several calls of one step share the budget (`calls.StepBudget`). `ck.budget`, `ck.plan`,
`ck.replan(...)`, ... are the chain state's (`rotor_state.ChainAttribute`). Eval mode and
`torch.no_grad()` run the plain module. `measure_step()` measures one step's activation memory
(`lightning_rotor.measure`).
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_rotor import pipeline, rotor_state, sharded
from lightning_rotor.budget import MemLimit
from lightning_rotor.calls import InfeasibleStep
from lightning_rotor.chain import Chain
from lightning_rotor.chain_state import ChainState
from lightning_rotor.compile import stage_compiler, train_eagerly, unwrap_compiled
from lightning_rotor.config import RotorConfig, module_settings
from lightning_rotor.huggingface import without_kv_cache
from lightning_rotor.measure import StepMeasurement
from lightning_rotor.memory import CudaMemoryProbe, MemoryProbe
from lightning_rotor.own_checkpointing import OwnCheckpointing
from lightning_rotor.pipeline import Entry
from lightning_rotor.planner import InfeasibleBudget, Plan
from lightning_rotor.profile import Profile
from lightning_rotor.shared_budget import Budget, auto_total
from lightning_rotor.stages import Stages, sequential_stages

if TYPE_CHECKING:
    from lightning_rotor.discovery import Discovery

__all__ = ["Checkpointable", "Entry", "InfeasibleBudget", "InfeasibleStep", "StepMeasurement", "auto_budget"]


def auto_budget(device: torch.device, parameters: Iterable[nn.Parameter] = ()) -> int | None:
    """The budget used when `mem_limit=None` in bytes on CUDA; None elsewhere, meaning the no-recompute peak."""
    return auto_total(device, parameters)


class Checkpointable(rotor_state.RotorModule):
    """A module (an nn.Sequential, or any module whose chain is discovered) trained within `mem_limit` bytes.

    The settings come as keyword arguments or as one `config=RotorConfig(...)`, not both: each is documented
    and checked in lightning_rotor/config.py (`mem_limit`: None for automatic, bytes, a size such as `"6GiB"`,
    or a fraction of the no-recomputation peak, `0.5` or `"50%"`). `stages`: the chain, found already.
    `shared` / `shared_name`: one `Budget` over several chains and this chain's name in it (lightning/wrap.py);
    `distributed`: trained under DDP (found on each call otherwise).

    After the first training forward: `.chain`, `.plan`, `.profile`, `.summary()`, `.profile_seconds`;
    `.entries` holds one profile and plan per input signature, all kept by `.chain_state` (chain_state.py);
    `.prepare_for(x)` profiles and plans `x`'s signature now, with no training step. `state_dict()` keys are
    the wrapped module's.
    """

    # Rotor's own attributes, kept in `_rotor` (`RotorState`), apart from the wrapped module's names (rotor_state.py)
    _rotor: rotor_state.RotorState
    module: nn.Module  # the wrapped module (its children, parameters and buffers are this module's registries)
    plain_module: nn.Module  # what eval mode and no_grad run (compiled when asked)
    compiler: Callable[[nn.Module], nn.Module] | None  # compiles each stage (None: stages run eagerly)
    chain_state: ChainState  # the chain's plans and budgets; the names below are its own (`ChainAttribute`)
    own: OwnCheckpointing  # the hand-off with the module's own checkpointing (own_checkpointing.py)
    discovery: Discovery | None  # how the chain was found (None: stages given, or not found yet)
    stages: Stages | None  # set by `ChainState.set_stages`
    stage_names: list[str]
    entries: dict[str, Entry]  # per plan key (input signature): the profile and the plan for the whole budget
    entry: Entry  # the profile and whole-budget plan of the last signature: what a call alone in its step runs
    budget: int | None  # bytes of the signature that ran last (each shape has its own)
    chain: Chain
    plan: Plan
    profile: Profile
    last_entry: Entry | None  # the entry the latest call ran
    sharded: bool | None  # FSDP2 units inside (lightning_rotor/sharded.py); None: not asked yet

    def __init__(
        self,
        module: nn.Module,
        mem_limit: MemLimit = None,
        *,
        stages: Stages | None = None,
        config: RotorConfig | None = None,
        discover: str = "auto",
        checkpoint_modules: Iterable[type[nn.Module]] | None = None,
        slots: int | None = None,
        loss_tmp: int | None = None,
        loss_fn: Callable[[Any], torch.Tensor] | None = None,
        repeats: int = 5,
        warmup: int = 0,
        fallback_plain: bool | None = None,
        compile: bool | dict[str, Any] | None = None,
        derive_shapes: bool = True,
        predict_shapes: bool = False,
        fit_shapes: bool = True,
        shape_buckets: dict[int, list[int]] | None = None,
        options: bool = False,
        offload: bool | int | float | str = False,
        host_limit: int | str | None = None,
        early_stop: bool = False,
        shared: Budget | None = None,
        shared_name: str = "",
        distributed: bool = False,
    ):
        config = RotorConfig.of(config, locals())  # the settings, checked (lightning_rotor/config.py)
        compiled = None
        if isinstance(module, nn.Module):  # torch.compile(m): stages of m, compiled alike (compile.py)
            module, compiled = unwrap_compiled(module)
        compiler = stage_compiler(config.compile, compiled)
        method, types = module_settings(config, module, stages)
        own_budget = Budget(config.mem_limit)  # type: ignore[arg-type]  # a per-chain dict fails here, in one line
        if shared is not None and shared_name not in shared.names:
            raise ValueError(f"shared_name={shared_name!r} is none of the shared budget's chains {shared.names}")
        sharded.refuse_sharded_root(module)  # FSDP2: Checkpointable first, fully_shard after (docs/sharded.md)
        super().__init__(module, rotor_state.RotorState())  # the wrapped module's registries are this module's
        state = self._rotor
        state.plain_module = compiler(module) if compiler else module
        state.own = OwnCheckpointing()
        state.chain_state = ChainState(module, own_budget, state.own)
        self.chain_state.take_settings(config, compiler, shared, shared_name, distributed)
        self.training = module.training  # the wrapped module's mode; `train()` sets both
        self.discover = None if method == "sequential" else method  # None: the stages are known
        self.chain_state.join_in_place = method == "sequential"  # before the first profile (`join_in_place`)
        self.checkpoint_modules = types
        self.rotor_config = config  # the settings as given (`replan` and a failed prediction change the live ones)
        self.fallback_plain = bool(config.fallback_plain)  # no chain found: warn once, run the forward as written
        self.on_discovered: Callable[[Checkpointable], None] | None = None  # called once the stages are found
        self.no_chain = ""  # why no chain was found, when falling back
        self.boxed: Callable[[Checkpointable, tuple, dict], Any] | None = None  # set while step_outside measures
        self.chain_state.set_stages(sequential_stages(module) if method == "sequential" else stages)  # type: ignore[arg-type]

    # -- the wrapped Sequential's container API ---------------------------------------------------
    def __bool__(self) -> bool:
        return True  # a module, even where the wrapped one has no len()

    def __len__(self) -> int:
        return len(self.module)  # type: ignore[arg-type]  # a Sequential's; others raise TypeError as len() does

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self.module)  # type: ignore[call-overload]  # a Sequential's; others raise TypeError

    def __getitem__(self, index: int | slice) -> nn.Module:
        """The wrapped Sequential's module at `index` (a slice gives an nn.Sequential, as Sequential does)."""
        return self.module[index]  # type: ignore[index]  # a Sequential's; others raise TypeError

    # -- the forward: route the call to the chain -------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Train within the budget; eval mode and `no_grad` run the wrapped module's own forward.

        A plain `nn.Sequential` passes one value from stage to stage, so there `rotor(a, b)`
        means the chain input `(a, b)`, at every budget and in eval mode. Any other module
        is called as written (`rotor(idx, targets=None)`); its chain is discovered on the
        first training call (`discover=`, docs/discovery.md).
        """
        if self.boxed is not None:  # the step outside the chains being measured (lightning_rotor/step_outside.py)
            return self.boxed(self, args, kwargs)
        training = self.training and torch.is_grad_enabled()
        if torch.compiler.is_compiling() and training:
            return train_eagerly(self, *args, **kwargs)  # a graph break: rotor's step runs eagerly (compile.py)
        if training:
            if not self.entries or self.sharded is None:  # before the first plan (or restored ones): FSDP2's order
                self.sharded = sharded.check_sharded(self.module)  # FSDP2's order, rotor's hooks on its units
            self.chain_state.check_modes()
        if self.stages is not None and self.discovery is None:  # an nn.Sequential, or stages given
            if kwargs:
                raise TypeError(f"a chain of stages takes its input positionally, got keyword(s) {sorted(kwargs)}")
            if not args:
                raise TypeError("Checkpointable needs the chain input: call it with one tensor or several")
            value = args[0] if len(args) == 1 else args
            if not training:
                return self.plain_module(value)
            self._measure_own((value,), {})
            return self.chain_state.run(value, lambda: self.module(value))
        if not training or self.no_chain:
            return self.plain_module(*args, **kwargs)  # the user's forward, as written (traced code freezes `training`)
        return self._module_call(*without_kv_cache(self.module, args, kwargs))  # Hugging Face: no KV cache

    def _module_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A training call of a module whose chain is discovered (now, on the first): the whole forward as the
        chain (graph), or the forward as written with the chain run in place of its blocks (modules)."""
        self._measure_own(args, kwargs)
        found = self.discovery if self.discovery is not None else self._discovered(args, kwargs)
        if found is None:  # no chain: the module runs as written (`fallback_plain`)
            return self.module(*args, **kwargs)
        if found.graph is not None:  # the whole forward is the chain
            bound = inspect.signature(self.module.forward).bind(*args, **kwargs)
            bound.apply_defaults()
            value = found.graph.chain_input(dict(bound.arguments))
            return self.chain_state.run(value, lambda: self.module(*args, **kwargs))
        run = found.run  # a run of blocks is the chain; the rest of the forward runs as written around it
        assert run is not None and self.stages is not None
        self.chain_state.measure_outside(args, kwargs)
        run.install(lambda value: self.chain_state.run(value, lambda: pipeline.run_stages(self.stages or (), value)))
        try:
            return self.module(*args, **kwargs)
        finally:
            run.uninstall()
            self.chain_state.call_done()

    def _discovered(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Discovery | None:
        """The chain found on this call, or None where none is and `fallback_plain` lets the module run as
        written (one warning)."""
        from lightning_rotor.discovery import DiscoveryError

        try:
            with sharded.outside_fsdp(self.module, bool(self.sharded)):  # FSDP2: none of its hooks fire
                return self.discover_on(*args, **kwargs)
        except DiscoveryError as err:
            if not self.fallback_plain:
                raise
            self.no_chain = str(err)
            warnings.warn(f"rotor: {type(self.module).__name__} runs without checkpointing: {err}", stacklevel=4)
            return None

    def discover_on(self, *args: Any, **kwargs: Any) -> Discovery:
        """Find the chain on a call's arguments now (the first training call does it otherwise).

        Raises `DiscoveryError` (or `ValueBranch`, naming file and line) when no chain is found.
        """
        if self.discover is None:
            raise RuntimeError("this Checkpointable was given its stages; there is nothing to discover")
        found = self.chain_state.discover(args, kwargs, self.discover, self.checkpoint_modules)
        hook, self.on_discovered = self.on_discovered, None
        if hook is not None:  # e.g. plans saved in a checkpoint, restored now that the stages are known
            hook(self)
        return found

    # -- the model's own checkpointing (lightning_rotor/own_checkpointing.py) ---------------------
    @property
    def own_checkpointing(self) -> list[tuple[str, nn.Module]]:
        """The modules whose own checkpointing flag rotor turned off (`restore_own_checkpointing` turns them on)."""
        return self.own.held

    def hold_own_checkpointing(self, found: list[tuple[str, nn.Module]], note: str | list[str]) -> None:
        """Flags turned off for this chain, and what to tell with its first plan (`OwnCheckpointing.hold`)."""
        self.own.hold(found, note)

    def restore_own_checkpointing(self) -> None:
        """Turn the wrapped module's own checkpointing flags back on, where rotor turned them off."""
        self.own.restore()

    def _measure_own(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Before the first plan: one step with the module's own checkpointing, measured (`OwnCheckpointing`)."""
        if not self.entries:
            with sharded.outside_fsdp(self.module, bool(self.sharded)):  # FSDP2: none of its hooks fire
                self.own.measure(self.module, args, kwargs, self.loss_fn)

    # -- measuring a step (lightning_rotor/measure.py) ---------------------------------------------
    def measure_step(self, probe: MemoryProbe | CudaMemoryProbe | None = None) -> StepMeasurement:
        """A context manager measuring the activation memory of the step run inside it.

        `probe`: what measures (default: tensor accounting of this module's activations on CPU,
        the allocator on CUDA); give a wider `MemoryProbe` to count the whole training step.
        """
        if probe is None:
            device = next((p.device for p in self.parameters()), torch.device("cpu"))
            if device.type == "cuda":
                probe = CudaMemoryProbe(device)
            elif self.sharded:  # FSDP2's gathered parameters counted too (NOTE: [measuring under FSDP2])
                probe = sharded.ShardedMemoryProbe(self, self, record_curve=True)
            else:
                probe = MemoryProbe(self, record_curve=True)
        return StepMeasurement(probe, self.chain_state.watch, self.chain_state.measured)

    # -- nn.Module --------------------------------------------------------------------------------
    def _apply(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Checkpointable:
        """`.to()`, `.double()`, ...: a discovered graph chain is found again on the next training call.

        Its stages read the module's own buffers through copies of the references taken at
        discovery; a conversion replaces buffer tensors, so those references would be stale.
        """
        self.module._apply(fn, *args, **kwargs)  # its registries are ours (`share_registries`)
        self.chain_state.converted()
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
