"""RotorDDPStrategy over gloo with 2 CPU processes (ddp_spawn) trains exactly like plain DDP."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_rotor.lightning import RotorDDPStrategy
from lightning_rotor.lightning.state import rotor_modules


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.net = nn.Sequential(
            nn.Linear(12, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(),
            nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32), nn.Sigmoid(), nn.Linear(32, 5),
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


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 12, generator=g), torch.randint(0, 5, (64,), generator=g))
    return DataLoader(data, batch_size=8)


def fit(tmp_path, strategy, callbacks=()) -> Net:
    model = Net()
    pl.Trainer(strategy=strategy, callbacks=list(callbacks), accelerator="cpu", devices=2, max_steps=3, logger=False,
               default_root_dir=tmp_path, enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False).fit(model, loader())
    return model


def test_rotor_ddp_spawn_equals_plain_ddp(tmp_path):
    plain = fit(tmp_path / "plain", "ddp_spawn")
    rotor = fit(tmp_path / "rotor", RotorDDPStrategy(mem_limit=0.6, start_method="spawn"), [Report(tmp_path)])
    assert all(int((tmp_path / f"rank{r}").read_text()) > 0 for r in (0, 1))  # both processes recomputed
    untrained = Net()
    assert any(not torch.equal(a, b) for a, b in zip(plain.state_dict().values(), untrained.state_dict().values(),
                                                      strict=True))
    assert isinstance(rotor.net, nn.Sequential) and type(rotor.net) is nn.Sequential
    for (name, a), b in zip(rotor.state_dict().items(), plain.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
