"""Lightning helpers shared by the test files: a quiet Trainer, and the data and callbacks their tests share.

Plain functions, not fixtures: they take the folder, strategy and options of each run as arguments.
"""

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_rotor.lightning.state import rotor_modules


def quiet_trainer(root, strategy="auto", **kw) -> pl.Trainer:
    """A CPU Trainer of 3 steps under `root` that writes and prints nothing a test did not ask for (no logger,
    checkpoint, progress bar or model summary); any keyword overrides these."""
    quiet = dict(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return pl.Trainer(strategy=strategy, default_root_dir=root, **{**quiet, **kw})


def classes_loader(n: int = 64, batch_size: int = 8) -> DataLoader:
    """`n` samples of 12 random features and one of 5 classes, the same at every call."""
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(n, 12, generator=g), torch.randint(0, 5, (n,), generator=g))
    return DataLoader(data, batch_size=batch_size)


class KeepRotorModules(pl.Callback):
    """The rotor modules at the end of training, by name (the strategy unwraps them at teardown)."""

    def __init__(self):
        self.modules = {}

    def on_train_end(self, trainer, pl_module):
        self.modules = rotor_modules(pl_module)


class SaveAtEnd(pl.Callback):
    """Saves a checkpoint to `path` when training ends, for a later fit to resume from."""

    def __init__(self, path):
        self.path = path

    def on_train_end(self, trainer, pl_module):
        trainer.save_checkpoint(self.path)
