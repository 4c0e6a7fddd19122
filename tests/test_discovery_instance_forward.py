"""Module-level discovery runs a block's own forward as the user's model has it: an instance-level forward
(accelerate's `add_hook_to_module`, rotor's turning off of torch's `offload_wrapper`) and not its class's.

It called `type(block).forward`: a block with an accelerate hook whose `pre_forward` changes the input trained a
different model than plain training, without a word.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from fitting import quiet_trainer
from test_user_models_silent import Fit, MLPBlock, assert_same_model, regression_loader, sgd_steps
from torch import nn

from lightning_rotor import Checkpointable
from lightning_rotor.lightning import RotorStrategy

hooks = pytest.importorskip("accelerate.hooks")


class Halve(hooks.ModelHook):
    """An accelerate hook that halves a block's input (as a device-placement hook moves it)."""

    def pre_forward(self, module, *args, **kwargs):
        return tuple(a * 0.5 for a in args), kwargs


class HookedBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(MLPBlock() for _ in range(6))
        for block in self.blocks:
            hooks.add_hook_to_module(block, Halve())

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_a_hooked_block_trains_as_plain_through_checkpointable():
    plain, net = HookedBlocks(), HookedBlocks()
    rotor = Checkpointable(net, "60%", discover="modules", repeats=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # rotor's notes on the plan
        sgd_steps(rotor, 3, width=32)
    assert max(rotor.last_entry.runs) > 1  # the plan recomputes: the hooked forward runs inside it
    sgd_steps(plain, 3, width=32)
    assert_same_model(plain, rotor)


def test_a_hooked_block_trains_as_plain_through_a_trainer(tmp_path):
    plain, rotor = Fit(HookedBlocks()), Fit(HookedBlocks())
    data = regression_loader(width=32)
    torch.manual_seed(2)
    quiet_trainer(tmp_path / "plain").fit(plain, data)
    torch.manual_seed(2)
    quiet_trainer(tmp_path / "rotor", RotorStrategy("60%", discover="modules")).fit(rotor, data)
    assert_same_model(plain, rotor)
