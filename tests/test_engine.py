"""The engine's layering: stage plumbing below profiler and executor, private torch APIs in one module."""

import ast
import pathlib
import subprocess
import sys

import lightning_rotor

PACKAGE = pathlib.Path(lightning_rotor.__file__).parent
COMPAT = PACKAGE / "_torch_compat.py"

# private attributes of torch objects (tensors, storages, graph nodes, ops, modules) rotor reads
PRIVATE_ATTRIBUTES = {
    "_version",
    "_base",
    "_cdata",
    "_backward_cls",
    "_schema",
    "_post_accumulate_grad_hooks",
    "_forward_hooks",
    "_global_forward_hooks",
    "_orig_module_call",
    "_orig_module_getattr",
    "_pre_forward",
    "_make_subclass",
    "kineto_results",
}
TORCH_ROOTS = {"torch", "nn", "F", "fx"}


def _root(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _private_uses(path: pathlib.Path) -> list[str]:
    """Code (not comments or docstrings) in `path` that reaches a private torch API directly."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        where = f"{path.relative_to(PACKAGE.parent)}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            if any(part.startswith("_") for part in node.module.split(".")) or any(
                a.name.startswith("_") for a in node.names
            ):
                found.append(f"{where} from {node.module} import ...")
        elif isinstance(node, ast.Import):
            found += [
                f"{where} import {a.name}"
                for a in node.names
                if a.name.split(".")[0] == "torch" and any(p.startswith("_") for p in a.name.split("."))
            ]
        elif isinstance(node, ast.Attribute) and _root(node) not in ("self", "cls"):  # not our own attributes
            private = node.attr.startswith("_") and not node.attr.startswith("__")
            if node.attr in PRIVATE_ATTRIBUTES or (private and _root(node) in TORCH_ROOTS):
                found.append(f"{where} .{node.attr}")
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr"):
            name = node.args[1] if len(node.args) > 1 else None
            if isinstance(name, ast.Constant) and name.value in PRIVATE_ATTRIBUTES:
                found.append(f"{where} {node.func.id}(..., {name.value!r})")
    return found


def test_private_torch_apis_are_used_only_through_torch_compat():
    uses = [use for path in sorted(PACKAGE.rglob("*.py")) if path != COMPAT for use in _private_uses(path)]
    assert uses == []


def test_torch_compat_names_the_version_it_was_checked_against():
    from lightning_rotor import _torch_compat

    assert _torch_compat.TORCH_CHECKED == "2.13.0"
    assert all(hasattr(_torch_compat, name) for name in _torch_compat.__all__)


def test_engine_imports_neither_profiler_nor_executor():
    code = (
        "import sys, lightning_rotor.engine; "
        "print(sorted(m for m in sys.modules if m in ('lightning_rotor.profile', 'lightning_rotor.execute')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_op_kinds_are_compared_as_opkind_not_as_strings():
    """ops.py promises dispatch on `OpKind`; a string comparison would let a renamed kind fall through."""
    kinds = {"Fn", "Fc", "Fe", "B", "Loss"}
    found = []
    for name in ("engine.py", "execute.py", "profile.py"):
        for node in ast.walk(ast.parse((PACKAGE / name).read_text())):
            if isinstance(node, ast.Compare):
                constants = [c for c in (node.left, *node.comparators) if isinstance(c, ast.Constant)]
                found += [f"{name}:{node.lineno} {c.value!r}" for c in constants if c.value in kinds]
    assert found == []
