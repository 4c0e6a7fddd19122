"""lightning_rotor: optimal activation checkpointing (rotor) for PyTorch and Lightning.

The flow of one training run: a chain's stages are profiled into a `Chain`,
`plan` finds the fastest schedule within a budget, and `Checkpointable`
executes it. `RotorStrategy` does all of that for a LightningModule's
`nn.Sequential` parts. Importing this package registers the strategy names
`"rotor"`, `"rotor_ddp"` and `"rotor_ddp_spawn"` for `Trainer(strategy=...)`.
"""

from lightning_rotor.budget import BudgetError, format_bytes, parse_budget
from lightning_rotor.chain import Chain, ChainError
from lightning_rotor.checkpointable import Checkpointable
from lightning_rotor.lightning import RotorCallback, RotorDDPStrategy, RotorStrategy
from lightning_rotor.memory import CudaMemoryProbe, MemoryProbe
from lightning_rotor.planner import InfeasibleBudget, Plan, min_feasible_budget, plan
from lightning_rotor.profile import InplaceError
from lightning_rotor.simulate import Simulation, simulate

__version__ = "0.1.0"

__all__ = [
    "BudgetError",
    "Chain",
    "ChainError",
    "Checkpointable",
    "CudaMemoryProbe",
    "InfeasibleBudget",
    "InplaceError",
    "MemoryProbe",
    "Plan",
    "RotorCallback",
    "RotorDDPStrategy",
    "RotorStrategy",
    "Simulation",
    "format_bytes",
    "min_feasible_budget",
    "parse_budget",
    "plan",
    "simulate",
]
