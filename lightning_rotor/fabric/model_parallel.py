"""`RotorFabricModelParallelStrategy`: Fabric's `ModelParallelStrategy` (FSDP2) with rotor's checkpointing.

Fabric's strategy applies the user's `parallelize_fn(module, device_mesh)` in `setup_module`. rotor's order
under FSDP2 is `Checkpointable` first (docs/sharded.md), so this strategy wraps the module in a
`Checkpointable` and hands that to `parallelize_fn`, which shards each block and then the module it was
given (the `Checkpointable`) as the root. The budget is per rank, and every rank runs the same plan.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import ModelParallelStrategy
from torch import nn

from lightning_rotor.budget import MemLimit
from lightning_rotor.checkpointable import Checkpointable


class RotorFabricModelParallelStrategy(ModelParallelStrategy):
    """Fabric's `ModelParallelStrategy` with rotor checkpointing on every rank.

    `parallelize_fn(module, device_mesh)` gets the `Checkpointable` around your module: `fully_shard` each
    block (`module.model.layers`, `module.blocks`: the wrapped module's names), then `module` itself, and
    return it. `mem_limit` and `rotor` (keyword arguments of `Checkpointable`: `discover`, `slots`,
    `loss_fn`, ...) set rotor; the rest is `ModelParallelStrategy`'s. `strategy.rotor` is the wrapped module
    once set up (its `summary()`, `plan`, `chain`). Not registered by name: like Fabric's own
    `ModelParallelStrategy`, it needs `parallelize_fn`.
    """

    def __init__(
        self,
        parallelize_fn: Callable[[nn.Module, Any], nn.Module],
        mem_limit: MemLimit = None,
        *,
        rotor: dict[str, Any] | None = None,
        data_parallel_size: Literal["auto"] | int = "auto",
        tensor_parallel_size: Literal["auto"] | int = "auto",
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ):
        super().__init__(
            parallelize_fn,
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.mem_limit = mem_limit
        self.rotor_arguments = dict(rotor or {})
        self.rotor: Checkpointable | None = None

    def setup_module(self, module: nn.Module) -> nn.Module:
        """`module` in a `Checkpointable` (a bad setting fails here, in one line), then `parallelize_fn` on it."""
        if not isinstance(module, Checkpointable):
            module = Checkpointable(module, self.mem_limit, **self.rotor_arguments)
        self.rotor = module
        return super().setup_module(module)
