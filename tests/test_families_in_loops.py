"""The model families users bring (encoder-decoders, diffusers U-Nets, MoE with router logits, PEFT LoRA) in the
loops users run them in: Lightning Fabric, bf16-mixed precision, a Trainer with the default strategy settings,
resuming from a checkpoint, and batches whose shapes change. Each run is compared with the same loop without rotor
on the same seed: parameters bitwise after a few AdamW steps, measured activation peak within the budget."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from test_diffusers import unet
from test_encoder_decoder import bart, seq2seq_batches, t5
from test_moe import moe
from test_peft import lora_llama, without_cache
from torch import nn

from lightning_rotor.fabric import RotorFabricStrategy
from lightning_rotor.memory import MemoryProbe

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
    "t5": (t5, lambda: seq2seq_batches(3), seq2seq_loss, "90%"),  # the decoder's blocks: smallest 82%
    "bart": (bart, lambda: seq2seq_batches(3), seq2seq_loss, "90%"),
    "unet": (unet, noise_batches, noise_loss, "50%"),
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
@pytest.mark.parametrize("family", list(FAMILIES))
def test_fabric_loop_trains_like_plain_fabric_within_budget(family, precision):
    make, data, loss, budget = FAMILIES[family]
    model, batches = make(), data()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, plain = fabric_loop("auto", copy.deepcopy(model), batches, loss, precision)
        strategy = RotorFabricStrategy(mem_limit=budget, measure_every_n_steps=0, print_summary=False)
        fabric, rotor = fabric_loop(strategy, model, batches, loss, precision)
    assert_same_parameters(plain.module, rotor.module)
    chain = strategy.chains["model"]
    assert sum(r > 1 for r in chain.last_entry.runs) > 0  # the budget really recomputes
    assert 0 < measured_peak(fabric, rotor, batches[0], loss) <= chain.plan.budget
