"""Which frame is the user's: files beside torch's folder whose names begin like it (`torchvision`, `torchtitan`,
`torchmetrics`) are not torch's, so messages name their lines."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_rotor.frames import first_outside
from lightning_rotor.own_checkpointing import checkpoint_calls

CALLER = "import sys\n\n\ndef call(f):\n    return f(sys._getframe(0))\n"  # hands `f` its own frame


def module_at(path):
    """The real module file `path` (written with `CALLER`), imported under a name of its own."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(CALLER)
    spec = importlib.util.spec_from_file_location(f"frames_{path.parent.name}_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_file_in_a_folder_named_like_torch_s_followed_by_more_letters_is_not_inside_it(tmp_path):
    site = tmp_path / "site-packages"
    torchvision, torch_own = module_at(site / "torchvision" / "blocks.py"), module_at(site / "torch" / "inner.py")
    skipped = [str(site / "torch")]
    found = torchvision.call(lambda frame: first_outside(frame, skipped))
    assert found is not None and found.f_code.co_filename == str(site / "torchvision" / "blocks.py")
    found = torch_own.call(lambda frame: first_outside(frame, skipped))
    assert found is not None and found.f_code.co_filename == __file__  # torch's own frame skipped: this test's


def test_a_checkpoint_call_from_a_package_named_like_torch_names_that_package_s_line():
    """torchmetrics' `rank_zero_only` wraps a function and calls it: here torch's checkpoint, called from a file
    under `.../site-packages/torchmetrics/`, whose path begins with torch's folder as a string."""
    prints = pytest.importorskip("torchmetrics.utilities.prints")
    block, x = nn.Linear(4, 4), torch.randn(2, 4, requires_grad=True)
    with checkpoint_calls() as seen:
        prints.rank_zero_only(checkpoint)(block, x, use_reentrant=False)
    assert len(seen) == 1 and seen[0].startswith(prints.__file__ + ":"), seen


def test_a_deprecation_from_a_package_named_like_rotor_s_names_that_package_s_line():
    """A warning names the user's line (`config._caller_level`): code in a folder beside rotor's whose name starts
    like it (`lightning_rotor_ext/`) is the user's, not rotor's own. The code object carries that file name."""
    import os

    import lightning_rotor
    from lightning_rotor.config import RotorConfig

    path = os.path.join(os.path.dirname(lightning_rotor.__file__) + "_ext", "user.py")
    code = compile("\n\nRotorConfig(loss_tmp=len)\n", path, "exec")
    with pytest.warns(DeprecationWarning, match="loss_tmp") as seen:
        exec(code, {"RotorConfig": RotorConfig})
    assert (seen[0].filename, seen[0].lineno) == (path, 3)
