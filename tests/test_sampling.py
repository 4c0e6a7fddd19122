"""Which steps the memory probe samples, with a last partial batch: a full batch and a partial one run two plans
(under a byte budget the full batch recomputes, the partial one does not), and each plan gets its sample, through a
real Trainer with `RotorCallback` and through Fabric with `RotorFabricStrategy`."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from fitting import quiet_trainer
from lightning.fabric import Fabric
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_rotor.fabric import RotorFabricStrategy
from lightning_rotor.lightning import RotorCallback, RotorStrategy
from lightning_rotor.lightning.callback import schedule_key

BUDGET = 60_000  # bytes: the full batch (32 rows, 98,568 bytes kept whole) recomputes; the partial one (8) fits
# every shape timed (no times derived by FLOPs, which a step's wall time could send back to be timed: a new
# profile under the probe spoils a sample, whatever the sampling)
TIMED = dict(mem_limit=BUDGET, derive_shapes=False)
ROWS = (32, 32, 8) * 3  # three epochs of two full batches and a partial one


def net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(64, 64), nn.Tanh())])


class ByKeyword(nn.Module):
    """The same layers, called as Hugging Face models are: `model(features=x)`."""

    def __init__(self):
        super().__init__()
        self.body = net()

    def forward(self, features):
        return self.body(features)


def batch(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 64, generator=g), torch.randint(0, 64, (rows,), generator=g)


class Epochs(Dataset):
    def __len__(self):
        return len(ROWS)

    def __getitem__(self, i):
        return batch(ROWS[i], seed=i)


class Classifier(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = net()

    def training_step(self, b, batch_idx):
        x, y = b
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def noted(measurements, samples):
    """Adds the schedule each measurement (..., chain, measurement, entries before) sampled to `samples` (None:
    the sample was spoilt)."""
    for measurement in measurements:
        rotor, m, before = measurement[-3:]
        samples.append(schedule_key(m.entry) if len(rotor.entries) == before else None)


class Sampled(RotorCallback):
    """RotorCallback that notes the schedule each probed step measured (None: a spoilt sample) and each step
    that profiled nothing ran."""

    def __init__(self):
        super().__init__(log_curves=False, print_summary=False)
        self.samples: list[tuple[str, ...] | None] = []
        self.ran: set[tuple[str, ...]] = set()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        noted(self._measurements, self.samples)
        if len(pl_module.net.entries) == self._entries_before["net"]:  # not a profiling step (never sampled)
            self.ran.add(schedule_key(pl_module.net.last_entry))
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)


def test_the_trainer_samples_the_full_and_the_partial_batch_s_plans_once_each(tmp_path):
    """Each plan's first step of a known shape is probed, once: the partial batch's plan too, and not the
    full batch after each partial one (which ran the full batch's plan, measured already)."""
    sampled = Sampled()
    trainer = quiet_trainer(tmp_path, RotorStrategy(**TIMED), max_steps=len(ROWS), callbacks=[sampled])
    trainer.fit(Classifier(), DataLoader(Epochs(), batch_size=None))
    assert len(sampled.ran) == 2  # the full batch's plan and the partial batch's
    assert sorted(sampled.samples) == sorted(sampled.ran), sampled.samples


class SampledFabric(RotorFabricStrategy):
    """RotorFabricStrategy that notes the schedule each probed step measured (None: a spoilt sample) and each
    step that profiled nothing ran."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.samples: list[tuple[str, ...] | None] = []
        self.ran: set[tuple[str, ...]] = set()

    def _end_step(self, seconds):
        noted(self._measurements, self.samples)
        rotor = self.chains["model"]
        if len(rotor.entries) == self._entries_before["model"]:  # not a profiling step (never sampled)
            self.ran.add(schedule_key(rotor.last_entry))
        super()._end_step(seconds)


@pytest.mark.parametrize("by_keyword", [False, True], ids=["model(x)", "model(features=x)"])
def test_fabric_samples_the_full_and_the_partial_batch_s_plans_once_each(by_keyword):
    """The step's batch is what its first training forward is given, by position or by keyword (Hugging Face
    models are called with `input_ids=...`), as the Trainer's is its batch."""
    strategy = SampledFabric(**TIMED, print_summary=False)
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=1)
    model = ByKeyword() if by_keyword else net()
    model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.05))
    for i, rows in enumerate(ROWS):
        x, y = batch(rows, seed=i)
        opt.zero_grad()
        fabric.backward(F.cross_entropy(model(features=x) if by_keyword else model(x), y))
        opt.step()
    assert len(strategy.ran) == 2
    assert sorted(strategy.samples) == sorted(strategy.ran), strategy.samples
