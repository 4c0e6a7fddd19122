"""Lightning face of rotor: strategies, the callback, and the LightningCLI entry point.

Importing this package registers the strategy names `"rotor"`, `"rotor_ddp"` and
`"rotor_ddp_spawn"` for `Trainer(strategy=...)` and LightningCLI.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_rotor.config import RotorConfig
from lightning_rotor.lightning.callback import RotorCallback
from lightning_rotor.lightning.strategy import RotorDDPStrategy, RotorStrategy

RotorStrategy.register_strategies(StrategyRegistry)
RotorDDPStrategy.register_strategies(StrategyRegistry)

__all__ = ["RotorCallback", "RotorConfig", "RotorDDPStrategy", "RotorStrategy"]
