"""Register the strategy names with Lightning as soon as Lightning is there, without importing it.

`Trainer(strategy="rotor")` looks the name up in Lightning's strategy registry,
which only `lightning_rotor.lightning` fills. Importing that eagerly would make
`import lightning_rotor` (and the `plan` command) pay Lightning's start-up, so
instead: if `lightning.pytorch` is already imported, register now; otherwise
register right after `lightning.pytorch` finishes importing, whatever imports it.
Lightning has no entry point that runs before it resolves a strategy name, so
`import lightning_rotor` once is the one import needed.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import Any

WATCHED = "lightning.pytorch"


def _register() -> None:
    importlib.import_module("lightning_rotor.lightning")


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the real loader of `lightning.pytorch` to register after it runs."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != WATCHED:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        real = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            real(module)
            _register()

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    if WATCHED in sys.modules:
        _register()
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
