"""Every script in examples/ runs, at tiny sizes through its own flags, and uses only the public API.

Each example runs in a child process (as a user runs it, from a fresh directory) against this
checkout, and one line of its output shows it did its job. The chain files of examples/ load and
plan with `lightning-rotor plan`.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import lightning_rotor
from lightning_rotor.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
THIRD_PARTY = {"torch", "lightning", "lightning_rotor"}  # what an example may import besides the standard library

# example -> (flags for a run of seconds, a line of its output that shows it did its job)
SMOKE: dict[str, tuple[list[str], str]] = {
    "plain_pytorch.py": (
        ["--width", "4", "--image-size", "8", "--batch-size", "2", "--steps", "1"],
        r"^budget [\d.]+ \w+, predicted peak [\d.]+ \w+, measured peak [\d.]+ \w+; profiling took",
    ),
    "offline_planning.py": (
        ["--width", "2", "--batch-size", "2", "--image-size", "16", "--budgets", "100%", "60%"],
        r"^\s+100%\s+[\d.]+ \w+\s+[\d.]+ms\s+0\.0%\s+0$",  # all of the budget: nothing recomputed
    ),
    "discovery_time.py": (
        ["--layers", "2", "--width", "16", "--seq", "8", "--batch", "1", "--repeats", "1"],
        r"^graph\s+\d+ stages\s+discovery [\d.]+ s",
    ),
    "fabric_gpt.py": (
        ["--layers", "2", "--width", "16", "--batch-size", "2", "--steps", "2"],
        r"^budget [\d.]+ \w+, measured peak [\d.]+ \w+, \d+ stages recomputed",
    ),
    "any_model.py": (
        ["--layers", "2", "--width", "16", "--seq", "8", "--batch-size", "4", "--steps", "2"],
        r"^trained 2 steps, loss [\d.]+; budget [\d.]+ \w+, \d+ stages recomputed",
    ),
    "diffusers_unet.py": (
        ["--levels", "8,16", "--layers", "1", "--size", "8", "--batch", "2"],
        r"^rotor at the own checkpointing's peak \(\d+ B\): measured \d+ B",
    ),
    "lightning_resnet.py": (
        ["--width", "4", "--image-size", "16", "--batch-size", "4", "--steps", "2", "--accelerator", "cpu"],
        r"^trained 2 steps, loss [\d.]+; budget [\d.]+ \w+, \d+ stages recomputed",
    ),
}
NEEDS = {"diffusers_unet.py": "diffusers"}  # an optional package the example imports: skipped without it
FAST = {"discovery_time.py"}  # under ~3 s of CPU here; the others start Lightning or profile a model


def run_example(name: str, args: list[str], cwd: Path) -> str:
    paths = [str(ROOT), os.environ.get("PYTHONPATH", "")]
    if name in NEEDS:  # found where the tests found it (tests/conftest.py puts `.models` on the path)
        paths.insert(1, str(Path(pytest.importorskip(NEEDS[name]).__file__).parents[1]))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")  # tiny tensors: threads only contend
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"{name} exited with {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return done.stdout


def test_every_example_has_a_smoke_run():
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(SMOKE)


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in FAST else pytest.mark.slow) for n in sorted(SMOKE)])
def test_example_runs(name, tmp_path):
    args, done_line = SMOKE[name]
    out = run_example(name, args, tmp_path)
    assert re.search(done_line, out, re.MULTILINE), f"{name}: no line matching {done_line!r} in:\n{out[-3000:]}"
    if name == "offline_planning.py":  # the chain it profiled is saved where it said
        assert lightning_rotor.Chain.load(tmp_path / "chain.json").length > 0


@pytest.mark.parametrize("chain", sorted(p.name for p in EXAMPLES.glob("*.json")))
def test_example_chain_plans(chain):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli_main(["plan", str(EXAMPLES / chain), "--mem-limit", "80%"])
    assert rc == 0, out.getvalue()
    assert re.search(r"^peak: +[\d.]+ \w+ \(\d+ bytes", out.getvalue(), re.MULTILINE), out.getvalue()


# -- public API only ------------------------------------------------------------------------------


def _public(module: str, name: str | None) -> bool:
    """Whether `from module import name` (or `import module` when `name` is None) is public API:
    the package's top-level names, and `lightning_rotor.models` with its submodules."""
    if module == "lightning_rotor":
        return name is None or name in lightning_rotor.__all__
    if module == "lightning_rotor.models" or module.startswith("lightning_rotor.models."):
        if name is None:
            return True
        exported = getattr(importlib.import_module(module), "__all__", ())
        return name in exported
    return False


def private_imports(source: str, allowed: frozenset[str] = frozenset()) -> list[str]:
    """The imports in `source` that reach past the public API, or outside what an example may import (the
    standard library, torch, Lightning, and the `allowed` packages the example is about)."""
    found = []
    packages: set[str] = set()  # local names bound to `lightning_rotor` itself
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            pairs = [(alias.name, None, alias.asname) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            pairs = [(module, alias.name, alias.asname) for alias in node.names]
        else:
            continue
        for module, name, asname in pairs:
            top = module.split(".")[0]
            if top not in THIRD_PARTY | allowed and top not in sys.stdlib_module_names and top != "__future__":
                found.append(f"{module} (not the standard library, torch, Lightning or lightning_rotor)")
            elif top == "lightning_rotor" and not _public(module, name):
                found.append(f"{module}.{name}" if name else module)
            elif module == "lightning_rotor" and name is None:
                packages.add(asname or "lightning_rotor")
    for node in ast.walk(ast.parse(source)):  # lightning_rotor.X after `import lightning_rotor`
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in packages:
            if node.attr not in lightning_rotor.__all__:
                found.append(f"lightning_rotor.{node.attr}")
    return found


@pytest.mark.parametrize("name", sorted(SMOKE))
def test_example_imports_only_public_names(name):
    allowed = frozenset([NEEDS[name]]) if name in NEEDS else frozenset()
    assert private_imports((EXAMPLES / name).read_text(), allowed) == []


def test_private_imports_are_found():
    source = (
        "import lightning_rotor as lr\nfrom lightning_rotor import Checkpointable\n"
        "from lightning_rotor.budget import format_bytes\nfrom lightning_rotor.models import get_model, _images\n"
        "import lightning_rotor.planner\nfrom models_any import GPT\nlr.plan, lr.profile_chain\n"
    )
    assert private_imports(source) == [
        "lightning_rotor.budget.format_bytes",
        "lightning_rotor.models._images",
        "lightning_rotor.planner",
        "models_any (not the standard library, torch, Lightning or lightning_rotor)",
        "lightning_rotor.profile_chain",
    ]
