"""RotorDDPStrategy over gloo with 2 CPU processes (ddp_spawn) trains exactly like plain DDP."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from fitting import classes_loader, quiet_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_rotor.lightning import RotorDDPStrategy
from lightning_rotor.lightning.state import rotor_modules

pytestmark = pytest.mark.slow  # two spawned processes per fit


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.net = nn.Sequential(
            nn.Linear(12, 32),
            nn.BatchNorm1d(32),
            nn.ReLU(),
            nn.Linear(32, 32),
            nn.Tanh(),
            nn.Linear(32, 32),
            nn.GELU(),
            nn.Linear(32, 32),
            nn.Sigmoid(),
            nn.Linear(32, 5),
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class Report(pl.Callback):
    """Each process writes how many stages its plan recomputes (the spawned processes are not ours to inspect)."""

    def __init__(self, folder):
        self.folder = folder

    def on_train_end(self, trainer, pl_module):
        runs = rotor_modules(pl_module)["net"].last_entry.runs
        (self.folder / f"rank{trainer.global_rank}").write_text(str(sum(r > 1 for r in runs)))


def fit(tmp_path, strategy, callbacks=()) -> Net:
    model = Net()
    quiet_trainer(tmp_path, strategy, devices=2, callbacks=list(callbacks)).fit(model, classes_loader())
    return model


def test_rotor_ddp_spawn_equals_plain_ddp(tmp_path):
    plain = fit(tmp_path / "plain", "ddp_spawn")
    rotor = fit(tmp_path / "rotor", RotorDDPStrategy(mem_limit=0.7, start_method="spawn"), [Report(tmp_path)])
    assert all(int((tmp_path / f"rank{r}").read_text()) > 0 for r in (0, 1))  # both processes recomputed
    untrained = Net()
    assert any(
        not torch.equal(a, b) for a, b in zip(plain.state_dict().values(), untrained.state_dict().values(), strict=True)
    )
    assert isinstance(rotor.net, nn.Sequential) and type(rotor.net) is nn.Sequential
    for (name, a), b in zip(rotor.state_dict().items(), plain.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


class GPTNet(pl.LightningModule):
    """A GPT whose forward loops over a ModuleList (no Sequential chain): discovered in every process."""

    def __init__(self):
        super().__init__()
        from lightning_rotor.bench.any_models import GPT

        torch.manual_seed(1)
        # no dropout: spawned processes draw unseeded random numbers, plain and rotor alike
        self.model = GPT(vocab_size=32, block_size=16, n_layer=3, n_head=2, n_embd=16, dropout=0.0)
        # untied: a weight two stages use is refused under DDP (tests/test_checkpointable_any.py)
        self.model.lm_head.weight = nn.Parameter(self.model.lm_head.weight.detach().clone())

    def training_step(self, batch, batch_idx):
        idx, targets = batch
        logits = self.model(idx)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class ReportKind(pl.Callback):
    def __init__(self, folder):
        self.folder = folder

    def on_train_end(self, trainer, pl_module):
        rotor = rotor_modules(pl_module)["model"]
        runs = rotor.last_entry.runs
        (self.folder / f"gpt{trainer.global_rank}").write_text(f"{rotor.discovery.kind} {sum(r > 1 for r in runs)}")


def test_rotor_ddp_spawn_on_a_discovered_chain_equals_plain_ddp(tmp_path):
    g = torch.Generator().manual_seed(0)
    data = torch.randint(32, (32, 17), generator=g)
    tokens = DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=4)
    models = {}
    for name, strategy, callbacks in (
        ("plain", "ddp_spawn", []),
        ("rotor", RotorDDPStrategy(mem_limit=0.5, start_method="spawn"), [ReportKind(tmp_path)]),
    ):
        model = GPTNet()
        quiet_trainer(tmp_path / name, strategy, devices=2, callbacks=callbacks).fit(model, tokens)
        models[name] = model
    for rank in (0, 1):
        kind, recomputed = (tmp_path / f"gpt{rank}").read_text().split()
        assert kind == "graph" and int(recomputed) > 0
    for (key, a), b in zip(models["rotor"].state_dict().items(), models["plain"].state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=key)
