"""Which parts of a model rotor takes over, and with what budget.

Policy (docs/lightning.md, docs/discovery.md):

- `discover="sequential"`: candidates are `nn.Sequential` submodules whose `forward` is
  `nn.Sequential.forward` with at least two stages once nested Sequentials are
  flattened; the outermost are wrapped;
- `discover="auto"` (the default), `"graph"`, `"modules"`: the outermost
  submodules that are either such a Sequential or a module of a class of your own
  (not torch's) with parameters; the latter's chain is discovered on its first training
  call (the whole forward with `"graph"`, a run of blocks with `"modules"`, the better of
  the two that works with `"auto"`). With `"auto"`, a Sequential of fewer than
  `MIN_AUTO_STAGES` stages (a classifier head) is not wrapped on its own beside
  another chain;
- an encoder-decoder found so (its `get_encoder()` and `get_decoder()` two disjoint submodules, as
  Hugging Face's) is wrapped as its encoder and its decoder, two chains under the one budget;
- `include` (names, globs or classes) replaces the search: exactly the matching
  submodules are wrapped; `exclude` removes matches and everything below them;
- one budget for all chains (`lightning_rotor.shared_budget`): each chain's minimum
  first, the rest in proportion to need; a dict `{name: budget}` sets each chain's
  budget itself;
- offloading (`offload=`, `host_limit=`): every chain may offload; a host limit is
  the whole model's, split evenly over its chains (their host copies can be alive at
  once: a chain's offloaded values wait for its backward while later chains run).

Wrapping swaps a `Checkpointable` in where the module stood: same parameter objects,
same `state_dict` keys. `unwrap` puts the user's modules back. The settings are one
`RotorConfig` (lightning_rotor/config.py); `chain_configs` derives each chain's own from it,
and each `Checkpointable` is built complete (its share of the one budget, `distributed`).
"""

from __future__ import annotations

import fnmatch
import importlib
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from lightning_rotor import own_checkpointing, step_outside
from lightning_rotor.budget import MemLimit, Offload
from lightning_rotor.checkpointable import Checkpointable
from lightning_rotor.compile import compiled_inner
from lightning_rotor.config import FIELDS, RotorConfig, check_discover, check_offload
from lightning_rotor.shared_budget import Budget
from lightning_rotor.stages import sequential_stages

Selector = str | type
MIN_AUTO_STAGES = 4  # "auto" leaves a shorter Sequential (a head) alone beside another chain


@dataclass
class Wrapped:
    """One swapped-in chain: where it stands, what stood there, and the rotor module."""

    name: str
    original: nn.Module
    rotor: Checkpointable


def is_candidate(module: nn.Module) -> bool:
    """A plain `nn.Sequential` (no custom forward) with at least two stages."""
    return _stage_count(module) >= 2


def _stage_count(module: nn.Module) -> int:
    if not isinstance(module, nn.Sequential) or type(module).forward is not nn.Sequential.forward:
        return 0
    try:
        return len(sequential_stages(module))
    except ValueError:
        return 0


def is_user_model(module: nn.Module) -> bool:
    """A module of a class of the user's own (not torch's, not a container) with parameters: a model to discover."""
    cls = type(module)
    if cls.__module__.startswith("torch.") or isinstance(
        module, (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)
    ):
        return False
    return any(True for _ in module.parameters())


def encoder_decoder(module: nn.Module) -> list[str]:
    """The names of an encoder-decoder's encoder and decoder inside `module` (its `get_encoder()` and
    `get_decoder()`, as Hugging Face models give them), when they are two disjoint submodules with parameters:
    wrapped as two chains, both stacks are checkpointed (docs/discovery.md, "Side inputs and several chains")."""
    stacks = [getattr(module, method, None) for method in ("get_encoder", "get_decoder")]
    if not all(callable(get) for get in stacks):
        return []
    try:
        encoder, decoder = (get() for get in stacks)  # type: ignore[misc]  # callable, checked above
    except (AttributeError, NotImplementedError, TypeError, ValueError):
        return []
    names = {id(m): n for n, m in module.named_modules() if n}
    found = [names.get(id(encoder)), names.get(id(decoder))]
    first, second = found
    if first is None or second is None or first == second:
        return []
    if first.startswith(second + ".") or second.startswith(first + "."):
        return []
    return [first, second] if is_user_model(encoder) and is_user_model(decoder) else []


def _matches(name: str, module: nn.Module, selectors: Sequence[Selector]) -> bool:
    for sel in selectors:
        if isinstance(sel, type):
            if isinstance(module, sel):
                return True
        elif fnmatch.fnmatchcase(name, sel) or type(module).__name__ == sel:
            return True
    return False


def find_chains(
    model: nn.Module,
    include: Sequence[Selector] | None = None,
    exclude: Sequence[Selector] | None = (),
    discover: str = "sequential",
) -> tuple[list[tuple[str, nn.Module]], str]:
    """The submodules to wrap (outermost first, in module order) and, when none, why not."""
    check_discover(discover)
    exclude = exclude or ()
    found: list[tuple[str, nn.Module]] = []
    skipped: set[str] = set()
    seen_sequential = 0
    for name, stands in model.named_modules():
        if not name or any(name.startswith(p + ".") for p in skipped):
            continue
        module = compiled_inner(stands) or stands  # torch.compile(submodule): judged by what it compiles
        if isinstance(module, Checkpointable):
            skipped.add(name)  # already rotor's (wrapped by hand)
            continue
        seen_sequential += isinstance(module, nn.Sequential)
        if exclude and _matches(name, module, exclude):
            skipped.add(name)  # excluded, with everything below it
            continue
        if not _chosen(name, module, include, discover):
            continue
        stacks = encoder_decoder(module) if include is None and not _plain(module) else []
        if stacks:  # its encoder and decoder: two chains, one budget
            found.extend((f"{name}.{stack}", module.get_submodule(stack)) for stack in stacks)
        else:
            found.append((name, stands))  # a compiled one is swapped whole: its stages compiled alike (compile.py)
        skipped.add(name)
    if discover == "auto" and include is None and len(found) > 1:
        big = [(n, m) for n, m in found if not 2 <= _stage_count(m) < MIN_AUTO_STAGES]
        found = big or found  # a head is wrapped only when it is all there is
    return (found, "") if found else ([], _why_none(model, include, discover, seen_sequential))


def _plain(module: nn.Module) -> bool:
    return isinstance(module, nn.Sequential) and type(module).forward is nn.Sequential.forward


def _chosen(name: str, module: nn.Module, include: Sequence[Selector] | None, discover: str) -> bool:
    """Whether `module` (not excluded) is wrapped: it matches `include`, or without one it is a candidate of the
    policy (module docstring). A match rotor cannot wrap is one clear error."""
    if include is None:
        return is_candidate(module) or (discover != "sequential" and is_user_model(module))
    if not _matches(name, module, include):
        return False
    if discover == "sequential" and not _plain(module):
        raise TypeError(
            f"include matched {name!r}, a {type(module).__name__}; with discover='sequential' "
            "rotor wraps plain nn.Sequential modules only (discover='auto' takes any model)"
        )
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        raise TypeError(
            f"include matched {name!r}, a {type(module).__name__}, which is never called; name "
            "the module whose forward loops over it, or its block class in checkpoint_modules"
        )
    return True


def _why_none(model: nn.Module, include: Sequence[Selector] | None, discover: str, seen_sequential: int) -> str:
    """Why `find_chains` found nothing to wrap in `model`, in one line."""
    cls = type(model).__name__
    if include is not None:
        return f"no submodule of {cls} matches include={list(include)!r}"
    if seen_sequential:
        why = (
            f"{cls} has {seen_sequential} nn.Sequential submodule(s) but none is a plain Sequential with at least "
            "two stages outside `exclude`"
        )
    else:
        why = f"{cls} has no nn.Sequential submodule"
    if discover != "sequential":
        why += " and no submodule of a class of your own with parameters to discover a chain in"
    return why


def resolve_block_types(model: nn.Module, checkpoint_modules: Sequence[str | type] | None) -> tuple[type, ...] | None:
    """Classes from `checkpoint_modules` (classes, dotted class paths, or class names found in `model`)."""
    if not checkpoint_modules:
        return None
    here = {type(m).__name__: type(m) for m in model.modules()}
    types: list[type] = []
    for item in checkpoint_modules:
        if isinstance(item, type):
            types.append(item)
        elif isinstance(item, str) and item in here:
            types.append(here[item])
        elif isinstance(item, str) and "." in item:
            module_name, _, cls_name = item.rpartition(".")
            try:
                types.append(getattr(importlib.import_module(module_name), cls_name))
            except (ImportError, AttributeError):
                raise ValueError(f"checkpoint_modules: cannot import {item!r}") from None
        else:
            own = sorted(n for n, c in here.items() if not c.__module__.startswith("torch."))
            raise ValueError(
                f"checkpoint_modules names {item!r}, which is no class of a submodule of "
                f"{type(model).__name__}; give a class, a class path, or one of: {', '.join(own)}"
            )
    if not all(isinstance(t, type) and issubclass(t, nn.Module) for t in types):
        raise TypeError(f"checkpoint_modules must name nn.Module classes, got {types!r}")
    return tuple(types)


def check_budget_names(mem_limit: Mapping[str, MemLimit], names: Sequence[str]) -> None:
    """A per-chain budget dict must name exactly the wrapped chains."""
    unknown = sorted(set(mem_limit) - set(names))
    if unknown:
        raise ValueError(f"mem_limit names {unknown} but the wrapped chains are {list(names)}")
    missing = [n for n in names if n not in mem_limit]
    if missing:
        raise ValueError(f"mem_limit gives no budget for wrapped chain(s) {missing}; give one per chain: {list(names)}")


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def take_own_checkpointing(
    model: nn.Module, chains: Sequence[tuple[str, nn.Module]]
) -> dict[str, tuple[list[tuple[str, nn.Module]], list[str]]]:
    """Turn off the own checkpointing flags of several chains of `model` at once, and tell it once for the model.

    Each chain would find its own flags and warn (an encoder-decoder's two stacks: two warnings). Where more than
    one chain has flags, they are turned off here, before the chains are made; each chain holds its own (to turn
    them back on) and the one note naming every chain, told by the first to plan. Empty where one chain or none
    has flags.
    """
    found = {name: own_checkpointing.flagged(module) for name, module in chains}
    if sum(bool(flags) for flags in found.values()) < 2:
        return {}
    parts = [name.split(".") for name in found]  # the chains' owner: their names' common prefix (T5's model)
    common = [part[0] for part in itertools.takewhile(lambda part: len(set(part)) == 1, zip(*parts, strict=False))]
    note = [own_checkpointing.turned_off_in_chains(type(model.get_submodule(".".join(common))).__name__, found)]
    for flags in found.values():
        own_checkpointing.turn_off(flags)
    return {name: (flags, note) for name, flags in found.items()}


def wrap(
    model: nn.Module,
    mem_limit: MemLimit | Mapping[str, MemLimit] = None,
    *,
    config: RotorConfig | None = None,
    distributed: bool = False,
    **settings: Any,
) -> tuple[list[Wrapped], str]:
    """Swap `Checkpointable`s in for the chosen submodules of `model`, in place, under one budget.

    The settings are `config=` or `RotorConfig`'s fields as keyword arguments (`mem_limit`, `include`, ...);
    `distributed`: the model trains under DDP (each chain refuses tied weights before its first profile).
    """
    unknown = sorted(set(settings) - set(FIELDS))
    if unknown:
        raise TypeError(f"wrap() got unknown setting(s) {unknown}; the settings are RotorConfig's: {', '.join(FIELDS)}")
    config = RotorConfig.of(config, {"mem_limit": mem_limit, **settings})
    chains, why = find_chains(model, config.include, config.exclude, config.discover)
    names = [name for name, _ in chains]
    shared = None
    if isinstance(config.mem_limit, Mapping):
        check_budget_names(config.mem_limit, names)
    elif chains:
        shared = Budget(config.mem_limit, names)
    own = take_own_checkpointing(model, chains)
    each = chain_configs(model, config, chains)
    wrapped = []
    for name, module in chains:
        rotor = Checkpointable(
            module,
            config=each[name],
            shared=shared,
            shared_name=name if shared is not None else "",
            distributed=distributed,
        )
        if own:
            rotor.hold_own_checkpointing(*own.pop(name))
        _set(model, name, rotor)
        wrapped.append(Wrapped(name, module, rotor))
    if shared is not None and len(wrapped) > 1:  # the model's code around the chains, charged to the budget
        step_outside.install(model, {w.name: w.rotor for w in wrapped}, shared)
    return wrapped, why


def chain_configs(
    model: nn.Module, config: RotorConfig, chains: Sequence[tuple[str, nn.Module]]
) -> dict[str, RotorConfig]:
    """Each chain's own settings from the model's: its budget (a per-chain dict's entry), its discovery method
    ("auto" finds a plain Sequential's stages as they are), the block classes resolved in `model`, its share of
    the host limit, no compile= for a module compiled already (its own options), and no include / exclude."""
    types = resolve_block_types(model, config.checkpoint_modules)
    transfer = offload_settings(config.offload, config.host_limit, len(chains))
    fallback = config.fallback_plain
    if fallback is None:
        fallback = config.discover == "auto" and config.include is None
    each = {}
    for name, module in chains:
        plain = is_candidate(module) and (types is None or config.discover == "sequential")
        each[name] = config.replace(
            mem_limit=config.mem_limit[name] if isinstance(config.mem_limit, Mapping) else config.mem_limit,
            include=None,
            exclude=None,
            discover="auto" if plain and config.discover in ("auto", "sequential") else config.discover,
            checkpoint_modules=types,
            fallback_plain=fallback,
            compile=None if compiled_inner(module) is not None else config.compile,
            **transfer,
        )
    return each


def unwrap(model: nn.Module, wrapped: Sequence[Wrapped]) -> None:
    """Put the user's modules back where `wrap` put rotor modules, their own checkpointing on again."""
    for item in reversed(wrapped):
        if item.rotor.shared is not None:
            step_outside.remove(item.rotor.shared)
        item.rotor.restore_own_checkpointing()
        _set(model, item.name, item.original)


def offload_settings(offload: Offload, host_limit: int | str | None, chains: int) -> dict[str, Any]:
    """`Checkpointable`'s `offload=` / `host_limit=` for each of `chains` chains (none when not offloading).

    Checked by `lightning_rotor.config.check_offload`, so the strategies, YAML and the module fail alike.
    The host limit is the whole model's: each chain gets an even share, so that all their host copies
    together stay within it.
    """
    setting, limit = check_offload(offload, host_limit)
    if setting is None:
        return {}
    return {"offload": offload, "host_limit": None if limit is None else max(1, limit // max(1, chains))}
