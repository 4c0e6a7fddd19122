"""Checkpointable chains inside a real DistributedDataParallel (gloo, one process: DDP's reducer and its
accumulator hooks run as with several; tests/test_lightning_ddp.py spawns two through a Trainer)."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_rotor import Checkpointable


def chain() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 16)
    )


class TwoChains(nn.Module):
    """A trainable layer, then two chains in a row, then a head: chain b's backward runs before chain a's."""

    def __init__(self, rotor: bool, by_hand: bool = False):
        super().__init__()
        torch.manual_seed(1)
        self.stem, self.a, self.b, self.head = nn.Linear(12, 16), chain(), chain(), nn.Linear(16, 5)
        if rotor:
            self.a, self.b = Checkpointable(self.a, 0.9), Checkpointable(self.b, 0.9)
            self.a.distributed = self.b.distributed = by_hand  # what RotorDDPStrategy sets; found without it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.b(self.a(self.stem(x))))


def train(rotor: bool, by_hand: bool = False) -> TwoChains:
    model = TwoChains(rotor, by_hand)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        x, y = torch.randn(8, 12, generator=g), torch.randint(0, 5, (8,), generator=g)
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
    return model


@pytest.mark.parametrize("by_hand", [True, False], ids=["distributed-set", "plain-torch-ddp"])
def test_two_chains_in_one_ddp_model_train_as_plain_ddp(tmp_path, by_hand):
    """Plain torch DDP (torchrun, no Lightning): the chains find the reducer themselves."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        plain, rotor = train(False), train(True, by_hand)
    finally:
        dist.destroy_process_group()
    assert all(sum(r > 1 for r in c.last_entry.runs) > 0 for c in (rotor.a, rotor.b))  # both recomputed
    for (name, p), q in zip(plain.state_dict().items(), rotor.state_dict().values(), strict=True):
        torch.testing.assert_close(q, p, rtol=0, atol=0, msg=name)


def test_tied_weight_under_plain_torch_ddp_refused_in_one_line(tmp_path):
    torch.manual_seed(0)
    shared = nn.Linear(16, 16)
    model = nn.Sequential(
        nn.Linear(12, 16), Checkpointable(nn.Sequential(shared, nn.Tanh(), nn.Linear(16, 16), nn.GELU(), shared), 0.9)
    )
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    ddp = None
    try:
        ddp = nn.parallel.DistributedDataParallel(model)
        with pytest.raises(RuntimeError, match=r"^rotor under DDP: parameter '0.weight' is used by stages 0, 4") as e:
            ddp(torch.randn(8, 12)).sum().backward()
        message = str(e.value)
        del e  # its traceback's frames hold the DDP module
    finally:
        del ddp  # DDP's reducer holds the group: gone before the group is (a gloo group dropped after can hang)
        gc.collect()
        dist.destroy_process_group()
    assert "\n" not in message and all(p.grad is None for p in model.parameters())
