"""`import lightning_rotor` stays light, and still registers the strategy names with Lightning."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "lightning", "matplotlib", "tensorboard")


def run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_import_loads_nothing_heavy():
    out = run(f"import sys, lightning_rotor; print([m for m in {HEAVY!r} if m in sys.modules])")
    assert out == "[]"


def test_plan_command_loads_nothing_heavy(tmp_path):
    chain = ROOT / "examples" / "heterogeneous.json"
    code = (
        "import sys, contextlib, io\n"
        "from lightning_rotor.cli import main\n"
        f"with contextlib.redirect_stdout(io.StringIO()): rc = main(['plan', {str(chain)!r}, '--mem-limit', '1TiB'])\n"
        f"print(rc, [m for m in {HEAVY!r} if m in sys.modules])"
    )
    assert run(code) == "0 []"


ORDERS = [
    "import lightning_rotor; import lightning",
    "import lightning; import lightning_rotor",
    "import lightning_rotor; from lightning.pytorch import Trainer",
    "import lightning_rotor.lightning; import lightning_rotor",
    "from lightning_rotor.lightning.strategy import RotorStrategy; import lightning_rotor",
]
REGISTERED = (
    "from lightning.pytorch.strategies import StrategyRegistry\n"
    "from lightning.fabric.strategies import STRATEGY_REGISTRY\n"
    "print(all(n in StrategyRegistry for n in ('rotor', 'rotor_ddp', 'rotor_ddp_spawn')), "
    "'rotor' in STRATEGY_REGISTRY)"
)
# Each order needs an interpreter that has imported neither Lightning nor lightning_rotor. One interpreter
# imports once what Lightning itself imports first and neither owns (torch, torchmetrics: most of the start-up),
# checks that this left both out, then forks a child per order; each child prints its line into a pipe.
FORKED = """
import json, os, sys, traceback
import torch, torchmetrics
early = sorted(m for m in sys.modules if m.split(".")[0] in ("lightning", "lightning_rotor", "pytorch_lightning"))
assert not early, early
lines = []
for code in {codes!r}:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        os.dup2(write, 1)
        try:
            exec(code, {{"__name__": "__main__"}})
            sys.stdout.flush()
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        out = pipe.read().strip()
    _, status = os.waitpid(pid, 0)
    lines.append(out if status == 0 else f"failed: {{out}}")
print(json.dumps(lines))
"""


@pytest.fixture(scope="module")
def registered_after() -> dict[str, str]:
    """What `REGISTERED` prints after each order of imports, each in a fresh child of one interpreter."""
    out = run(FORKED.format(codes=[f"{imports}\n{REGISTERED}" for imports in ORDERS]))
    return dict(zip(ORDERS, json.loads(out.splitlines()[-1]), strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("imports", ORDERS)
def test_strategy_names_registered_in_any_import_order(imports, registered_after):
    assert registered_after[imports] == "True True"  # the Trainer's names and Fabric's


def test_lazy_names_resolve():
    import lightning_rotor

    for name in lightning_rotor.__all__:
        assert getattr(lightning_rotor, name) is not None
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        lightning_rotor.nope  # noqa: B018


def test_public_names_are_not_shadowed_by_their_submodules():
    """`simulate` is both a public function and a submodule: importing the submodule first
    (as `lightning_rotor.planner` does) made `from lightning_rotor import simulate` the module."""
    code = (
        "import importlib, importlib.util, lightning_rotor as lr\n"
        "clash = [n for n in lr.__all__ if importlib.util.find_spec('lightning_rotor.' + n)]\n"
        "for n in clash: importlib.import_module('lightning_rotor.' + n)\n"
        "from lightning_rotor import simulate\n"
        "print(clash, [n for n in clash if isinstance(getattr(lr, n), type(lr))], simulate.__name__)"
    )
    assert run(code) == "['simulate'] [] simulate"
