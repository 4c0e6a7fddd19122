"""`RotorFabricStrategy`: Lightning Fabric on one device, with rotor's optimal checkpointing.

It is Fabric's `SingleDeviceStrategy` plus one step in `setup_module`: once the model
is on its device, the model itself (its chain discovered on the first training
batch) or, with `include=`, the named submodules are swapped for `Checkpointable`s
(same parameters, same `state_dict` keys), as `RotorStrategy` does for the Trainer.

Fabric has no training-loop hooks, so a step is what runs from the first training
forward of a set-up module to `fabric.backward(loss)`. At the end of each backward
the strategy does what the Trainer's `RotorCallback` does at the end of a batch:
checks a shared budget, prints the plan table once, warns when a sampled activation
peak is above the budget, and updates `strategy.metrics` with the same `rotor/...`
names, for `fabric.log_dict(fabric.strategy.metrics, step=...)`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import SingleDeviceStrategy
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_rotor.checkpointable import Checkpointable
from lightning_rotor.config import RotorConfig
from lightning_rotor.lightning.callback import checked_measure_every, step_metrics, summary_text, warn_if_over_budget
from lightning_rotor.lightning.sampling import Measured, StepSampler, batch_key
from lightning_rotor.lightning.strategy import ConfigAttributes, ProfileProgress, budget_words
from lightning_rotor.lightning.wrap import Wrapped, is_candidate, is_user_model, unwrap, wrap
from lightning_rotor.loss_watch import settle_watches
from lightning_rotor.memory import MemoryProbe

ROOT = "model"  # the chain's name when the whole set-up module is wrapped
KEPT_OUTPUT_HINT = (
    "a loop that keeps the model's output alive through fabric.backward adds its size: "
    "write `loss = loss_fn(model(x), y)`"
)


class RotorFabricStrategy(ConfigAttributes, SingleDeviceStrategy):
    """One device (CUDA with `accelerator="gpu"`, CPU otherwise) with rotor checkpointing, for Fabric.

    The rotor settings are `RotorStrategy`'s, `RotorConfig`'s fields (lightning_rotor/config.py), as
    `config=` or keyword arguments: `mem_limit` (None: automatic; bytes; a size such as `"6GiB"`; a
    fraction of the no-recomputation peak such as `0.5` or `"50%"`; or `{chain name: budget}`),
    `include` / `exclude` (submodule names relative to the set-up module, globs, class names or classes;
    without `include` the module itself is the chain), and the rest.
    Each `fabric.setup(module, ...)` gets the whole budget. `measure_every_n_steps`: how often
    the activation peak is sampled (0: only the first step of each plan). `print_summary`: print the plan table once.
    `device`: leave None to take Fabric's `accelerator` and `devices`.
    """

    strategy_name = "rotor"

    def __init__(
        self,
        mem_limit: int | float | str | dict[str, int | float | str | None] | None = None,
        *,
        config: RotorConfig | None = None,
        include: list[str | type] | None = None,
        exclude: list[str | type] | None = None,
        discover: str = "auto",
        checkpoint_modules: list[str | type] | None = None,
        slots: int | None = None,
        loss_fn: Callable[[Any], Any] | None = None,
        loss_tmp: int | None = None,
        repeats: int = 5,
        warmup: int = 0,
        fallback_plain: bool | None = None,
        compile: bool | dict | None = None,
        derive_shapes: bool = True,
        predict_shapes: bool = False,
        fit_shapes: bool = True,
        shape_buckets: dict[int, list[int]] | None = None,
        options: bool = False,
        offload: bool | float | str = False,
        host_limit: int | str | None = None,
        early_stop: bool = False,
        measure_every_n_steps: int = 50,
        print_summary: bool = True,
        device: str | torch.device | None = None,
        accelerator: Accelerator | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
    ):
        settings = RotorConfig.of(config, locals())  # bad settings fail here, in one line, before setup
        every = checked_measure_every(measure_every_n_steps)
        super().__init__(device="cpu", accelerator=accelerator, checkpoint_io=checkpoint_io, precision=precision)
        self.config = settings
        self.measure_every_n_steps = every
        self.print_summary = print_summary
        self.chains: dict[str, Checkpointable] = {}  # every set-up module's rotor modules, by name
        self.metrics: dict[str, float] = {}  # the latest step's `rotor/...` scalars
        self._modules: list[nn.Module] = []  # the set-up modules that hold chains
        self._swapped: list[tuple[nn.Module, list[Wrapped]]] = []  # per set-up module: where `wrap` swapped rotor in
        self._hooks: list[RemovableHandle] = []  # `_on_forward` on each set-up module
        self._device = None if device is None else torch.device(device)
        self._parallel_devices: list[torch.device] = []
        self._in_step = False
        self._t0 = 0.0
        self._step_seconds: float | None = None
        self._measured_peak: int | None = None
        self._measurements: list[Measured] = []
        self.sampler = StepSampler(every)  # which steps run under the probe (as RotorCallback's)
        self._batch_key: tuple[Any, ...] = ()
        self._entries_before: dict[str, int] = {}
        self._printed = False
        self._warned_unused = False
        self._warned_over: set[tuple[int, ...]] = set()

    # Fabric's connector fills `parallel_devices` from `accelerator=` and `devices=` for strategies that
    # have the attribute (as the Trainer's does): that is how this strategy learns its device.
    @property
    def parallel_devices(self) -> list[torch.device]:
        return [self._device] if self._device is not None else self._parallel_devices

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device]) -> None:
        devices = [torch.device(d) if not isinstance(d, torch.device) else d for d in devices or []]
        if len(devices) > 1:
            raise ValueError(
                f"the rotor Fabric strategy runs on one device but Fabric asks for {len(devices)}; use devices=1 "
                "(or DDP without rotor; FSDP2: RotorFabricModelParallelStrategy, docs/sharded.md)"
            )
        self._parallel_devices = devices

    @property
    def root_device(self) -> torch.device:
        devices = self.parallel_devices
        return devices[0] if devices else torch.device("cpu")

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="single device with rotor checkpointing", override=True
        )

    # -- set-up: swap rotor in ----------------------------------------------------------------------------
    def setup_module(self, module: nn.Module) -> nn.Module:
        """The module with its chains swapped for `Checkpointable`s (the module itself when it is the chain)."""
        module = super().setup_module(module)
        whole = (
            self.config.include is None
            and not isinstance(module, Checkpointable)
            and (is_candidate(module) or (self.config.discover != "sequential" and is_user_model(module)))
        )
        if whole:  # the module is the chain: wrap it as the only child of a holder, named ROOT
            holder = nn.ModuleDict({ROOT: module})
            wrapped, why = wrap(holder, config=self.config.replace(exclude=None))
            self._swapped.append((holder, wrapped))
            module = holder[ROOT]
        else:
            wrapped, why = wrap(module, config=self.config)
            self._swapped.append((module, wrapped))
        found = {w.name: w.rotor for w in wrapped}
        found.update({name or ROOT: m for name, m in _outermost_rotor(module).items() if m not in found.values()})
        if not found:
            rank_zero_warn(
                f"rotor: nothing to checkpoint in {type(module).__name__}, training runs without it: "
                f"{why}. Name what to wrap with include=[...]."
            )
            return module
        found = {self._unique(name): rotor for name, rotor in found.items()}  # fabric.setup(G), fabric.setup(D)
        for name, rotor in found.items():
            rotor.on_profile_progress = ProfileProgress(name)
        self.chains.update(found)
        self._modules.append(module)
        self._hooks.append(module.register_forward_pre_hook(self._on_forward, with_kwargs=True))
        parts = ", ".join(
            f"{name} ({len(r.stages)} stages)"
            if r.stages is not None
            else f"{name} ({type(r.module).__name__}, chain found on the first batch)"
            for name, r in found.items()
        )
        total = budget_words(self.config.mem_limit)
        rank_zero_info(f"rotor: checkpointing {parts} within {total}; profiling on the first training batch")
        return module

    def _unique(self, name: str) -> str:
        """`name`, or `name_2`, `name_3`, ... when an earlier set-up module has a chain of that name."""
        unique, i = name, 1
        while unique in self.chains:
            i += 1
            unique = f"{name}_{i}"
        return unique

    def restore_own_checkpointing(self) -> None:
        """The model's own checkpointing (Hugging Face's flags, `checkpoint_wrapper`s) that rotor turned off, back
        on in every chain. Fabric has no end of training to do it at: call this, or `teardown()`, when done."""
        for rotor in self.chains.values():
            rotor.restore_own_checkpointing()

    def teardown(self) -> None:
        """As a Trainer's fit does at its end: the user's modules back where rotor swapped its own in (a module set
        up whole is the user's object throughout), their own checkpointing on again, no hook of rotor's left on
        them; then Fabric's teardown. A second call changes nothing."""
        self.restore_own_checkpointing()  # chains the user wrapped too
        for parent, wrapped in reversed(self._swapped):
            unwrap(parent, wrapped)
        for hook in self._hooks:
            hook.remove()
        self._swapped, self._hooks = [], []
        super().teardown()

    # -- a step: the first training forward ... fabric.backward -------------------------------------------
    def _on_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._in_step or not module.training or not torch.is_grad_enabled():
            return
        self._in_step = True
        self._measurements = []
        self._batch_key = batch_key((args, kwargs))  # the step's batch: its first training forward's arguments
        if self.sampler.wants(self.chains, self._batch_key):
            for name, rotor in self.chains.items():
                # on CPU the whole step, parameters excluded (as the Trainer's callback); the allocator on CUDA
                probe = MemoryProbe(self._modules, record_curve=True) if self.root_device.type != "cuda" else None
                m = rotor.measure_step(probe=probe)
                m.__enter__()
                self._measurements.append((name, rotor, m, len(rotor.entries)))
        self._entries_before = {name: len(rotor.entries) for name, rotor in self.chains.items()}
        self._synchronize()
        self._t0 = time.perf_counter()

    def _close_measurements(self) -> None:
        for _, _, m, _ in reversed(self._measurements):
            if m.is_open:
                m.__exit__(None, None, None)

    def backward(self, tensor: torch.Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        try:
            super().backward(tensor, module, *args, **kwargs)
        finally:
            settle_watches()  # loss windows off the dispatch-mode stack before the optimizer step
            self._close_measurements()
        if self._in_step:
            self._synchronize()
            seconds = time.perf_counter() - self._t0
            self._in_step = False
            self._end_step(seconds)

    def _end_step(self, seconds: float) -> None:
        shared = {id(r.shared): r.shared for r in self.chains.values() if r.shared is not None}
        for budget in shared.values():  # a total too small for the chains that ran: before any optimizer step
            budget.check()
        planned = {name: rotor for name, rotor in self.chains.items() if rotor.last_entry is not None}
        if not planned:
            if self.chains and not self._warned_unused:
                self._warned_unused = True
                rank_zero_warn(
                    f"rotor: the wrapped chain(s) {', '.join(self.chains)} did not run in the training "
                    "forward of the first batch, so nothing was profiled or planned"
                )
            return
        profiled = any(len(r.entries) != self._entries_before.get(n, 0) for n, r in self.chains.items())
        clean = self.sampler.ran(self._batch_key, planned, self._entries_before, self._measurements)
        peaks = [m.peak for _, _, m, _ in clean]
        self._measurements = []
        if peaks:
            self._measured_peak = max(peaks)
            warn_if_over_budget(planned, self._measured_peak, self._warned_over, KEPT_OUTPUT_HINT)
        elif not profiled:
            self._step_seconds = seconds  # a step neither profiled nor slowed by the probe
        if self.print_summary and not self._printed and self.is_global_zero:
            self._printed = True
            print(summary_text(planned))
        self.metrics = step_metrics(planned, self._step_seconds, self._measured_peak)

    def _synchronize(self) -> None:
        if self.root_device.type == "cuda":
            torch.cuda.synchronize(self.root_device)


def _outermost_rotor(module: nn.Module) -> dict[str, Checkpointable]:
    found: dict[str, Checkpointable] = {}
    for name, m in module.named_modules():
        if isinstance(m, Checkpointable) and not any(name.startswith(p + ".") or p == "" for p in found):
            found[name] = m
    return found
