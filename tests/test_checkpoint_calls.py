"""`torch.utils.checkpoint.checkpoint` called in a user's forward: discovery sees every call, however the forward
makes it (reentrant or not, the function imported under another name, through `checkpoint_sequential`), and names
the caller's file and line in the one warning; and seeing them costs the forward no hook on every Python call."""

from __future__ import annotations

import inspect
import sys
import threading
from typing import Any

import pytest
import torch
import torch.utils.checkpoint
from torch import nn
from torch.utils.checkpoint import checkpoint as ckpt

from lightning_rotor import Checkpointable


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.relu(self.a(x)))


class Calls(nn.Module):
    """Four blocks, the first run under `torch.utils.checkpoint` the way `how` says (the others plainly)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.how = how
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.profilers: list[Any] = []  # the Python profiler each forward ran under

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.profilers.append(sys.getprofile())
        first, *rest = self.blocks
        if self.how == "sequential":  # its first segment under checkpoint, its last run plainly
            x = torch.utils.checkpoint.checkpoint_sequential([first, rest.pop(0)], 2, x, use_reentrant=False)
        elif self.how == "reentrant":
            x = torch.utils.checkpoint.checkpoint(first, x, use_reentrant=True)
        elif self.how == "renamed":
            x = ckpt(first, x, use_reentrant=False)
        else:
            x = torch.utils.checkpoint.checkpoint(first, x, use_reentrant=False)
        for block in rest:
            x = block(x)
        return x


def _call_line(how: str) -> int:
    """The line of `Calls.forward` that calls torch.utils.checkpoint for `how`."""
    lines, start = inspect.getsourcelines(Calls.forward)
    word = {"renamed": "ckpt(", "sequential": "checkpoint_sequential("}.get(how, "checkpoint(first")
    keyed = [i for i, line in enumerate(lines) if word in line and ("reentrant=True" in line) == (how == "reentrant")]
    return start + keyed[0]


def _said(model: nn.Module) -> str:
    rotor = Checkpointable(model, "80%", discover="graph", repeats=1)
    with pytest.warns(UserWarning) as record:
        rotor(torch.randn(4, 16, requires_grad=True)).sum().backward()
    (said,) = [str(w.message) for w in record if "calls torch.utils.checkpoint" in str(w.message)]
    return said


@pytest.mark.parametrize("how", ["plain", "reentrant", "renamed", "sequential"])
def test_every_way_of_calling_checkpoint_is_seen_and_its_line_named(how):
    said = _said(Calls(how))
    assert f"calls torch.utils.checkpoint ({__file__}:{_call_line(how)})" in said, said
    assert "rotor's plan replaces them" in said, said


def test_discovery_puts_no_profiler_on_the_users_forward():
    """A hook on every Python call (`sys.setprofile`) cost ConvNeXt-Atto's discovery 16-17 plain steps; the forward
    runs under the profiler the user set (none here), and the call is seen all the same."""
    users = sys.getprofile()
    model = Calls("plain")
    _said(model)
    assert model.profilers and all(p is users for p in model.profilers)


def test_calls_of_another_thread_are_not_this_discoverys():
    """A checkpoint call on another thread while one discovers is no part of its forward (nothing said)."""
    from lightning_rotor.own_checkpointing import checkpoint_calls

    block, x = Block(), torch.randn(2, 16)
    reentrant = torch.utils.checkpoint.CheckpointFunction
    with checkpoint_calls() as calls:
        other = threading.Thread(target=lambda: torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False))
        other.start()
        other.join()
        torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
    assert len(calls) == 1 and calls[0].startswith(f"{__file__}:"), calls
    assert torch.utils.checkpoint.CheckpointFunction is reentrant  # torch as it was


class Looped(nn.Module):
    """Every block called through `torch.utils.checkpoint` in the forward's loop (per-block checkpointing)."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.reentrant = reentrant
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = ckpt(block, x, use_reentrant=self.reentrant)
        return self.head(x).sum()


@pytest.mark.parametrize("reentrant", [False, True])
def test_blocks_called_through_checkpoint_are_refused_by_module_discovery_in_one_line(reentrant):
    """Module-level discovery would call the blocks outside the user's checkpoint: the non-reentrant one then saves
    other tensors than it recorded (CheckpointError), the reentrant one hides the blocks (ChainDiverged)."""
    x = torch.randn(8, 16, requires_grad=True)
    rotor = Checkpointable(Looped(reentrant), mem_limit="100%", discover="modules")
    with pytest.raises(NotImplementedError) as caught:
        rotor(x)
    said = str(caught.value)
    assert "\n" not in said
    assert said.startswith("Looped's forward calls blocks.0 and 3 more through torch.utils.checkpoint")
    assert "discover='graph'" in said


@pytest.mark.parametrize("reentrant", [False, True])
def test_blocks_called_through_checkpoint_train_bitwise_under_auto(reentrant):
    x = torch.randn(8, 16, requires_grad=True)
    plain, model = Looped(reentrant), Looped(reentrant)
    plain(x).backward()
    with pytest.warns(UserWarning, match="torch.utils.checkpoint"):
        Checkpointable(model, mem_limit="60%")(x).backward()
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
