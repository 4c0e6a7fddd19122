"""Random tensors made in the forward from constants (`torch.randn(16)`, a mask from `torch.rand(1, 16)`,
dropout of a constant): graph discovery records the draw as an op, so each step draws anew as plain training does;
through `Checkpointable` and a real Trainer. (Before, the trace's one draw was frozen into the graph as a constant:
the same noise at every step and every later draw of the step shifted, so gradients silently differed from plain
training's.)"""

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
from lightning_rotor.lightning import RotorStrategy

W = 16


FORMS = {
    "noise of a fixed size": lambda m, h: h + 0.1 * torch.randn(W),
    "a random mask from constants": lambda m, h: h * (torch.rand(1, W) > 0.3),
    "bernoulli of a constant": lambda m, h: h * torch.bernoulli(torch.full((W,), 0.7)),
    "dropout of a constant": lambda m, h: h + F.dropout(torch.ones(W), 0.5),
}


class Noisy(nn.Module):
    def __init__(self, form: str):
        super().__init__()
        torch.manual_seed(0)
        self.form = form
        self.layers = nn.ModuleList(nn.Linear(W, W) for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.layers[0](x))
        h = FORMS[self.form](self, h)
        for layer in self.layers[1:]:
            h = F.dropout(torch.tanh(layer(h)), 0.1)  # a draw on the traced value after each, as usual
        return h


def batch(seed: int, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, W, generator=g), torch.randint(0, W, (rows,), generator=g)


@pytest.mark.parametrize("form", FORMS)
def test_a_draw_from_constants_is_drawn_at_every_step_as_in_plain_training(form):
    """Four steps of the graph chain, each bitwise plain training's gradients and within its budget."""
    plain, rotor = Noisy(form), Checkpointable(Noisy(form), "60%", discover="graph", repeats=1)
    for step in range(4):
        x, y = batch(step)
        plain.zero_grad()
        torch.manual_seed(step)
        F.cross_entropy(plain(x), y).backward()
        rotor.zero_grad()
        torch.manual_seed(step)
        with rotor.measure_step() as m:
            F.cross_entropy(rotor(x), y).backward()
        assert_same_state(plain, rotor)
        assert m.peak <= rotor.last_entry.plan.budget or not step  # the first step profiles
    assert rotor.discovery is not None and rotor.discovery.graph is not None
    assert rotor.plan.recomputed_stages > 0


class Task(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = Noisy("noise of a fixed size")

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def test_the_trainer_draws_the_noise_anew_at_every_step_bitwise(tmp_path):
    """Four steps of a real Trainer: the weights after them are plain training's; no sampled step above its budget."""
    batches = [batch(seed) for seed in range(4)]
    plain, rotor = Task(), Task()
    rotor.load_state_dict(copy.deepcopy(plain.state_dict()))
    fit_like_plain(tmp_path, plain, rotor, RotorStrategy(mem_limit="60%", discover="graph"), batches, seed=3)
