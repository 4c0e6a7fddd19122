"""torch's `offload_wrapper` (the model's own activation offloading) under rotor: turned off with one warning.

A block wrapped by `offload_wrapper` runs under `save_on_cpu`, its saved tensors moved to host memory by hooks nested
inside rotor's plan: graph discovery traced through the wrapper and dropped the offloading without a word, while
module-level discovery profiled the block with it (on the CPU, a copy of every saved tensor: a no-recompute peak
almost six times plain's). Rotor turns it off like `checkpoint_wrapper`, says so in one warning, trains bitwise as
the model with its wrappers on, and turns them back on at the end of a fit (docs/checkpointable.md, "The model's
own checkpointing").
"""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
from fitting import KeepRotorModules, quiet_trainer
from test_user_models_silent import MLPBlock, assert_same_model, gpt2, lm_steps, own_warnings, sgd_steps, tokens
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import offload_wrapper
from torch.utils.data import DataLoader, TensorDataset

from lightning_rotor import Checkpointable
from lightning_rotor._torch_compat import offload_wrapper_on
from lightning_rotor.lightning import RotorStrategy
from lightning_rotor.simulate import no_recompute_peak

SAID = "had its own activation offloading (torch's offload_wrapper, 4 modules) on (4 modules: "


def gpt2_offloading() -> nn.Module:
    """The tiny GPT-2 with each block under torch's `offload_wrapper`."""
    model = gpt2()
    for k, block in enumerate(model.transformer.h):
        model.transformer.h[k] = offload_wrapper(block)
    return model


def wrappers(blocks: nn.ModuleList) -> list[bool]:
    return [offload_wrapper_on(block) for block in blocks]


def test_offload_wrapper_is_turned_off_with_one_warning_through_checkpointable():
    """Hugging Face's GPT-2, its blocks wrapped, module-level discovery (graph discovery cannot bind its forward)."""
    model = gpt2_offloading()
    plain = copy.deepcopy(model)  # the user's model as it is: its wrappers offload (values unchanged)
    rotor = Checkpointable(model, "50%", discover="modules", repeats=1)
    with pytest.warns(UserWarning) as record:
        lm_steps(rotor, 1)
    (said,) = own_warnings(record)
    assert SAID in said and "rotor turned it off" in said
    assert wrappers(model.transformer.h) == [False] * 4
    unwrapped = Checkpointable(gpt2(), "50%", discover="modules", repeats=1)
    lm_steps(unwrapped, 1)
    assert no_recompute_peak(rotor.chain) == no_recompute_peak(unwrapped.chain)  # profiled without save_on_cpu
    with rotor.measure_step() as measured:
        lm_steps(rotor, 1, first=1)
    assert measured.chain_peak <= rotor.budget
    lm_steps(rotor, 1, first=2)
    lm_steps(plain, 3)
    assert_same_model(plain, rotor)
    rotor.restore_own_checkpointing()
    assert wrappers(model.transformer.h) == [True] * 4


class Blocks(nn.Module):
    """Eight MLP blocks in a loop of the user's own (graph discovery traces it), each under `offload_wrapper`."""

    def __init__(self, offloading: bool = True):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(MLPBlock() for _ in range(8))
        if offloading:
            self.blocks = nn.ModuleList(offload_wrapper(b) for b in self.blocks)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_graph_discovery_says_it_turned_the_offloading_off():
    """Graph discovery traced through the wrapper: the offloading was gone, and nothing said so."""
    plain, net = Blocks(), Blocks()
    rotor = Checkpointable(net, "60%", discover="graph", repeats=1)
    with pytest.warns(UserWarning) as record:
        sgd_steps(rotor, 1, width=32)
    (said,) = own_warnings(record)
    assert SAID.replace("4 modules", "8 modules") in said
    unwrapped = Checkpointable(Blocks(offloading=False), "60%", discover="graph", repeats=1)
    sgd_steps(unwrapped, 1, width=32)
    assert no_recompute_peak(rotor.chain) == no_recompute_peak(unwrapped.chain)
    sgd_steps(plain, 1, width=32)
    assert_same_model(plain, rotor)
    sgd_steps(rotor, 2, width=32)
    sgd_steps(plain, 2, width=32)
    assert_same_model(plain, rotor)
    rotor.restore_own_checkpointing()
    assert wrappers(net.blocks) == [True] * 8


class LM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = gpt2_offloading()

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.model(input_ids=x, labels=x).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_offload_wrapper_is_turned_off_through_a_trainer_and_back_on_after(tmp_path):
    data = DataLoader(TensorDataset(tokens(24)), batch_size=8)
    plain = LM()
    torch.manual_seed(1)
    quiet_trainer(tmp_path / "plain").fit(plain, data)
    rotor, keep = LM(), KeepRotorModules()
    torch.manual_seed(1)
    with pytest.warns(UserWarning) as record:
        quiet_trainer(tmp_path / "rotor", RotorStrategy("50%"), callbacks=[keep]).fit(rotor, data)
    (said,) = own_warnings(record)
    assert SAID in said
    assert keep.modules["model"].last_entry.runs  # rotor's plan ran
    assert_same_model(plain, rotor)
    assert wrappers(rotor.model.transformer.h) == [True] * 4  # the user's wrappers, back after the fit
