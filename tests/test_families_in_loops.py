"""The model families users bring (encoder-decoders, diffusers U-Nets, MoE with router logits, PEFT LoRA) in the
loops users run them in: Lightning Fabric, bf16-mixed precision, a Trainer with the default strategy settings,
resuming from a checkpoint, and batches whose shapes change. Each run is compared with the same loop without rotor
on the same seed: parameters bitwise after a few AdamW steps, measured activation peak within the budget."""

from __future__ import annotations

import copy
import logging
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from fitting import SaveAtEnd, quiet_trainer
from lightning.fabric import Fabric
from test_diffusers import unet
from test_encoder_decoder import bart, check_at_smallest, seq2seq_batches, t5
from test_moe import moe
from test_peft import lora_llama, without_cache
from torch import nn
from torch.utils.data import DataLoader

from lightning_rotor.checkpointable import Checkpointable
from lightning_rotor.fabric import RotorFabricStrategy
from lightning_rotor.lightning import RotorCallback, RotorStrategy
from lightning_rotor.lightning.callback import step_budget
from lightning_rotor.lightning.state import rotor_modules
from lightning_rotor.memory import MemoryProbe
from lightning_rotor.shared_budget import InfeasibleTotal

pytest.importorskip("transformers")

torch.set_num_threads(1)

Batch = dict
LossFn = Callable[[nn.Module, Batch], torch.Tensor]


def seq2seq_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    return model(**batch).loss


def lm_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    return model(input_ids=batch["x"], labels=batch["x"]).loss


def noise_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    return F.mse_loss(model(batch["sample"], batch["t"]).sample, batch["noise"])


def token_batches(n: int = 3, t: int = 16) -> list[Batch]:
    g = torch.Generator().manual_seed(0)
    return [{"x": torch.randint(64, (4, t), generator=g)} for _ in range(n)]


def noise_batches(n: int = 3) -> list[Batch]:
    g = torch.Generator().manual_seed(1)
    return [
        {
            "sample": torch.randn(4, 3, 16, 16, generator=g),
            "t": torch.randint(0, 1000, (4,), generator=g),
            "noise": torch.randn(4, 3, 16, 16, generator=g),
        }
        for _ in range(n)
    ]


FAMILIES: dict[str, tuple[Callable[[], nn.Module], Callable[[], list[Batch]], LossFn, str]] = {
    "t5": (t5, lambda: seq2seq_batches(3), seq2seq_loss, "80%"),
    "bart": (bart, lambda: seq2seq_batches(3), seq2seq_loss, "60%"),
    "unet": (unet, noise_batches, noise_loss, "50%"),  # 3-4 s a loop: its Fabric cases are slow
    "mixtral": (lambda: moe("mixtral", use_cache=False), token_batches, lm_loss, "50%"),
    "lora_llama": (lambda: without_cache(lora_llama("CAUSAL_LM")), token_batches, lm_loss, "50%"),
}


def fabric_loop(
    strategy: object, model: nn.Module, batches: list[Batch], loss: LossFn, precision: str = "32-true"
) -> tuple[Fabric, nn.Module]:
    """A user's Fabric loop: setup, then per batch zero_grad, forward, fabric.backward, AdamW step."""
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=1, precision=precision)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, opt = fabric.setup(model, opt)
    for i, batch in enumerate(batches):
        opt.zero_grad()
        torch.manual_seed(100 + i)  # dropout draws the same with and without rotor
        fabric.backward(loss(model, batch))
        opt.step()
    return fabric, model


def assert_same_parameters(plain: nn.Module, trained: nn.Module) -> None:
    for (n, a), (m, b) in zip(plain.named_parameters(), trained.named_parameters(), strict=True):
        assert n == m and torch.equal(a, b), n


def measured_peak(fabric: Fabric, model: nn.Module, batch: Batch, loss: LossFn) -> int:
    """One more step's activation peak, measured on the tensors themselves."""
    with MemoryProbe([model]) as probe:
        torch.manual_seed(7)
        fabric.backward(loss(model, batch))
    return probe.peak


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.slow) if f == "unet" else f for f in FAMILIES])
def test_fabric_loop_trains_like_plain_fabric_within_budget(family, precision):
    make, data, loss, budget = FAMILIES[family]
    model, batches = make(), data()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, plain = fabric_loop("auto", copy.deepcopy(model), batches, loss, precision)
        strategy = RotorFabricStrategy(mem_limit=budget, measure_every_n_steps=0, print_summary=False)
        fabric, rotor = fabric_loop(strategy, model, batches, loss, precision)
    assert_same_parameters(plain.module, rotor.module)
    # an encoder-decoder: its encoder and its decoder, two chains under the one budget
    assert len(strategy.chains) == (2 if family in ("t5", "bart") else 1)
    assert any(sum(r > 1 for r in c.last_entry.runs) > 0 for c in strategy.chains.values())  # really recomputes
    assert 0 < measured_peak(fabric, rotor, batches[0], loss) <= step_budget(strategy.chains)


# -- a Trainer with the default strategy settings (no include) ---------------------------------------------------
class Task(pl.LightningModule):
    """A LightningModule around a family's model: its loss on each batch, AdamW, dropout seeded per batch."""

    def __init__(self, model: nn.Module, loss: LossFn):
        super().__init__()
        self.model, self.loss = model, loss
        self.chains: dict[str, Checkpointable] = {}

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        self.chains = self.chains or rotor_modules(self)  # the strategy puts the modules back after fit
        torch.manual_seed(100 + batch_idx)
        return self.loss(self.model, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


def fit(root: Path, strategy: object, model: nn.Module, loss: LossFn, batches: list[Batch], **kw: Any) -> Task:
    """A fit of one step per batch; a sampled step above its budget (the callback's warning) fails it."""
    task = Task(model, loss)
    loader = DataLoader(batches, batch_size=None)  # the batches as they are, shapes and all
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        quiet_trainer(root, strategy, max_steps=len(batches), **kw).fit(task, loader)
    assert not [str(w.message) for w in record if "above the budget" in str(w.message)]
    return task


class MeasureLastBatch(pl.Callback):
    """At the end of training (the chains still wrapped) one more step on `batch`, measured on every tensor of the
    LightningModule's step, and the step budget of its chains."""

    def __init__(self, batch: Batch):
        self.batch, self.peak, self.budget, self.profiled = batch, 0, 0, True

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        chains = rotor_modules(pl_module)
        entries = [len(c.entries) for c in chains.values()]
        with MemoryProbe([pl_module]) as probe:
            torch.manual_seed(7)
            with trainer.precision_plugin.forward_context():
                value = pl_module.loss(pl_module.model, self.batch)
            value.backward()
        self.peak, self.budget = probe.peak, step_budget(chains)
        self.profiled = entries != [len(c.entries) for c in chains.values()]


@pytest.mark.parametrize(
    "family, strategy, precision",
    [
        ("t5", "rotor", "32-true"),
        ("bart", "60%", "32-true"),
        ("t5", "80%", "bf16-mixed"),
        ("mixtral", "50%", "bf16-mixed"),
    ],
)
def test_trainer_with_default_settings_trains_like_plain(tmp_path, family, strategy, precision):
    """Without include an encoder-decoder is wrapped as its encoder and its decoder, any other model as one chain;
    every step sampled (the callback warns of a sample above the budget), one more measured at the end."""
    make, data, loss, _ = FAMILIES[family]
    model, batches = make(), data()
    rotor_strategy = "rotor" if strategy == "rotor" else RotorStrategy(mem_limit=strategy)
    sample = RotorCallback(measure_every_n_steps=1, log_curves=False, print_summary=False)
    last = MeasureLastBatch(batches[0])
    plain = fit(tmp_path / "plain", "auto", copy.deepcopy(model), loss, batches, precision=precision)
    rotor = fit(tmp_path / "rotor", rotor_strategy, model, loss, batches, precision=precision, callbacks=[sample, last])
    assert_same_parameters(plain.model, rotor.model)
    assert len(rotor.chains) == (2 if family in ("t5", "bart") else 1)
    assert not last.profiled and 0 < last.peak <= last.budget


def test_a_budget_below_the_smallest_is_refused_in_one_line_before_any_step(tmp_path):
    """ "20%" of a BART's encoder and decoder chains is below their smallest total: one line naming each chain's
    smallest and the total to use, no parameter moved."""
    make, data, loss, _ = FAMILIES["bart"]
    model = make()
    before = copy.deepcopy(model)
    with pytest.raises(InfeasibleTotal, match=r"below the smallest feasible budget .* use mem_limit >= \d+") as err:
        fit(tmp_path, RotorStrategy(mem_limit="20%"), model, loss, data())
    assert "\n" not in str(err.value) and "'model.model.encoder'" in str(err.value)
    assert_same_parameters(before, model)


# -- resuming from a Lightning checkpoint ----------------------------------------------------------------------------
def fit_and_resume(
    root: Path, strategy: Callable[[], object], model: nn.Module, batches: list[Batch], loss: LossFn
) -> Task:
    """Two steps and a checkpoint (rotor's plans in it), then a fit resumed from it up to four steps."""
    ckpt = root / "first.ckpt"
    fit(root / "first", strategy(), copy.deepcopy(model), loss, batches[:2], callbacks=[SaveAtEnd(ckpt)])
    resumed = Task(copy.deepcopy(model), loss)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = quiet_trainer(root / "second", strategy(), max_steps=4)
        trainer.fit(resumed, DataLoader(batches, batch_size=None), ckpt_path=ckpt)
    return resumed


@pytest.mark.parametrize("family", ["t5", "mixtral"])
def test_resumed_fit_reuses_the_saved_plans_and_trains_like_plain(tmp_path, caplog, family):
    make, data, loss, budget = FAMILIES[family]
    model, batches = make(), data() + data()[:1]
    plain = fit_and_resume(tmp_path / "plain", lambda: "auto", model, batches, loss)
    with caplog.at_level(logging.INFO):
        rotor = fit_and_resume(tmp_path / "rotor", lambda: RotorStrategy(mem_limit=budget), model, batches, loss)
    assert "restored from the checkpoint; no profiling for the same input shapes" in caplog.text
    assert_same_parameters(plain.model, rotor.model)
    assert all(len(c.entries) == 1 for c in rotor.chains.values())  # the saved plans
    assert any(sum(r > 1 for r in c.last_entry.runs) > 0 for c in rotor.chains.values())


# -- batches whose shapes change ---------------------------------------------------------------------------------------
def changing_seq2seq() -> list[Batch]:
    """Source and target lengths change, and the last batch is a partial one (one sample)."""
    g = torch.Generator().manual_seed(3)
    shapes = [(2, 16, 12), (2, 10, 7), (2, 16, 12), (1, 16, 12)]
    return [
        {"input_ids": torch.randint(3, 64, (n, s), generator=g), "labels": torch.randint(3, 64, (n, t), generator=g)}
        for n, s, t in shapes
    ]


def changing_tokens() -> list[Batch]:
    g = torch.Generator().manual_seed(3)
    return [{"x": torch.randint(64, (n, t), generator=g)} for n, t in [(4, 16), (4, 9), (4, 16), (1, 16)]]


@pytest.mark.slow  # two fits of four steps, 4-5 s
@pytest.mark.parametrize(
    "family, batches, precision",
    [
        ("bart", changing_seq2seq, "32-true"),
        ("bart", changing_seq2seq, "bf16-mixed"),
        ("mixtral", changing_tokens, "bf16-mixed"),
    ],
)
def test_changing_shapes_and_a_partial_last_batch_train_like_plain_within_budget(tmp_path, family, batches, precision):
    """Each new shape is profiled inside its training step (under bf16-mixed: inside the autocast region)."""
    make, _, loss, budget = FAMILIES[family]
    model, data = make(), batches()
    last = MeasureLastBatch(data[-1])  # the partial batch again, its plan known
    plain = fit(tmp_path / "plain", "auto", copy.deepcopy(model), loss, data, precision=precision)
    rotor = fit(
        tmp_path / "rotor", RotorStrategy(mem_limit=budget), model, loss, data, precision=precision, callbacks=[last]
    )
    assert_same_parameters(plain.model, rotor.model)
    assert all(len(c.entries) >= 2 for c in rotor.chains.values())  # a plan per shape
    assert not last.profiled and 0 < last.peak <= last.budget


# -- an encoder-decoder's two chains (include=) under bf16-mixed ------------------------------------------------------
BOTH_CHAINS = ["*encoder", "*decoder"]


def test_fabric_encoder_and_decoder_chains_under_bf16_train_like_plain_fabric():
    model, batches = bart(), seq2seq_batches(3)
    _, plain = fabric_loop("auto", copy.deepcopy(model), batches, seq2seq_loss, "bf16-mixed")
    strategy = RotorFabricStrategy(mem_limit="60%", include=BOTH_CHAINS, measure_every_n_steps=0, print_summary=False)
    fabric, rotor = fabric_loop(strategy, model, batches, seq2seq_loss, "bf16-mixed")
    assert_same_parameters(plain.module, rotor.module)
    assert sorted(strategy.chains) == ["model.decoder", "model.encoder"]
    assert all(sum(r > 1 for r in c.last_entry.runs) > 0 for c in strategy.chains.values())  # both recompute


def test_trainer_encoder_and_decoder_chains_under_bf16_train_like_plain(tmp_path):
    model, batches = t5(), seq2seq_batches(3)
    plain = fit(tmp_path / "plain", "auto", copy.deepcopy(model), seq2seq_loss, batches, precision="bf16-mixed")
    strategy = RotorStrategy(mem_limit="80%", include=BOTH_CHAINS)  # smallest: 71%
    rotor = fit(tmp_path / "rotor", strategy, model, seq2seq_loss, batches, precision="bf16-mixed")
    assert_same_parameters(plain.model, rotor.model)
    assert sorted(rotor.chains) == ["model.decoder", "model.encoder"]
    assert all(sum(r > 1 for r in c.last_entry.runs) > 0 for c in rotor.chains.values())  # both recompute


# -- PEFT with its default config in Fabric ----------------------------------------------------------------------
def test_fabric_lora_with_the_default_kv_cache_trains_like_plain_and_keeps_the_config():
    model, batches = lora_llama("CAUSAL_LM"), token_batches()
    _, plain = fabric_loop("auto", without_cache(model), batches, lm_loss)
    strategy = RotorFabricStrategy(mem_limit="50%", discover="modules", measure_every_n_steps=0, print_summary=False)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _, rotor = fabric_loop(strategy, model, batches, lm_loss)
    assert any("use_cache=False" in str(w.message) for w in record)
    assert_same_parameters(plain.module, rotor.module)
    assert model.get_base_model().config.use_cache  # the user's config is left as it was


# -- the user's own autocast region (its weight-cast cache on, as Fabric's bf16-mixed; the Trainer's is off) --
@pytest.mark.parametrize("make", [bart, t5], ids=["bart", "t5"])
def test_checkpointable_in_the_users_autocast_trains_a_tied_embedding_bitwise(make):
    """The LM head casts the tied embedding to bf16, the embeddings use it in float32: the first step (discovery and
    profiling in the same autocast region) sums its gradient in plain training's order."""

    def bf16() -> torch.autocast:
        return torch.autocast("cpu", dtype=torch.bfloat16)  # cache_enabled: torch's default

    rotor, _ = check_at_smallest(make(), seq2seq_batches(3), region=bf16)
    assert sum(r > 1 for r in rotor.last_entry.runs) > 0


@pytest.mark.parametrize(
    "family, batches", [pytest.param("bart", changing_seq2seq, marks=pytest.mark.slow), ("mixtral", changing_tokens)]
)
def test_fabric_changing_shapes_under_bf16_train_like_plain_fabric_within_budget(family, batches):
    """Each new shape is profiled inside Fabric's autocast region (its cast cache on), mid-training. A step that
    profiles is no clean sample; two steps of known shapes in a row (the fourth batch) give one."""
    make, _, loss, budget = FAMILIES[family]
    model, data = make(), batches()
    data.insert(3, data[0])
    _, plain = fabric_loop("auto", copy.deepcopy(model), data, loss, "bf16-mixed")
    strategy = RotorFabricStrategy(mem_limit=budget, measure_every_n_steps=1, print_summary=False)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fabric, rotor = fabric_loop(strategy, model, data, loss, "bf16-mixed")
    assert not [w for w in record if "above the budget" in str(w.message)]  # every sampled step within its budget
    assert strategy.metrics["rotor/measured_peak_bytes"] > 0
    assert_same_parameters(plain.module, rotor.module)
    assert all(len(c.entries) >= 2 for c in strategy.chains.values())
    assert 0 < measured_peak(fabric, rotor, data[-1], loss) <= step_budget(strategy.chains)
