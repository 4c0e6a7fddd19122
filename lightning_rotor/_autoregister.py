"""Register the strategy names with Lightning as soon as Lightning is there, without importing it.

`Trainer(strategy="rotor")` looks the name up in Lightning's strategy registry,
which only `lightning_rotor.lightning` fills. Importing that eagerly would make
`import lightning_rotor` (and the `plan` command) pay Lightning's start-up, so
instead: if `lightning.pytorch` is already imported, register now; otherwise
register right after `lightning.pytorch` finishes importing, whatever imports it.
Lightning has no entry point that runs before it resolves a strategy name, so
`import lightning_rotor` once is the one import needed.

Fabric's registry (`lightning.fabric.strategies`) gets `"rotor"` the same way, once
`lightning.fabric` is imported, as a factory that imports `lightning_rotor.fabric` only
when `Fabric(strategy="rotor")` is built: `lightning.fabric` is imported while
`import lightning` is still running, too early to import the Trainer side.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import Any


def _register_trainer() -> None:
    importlib.import_module("lightning_rotor.lightning")


def _fabric_rotor(**kwargs: Any) -> Any:
    return importlib.import_module("lightning_rotor.fabric").RotorFabricStrategy(**kwargs)


def _register_fabric() -> None:
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    if "rotor" not in STRATEGY_REGISTRY:  # importing lightning_rotor.fabric registers the class itself
        STRATEGY_REGISTRY.register("rotor", _fabric_rotor, description="single device with rotor checkpointing")


WATCHED = {"lightning.pytorch": _register_trainer, "lightning.fabric": _register_fabric}


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the real loader of the watched module `name` to register after it runs."""

    def __init__(self, name: str):
        self.name = name

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        real = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            real(module)
            WATCHED[fullname]()

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    for name, register in WATCHED.items():
        if name in sys.modules:
            register()
        elif not any(isinstance(f, _AfterImport) and f.name == name for f in sys.meta_path):
            sys.meta_path.insert(0, _AfterImport(name))
