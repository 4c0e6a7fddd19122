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


def fit_like_plain(root, plain: pl.LightningModule, rotor: pl.LightningModule, strategy, batches, seed=None):
    """`plain` fitted by a plain Trainer and `rotor` by `strategy` on the same `batches`, every rotor step measured:
    no step above its budget (the callback warns of one), and the weights after the fit plain training's."""
    import warnings

    from lightning_rotor.lightning import RotorCallback

    if seed is not None:
        torch.manual_seed(seed)
    quiet_trainer(root / "plain", max_steps=len(batches)).fit(plain, DataLoader(batches, batch_size=None))
    sample = RotorCallback(measure_every_n_steps=1, log_curves=False, print_summary=False)
    trainer = quiet_trainer(root / "rotor", strategy, max_steps=len(batches), callbacks=[sample])
    if seed is not None:
        torch.manual_seed(seed)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.fit(rotor, DataLoader(batches, batch_size=None))
    assert not [str(w.message) for w in record if "above the budget" in str(w.message)]
    for (key, a), b in zip(rotor.state_dict().items(), plain.state_dict().values(), strict=True):
        assert torch.equal(a, b), key


def fit_both(root, make, loader, steps: int, strategy, callbacks=(), seed: int = 7) -> dict[str, pl.LightningModule]:
    """`make()` fitted for `steps` steps by a plain Trainer ("plain") and by `strategy` with `callbacks`
    ("rotor"), each from `seed`."""
    runs = {}
    for name, chosen in (("plain", "auto"), ("rotor", strategy)):
        model = make()
        torch.manual_seed(seed)
        trainer = quiet_trainer(root / name, chosen, max_steps=steps)
        if name == "rotor":
            trainer.callbacks.extend(callbacks)
        trainer.fit(model, loader)
        runs[name] = model
    return runs
