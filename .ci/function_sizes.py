"""Code gate: no function in the package longer than the limit (issue 26: 80 lines).

A function's length runs from its `def` line to its last line, docstring, comments and blank
lines inside included (decorators left out); a nested function counts in its own right and
inside the function around it. Prints each function over the limit as `path:line: name is N
lines (limit L)` and exits 1 if there is any, 0 otherwise.

    python .ci/function_sizes.py [--max-lines 80] [paths ...]   (default: lightning_rotor)
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

MAX_LINES = 80


@dataclass(frozen=True)
class Function:
    path: Path
    line: int
    name: str  # qualified within its file: Class.method, outer.inner
    lines: int


def functions(path: Path) -> Iterator[Function]:
    """Every function and method defined in the Python file `path`, nested ones included."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    yield from _walk(path, tree, "")


def _walk(path: Path, node: ast.AST, prefix: str) -> Iterator[Function]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            end = child.end_lineno if child.end_lineno is not None else child.lineno
            yield Function(path, child.lineno, prefix + child.name, end - child.lineno + 1)
            yield from _walk(path, child, f"{prefix}{child.name}.")
        elif isinstance(child, ast.ClassDef):
            yield from _walk(path, child, f"{prefix}{child.name}.")
        else:
            yield from _walk(path, child, prefix)


def python_files(paths: list[Path]) -> list[Path]:
    """The .py files under each path (a file stands for itself), in a stable order."""
    found: list[Path] = []
    for p in paths:
        found.extend(sorted(p.rglob("*.py")) if p.is_dir() else [p])
    return found


def too_long(paths: list[Path], max_lines: int = MAX_LINES) -> list[Function]:
    return [f for path in python_files(paths) for f in functions(path) if f.lines > max_lines]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Fail on functions longer than --max-lines.")
    parser.add_argument("paths", nargs="*", type=Path, default=[Path("lightning_rotor")])
    parser.add_argument("--max-lines", type=int, default=MAX_LINES)
    args = parser.parse_args(argv)
    over = too_long(args.paths, args.max_lines)
    for f in over:
        print(f"{f.path}:{f.line}: {f.name} is {f.lines} lines (limit {args.max_lines})")
    if over:
        print(f"{len(over)} function(s) over {args.max_lines} lines", file=sys.stderr)
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
