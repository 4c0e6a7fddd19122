"""Tensors made in the forward with a size taken from the input (`torch.ones(x.shape[0], 1)`): graph discovery
records the factory with the size itself, so each batch (a last partial one too) gets tensors of its own size,
trains bitwise like plain training and stays within its budget; through `Checkpointable` and a real Trainer."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from fitting import KeepRotorModules, quiet_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from training import assert_same_state

from lightning_rotor import Checkpointable
from lightning_rotor.discovery import discover_chain
from lightning_rotor.lightning import RotorStrategy

# how users write a tensor as long as the batch (`b = x.shape[0]`), each with several sizes
FORMS = {
    "ones, sizes as arguments": lambda x, b: torch.ones(b, 1),
    "zeros with a device": lambda x, b: torch.zeros(b, 32, device=x.device),
    "randn, sizes as arguments": lambda x, b: torch.randn(b, 1),
    "empty then filled": lambda x, b: torch.empty(b, 32).fill_(0.5),
    "new_zeros": lambda x, b: x.new_zeros(b, 32),
    "full, sizes as a tuple": lambda x, b: torch.full((b, 1), 2.0),
    "ones, the batch size second": lambda x, b: torch.ones(1, b).t(),
}


class Shifted(nn.Module):
    """Eight layers with a tensor as long as the batch added after the first (a diffusion model's broadcast
    timesteps, a padding mask)."""

    def __init__(self, form: str):
        super().__init__()
        torch.manual_seed(0)
        self.form = form
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.layers[0](x))
        h = h + FORMS[self.form](h, x.shape[0])
        for layer in self.layers[1:]:
            h = torch.tanh(layer(h))
        return h


BATCHES = (48, 48, 20)  # the last one partial


def batch(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Features and one of 32 classes (the loss the profiler stands in: cross-entropy over the last dimension)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 32, generator=g), torch.randint(0, 32, (rows,), generator=g)


@pytest.mark.parametrize("form", FORMS)
def test_graph_discovery_records_a_factory_sized_by_the_batch_and_a_partial_batch_trains_bitwise(form):
    """Each step bitwise plain training's gradients, measured within its plan's budget; the chain the graph's."""
    plain, rotor = Shifted(form), Checkpointable(Shifted(form), "60%", discover="graph", repeats=1)
    for step, rows in enumerate(BATCHES):
        x, y = batch(rows, step)
        plain.zero_grad()
        torch.manual_seed(step)
        F.cross_entropy(plain(x), y).backward()
        rotor.zero_grad()
        if step:  # the first step discovers and profiles (a profiling step is not held to the budget)
            rotor.prepare_for(x)
        torch.manual_seed(step)
        with rotor.measure_step() as m:
            F.cross_entropy(rotor(x), y).backward()
        assert_same_state(plain, rotor)
        assert m.peak <= rotor.last_entry.plan.budget or not step
    assert rotor.discovery is not None and rotor.discovery.graph is not None
    assert len(rotor.entries) == 2  # the full batches' plan and the partial one's


@pytest.mark.parametrize("form", FORMS)
def test_auto_discovery_traces_the_forward_and_fixes_no_batch_size(form):
    """The forward is traced (no fallback), and no guard holds the batch size to the sample's."""
    found = discover_chain(Shifted(form), (torch.randn(4, 32),))
    assert found.graph is not None and found.notes[0] == "graph: 8 stages, 0 shape guard(s)", found.notes


class Regressor(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = Shifted("zeros with a device")

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def test_the_trainer_trains_a_model_making_batch_sized_tensors_over_a_partial_batch_bitwise(tmp_path):
    """120 samples in batches of 48: the last batch has 24. The weights after the epoch are plain training's."""
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(120, 32, generator=g), torch.randint(0, 32, (120,), generator=g))
    plain, rotor, keep = Regressor(), Regressor(), KeepRotorModules()
    torch.manual_seed(7)
    quiet_trainer(tmp_path / "plain", max_steps=3).fit(plain, DataLoader(data, batch_size=48))
    torch.manual_seed(7)
    trainer = quiet_trainer(tmp_path / "rotor", RotorStrategy(mem_limit="60%", discover="graph"), max_steps=3)
    trainer.callbacks.append(keep)
    trainer.fit(rotor, DataLoader(data, batch_size=48))
    assert len(keep.modules["net"].entries) == 2
    for (key, a), b in zip(rotor.state_dict().items(), plain.state_dict().values(), strict=True):
        assert torch.equal(a, b), key
