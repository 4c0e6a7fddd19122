"""Acceptance models installed outside the venv (`pip install --no-deps --target .models litgpt psutil`).

Their directory (`.models` at the repository root, or `LIGHTNING_ROTOR_TEST_MODELS`) is put on
`sys.path` when it exists; tests that need such a model skip cleanly without it (`importorskip`).
"""

import os
import sys
from pathlib import Path

_MODELS = Path(os.environ.get("LIGHTNING_ROTOR_TEST_MODELS", Path(__file__).resolve().parents[1] / ".models"))
if _MODELS.is_dir() and str(_MODELS) not in sys.path:
    sys.path.append(str(_MODELS))  # appended: never shadows the venv's own packages
