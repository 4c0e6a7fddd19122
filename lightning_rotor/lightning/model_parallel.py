"""`RotorModelParallelStrategy`: Lightning's `ModelParallelStrategy` (FSDP2) with rotor's checkpointing.

Lightning calls `configure_model` between `setup_environment` and `setup`; the user's
`configure_model` applies `fully_shard` there, as Lightning documents, without checkpointing.
rotor's order under FSDP2 is `Checkpointable` first (docs/sharded.md), so this strategy wraps the
LightningModule's chains in `setup_environment`, before `configure_model`: the user shards each
block, then the wrapped model (`self.model`, now the `Checkpointable`) as the root. Every rank
profiles, the chain's figures are reduced across ranks, and every rank runs the same plan
(lightning_rotor/sharded.py).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.pytorch.strategies import ModelParallelStrategy

from lightning_rotor.config import RotorConfig
from lightning_rotor.lightning.strategy import _RotorMixin


class RotorModelParallelStrategy(_RotorMixin, ModelParallelStrategy):
    """Lightning's `ModelParallelStrategy` with rotor checkpointing on every rank (rotor's arguments as
    `RotorStrategy`'s; `data_parallel_size`, `tensor_parallel_size`, `save_distributed_checkpoint`,
    `process_group_backend`, `timeout` as `ModelParallelStrategy`'s).

    Your `configure_model` shards: `fully_shard` each block, then the wrapped model (the attribute
    holding it is a `Checkpointable` by then), e.g.
    `for b in self.model.blocks: fully_shard(b, mesh=m)` then `fully_shard(self.model, mesh=m)`,
    with `m = self.device_mesh["data_parallel"]` and `data_parallel_size=` the number of devices.
    The budget is per rank (docs/sharded.md). Tensor parallelism is refused in one line.
    """

    strategy_name = "rotor_model_parallel"

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
        data_parallel_size: Literal["auto"] | int = "auto",
        tensor_parallel_size: Literal["auto"] | int = "auto",
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ):
        settings = RotorConfig.of(config, locals())  # bad settings fail here, before the Trainer
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._init_rotor(settings)

    def setup_environment(self) -> None:
        """Wrap the chains before Lightning calls `configure_model`, where the user's `fully_shard` runs."""
        super().setup_environment()
        self._wrap_model()

    def teardown(self) -> None:
        """The chains stay wrapped: the `Checkpointable` is the FSDP root, which unwrapping would take away. Their
        own checkpointing (Hugging Face's flags, `checkpoint_wrapper`s) is turned back on, as `unwrap` does."""
        for item in self.wrapped:
            item.rotor.restore_own_checkpointing()
        self.wrapped = []
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="FSDP2 (ModelParallelStrategy) with rotor checkpointing", override=True
        )
