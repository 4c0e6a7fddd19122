"""Set-up shared by every test file.

Acceptance models installed outside the venv (`pip install --no-deps --target .models litgpt psutil`):
their directory (`.models` at the repository root, or `LIGHTNING_ROTOR_TEST_MODELS`) is put on
`sys.path` when it exists; tests that need such a model skip cleanly without it (`importorskip`).

One intra-op thread: the tensors are tiny, so threads only contend on a shared machine. Set here at
import, before collection imports the test files (some build and profile models while collected).
Helpers are plain functions in training.py (PyTorch) and fitting.py (Lightning).
"""

import os
import sys
from pathlib import Path

import pytest
import torch

from lightning_rotor.loss_watch import settle_watches

torch.set_num_threads(1)

_MODELS = Path(os.environ.get("LIGHTNING_ROTOR_TEST_MODELS", Path(__file__).resolve().parents[1] / ".models"))
if _MODELS.is_dir() and str(_MODELS) not in sys.path:
    sys.path.append(str(_MODELS))  # appended: never shadows the venv's own packages


@pytest.fixture(autouse=True)
def _settled_loss_windows():
    """A loss window left in a test's last backward stays on the dispatch-mode stack until a chain call or an
    optimizer step settles it (lightning_rotor/loss_watch.py); a test that ends on `torch.autograd.grad` has
    neither, and the next test would run under it."""
    yield
    settle_watches()
