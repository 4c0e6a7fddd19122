"""RotorDDPStrategy over gloo with 2 CPU processes (ddp_spawn) trains exactly like plain DDP.

Two chains under test: a `Sequential` (wrapped as it is) and a GPT whose forward loops over a `ModuleList`
(discovered in every process), each at its own budget fraction. Each spawn starts two interpreters, so plain
DDP trains both in one model (each part's gradients are its own loss's: the same as training it alone), and
rotor trains each in a model of its own.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from fitting import quiet_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_rotor.bench.any_models import GPT
from lightning_rotor.lightning import RotorDDPStrategy
from lightning_rotor.lightning.state import rotor_modules

pytestmark = pytest.mark.slow  # two spawned processes per fit

PARTS = ("net", "model")


class Net(pl.LightningModule):
    """`net`: a Sequential chain; `model`: a GPT whose forward loops over a ModuleList (no Sequential chain).
    Each part is built from its own seed, so it starts the same whichever parts the module has."""

    def __init__(self, parts=PARTS):
        super().__init__()
        if "net" in parts:
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
        if "model" in parts:
            torch.manual_seed(1)
            # no dropout: spawned processes draw unseeded random numbers, plain and rotor alike
            self.model = GPT(vocab_size=32, block_size=16, n_layer=3, n_head=2, n_embd=16, dropout=0.0)
            # untied: a weight two stages use is refused under DDP (tests/test_checkpointable_any.py)
            self.model.lm_head.weight = nn.Parameter(self.model.lm_head.weight.detach().clone())

    def training_step(self, batch, batch_idx):
        x, y, idx, targets = batch
        loss = 0
        if hasattr(self, "net"):
            loss = loss + F.cross_entropy(self.net(x), y)
        if hasattr(self, "model"):
            logits = self.model(idx)
            loss = loss + F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def loader() -> DataLoader:
    """64 samples of 12 features and one of 5 classes, beside 64 sequences of 16 tokens and their next tokens."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 12, generator=g), torch.randint(0, 5, (64,), generator=g)
    tokens = torch.randint(32, (64, 17), generator=g)
    return DataLoader(TensorDataset(x, y, tokens[:, :-1], tokens[:, 1:]), batch_size=8)


class Report(pl.Callback):
    """Each process writes, per chain, how it was found and how many stages its plan recomputes (the spawned
    processes are not ours to inspect)."""

    def __init__(self, folder):
        self.folder = folder

    def on_train_end(self, trainer, pl_module):
        for name, rotor in rotor_modules(pl_module).items():
            recomputed = sum(r > 1 for r in rotor.last_entry.runs)
            kind = rotor.discovery.kind if rotor.discovery is not None else "sequential"
            (self.folder / f"{name}{trainer.global_rank}").write_text(f"{kind} {recomputed}")


def state(module, part):
    return getattr(module, part).state_dict()


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """Both parts trained by plain DDP, in one spawn."""
    model = Net()
    quiet_trainer(tmp_path_factory.mktemp("plain"), "ddp_spawn", devices=2).fit(model, loader())
    untrained = Net()
    for part in PARTS:  # the comparisons below compare trained weights
        pairs = zip(state(model, part).values(), state(untrained, part).values(), strict=True)
        assert any(not torch.equal(a, b) for a, b in pairs), part
    return model


def rotor_fit(tmp_path, part, mem_limit):
    model = Net(parts=(part,))
    strategy = RotorDDPStrategy(mem_limit=mem_limit, start_method="spawn")
    quiet_trainer(tmp_path, strategy, devices=2, callbacks=[Report(tmp_path)]).fit(model, loader())
    return model


def assert_same_weights(rotor, plain, part):
    for (name, a), b in zip(state(rotor, part).items(), state(plain, part).values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_rotor_ddp_spawn_equals_plain_ddp(tmp_path, plain):
    rotor = rotor_fit(tmp_path, "net", 0.7)
    assert all(int((tmp_path / f"net{r}").read_text().split()[1]) > 0 for r in (0, 1))  # both processes recomputed
    assert isinstance(rotor.net, nn.Sequential) and type(rotor.net) is nn.Sequential
    assert_same_weights(rotor, plain, "net")


def test_rotor_ddp_spawn_on_a_discovered_chain_equals_plain_ddp(tmp_path, plain):
    rotor = rotor_fit(tmp_path, "model", 0.5)
    for rank in (0, 1):
        kind, recomputed = (tmp_path / f"model{rank}").read_text().split()
        assert kind == "graph" and int(recomputed) > 0
    assert_same_weights(rotor, plain, "model")
