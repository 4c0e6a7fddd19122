"""Importing from a source checkout after a non-editable `pip install .` (the README's install).

Python started in the checkout imports the checkout's `lightning_rotor/`, which has no built C++
planner; `from lightning_rotor import Checkpointable` then failed with "cannot import name
'_planner'". Now the installed copy's build is loaded, and with no build anywhere one line says
what to do. Both run for real in a subprocess: a temporary checkout without the extension, and a
real `pip install --no-deps --target` of this source tree (its existing build reused, so no compile).
"""

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRAIN = (
    "import torch\n"
    "from torch import nn\n"
    "from lightning_rotor import Checkpointable\n"
    "from lightning_rotor.planner import _planner\n"
    "model = Checkpointable(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)))\n"
    "model(torch.randn(3, 4)).sum().backward()\n"
    "print(_planner.__file__)\n"
)


def built_planner() -> Path:
    found = sorted((ROOT / "lightning_rotor").glob("_planner.*"))
    if not found:
        pytest.skip("the C++ planner is not built in place in this checkout")
    return found[0]


def checkout_without_build(tmp_path: Path) -> Path:
    checkout = tmp_path / "checkout"
    shutil.copytree(
        ROOT / "lightning_rotor",
        checkout / "lightning_rotor",
        ignore=shutil.ignore_patterns("_planner.*", "__pycache__"),
    )
    return checkout


# this venv's own editable install of lightning_rotor maps `lightning_rotor.*` to its tree through a finder on
# sys.meta_path; the README's user has a plain install, so the subprocess drops that finder first
NO_EDITABLE = "import sys\nsys.meta_path[:] = [f for f in sys.meta_path if '__editable__' not in repr(f)]\n"


def python(code: str, cwd: Path, pythonpath: str | None) -> subprocess.CompletedProcess:
    code = NO_EDITABLE + code
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_a_checkout_without_a_build_uses_the_installed_copys_planner(tmp_path):
    so = built_planner()
    for build_requirement in ("setuptools", "pybind11"):  # pyproject's build-system, used without isolation
        pytest.importorskip(build_requirement)
    source = tmp_path / "source"  # this tree with its build, as `pip install .` in the checkout sees it
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    shutil.copytree(ROOT / "cpp", source / "cpp")
    shutil.copytree(ROOT / "lightning_rotor", source / "lightning_rotor", ignore=shutil.ignore_patterns("__pycache__"))
    build = source / "build" / f"lib.{sysconfig.get_platform()}-{sys.implementation.cache_tag}" / "lightning_rotor"
    build.mkdir(parents=True)
    shutil.copy2(so, build / so.name)  # newer than the sources: build_ext finds it up to date (a compile otherwise)
    site = tmp_path / "site"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(site),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert (site / "lightning_rotor" / so.name).is_file()

    ran = python(TRAIN, checkout_without_build(tmp_path), str(site))
    assert ran.returncode == 0, ran.stderr
    assert Path(ran.stdout.strip()).resolve() == (site / "lightning_rotor" / so.name).resolve()
    assert "has no built C++ planner; using the installed one" in ran.stderr


def test_no_build_anywhere_says_in_one_line_what_to_do(tmp_path):
    built_planner()
    ran = python("from lightning_rotor import plan\nplan", checkout_without_build(tmp_path), None)
    assert ran.returncode != 0
    last = ran.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: lightning_rotor's C++ planner is not built in "), ran.stderr
    assert "pip install -e ." in last and "build_ext --inplace" in last and "outside the checkout" in last
