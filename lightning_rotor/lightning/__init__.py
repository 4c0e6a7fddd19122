"""Lightning face of rotor: strategies, the callback, and the LightningCLI entry point.

Importing this package registers the strategy names `"rotor"`, `"rotor_ddp"`,
`"rotor_ddp_spawn"` and `"rotor_model_parallel"` (FSDP2) for `Trainer(strategy=...)` and LightningCLI.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_rotor.config import RotorConfig
from lightning_rotor.lightning.callback import RotorCallback
from lightning_rotor.lightning.model_parallel import RotorModelParallelStrategy
from lightning_rotor.lightning.strategy import RotorDDPStrategy, RotorStrategy

RotorStrategy.register_strategies(StrategyRegistry)
RotorDDPStrategy.register_strategies(StrategyRegistry)
RotorModelParallelStrategy.register_strategies(StrategyRegistry)

__all__ = ["RotorCallback", "RotorConfig", "RotorDDPStrategy", "RotorModelParallelStrategy", "RotorStrategy"]
