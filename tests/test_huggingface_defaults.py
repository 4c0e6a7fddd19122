"""A Hugging Face causal LM with its default config (`use_cache=True`) trains under rotor, as under
Hugging Face's own gradient checkpointing: the KV cache is off in training, with one warning."""

from __future__ import annotations

import copy
import warnings

import lightning.pytorch as pl
import pytest
import torch
from hf_models import tiny_llama
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_rotor.checkpointable import Checkpointable
from lightning_rotor.huggingface import without_kv_cache
from lightning_rotor.lightning import RotorStrategy
from lightning_rotor.lightning.state import rotor_modules

torch.set_num_threads(1)


def llama() -> nn.Module:
    """A four-layer Llama from a small config, its defaults untouched (`use_cache=True`); nothing downloaded."""
    model = tiny_llama()
    assert model.config.use_cache  # the default this file is about
    return model


def tokens(n: int = 16, t: int = 16) -> torch.Tensor:
    return torch.randint(64, (n, t), generator=torch.Generator().manual_seed(0))


def cache_warnings(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if "use_cache" in str(w.message) and "rotor" in str(w.message)]


def train(model: nn.Module, batches: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """SGD steps on next-token loss (labels= the input, as HF shifts them); the gradients of every step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for x in batches:
        opt.zero_grad()
        model(input_ids=x, labels=x).loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return grads


def assert_bitwise(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> None:
    assert len(a) == len(b)
    for step_a, step_b in zip(a, b, strict=True):
        for x, y in zip(step_a, step_b, strict=True):
            assert torch.equal(x, y)


# -- the rule ------------------------------------------------------------------------------------------------
class Cached(nn.Module):
    def __init__(self, default: bool | None):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.default = default

    def forward(self, x, use_cache=None):
        return self.lin(x)


class CachedOn(Cached):
    def forward(self, x, use_cache=True):
        return self.lin(x)


class Configured(Cached):
    def __init__(self):
        super().__init__(None)
        self.config = type("Config", (), {"use_cache": True})()


class NoCache(nn.Module):
    def forward(self, x, **kwargs):
        return x


def test_rule_mirrors_hugging_face():
    x = torch.zeros(1)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert without_kv_cache(NoCache(), (x,), {"use_cache": True}) == ((x,), {"use_cache": True})  # not ours
        assert without_kv_cache(Cached(None), (x,), {}) == ((x,), {})  # no default, no config: off already
        assert without_kv_cache(Cached(None), (x,), {"use_cache": False}) == ((x,), {"use_cache": False})
        assert cache_warnings(record) == []
        configured = Configured()
        assert without_kv_cache(configured, (x,), {}) == ((x,), {"use_cache": False})  # the config's True
        assert without_kv_cache(configured, (x,), {"use_cache": None}) == ((x,), {"use_cache": False})
        assert without_kv_cache(configured, (x,), {"use_cache": False}) == ((x,), {"use_cache": False})
        assert len(cache_warnings(record)) == 1  # once per module
        assert without_kv_cache(CachedOn(None), (x,), {}) == ((x,), {"use_cache": False})  # the default's True
        assert without_kv_cache(Cached(None), (x, True), {}) == ((x, False), {})  # explicit True too, as HF does
        assert len(cache_warnings(record)) == 3


# -- a real model ---------------------------------------------------------------------------------------------
def test_default_config_trains_through_checkpointable_like_plain_without_cache():
    pytest.importorskip("transformers")
    model = llama()
    plain = copy.deepcopy(model)
    plain.config.use_cache = False
    batches = [tokens()[:8], tokens()[8:]]
    rotor = Checkpointable(model, "50%", discover="modules", repeats=1)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = train(rotor, batches)
    assert len(cache_warnings(record)) == 1
    assert rotor.stage_names == [f"model.layers.{i}" for i in range(4)]
    assert sum(r > 1 for r in rotor.last_entry.runs) > 0  # the budget really recomputes
    assert model.config.use_cache  # the user's config is left as it was
    assert_bitwise(got, train(plain, batches))


class CausalLM(pl.LightningModule):
    def __init__(self, use_cache: bool):
        super().__init__()
        self.model = llama()
        self.model.config.use_cache = use_cache
        self.grads: list[list[torch.Tensor]] = []
        self.keep: dict[str, Checkpointable] = {}

    def training_step(self, batch, batch_idx):
        self.keep = self.keep or rotor_modules(self)
        (x,) = batch
        return self.model(input_ids=x, labels=x).loss

    def on_before_optimizer_step(self, optimizer):
        self.grads.append([p.grad.detach().clone() for p in self.parameters()])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_default_config_trains_through_a_trainer_like_plain_without_cache(tmp_path):
    pytest.importorskip("transformers")
    runs = {}
    for name, strategy, use_cache in (
        ("plain", "auto", False),
        ("rotor", RotorStrategy("50%", discover="modules"), True),
    ):
        model = CausalLM(use_cache)
        trainer = pl.Trainer(
            strategy=strategy,
            accelerator="cpu",
            devices=1,
            default_root_dir=tmp_path / name,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            max_steps=2,
        )
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            trainer.fit(model, DataLoader(TensorDataset(tokens()), batch_size=8))
        runs[name] = model, cache_warnings(record)
    (plain, plain_warned), (rotor, rotor_warned) = runs["plain"], runs["rotor"]
    assert plain_warned == [] and len(rotor_warned) == 1
    wrapped = rotor.keep["model"]
    assert wrapped.discovery.kind == "modules" and sum(r > 1 for r in wrapped.last_entry.runs) > 0
    assert_bitwise(rotor.grads, plain.grads)
