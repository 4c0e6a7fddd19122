"""`RotorConfig`: every rotor setting, declared, documented and checked in one place.

`Checkpointable`, `wrap()` and the strategies (Trainer, DDP, Fabric) take the settings either as
one `RotorConfig` (`config=`) or as flat keyword arguments of the same names (what code and
LightningCLI YAML give: `init_args: {mem_limit: 50%}`); `RotorConfig.of` turns either into one
checked, frozen object, so a bad value fails where it is given, in one line, whatever the entry.

The settings that need the wrapped module (a discovery method that fits it, block classes) are
checked by `module_settings` when a `Checkpointable` is made.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from lightning_rotor.budget import BudgetError, MemLimit, Offload, parse_budget, parse_host_limit, parse_offload
from lightning_rotor.compile import stage_compiler
from lightning_rotor.discretize import check_slots
from lightning_rotor.frames import in_folder
from lightning_rotor.shapes import check_buckets
from lightning_rotor.stages import Stages

__all__ = ["RotorConfig", "check_offload", "module_settings"]

Selector = str | type  # a submodule name (globs allowed), a class name, or a class


@dataclass(frozen=True)
class RotorConfig:
    """Rotor's settings for a `Checkpointable`, `wrap()` or a strategy (docs/checkpointable.md, "Settings")."""

    mem_limit: MemLimit | Mapping[str, MemLimit] = None
    """The activation budget: None (automatic: device memory on CUDA, no recomputation elsewhere), bytes,
    a size (`"6GiB"`) or a fraction of the no-recomputation peak (`0.5`, `"50%"`). In `wrap()` and the
    strategies it is one budget for the whole model, split over its chains by need, or `{chain name: budget}`."""

    include: Sequence[Selector] | None = None
    """`wrap()` and the strategies: the submodules to wrap (names, globs, class names or classes), overriding
    the policy of docs/lightning.md; None: the policy. A `Checkpointable` wraps the module it is given."""

    exclude: Sequence[Selector] | None = None
    """`wrap()` and the strategies: submodules never wrapped (as `include`)."""

    discover: str = "auto"
    """How a module that is not a plain nn.Sequential becomes a chain, on its first training call: "auto",
    "graph" (torch.fx, the whole forward), "modules" (a run of sibling blocks) or "sequential" (plain
    nn.Sequential parts only). docs/discovery.md."""

    checkpoint_modules: Sequence[str | type] | None = None
    """Block classes kept whole in one stage each: classes (a `Checkpointable`), or in `wrap()` and the
    strategies also class paths (`my_project.model.Block`) or class names found in the model."""

    slots: int | None = None
    """The planner's memory precision (None: automatic)."""

    loss_fn: Callable[[Any], Any] | None = None
    """The caller's loss as a function of a chain's output, measured on the first call (default: a softmax
    cross-entropy over the last dimension)."""

    loss_tmp: int | None = None
    """What the loss costs in bytes, charged instead of measuring it (not with `loss_fn`)."""

    repeats: int = 5
    """Timing rounds when profiling (at most; from 3 on, fewer once profiling has taken 10 plain steps)."""

    warmup: int = 0
    """Untimed runs per stage before the timed ones (the memory runs warm up already)."""

    fallback_plain: bool | None = None
    """Where no chain is found: True warns once and runs the module's forward as written, False raises.
    None: True for a model `wrap()` or a strategy discovers by default (`discover="auto"`, no `include`)."""

    compile: bool | dict[str, Any] | None = None
    """True or a dict of torch.compile arguments compiles each stage (docs/compile.md)."""

    derive_shapes: bool = True
    """A later input shape is profiled for sizes only, its times derived from the first shape's by FLOP
    counts (compiled stages: every shape is timed); False times every shape."""

    predict_shapes: bool = False
    """A later shape that differs from measured ones in one size is planned, without a run, on a chain
    bounding its own from above; measured only when that bound cannot meet its budget (shapes.py)."""

    fit_shapes: bool = True
    """A later shape along one size axis of three measured ones gets its exact sizes from their traced
    profiles, without a run, where they follow (symbolic_sizes.py); others are measured."""

    shape_buckets: Mapping[int, Sequence[int]] | None = None
    """Fewer plans, e.g. `{1: [64, 128, 256]}`: an input of length `n` along dimension 1 runs the plan of the
    smallest bucket `>= n` (the input itself is not padded)."""

    options: bool = False
    """Also profile each stage's option "sac" (record only matmul, convolution and attention outputs) so the
    planner may choose it per stage; adds profiling time and changes plans (docs/checkpointable.md)."""

    offload: Offload = False
    """Also move kept stage inputs to host memory while they wait: False, True (the link's bandwidth measured
    at the first profile), or a bandwidth as bytes/s (`12e9`) or a rate (`"12GB/s"`)."""

    host_limit: int | str | None = None
    """The most host memory offloaded copies hold at once, bytes or a size (`"2GiB"`): the whole model's in
    `wrap()` and the strategies, split evenly over its chains. None: no limit."""

    early_stop: bool = False
    """A recomputation before a stage's backward stops once the backward's tensors are made, as torch's
    non-reentrant checkpoint does (docs/memory-model.md); pays on large blocks, costs hooks on small ones."""

    def __post_init__(self) -> None:
        _check_budgets(self.mem_limit)
        for name in ("include", "exclude"):
            self._set(name, _selectors(name, getattr(self, name)))
        self._set("discover", check_discover("auto" if self.discover is None else self.discover))
        self._set("checkpoint_modules", _block_names(self.checkpoint_modules))
        check_slots(self.slots)
        self._set_loss(self.loss_tmp, self.loss_fn)
        for name, least in (("repeats", 1), ("warmup", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
        if self.fallback_plain is not None:
            self._set("fallback_plain", bool(self.fallback_plain))
        stage_compiler(self.compile)  # a bad compile= fails here, in one line
        self._set("shape_buckets", check_buckets(self.shape_buckets))
        check_offload(self.offload, self.host_limit)
        for name in ("derive_shapes", "predict_shapes", "fit_shapes", "options", "early_stop"):
            self._set(name, bool(getattr(self, name)))

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)  # a frozen dataclass's own normalising, once, while it is made

    def _set_loss(self, loss_tmp: Any, loss_fn: Any) -> None:
        """A function given as `loss_tmp=` (deprecated in 0.2.0) moves to `loss_fn=`; the two exclude each other."""
        if callable(loss_tmp):
            warnings.warn(
                "Checkpointable(loss_tmp=<function>) is deprecated since 0.2.0: give the loss as loss_fn=; "
                "loss_tmp= takes bytes",
                DeprecationWarning,
                stacklevel=_caller_level(),
            )
            loss_tmp, loss_fn = None, loss_tmp if loss_fn is None else loss_fn
        if loss_tmp is not None and loss_fn is not None:
            raise ValueError("give loss_fn= (the loss, measured) or loss_tmp= (its bytes), not both")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn must be a function of the output, got {type(loss_fn).__name__}")
        if loss_tmp is not None and (isinstance(loss_tmp, bool) or not isinstance(loss_tmp, int)):
            raise TypeError(f"loss_tmp must be bytes (an int), got {loss_tmp!r}; give a loss function as loss_fn=")
        self._set("loss_tmp", loss_tmp)
        self._set("loss_fn", loss_fn)

    @classmethod
    def of(cls, config: RotorConfig | None, given: Mapping[str, Any]) -> RotorConfig:
        """The settings of an entry point that takes `config=` beside flat keyword arguments (`given`, its
        `locals()`: names that are no setting are left out): `config`, or else the flat arguments, checked.

        Both at once is refused in one line where a flat argument differs from its default.
        """
        flat = {name: given[name] for name in FIELDS if name in given}
        if config is None:
            return cls(**flat)
        if not isinstance(config, RotorConfig):
            raise TypeError(f"config must be a lightning_rotor.RotorConfig, got {type(config).__name__}")
        beside = [name for name, value in flat.items() if not _is_default(name, value)]
        if beside:
            raise ValueError(
                f"give rotor's settings as config= or as keyword arguments, not both: {', '.join(beside)} "
                f"given beside config=; use config=config.replace({beside[0]}=...)"
            )
        return config

    def replace(self, **changes: Any) -> RotorConfig:
        """A copy with `changes`, checked again."""
        return dataclasses.replace(self, **changes)

    def transfer(self) -> tuple[str | float | None, int | None]:
        """`check_offload` of this config: (None: off, "measure", or bytes/s; the host limit in bytes or None)."""
        return check_offload(self.offload, self.host_limit)


FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(RotorConfig))
DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(RotorConfig)}


def _is_default(name: str, value: Any) -> bool:
    default = DEFAULTS[name]
    if value is default or (default is None and isinstance(value, (list, tuple)) and not value):
        return True
    return type(value) is type(default) and bool(value == default)


def check_discover(discover: Any) -> str:
    """`discover` as given, or one clear error naming the methods."""
    from lightning_rotor.discovery import DISCOVER_METHODS

    if discover not in DISCOVER_METHODS:
        raise ValueError(f"discover={discover!r} is not a discovery method; use one of {', '.join(DISCOVER_METHODS)}")
    return str(discover)


def _check_budgets(mem_limit: Any) -> None:
    """Every budget parses (a per-chain dict: each of its values), or `BudgetError` says what is accepted."""
    for value in mem_limit.values() if isinstance(mem_limit, Mapping) else [mem_limit]:
        if value is not None:
            parse_budget(value)


def _selectors(name: str, value: Any) -> tuple[Selector, ...] | None:
    """`include` / `exclude` as a tuple, or one clear error (a lone name would be read letter by letter)."""
    if value is None:
        return None
    value = _items(value)
    if isinstance(value, (str, type)) or not all(isinstance(v, (str, type)) for v in value):
        raise TypeError(f"{name} must be a list of submodule names (globs), class names or classes, got {value!r}")
    return tuple(value)


def _items(value: Any) -> Any:
    """A list or tuple as given; another iterable as a tuple (read once); anything else as given, to refuse."""
    if isinstance(value, (list, tuple, str, type)) or not hasattr(value, "__iter__"):
        return value
    return tuple(value)


def _block_names(value: Any) -> tuple[str | type, ...] | None:
    if value is None:
        return None
    value = _items(value)
    if isinstance(value, (str, type)) or not all(isinstance(c, (str, type)) for c in value):
        raise TypeError(f"checkpoint_modules must be a list of classes, class paths or class names, got {value!r}")
    return tuple(value)


def check_offload(offload: Any, host_limit: Any) -> tuple[str | float | None, int | None]:
    """(None: off, "measure", or bytes/s; host limit in bytes or None) from `offload=` and `host_limit=`.

    Bad values fail when the settings are made, in one line that says what is accepted (the parsers
    of lightning_rotor/budget.py), not at the first training step.
    """
    rate = False if offload is None else parse_offload(offload)
    setting: str | float | None = None if rate is False else "measure" if rate is True else float(rate)
    if host_limit is None:
        return setting, None
    try:
        nbytes = parse_host_limit(host_limit)
    except BudgetError as err:
        raise ValueError(
            f"host_limit={host_limit!r} is not a size: give bytes or a size with a unit ('2GiB', '512MB', "
            f"8000000000), not a fraction ({err})"
        ) from None
    if setting is None:
        raise ValueError(f"host_limit={host_limit!r} bounds offloaded copies; give offload= too, or leave it out")
    return setting, nbytes


def module_settings(
    config: RotorConfig, module: nn.Module, stages: Stages | None
) -> tuple[str | None, tuple[type[nn.Module], ...] | None]:
    """A `Checkpointable`'s discovery method for `module` ("sequential" for a plain nn.Sequential; None:
    `stages` given) and block classes, or one clear error (what needs the module, beside `RotorConfig`'s checks)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"Checkpointable wraps an nn.Module, got {type(module).__name__}")
    if stages is not None and not isinstance(stages, Stages):
        raise TypeError(f"stages must be a lightning_rotor.Stages, got {type(stages).__name__}")
    if config.include is not None or config.exclude:
        raise ValueError(
            "include= and exclude= choose the submodules wrap() and the strategies wrap; a Checkpointable wraps "
            "the module it is given: leave them out"
        )
    discover = config.discover
    if stages is not None and discover != "auto":
        raise ValueError("give stages= (found already) or discover= (found on the first training call), not both")
    types = config.checkpoint_modules
    if types is not None and not all(isinstance(t, type) and issubclass(t, nn.Module) for t in types):
        raise TypeError(f"checkpoint_modules must be nn.Module classes, got {list(types)!r}")
    if stages is not None:
        return None, types  # type: ignore[return-value]  # classes, checked above
    plain_sequential = isinstance(module, nn.Sequential) and type(module).forward is nn.Sequential.forward
    if discover == "auto" and plain_sequential and types is None:
        discover = "sequential"
    if discover == "sequential" and not plain_sequential:
        raise TypeError(
            f"discover='sequential' needs a plain nn.Sequential, got {type(module).__name__}; "
            "use discover='auto', 'graph' or 'modules'"
        )
    return discover, types  # type: ignore[return-value]  # classes, checked above


def _caller_level() -> int:
    """The `stacklevel` of the first frame outside this package (a warning names the user's line)."""
    package = os.path.dirname(__file__)
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and (
        frame.f_code.co_filename.startswith("<string>") or in_folder(frame.f_code.co_filename, package)
    ):
        frame, level = frame.f_back, level + 1
    return level
