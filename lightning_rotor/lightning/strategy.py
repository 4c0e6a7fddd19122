"""`RotorStrategy` and `RotorDDPStrategy`: Lightning strategies that train the model
with rotor's optimal checkpointing.

Both do what Lightning's own single-device and DDP strategies do, plus one step
at model setup: once the model is on its device, and before DDP wraps it, the
parts chosen by the policy in `lightning_rotor.lightning.wrap` (the model itself,
whose chain is discovered on the first batch, or its `nn.Sequential`s) are swapped
for `Checkpointable`s in place (same parameters, same `state_dict` keys). The
swap happens only when fitting (evaluation runs the plain module anyway) and is
undone at teardown. A `RotorCallback` is added when the Trainer has none.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_rotor.budget import MemLimit, format_bytes
from lightning_rotor.compile import stage_compiler
from lightning_rotor.lightning.wrap import Selector, Wrapped, check_rotor_arguments, unwrap, wrap
from lightning_rotor.shapes import check_buckets


class ProfileProgress:
    """A rank-zero line while a chain's first batch is profiled, once profiling has taken over a second.

    At most one line a second, and always one when the profile ends, so a slow first step
    shows what it is doing (stage count and elapsed time).
    """

    def __init__(self, name: str, after_seconds: float = 1.0):
        self.name = name
        self.after_seconds = after_seconds
        self.shown = 0.0

    def __call__(self, done: int, total: int, seconds: float) -> None:
        if done == 1:
            self.shown = 0.0
        if seconds < self.after_seconds or (done < total and seconds - self.shown < 1.0):
            return
        self.shown = seconds
        rank_zero_info(f"rotor: profiling {self.name}: {done}/{total} stages, {seconds:.1f} s")


class _RotorMixin:
    """The rotor part shared by the single-device and DDP strategies."""

    def _init_rotor(
        self,
        mem_limit: MemLimit | Mapping[str, MemLimit],
        include: Sequence[Selector] | None,
        exclude: Sequence[Selector],
        slots: int | None,
        discover: str = "auto",
        checkpoint_modules: Sequence[str | type] | None = None,
        compile: bool | dict | None = None,
        options: bool = False,
        offload: bool | float | str = False,
        host_limit: int | str | None = None,
    ) -> None:
        check_rotor_arguments(mem_limit, slots, discover, checkpoint_modules, offload, host_limit)
        stage_compiler(compile)  # a bad compile= fails here, in one line
        self.discover = discover
        self.checkpoint_modules = None if checkpoint_modules is None else list(checkpoint_modules)
        self.mem_limit = dict(mem_limit) if isinstance(mem_limit, Mapping) else mem_limit
        self.include = None if include is None else list(include)
        self.exclude = list(exclude or ())
        self.slots = slots
        self.compile = compile
        self.options = bool(options)
        self.offload = offload
        self.host_limit = host_limit
        self.wrapped: list[Wrapped] = []
        self.not_wrapped_reason = ""
        self._warned = False

    def _add_callback(self, model: pl.LightningModule) -> None:
        from lightning_rotor.lightning.callback import RotorCallback

        trainer = getattr(model, "_trainer", None)
        if trainer is not None and not any(isinstance(c, RotorCallback) for c in trainer.callbacks):
            trainer.callbacks.insert(0, RotorCallback())

    def _wrap_model(self) -> None:
        module = self.lightning_module
        trainer = module._trainer if module is not None else None
        if module is None or trainer is None or trainer.state.fn != TrainerFn.FITTING or self.wrapped:
            return
        self.wrapped, self.not_wrapped_reason = wrap(
            module,
            self.mem_limit,
            include=self.include,
            exclude=self.exclude,
            slots=self.slots,
            discover=self.discover,
            checkpoint_modules=self.checkpoint_modules,
            compile=self.compile,
            options=self.options,
            offload=self.offload,
            host_limit=self.host_limit,
        )
        if not self.wrapped:
            if not self._warned:
                self._warned = True
                rank_zero_warn(
                    f"rotor: nothing to checkpoint, training runs without it: {self.not_wrapped_reason}. "
                    "Put the model in a submodule (self.model = ...), or name what to wrap with include=[...]."
                )
            return
        for w in self.wrapped:  # changing shapes: fewer plans (shape_buckets=...), fewer profiles (predict_shapes=True)
            w.rotor.shape_buckets = getattr(self, "shape_buckets", None)
            w.rotor.predict_shapes = getattr(self, "predict_shapes", False)
            w.rotor.fit_shapes = getattr(self, "fit_shapes", False)
        for w in self.wrapped:
            w.rotor.on_profile_progress = ProfileProgress(w.name)
            w.rotor.distributed = isinstance(self, DDPStrategy)
        budget = self.mem_limit
        if isinstance(budget, Mapping):
            total = "per-chain budgets"
        elif budget is None:
            total = "an automatic budget"
        else:
            total = f"budget {format_bytes(budget) if isinstance(budget, int) else budget}"
        parts = ", ".join(
            f"{w.name} ({len(w.rotor.stages)} stages)"
            if w.rotor.stages is not None
            else f"{w.name} ({type(w.original).__name__}, chain found on the first batch)"
            for w in self.wrapped
        )
        rank_zero_info(f"rotor: checkpointing {parts} within {total}; profiling on the first training batch")

    def _unwrap_model(self) -> None:
        if self.wrapped and self.lightning_module is not None:
            unwrap(self.lightning_module, self.wrapped)
        self.wrapped = []

    # Lightning hooks, shared by both strategies (the mixin comes first in their MRO).
    def connect(self, model: pl.LightningModule) -> None:
        super().connect(model)
        self._add_callback(model)

    def _setup_model(self, model: nn.Module) -> nn.Module:
        self._wrap_model()
        return super()._setup_model(model)

    def teardown(self) -> None:
        self._unwrap_model()
        super().teardown()


class RotorStrategy(_RotorMixin, SingleDeviceStrategy):
    """One device (CUDA with `accelerator="gpu"`, CPU otherwise) with rotor checkpointing.

    `mem_limit`: ONE activation budget for the whole model, split over its chains by
    need: None (automatic: on CUDA free memory minus parameter gradients and optimizer
    state, with a 10% margin; on CPU the no-recomputation peak), bytes, a size
    (`"6GiB"`), a fraction of the no-recomputation peak (`0.5`, `"50%"`), or
    `{name: budget}` per chain. `discover`: "auto" (the model's chain is discovered on
    the first batch; its plain Sequentials are taken as they are), "graph", "modules",
    or "sequential" (only nn.Sequential parts, as before). `checkpoint_modules`: block
    classes (classes, class paths or names) each kept whole in one stage.
    `include` / `exclude`: submodule names (globs allowed), class names or classes
    overriding what is wrapped. `slots`: the planner's memory precision (None: automatic). `compile`: True
    or a dict of torch.compile arguments compiles each stage (docs/compile.md). `device`:
    leave None to take the Trainer's accelerator and `devices`. `options`: also profile each stage's
    selective-recording option (docs/checkpointable.md, "Per-stage options"). `shape_buckets`: fewer plans over
    changing input shapes, e.g. `{1: [128, 256, 512]}`; `predict_shapes`: fewer profiles, a shape that differs
    from measured ones in one size planned from a bound of their chains (docs/checkpointable.md, "Changing shapes");
    `fit_shapes`: exact sizes without a run, a shape between measured ones whose sizes follow them.
    `offload`: also let plans copy kept activations to host memory while later stages run (False; True:
    the link's bandwidth measured at profile time; or a rate such as `"12GB/s"`); `host_limit`: the most
    host memory those copies may take at once, for the whole model (`"2GiB"`, bytes; None: no limit).
    """

    strategy_name = "rotor"

    def __init__(
        self,
        mem_limit: int | float | str | dict[str, int | float | str | None] | None = None,
        *,
        include: list[str | type] | None = None,
        exclude: list[str | type] | None = None,
        slots: int | None = None,
        discover: str = "auto",
        checkpoint_modules: list[str | type] | None = None,
        compile: bool | dict | None = None,
        options: bool = False,
        device: str | torch.device | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        shape_buckets: dict[int, list[int]] | None = None,
        predict_shapes: bool = False,
        fit_shapes: bool = False,
        offload: bool | float | str = False,
        host_limit: int | str | None = None,
    ):
        self.shape_buckets = check_buckets(shape_buckets)  # bad buckets fail here, before the Trainer
        self.predict_shapes = bool(predict_shapes)
        self.fit_shapes = bool(fit_shapes)
        super().__init__(
            device="cpu", accelerator=accelerator, checkpoint_io=checkpoint_io, precision_plugin=precision_plugin
        )
        self._init_rotor(
            mem_limit,
            include,
            exclude or (),
            slots,
            discover,
            checkpoint_modules,
            compile,
            options,
            offload,
            host_limit,
        )
        self._device = None if device is None else torch.device(device)
        self._parallel_devices: list[torch.device] = []

    # The accelerator connector fills `parallel_devices` from `accelerator=` and `devices=`
    # for strategies that have the attribute; that is how this strategy learns its device.
    @property
    def parallel_devices(self) -> list[torch.device]:
        return [self._device] if self._device is not None else self._parallel_devices

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device]) -> None:
        devices = [torch.device(d) if not isinstance(d, torch.device) else d for d in devices or []]
        if len(devices) > 1:
            raise ValueError(
                f"RotorStrategy runs on one device but the Trainer asks for {len(devices)}; "
                "use strategy='rotor_ddp' (or 'rotor_ddp_spawn') for several (FSDP2 is not supported yet: issue 27)"
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


class RotorDDPStrategy(_RotorMixin, DDPStrategy):
    """Lightning's DDP with rotor checkpointing in every process (same arguments as
    `RotorStrategy` for rotor; the rest as `DDPStrategy`). The chains are wrapped
    before DDP wraps the model, so DDP sees the same parameters; every process
    profiles and plans its own chain."""

    strategy_name = "rotor_ddp"

    def __init__(
        self,
        mem_limit: int | float | str | dict[str, int | float | str | None] | None = None,
        *,
        include: list[str | type] | None = None,
        exclude: list[str | type] | None = None,
        slots: int | None = None,
        discover: str = "auto",
        checkpoint_modules: list[str | type] | None = None,
        compile: bool | dict | None = None,
        options: bool = False,
        offload: bool | float | str = False,
        host_limit: int | str | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        ddp_comm_state: object | None = None,
        ddp_comm_hook: Callable | None = None,
        ddp_comm_wrapper: Callable | None = None,
        model_averaging_period: int | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **kwargs: Any,
    ):
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            ddp_comm_state=ddp_comm_state,
            ddp_comm_hook=ddp_comm_hook,
            ddp_comm_wrapper=ddp_comm_wrapper,
            model_averaging_period=model_averaging_period,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            **kwargs,
        )
        self._init_rotor(
            mem_limit,
            include,
            exclude or (),
            slots,
            discover,
            checkpoint_modules,
            compile,
            options,
            offload,
            host_limit,
        )

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        for name, start_method in (("rotor_ddp", "popen"), ("rotor_ddp_spawn", "spawn")):
            strategy_registry.register(
                name,
                cls,
                description=f"DDP with rotor checkpointing, start_method '{start_method}'",
                start_method=start_method,
                override=True,
            )
