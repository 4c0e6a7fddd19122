"""lightning_rotor: optimal activation checkpointing (rotor) for PyTorch and Lightning.

The flow of one training run: a chain's stages are profiled into a `Chain`,
`plan` finds the fastest schedule within a budget, and `Checkpointable`
executes it. `RotorStrategy` does all of that for a LightningModule.

Names are imported on first use, so `import lightning_rotor` (and the `plan`
command) loads neither torch nor Lightning, matplotlib or TensorBoard. It does
register the strategy names `"rotor"`, `"rotor_ddp"` and `"rotor_ddp_spawn"` for
`Trainer(strategy=...)`, and `"rotor"` for `Fabric(strategy=...)`: at once if Lightning
is loaded, else as soon as it is.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lightning_rotor import _autoregister

# `simulate` is also a submodule's name: importing `lightning_rotor.simulate` (the planner does)
# binds the module over a lazily resolved function, so the simulator's names (no torch) bind now.
from lightning_rotor.simulate import Simulation, no_recompute_peak, simulate

__version__ = "0.2.0"

_HOMES = {
    "BudgetError": "budget",
    "format_bytes": "budget",
    "parse_budget": "budget",
    "Chain": "chain",
    "ChainError": "chain",
    "Checkpointable": "checkpointable",
    "RotorConfig": "config",
    "ChainDiverged": "discovery",
    "DiscoveryError": "discovery",
    "GuardFailed": "discovery",
    "ValueBranch": "discovery",
    "discover": "discovery",
    "discover_chain": "discovery",
    "RotorCallback": "lightning",
    "RotorDDPStrategy": "lightning",
    "RotorFabricStrategy": "fabric",
    "RotorStrategy": "lightning",
    "CudaMemoryProbe": "memory",
    "MemoryProbe": "memory",
    "Op": "ops",
    "OpKind": "ops",
    "InfeasibleBudget": "planner",
    "Plan": "planner",
    "min_feasible_budget": "planner",
    "plan": "planner",
    "InplaceError": "engine",
    "InfeasibleTotal": "shared_budget",
    "Stages": "stages",
}

__all__ = [
    "BudgetError",
    "Chain",
    "ChainDiverged",
    "ChainError",
    "Checkpointable",
    "CudaMemoryProbe",
    "DiscoveryError",
    "GuardFailed",
    "InfeasibleBudget",
    "InfeasibleTotal",
    "InplaceError",
    "MemoryProbe",
    "Op",
    "OpKind",
    "Plan",
    "RotorCallback",
    "RotorConfig",
    "RotorDDPStrategy",
    "RotorFabricStrategy",
    "RotorStrategy",
    "Simulation",
    "Stages",
    "ValueBranch",
    "discover",
    "discover_chain",
    "format_bytes",
    "min_feasible_budget",
    "no_recompute_peak",
    "parse_budget",
    "plan",
    "simulate",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'lightning_rotor' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"lightning_rotor.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])


_autoregister.install()


if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from lightning_rotor.budget import BudgetError, format_bytes, parse_budget
    from lightning_rotor.chain import Chain, ChainError
    from lightning_rotor.checkpointable import Checkpointable
    from lightning_rotor.config import RotorConfig
    from lightning_rotor.discovery import (
        ChainDiverged,
        DiscoveryError,
        GuardFailed,
        ValueBranch,
        discover,
        discover_chain,
    )
    from lightning_rotor.engine import InplaceError
    from lightning_rotor.fabric import RotorFabricStrategy
    from lightning_rotor.lightning import RotorCallback, RotorDDPStrategy, RotorStrategy
    from lightning_rotor.memory import CudaMemoryProbe, MemoryProbe
    from lightning_rotor.ops import Op, OpKind
    from lightning_rotor.planner import InfeasibleBudget, Plan, min_feasible_budget, plan
    from lightning_rotor.shared_budget import InfeasibleTotal
    from lightning_rotor.stages import Stages
