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
from lightning_rotor.config import FIELDS, RotorConfig


class RotorFabricModelParallelStrategy(ModelParallelStrategy):
    """Fabric's `ModelParallelStrategy` with rotor checkpointing on every rank.

    `parallelize_fn(module, device_mesh)` gets the `Checkpointable` around your module: `fully_shard` each
    block (`module.model.layers`, `module.blocks`: the wrapped module's names), then `module` itself, and
    return it. `mem_limit` and rotor's other settings (`RotorConfig`'s fields as keyword arguments, or one
    `config=`; `include`/`exclude` excepted: the whole module is the chain) set rotor; the rest is
    `ModelParallelStrategy`'s. `strategy.rotor` is the wrapped module
    once set up (its `summary()`, `plan`, `chain`). Not registered by name: like Fabric's own
    `ModelParallelStrategy`, it needs `parallelize_fn`.
    """

    def __init__(
        self,
        parallelize_fn: Callable[[nn.Module, Any], nn.Module],
        mem_limit: MemLimit = None,
        *,
        config: RotorConfig | None = None,
        data_parallel_size: Literal["auto"] | int = "auto",
        tensor_parallel_size: Literal["auto"] | int = "auto",
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        **settings: Any,
    ):
        unknown = sorted(set(settings) - set(FIELDS))
        if unknown:
            raise TypeError(f"RotorFabricModelParallelStrategy got unknown setting(s) {unknown}; rotor's: {FIELDS}")
        self.config = RotorConfig.of(config, {"mem_limit": mem_limit, **settings})  # bad settings fail here
        super().__init__(
            parallelize_fn,
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.rotor: Checkpointable | None = None

    def setup_module(self, module: nn.Module) -> nn.Module:
        """`module` in a `Checkpointable` (a bad setting fails here, in one line), then `parallelize_fn` on it."""
        if not isinstance(module, Checkpointable):
            module = Checkpointable(module, config=self.config)
        self.rotor = module
        return super().setup_module(module)

    def restore_own_checkpointing(self) -> None:
        """The model's own checkpointing (Hugging Face's flags, `checkpoint_wrapper`s) that rotor turned off, back
        on. Fabric has no end of training to do it at: call this, or `teardown()`, when done. The module stays
        wrapped: the `Checkpointable` is the FSDP root, as under the Trainer's strategy."""
        if self.rotor is not None:
            self.rotor.restore_own_checkpointing()

    def teardown(self) -> None:
        """The model's own checkpointing back on, as the Trainer's `RotorModelParallelStrategy` does at the end of
        a fit; then Fabric's teardown."""
        self.restore_own_checkpointing()
        super().teardown()
