"""Refusing FSDP2-sharded models: rotor's executor does not compose with `fully_shard` yet (docs/sharded.md).

FSDP2 keeps each unit's parameters as sharded DTensors outside its own forward and runs
its reshard / reduce-scatter at the end of every backward engine call; rotor calls
stages outside their unit's hooks and runs backwards of its own (profiling, recomputation),
so today a sharded model fails deep inside torch or inside discovery. This says so in one line.
"""

from __future__ import annotations

import torch
from torch import nn

FSDP2_WAY_OUT = "train it with fully_shard without rotor, or with rotor under DDP (issue 27, docs/sharded.md)"


def sharded_by_fsdp2(module: nn.Module) -> str | None:
    """The name of the first `fully_shard`ed module or DTensor parameter in `module`, or None."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    # names are looked up only once something is found
    if any(isinstance(sub, FSDPModule) for sub in module.modules()):
        name = next(n for n, sub in module.named_modules() if isinstance(sub, FSDPModule))
        return f"module {name or type(module).__name__!r} is fully_shard'ed"
    if any(isinstance(p, DTensor) for p in module.parameters()):
        name = next(n for n, p in module.named_parameters() if isinstance(p, DTensor))
        return f"parameter {name!r} is a DTensor"
    return None


def refuse_fsdp2(module: nn.Module) -> None:
    """Raise before any profile, plan or optimizer step when `module` is sharded by FSDP2.

    `Checkpointable` asks on each training call until its first plan exists (a few hundred
    microseconds over a model's modules and parameters), not on every step after it."""
    where = sharded_by_fsdp2(module)
    if where is not None:
        raise NotImplementedError(f"rotor does not support FSDP2 yet ({where}): {FSDP2_WAY_OUT}")
