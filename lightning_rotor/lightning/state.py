"""Profiled chains and plans inside Lightning checkpoints.

`checkpoint["rotor"]` maps each rotor module's name (its path in the
LightningModule) to its stage names and `Checkpointable.plan_state()`: the
budget and its `PlanCache`'s state (per input signature, the chain and the plan). All of it is plain
data (lists, dicts, strings, numbers), so checkpoints load with
`weights_only=True`, and a Trainer without rotor ignores the key. Restoring
puts the chains back, so resuming with the same shapes skips profiling. When
the module's budget now resolves to different bytes than the saved one, the
saved chains are re-planned for the new budget (`Checkpointable.restore_plans`;
planning is cheap, profiling is what is skipped).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from torch import nn

from lightning_rotor.chain import ChainError
from lightning_rotor.checkpointable import Checkpointable
from lightning_rotor.planner import InfeasibleBudget

STATE_KEY = "rotor"
STATE_VERSION = 1


def rotor_modules(model: nn.Module) -> dict[str, Checkpointable]:
    """Every `Checkpointable` in `model` by name, outermost only."""
    found: dict[str, Checkpointable] = {}
    for name, module in model.named_modules():
        if isinstance(module, Checkpointable) and not any(name.startswith(p + ".") for p in found):
            found[name] = module
    return found


def export_state(model: nn.Module) -> dict[str, Any]:
    """What `checkpoint["rotor"]` holds for the rotor modules of `model`."""
    modules = {
        name: {"stages": list(rotor.stage_names), **rotor.plan_state()} for name, rotor in rotor_modules(model).items()
    }
    return {"version": STATE_VERSION, "modules": modules}


def _restore_one(rotor: Checkpointable, saved: dict[str, Any]) -> None:
    rotor.restore_plans(saved)  # loads, then plans again where the budget now resolves differently


def _restore_after_discovery(name: str, saved: dict[str, Any]) -> Callable[[Checkpointable], None]:
    """Put a discovered chain's saved plans back once discovery has found its stages again."""

    def restore(rotor: Checkpointable) -> None:
        if list(saved.get("stages", [])) != list(rotor.stage_names):
            warnings.warn(
                f"rotor: {name}: the checkpoint's stages differ from the ones found now; it will be profiled again",
                stacklevel=2,
            )
            return
        try:
            _restore_one(rotor, saved)
        except InfeasibleBudget:
            raise
        except (ChainError, KeyError, TypeError, ValueError, AttributeError, IndexError) as err:
            warnings.warn(f"rotor: {name}: saved plan state not used ({err}); it will be profiled again", stacklevel=2)

    return restore


def import_state(model: nn.Module, state: Any) -> tuple[list[str], list[str]]:
    """Put saved chains and plans into the rotor modules of `model`.

    Returns (restored names, reasons for what was not restored); a saved chain
    whose stages differ from the module's is skipped, never forced in.
    """
    if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
        version = state.get("version") if isinstance(state, dict) else state
        return [], [f"checkpoint: unknown rotor state version {version!r} (this release reads {STATE_VERSION})"]
    restored, problems = [], []
    modules = rotor_modules(model)
    saved_modules = state.get("modules") or {}
    if not isinstance(saved_modules, dict):
        return [], [f"checkpoint: malformed rotor state (modules is a {type(saved_modules).__name__}, not a mapping)"]
    for name, saved in saved_modules.items():
        rotor = modules.get(name)
        if rotor is None:
            problems.append(f"{name}: no rotor module of that name in this model")
        elif not isinstance(saved, dict) or not isinstance(saved.get("stages", []), list):
            problems.append(f"{name}: malformed saved plan state; it will be profiled again")
        elif rotor.stages is None and saved.get("stages"):
            rotor.on_discovered = _restore_after_discovery(name, saved)  # stages are known after the first call
            restored.append(name)
        elif list(saved.get("stages", [])) != list(rotor.stage_names):
            problems.append(f"{name}: the checkpoint's stages differ from the model's; it will be profiled again")
        else:
            try:
                _restore_one(rotor, saved)
            except InfeasibleBudget:
                raise  # the budget now asked for cannot be met: fail as a fresh run does
            except (ChainError, KeyError, TypeError, ValueError, AttributeError, IndexError) as err:
                problems.append(f"{name}: saved plan state not used ({err}); it will be profiled again")
                continue
            restored.append(name)
    return restored, problems
