"""The function-size gate `.ci/run` runs (`.ci/function_sizes.py`), on synthetic files."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / ".ci" / "function_sizes.py"


@pytest.fixture(scope="module")
def gate() -> ModuleType:
    spec = importlib.util.spec_from_file_location("function_sizes", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def _function(name: str, lines: int, indent: str = "") -> str:
    """Source of a function `lines` long, from its `def` line to its last line."""
    body = [f"{indent}    x = {i}\n" for i in range(lines - 2)]
    return f"{indent}def {name}():\n{''.join(body)}{indent}    return x\n"


def test_a_function_of_81_lines_fails_the_gate(gate: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    path = tmp_path / "long.py"
    path.write_text("import os\n\n\n" + _function("short", 10) + "\n\n" + _function("long", 81))
    assert gate.main([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert out == f"{path}:16: long is 81 lines (limit 80)\n"


def test_a_function_of_80_lines_passes_the_gate(gate: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    (tmp_path / "exact.py").write_text(_function("exact", 80))
    assert gate.main([str(tmp_path)]) == 0
    assert capsys.readouterr().out == ""


def test_methods_and_nested_functions_are_measured_with_their_qualified_names(gate: ModuleType, tmp_path: Path):
    nested = "def outer():\n" + _function("inner", 81, indent="    ") + "    return inner\n"
    method = "class Model:\n" + _function("forward", 82, indent="    ")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text(nested)
    (tmp_path / "pkg" / "b.py").write_text(method)
    found = {(f.name, f.lines) for f in gate.too_long([tmp_path])}
    assert found == {("outer", 83), ("outer.inner", 81), ("Model.forward", 82)}
