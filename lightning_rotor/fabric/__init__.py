"""Lightning Fabric face of rotor: `RotorFabricStrategy`, registered as `Fabric(strategy="rotor")`.

`import lightning_rotor` registers the name lazily as soon as Lightning Fabric is
imported (`lightning_rotor._autoregister`); importing this package registers the class
itself. docs/fabric.md shows a training loop. `RotorFabricModelParallelStrategy`: FSDP2 (docs/sharded.md).
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY

from lightning_rotor.fabric.model_parallel import RotorFabricModelParallelStrategy
from lightning_rotor.fabric.strategy import RotorFabricStrategy

RotorFabricStrategy.register_strategies(STRATEGY_REGISTRY)

__all__ = ["RotorFabricModelParallelStrategy", "RotorFabricStrategy"]
