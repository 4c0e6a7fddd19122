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

from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy, Strategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_rotor.budget import format_bytes
from lightning_rotor.config import FIELDS, RotorConfig
from lightning_rotor.lightning.wrap import Wrapped, unwrap, wrap


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


def budget_words(mem_limit: Any) -> str:
    """The budget as the line that starts training tells it ("within ...")."""
    if isinstance(mem_limit, Mapping):
        return "per-chain budgets"
    if mem_limit is None:
        return "an automatic budget"
    return f"budget {format_bytes(mem_limit) if isinstance(mem_limit, int) else mem_limit}"


class ConfigAttributes:
    """A strategy's rotor settings read as its attributes too (`strategy.mem_limit`, as before `config=`)."""

    config: RotorConfig

    def __getattr__(self, name: str) -> Any:
        config = self.__dict__.get("config")
        if config is not None and name in FIELDS:
            return getattr(config, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


if TYPE_CHECKING:  # the mixin is always combined with a Lightning strategy (first in the MRO)
    _StrategyBase = Strategy
else:
    _StrategyBase = object


class _RotorMixin(ConfigAttributes, _StrategyBase):
    """The rotor part shared by the single-device and DDP strategies."""

    def _init_rotor(self, config: RotorConfig) -> None:
        self.config = config
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
        distributed = isinstance(self, DDPStrategy)
        self.wrapped, self.not_wrapped_reason = wrap(module, config=self.config, distributed=distributed)
        if not self.wrapped:
            if not self._warned:
                self._warned = True
                rank_zero_warn(
                    f"rotor: nothing to checkpoint, training runs without it: {self.not_wrapped_reason}. "
                    "Put the model in a submodule (self.model = ...), or name what to wrap with include=[...]."
                )
            return
        for w in self.wrapped:
            w.rotor.on_profile_progress = ProfileProgress(w.name)  # a hook, not a setting
        parts = ", ".join(
            f"{w.name} ({len(w.rotor.stages)} stages)"
            if w.rotor.stages is not None
            else f"{w.name} ({type(w.original).__name__}, chain found on the first batch)"
            for w in self.wrapped
        )
        total = budget_words(self.config.mem_limit)
        rank_zero_info(f"rotor: checkpointing {parts} within {total}; profiling on the first training batch")

    def _unwrap_model(self) -> None:
        if self.wrapped and self.lightning_module is not None:
            unwrap(self.lightning_module, self.wrapped)
        self.wrapped = []

    # Lightning hooks, shared by both strategies (the mixin comes first in their MRO); each wraps in `_setup_model`.
    def connect(self, model: pl.LightningModule) -> None:
        super().connect(model)
        self._add_callback(model)

    def teardown(self) -> None:
        self._unwrap_model()
        super().teardown()


class RotorStrategy(_RotorMixin, SingleDeviceStrategy):
    """One device (CUDA with `accelerator="gpu"`, CPU otherwise) with rotor checkpointing.

    The rotor settings are `RotorConfig`'s (lightning_rotor/config.py documents each), as `config=` or as
    keyword arguments (what LightningCLI's `init_args` give). `mem_limit`: ONE activation budget for the
    whole model, split over its chains by need: None (automatic: on CUDA free memory minus parameter
    gradients and optimizer state, with a 10% margin; on CPU the no-recomputation peak), bytes, a size
    (`"6GiB"`), a fraction of the no-recomputation peak (`0.5`, `"50%"`), or `{name: budget}` per chain.
    `discover` ("auto": the model's chain is discovered on the first batch, its plain Sequentials taken as
    they are), `checkpoint_modules` (classes, class paths or names), `include` / `exclude` choose what is
    wrapped (docs/lightning.md); `host_limit` is the whole model's. `device`: leave None to take the
    Trainer's accelerator and `devices`.
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
        device: str | torch.device | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ):
        settings = RotorConfig.of(config, locals())  # bad settings fail here, before the Trainer
        super().__init__(
            device="cpu", accelerator=accelerator, checkpoint_io=checkpoint_io, precision_plugin=precision_plugin
        )
        self._init_rotor(settings)
        self._device = None if device is None else torch.device(device)
        self._parallel_devices: list[torch.device] = []

    def _setup_model(self, model: nn.Module) -> nn.Module:
        self._wrap_model()  # on its device, when fitting
        return super()._setup_model(model)

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
                "use strategy='rotor_ddp' (or 'rotor_ddp_spawn') for several "
                "(FSDP2: 'rotor_model_parallel', docs/sharded.md)"
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
        settings = RotorConfig.of(config, locals())  # bad settings fail here, before the Trainer
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
        self._init_rotor(settings)

    def _setup_model(self, model: nn.Module) -> DistributedDataParallel:
        self._wrap_model()  # on its device, before DDP wraps the model, when fitting
        return super()._setup_model(model)

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
