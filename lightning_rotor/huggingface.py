"""Hugging Face defaults under rotor: no KV cache in training, as Hugging Face's own checkpointing does.

A causal LM's config says `use_cache=True`, so every training call would build a
`DynamicCache` that each block appends to; a recomputed block would append twice
(discovery refuses such a chain with `ChainDiverged`). Hugging Face's gradient
checkpointing (`merge_with_config_defaults` in transformers) sets `use_cache=False`
for training calls, explicit `True` included, with one warning. Rotor does the same
for the modules it checkpoints: docs/discovery.md, "Hugging Face models". A wrapper
that passes its keyword arguments on to the model it wraps (a PEFT `PeftModel`, found
through `get_base_model()`) is looked through to the forward that takes `use_cache`.
"""

from __future__ import annotations

import functools
import inspect
import warnings
import weakref
from collections.abc import Callable
from typing import Any

from torch import nn

_warned: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # modules told once that their cache is off


@functools.lru_cache(maxsize=256)
def _use_cache_parameter(forward: Callable[..., Any]) -> tuple[int | None, Any] | None:
    """Where `use_cache` sits in `forward` (index among positional arguments, or None) and its default;
    None when `forward` takes no `use_cache`."""
    try:
        params = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):
        return None
    params = [p for p in params if p.name != "self"]
    for i, p in enumerate(params):
        if p.name == "use_cache":
            positional = p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
            default = None if p.default is p.empty else p.default
            return (i if positional else None), default
    return None


def _wrapped(module: nn.Module) -> nn.Module | None:
    """The model a wrapper passes its keyword arguments on to, when its forward takes `**kwargs` and no
    `use_cache` and it says which model that is (`get_base_model()`, as PEFT's `PeftModel` does); else None."""
    base = getattr(module, "get_base_model", None)
    if not callable(base) or not _takes_var_keyword(type(module).forward):
        return None
    try:
        inner = base()
    except Exception:  # noqa: BLE001 (a wrapper that cannot say what it wraps is called as it is)
        return None
    return inner if isinstance(inner, nn.Module) and inner is not module else None


@functools.lru_cache(maxsize=256)
def _takes_var_keyword(forward: Callable[..., Any]) -> bool:
    try:
        return any(p.kind is p.VAR_KEYWORD for p in inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):
        return False


def _cache_owner(module: nn.Module) -> tuple[nn.Module, tuple[int | None, Any]] | None:
    """The module whose forward takes `use_cache` (`module`, or the model a wrapper passes keywords on to, at any
    depth) and where `use_cache` sits in it; None when none takes it."""
    seen: set[int] = set()
    current: nn.Module | None = module
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        found = _use_cache_parameter(type(current).forward)
        if found is not None:
            return current, found
        current = _wrapped(current)
    return None


def without_kv_cache(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """The arguments of a training call of `module` with `use_cache=False` where the cache would be on.

    Mirrors Hugging Face: the value passed (positionally or by name) wins over the
    config's `use_cache`, which wins over the signature's default; when that is true,
    the call gets `use_cache=False` and the module's first such call warns once.
    Modules whose forward takes no `use_cache` are called as they are, unless they
    pass their keywords on to a model that takes it (a PEFT model): the config and the
    default are then that model's, and `use_cache=False` goes in by name.
    """
    owner = _cache_owner(module)
    if owner is None:
        return args, kwargs
    inner, (index, default) = owner
    if inner is not module:
        index = None  # a wrapper's positional arguments are its own: the inner use_cache is passed by name
    if index is not None and index < len(args):
        value = args[index]
    else:
        value = kwargs.get("use_cache")
    if value is None:
        value = getattr(getattr(inner, "config", None), "use_cache", default)
    if not value:
        return args, kwargs
    if module not in _warned:
        _warned.add(module)
        within = "" if inner is module else f" (through to {type(inner).__name__})"
        warnings.warn(
            f"rotor: `use_cache=True` is incompatible with checkpointing (a recomputed block would append to "
            f"the KV cache again); training calls of {type(module).__name__}{within} run with `use_cache=False`, "
            "as Hugging Face's gradient checkpointing does",
            stacklevel=2,
        )
    if index is not None and index < len(args):
        return (*args[:index], False, *args[index + 1 :]), kwargs
    return args, {**kwargs, "use_cache": False}
