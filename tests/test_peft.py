"""PEFT models train under rotor as without it: LoRA on a tiny Llama (its default config, `use_cache=True`)
through `Checkpointable` and a real Trainer, bitwise equal to plain training with `use_cache=False`.

`PeftModel.forward` takes `**kwargs` and calls the model it wraps, so the KV cache is turned off through it
(lightning_rotor/huggingface.py); the adapters are the only trainable parameters, the base weights stay.
"""

from __future__ import annotations

import copy
import warnings

import lightning.pytorch as pl
import pytest
import torch
from fitting import quiet_trainer
from hf_models import tiny_llama
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from training import check_measured_peak

from lightning_rotor.checkpointable import Checkpointable
from lightning_rotor.lightning import RotorStrategy
from lightning_rotor.lightning.state import rotor_modules

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")

torch.set_num_threads(1)

LAYERS = [f"base_model.model.model.layers.{i}" for i in range(4)]


def lora_llama(task_type: str | None = None) -> nn.Module:
    """LoRA (with dropout) on the attention of a four-layer Llama from a small config, its defaults untouched."""
    model = tiny_llama()
    assert model.config.use_cache  # the default the fix is about
    lora = peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj"], task_type=task_type
    )
    return peft.get_peft_model(model, lora)


def without_cache(model: nn.Module) -> nn.Module:
    """A copy for plain training, with the KV cache off as rotor turns it off."""
    plain = copy.deepcopy(model)
    plain.get_base_model().config.use_cache = False
    return plain


def tokens(n: int = 8, t: int = 16) -> torch.Tensor:
    return torch.randint(64, (n, t), generator=torch.Generator().manual_seed(0))


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def train(model: nn.Module, x: torch.Tensor, steps: int = 3) -> dict[str, torch.Tensor]:
    """AdamW steps on next-token loss (labels= the input); every parameter afterwards, by name."""
    torch.manual_seed(1)  # the adapters' dropout draws the same in both runs
    opt = adamw(model)
    for _ in range(steps):
        opt.zero_grad()
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_lora_trained_like_plain(got: dict, want: dict, before: dict) -> None:
    """Same parameters bitwise; the adapters moved, the frozen base weights did not."""
    assert got.keys() == want.keys()
    for name in got:
        assert torch.equal(got[name], want[name]), name
        assert torch.equal(got[name], before[name]) == ("lora_" not in name), name


def trainable(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


@pytest.mark.parametrize("task_type", [None, "CAUSAL_LM"])
def test_lora_llama_with_default_config_trains_like_plain_without_cache(task_type):
    model = lora_llama(task_type)
    assert trainable(model) and all("lora_" in n for n in trainable(model))
    plain = without_cache(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x = tokens()
    rotor = Checkpointable(model, "50%", discover="modules", repeats=1)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = train(rotor, x)
    assert any("use_cache=False" in str(w.message) and "LlamaForCausalLM" in str(w.message) for w in record)
    assert rotor.stage_names == LAYERS
    assert sum(r > 1 for r in rotor.last_entry.runs) > 0  # the budget really recomputes
    assert model.get_base_model().config.use_cache  # the user's config is left as it was
    assert_lora_trained_like_plain(got, train(plain, x), before)
    rotor.zero_grad()
    with rotor.measure_step() as m:
        rotor(input_ids=x, labels=x).loss.backward()
    check_measured_peak(rotor, m.peak)


class LoraLM(pl.LightningModule):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.keep: dict[str, Checkpointable] = {}

    def training_step(self, batch, batch_idx):
        self.keep = self.keep or rotor_modules(self)
        (x,) = batch
        return self.model(input_ids=x, labels=x).loss

    def configure_optimizers(self):
        return adamw(self)


def test_lora_llama_trains_through_a_trainer_like_plain(tmp_path):
    model = lora_llama("CAUSAL_LM")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    loader = DataLoader(TensorDataset(tokens(16)), batch_size=8)
    runs = {}
    for name, strategy, peft_model in (
        ("plain", "auto", without_cache(model)),
        ("rotor", RotorStrategy("50%", discover="modules"), model),
    ):
        module = LoraLM(peft_model)
        torch.manual_seed(1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            quiet_trainer(tmp_path / name, strategy, max_steps=4).fit(module, loader)
        runs[name] = module
    wrapped = runs["rotor"].keep["model"]
    assert wrapped.discovery.kind == "modules" and wrapped.stage_names == LAYERS
    assert sum(r > 1 for r in wrapped.last_entry.runs) > 0
    got = {n: p.detach() for n, p in runs["rotor"].model.named_parameters()}
    want = {n: p.detach() for n, p in runs["plain"].model.named_parameters()}
    assert_lora_trained_like_plain(got, want, before)


@pytest.mark.parametrize("own_checkpointing, budget", [(False, "50%"), (True, None)])
def test_lora_with_input_grads_trains_like_plain(own_checkpointing, budget):
    """`prepare_model_for_kbit_training`'s setup on a model it does not quantize: base frozen, the embeddings'
    output made to require grad by a forward hook (`enable_input_require_grads`), with and without the model's
    own gradient checkpointing. The chain input then requires grad, a leaf whose gradient rotor passes back."""
    base = peft.prepare_model_for_kbit_training(tiny_llama(), use_gradient_checkpointing=False)
    if own_checkpointing:
        base.gradient_checkpointing_enable()
    base.enable_input_require_grads()
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_dropout=0.1, target_modules=["q_proj", "v_proj"]))
    plain = without_cache(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x = tokens()
    rotor = Checkpointable(model, budget, discover="modules", repeats=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = train(rotor, x)
    assert rotor.stage_names == LAYERS
    if budget is not None:
        assert sum(r > 1 for r in rotor.last_entry.runs) > 0
    assert_lora_trained_like_plain(got, train(plain, x), before)
