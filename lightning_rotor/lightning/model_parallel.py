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

from collections.abc import Mapping
from datetime import timedelta
from typing import Literal

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.pytorch.strategies import ModelParallelStrategy

from lightning_rotor.budget import MemLimit
from lightning_rotor.lightning.strategy import _RotorMixin
from lightning_rotor.lightning.wrap import Selector
from lightning_rotor.shapes import check_buckets


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
        mem_limit: MemLimit | Mapping[str, MemLimit] = None,
        *,
        include: list[Selector] | None = None,
        exclude: list[Selector] | None = None,
        slots: int | None = None,
        discover: str = "auto",
        checkpoint_modules: list[str | type] | None = None,
        compile: bool | dict | None = None,
        options: bool = False,
        shape_buckets: dict[int, list[int]] | None = None,
        predict_shapes: bool = False,
        fit_shapes: bool = False,
        offload: bool | float | str = False,
        host_limit: int | str | None = None,
        data_parallel_size: Literal["auto"] | int = "auto",
        tensor_parallel_size: Literal["auto"] | int = "auto",
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ):
        self.shape_buckets = check_buckets(shape_buckets)
        self.predict_shapes = bool(predict_shapes)
        self.fit_shapes = bool(fit_shapes)
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
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

    def setup_environment(self) -> None:
        """Wrap the chains before Lightning calls `configure_model`, where the user's `fully_shard` runs."""
        super().setup_environment()
        self._wrap_model()

    def teardown(self) -> None:
        """The chains stay wrapped: the `Checkpointable` is the FSDP root, which unwrapping would take away."""
        self.wrapped = []
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="FSDP2 (ModelParallelStrategy) with rotor checkpointing", override=True
        )
