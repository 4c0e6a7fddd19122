"""A tensor the forward makes from constants alone (`torch.ones(16, 16)`) is one constant of a traced graph, shared by
every call; an in-place write into it that depends on the call (`mask[t:] = 0`, `keep.masked_fill_(x < 0, 0)`) would
carry over to the next call. Graph discovery refuses such a forward in one line (file and line); `discover="auto"`
then falls back to module runs, which train bitwise like plain training over changing lengths and within budget;
through `Checkpointable` and a real Trainer. (Before, `mask[t:] = 0` raised `GuardFailed` on another length, or, with
sizes recorded, trained silently wrong; the masked fill trained silently wrong once the sign flipped.)"""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from fitting import fit_like_plain
from torch import nn
from training import assert_same_state

from lightning_rotor import Checkpointable
from lightning_rotor.discovery import DiscoveryError
from lightning_rotor.lightning import RotorStrategy

W = 16


def cut_to_length(h: torch.Tensor, x: torch.Tensor, t: int) -> torch.Tensor:
    mask = torch.ones(32, W)
    mask[t:] = 0  # a constant, written with the call's length
    return h * mask[:t] + mask.sum()


def zeroed_where_negative(h: torch.Tensor, x: torch.Tensor, t: int) -> torch.Tensor:
    keep = torch.ones(W)
    keep.masked_fill_(x[0, 0, 0] < 0, 0.0)  # a constant, written where the call's input says
    return h * keep


FORMS = {
    "a mask cut to the length": cut_to_length,
    "a constant zeroed where the input is negative": zeroed_where_negative,
}
WRITES = {"a mask cut to the length": "__setitem__", "a constant zeroed where the input is negative": "masked_fill_"}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(W, W)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(h))


class Masked(nn.Module):
    def __init__(self, form: str):
        super().__init__()
        torch.manual_seed(0)
        self.form = form
        self.blocks = nn.ModuleList(Block() for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = FORMS[self.form](self.blocks[0](x), x, t)
        for block in self.blocks[1:]:
            h = block(h)
        return h


SHAPES = ((4, 16), (4, 12), (4, 16), (2, 9), (4, 16))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens of another length at each step, the first feature's sign flipping from step to step."""
    shape = SHAPES[step]
    g = torch.Generator().manual_seed(step)
    x = torch.randn(*shape, W, generator=g)
    x[0, 0, 0] = (-1) ** step * (1 + x[0, 0, 0].abs())
    return x, torch.randint(0, W, shape, generator=g)


def token_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


@pytest.mark.parametrize("form", FORMS)
def test_graph_discovery_refuses_a_constant_written_in_place_in_one_line_before_any_step(form):
    model = Masked(form)
    before = copy.deepcopy(model.state_dict())
    rotor = Checkpointable(model, "80%", discover="graph", repeats=1)
    x, y = batch(0)
    with pytest.raises(DiscoveryError) as refused:
        token_loss(rotor(x), y).backward()
    message = str(refused.value)
    assert "\n" not in message and "test_discovery_constants.py:" in message, message
    assert f"writes in place ({WRITES[form]}) into a tensor it made from constants" in message, message
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), before.values(), strict=True))


@pytest.mark.parametrize("form", FORMS)
def test_auto_discovery_falls_back_to_module_runs_and_trains_bitwise_over_new_lengths(form):
    """Each step bitwise plain training's gradients, measured within its plan's budget."""
    plain, rotor = Masked(form), Checkpointable(Masked(form), "80%", repeats=1)
    for step in range(len(SHAPES)):
        x, y = batch(step)
        plain.zero_grad()
        token_loss(plain(x), y).backward()
        rotor.zero_grad()
        if step:
            rotor.prepare_for(x)
        with rotor.measure_step() as m:
            token_loss(rotor(x), y).backward()
        assert_same_state(plain, rotor)
        assert not step or m.peak <= rotor.plan.budget
    assert rotor.discovery.kind == "modules", rotor.discovery.notes
    assert rotor.plan.recomputed_stages > 0
    assert "writes in place" in rotor.discovery.notes[0]


class Task(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = Masked("a mask cut to the length")

    def training_step(self, batch, batch_idx):
        x, y = batch
        return token_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def test_the_trainer_trains_such_a_forward_over_new_lengths_bitwise_within_budget(tmp_path):
    batches = [batch(step) for step in range(len(SHAPES))]
    plain, rotor = Task(), Task()
    fit_like_plain(tmp_path, plain, rotor, RotorStrategy(mem_limit="80%"), batches)
