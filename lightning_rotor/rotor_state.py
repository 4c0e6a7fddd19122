"""Where a `Checkpointable` keeps its own attributes, apart from the wrapped module's names.

A `Checkpointable`'s children, parameters and buffers are the wrapped module's (`share_registries`), so
any name the user's model uses (`shared`, `budget`, `plan`, ...) stays the user's. Rotor's own values
live in one plain object (`RotorState`, the module's `_rotor`); the chain's plans and budgets in its
`ChainState` (lightning_rotor/chain_state.py), read through `ChainAttribute`s on the class.
`RotorModule` is the nn.Module that keeps names so (`Checkpointable`'s base).
(docs/checkpointable.md, "Your module's names".)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from lightning_rotor.chain_state import ChainState
    from lightning_rotor.own_checkpointing import OwnCheckpointing

__all__ = [
    "CHAIN_ATTRIBUTES",
    "ChainAttribute",
    "RotorAttribute",
    "RotorModule",
    "RotorState",
    "rotor_getattr",
    "rotor_setattr",
    "share_registries",
]

REGISTRIES = ("_parameters", "_buffers", "_non_persistent_buffers_set", "_modules")
ROTOR_ATTRIBUTES = ("module", "plain_module", "chain_state", "own")  # written to `_rotor` directly
# the chain state's settings, plans and budgets, read and written as the module's own (`ChainAttribute`)
CHAIN_ATTRIBUTES = """
    mem_limit _own_budget shared shared_name slots early_stop repeats warmup loss_fn loss_tmp options offload
    _offload_setting host_limit bandwidth derive_shapes predict_shapes fit_shapes shape_buckets on_profile_progress
    compiler distributed sharded discovery stages stage_names outside shared_parameters plan_cache entries budget
    predicted fitted calls last_entry last_measurement _measurement entry chain plan profile profile_seconds step_limit
    summary automatic_budget_note replan plan_state load_plan_state restore_plans budget_for_call prepare_for
    step_timed retimed
""".split()


class RotorState:
    """A `Checkpointable`'s own attributes (settings, stages, discovery, its `ChainState`), in one plain object.

    Kept apart from nn.Module's registries, which are the wrapped module's: no name the user's model
    uses for a child, parameter or buffer can meet one of rotor's.
    """

    module: nn.Module  # the wrapped module
    plain_module: nn.Module  # what eval mode and no_grad run
    compiler: Callable[[nn.Module], nn.Module] | None
    chain_state: ChainState
    own: OwnCheckpointing


class RotorAttribute:
    """A class attribute reading rotor's attribute `name` from `_rotor` (a dict lookup, not nn.Module's
    `__getattr__` after a failed lookup); where this instance has none, the wrapped module's child,
    parameter or buffer of that name is read, as nn.Module does."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        try:
            return obj.__dict__["_rotor"].__dict__[self.name]
        except KeyError:
            return nn.Module.__getattr__(obj, self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(obj, self.name, value)  # the class's `__setattr__`: into `_rotor`, or the user's registries


class ChainAttribute:
    """A class attribute reading and writing attribute `name` of the module's `ChainState` (plans, budgets,
    the settings they are made with): `ck.budget`, `ck.plan`, `ck.replan(...)` are the chain state's."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        return getattr(obj.__dict__["_rotor"].__dict__["chain_state"], self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(obj.__dict__["_rotor"].__dict__["chain_state"], self.name, value)


def rotor_getattr(obj: nn.Module, name: str) -> Any:
    """Rotor's attribute `name`, else the wrapped module's child, parameter or buffer of that name."""
    state = obj.__dict__.get("_rotor")
    if state is not None and name in state.__dict__:
        return state.__dict__[name]
    return nn.Module.__getattr__(obj, name)


def rotor_setattr(obj: nn.Module, name: str, value: Any) -> None:
    """A plain value is rotor's (kept in `_rotor`, whatever the wrapped module names), or its chain state's where
    the class says so (`ChainAttribute`); a module or a tensor is the user's, registered in the wrapped module's
    registries as nn.Module does; nn.Module's own attributes stay where nn.Module keeps them."""
    state = obj.__dict__.get("_rotor")
    if name == "__class__" or isinstance(getattr(type(obj), name, None), ChainAttribute):  # fully_shard: the class
        object.__setattr__(obj, name, value)
        return
    if state is None or name in obj.__dict__ or isinstance(value, (nn.Module, torch.Tensor)):
        nn.Module.__setattr__(obj, name, value)
        return
    state.__dict__[name] = value
    if not hasattr(type(obj), name):  # read fast from now on, by every instance of the class (`RotorAttribute`)
        setattr(type(obj), name, RotorAttribute(name))


def share_registries(owner: nn.Module, module: nn.Module) -> None:
    """`owner`'s children, parameters and buffers are `module`'s: the same dicts, so the same objects under
    the same names (`state_dict` keys, `parameters()`), whatever those names are; nothing is re-registered."""
    for registry in REGISTRIES:
        object.__setattr__(owner, registry, module.__dict__[registry])


class RotorModule(nn.Module):
    """An nn.Module whose own attributes live in `_rotor` (`RotorState`) and its `ChainState`, apart from the
    wrapped module's children, parameters and buffers, which are its registries (`share_registries`)."""

    def __init__(self, module: nn.Module, state: RotorState) -> None:
        object.__setattr__(self, "_rotor", state)  # before any attribute: see `__setattr__`
        super().__init__()
        share_registries(self, module)
        state.module = module

    def __getattr__(self, name: str) -> Any:
        """Rotor's attribute `name`, else the wrapped module's child, parameter or buffer of that name."""
        return rotor_getattr(self, name)

    def __setattr__(self, name: str, value: Any) -> None:
        """Rotor's attribute, its chain state's, or the user's module or tensor (`rotor_setattr`)."""
        rotor_setattr(self, name, value)

    def __delattr__(self, name: str) -> None:
        state = self.__dict__.get("_rotor")
        if state is not None and name in state.__dict__:
            delattr(state, name)
        else:
            super().__delattr__(name)


for _name in ROTOR_ATTRIBUTES:
    setattr(RotorModule, _name, RotorAttribute(_name))
for _name in CHAIN_ATTRIBUTES:
    setattr(RotorModule, _name, ChainAttribute(_name))
