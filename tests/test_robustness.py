"""Unusual but legal PyTorch use around a rotor module: copies, threads, autograd variants, resumes."""

from __future__ import annotations

import copy
import gc
import io
import pickle

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, TensorDataset

from lightning_rotor.checkpointable import Checkpointable
from lightning_rotor.lightning import RotorStrategy

torch.set_num_threads(1)


def dropout_net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[m for _ in range(5) for m in (nn.Linear(24, 24), nn.Tanh(), nn.Dropout(0.2))],
                         nn.Linear(24, 4))


def data(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(16, 24, generator=g), torch.randint(0, 4, (16,), generator=g)


def step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    return loss.detach()


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def raw_handles(root: object) -> list[str]:
    """Storage weak references or dispatch modes reachable from `root` (the object graph, not tensors' data)."""
    found, seen, todo = [], set(), [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (torch.Tensor, type)):
            continue
        seen.add(id(obj))
        if isinstance(obj, (StorageWeakRef, TorchDispatchMode)):
            found.append(type(obj).__name__)
        todo.extend(gc.get_referents(obj))
    return found


# -- 1. copies of a measured module ---------------------------------------------------------------------
def measured_rotor() -> tuple[Checkpointable, torch.Tensor, torch.Tensor]:
    rotor = Checkpointable(dropout_net(), 0.5)
    x, y = data()
    with rotor.measure_step() as m:
        step(rotor, x, y)
    assert m.peak > 0 and rotor.plan.recomputed_stages > 0
    return rotor, x, y


def test_measured_module_holds_no_storage_handles():
    rotor, _, _ = measured_rotor()
    assert raw_handles(rotor) == []
    assert rotor.last_measurement.peak > 0 and rotor.last_measurement.curve  # the figures stay


def _save_load(module: nn.Module) -> nn.Module:
    buf = io.BytesIO()
    torch.save(module, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_copy_after_a_measured_step_trains_bitwise_like_the_original(how):
    rotor, x, y = measured_rotor()
    copier = {"deepcopy": copy.deepcopy, "pickle": lambda m: pickle.loads(pickle.dumps(m)),
              "torch.save": _save_load}[how]
    twin = copier(rotor)
    assert twin.entries.keys() == rotor.entries.keys()  # the plan travels with the copy
    for _ in range(2):
        torch.manual_seed(5)
        loss_a = step(rotor, x, y)
        torch.manual_seed(5)
        loss_b = step(twin, x, y)
        assert torch.equal(loss_a, loss_b)
        for a, b in zip(grads(rotor), grads(twin), strict=True):
            assert torch.equal(a, b)
    # the copy trains its own parameters, not the original's
    assert all(p.grad is not None for p in twin.parameters())
    assert not any(a is b for a, b in zip(rotor.parameters(), twin.parameters(), strict=True))
    del twin
    gc.collect()


def test_copy_while_a_step_is_measured():
    rotor = Checkpointable(dropout_net(), 0.5)
    x, y = data()
    step(rotor, x, y)  # plans
    with rotor.measure_step():
        loss = F.cross_entropy(rotor(x), y)
        twin = copy.deepcopy(rotor)
        loss.backward()
    assert twin._measurement is None and raw_handles(twin) == []
    step(twin, x, y)
    assert all(p.grad is not None for p in twin.parameters())


class LitNet(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = dropout_net()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class DeepCopies(pl.Callback):
    """EMA/teacher style: deep-copies the LightningModule at several points of every step."""

    def __init__(self):
        self.copies = 0

    def _copy(self, pl_module):
        twin = copy.deepcopy(pl_module)
        twin.net(torch.randn(4, 24)).sum().backward()
        self.copies += 1

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._copy(pl_module)

    def on_before_backward(self, trainer, pl_module, loss):
        self._copy(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._copy(pl_module)


def lit_loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(48, 24, generator=g), torch.randint(0, 4, (48,), generator=g)),
                      batch_size=16)


def lit_trainer(tmp_path, **kw) -> pl.Trainer:
    kw.setdefault("max_steps", 3)
    return pl.Trainer(accelerator="cpu", devices=1, default_root_dir=tmp_path, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, **kw)


def test_callback_deep_copying_the_module_during_fit(tmp_path):
    copies = DeepCopies()
    lit_trainer(tmp_path, strategy=RotorStrategy(mem_limit=0.5), enable_checkpointing=False,
                callbacks=[copies]).fit(LitNet(), lit_loader())
    assert copies.copies == 9
