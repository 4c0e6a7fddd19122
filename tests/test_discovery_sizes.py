"""Tensors made in the forward from the input's batch size and length by any torch function taking integers
(`torch.eye(t)`, `mask.expand(b, t, -1)` on a plain tensor, `ones(b, t)` imported by name, a plain tensor attribute
sliced to the length): graph discovery records each call with the sizes themselves, so a last partial batch and
a new length train bitwise like plain training, each step within its budget; through `Checkpointable` and a real
Trainer. (Before, each of these fixed the sample's sizes into the graph: `GuardFailed` on the next shape, or no
trace at all.)"""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from fitting import fit_like_plain
from test_discovery_models import litgpt_case
from torch import nn, ones
from training import assert_same_state, check_measured_peak, tokens_loss

from lightning_rotor import Checkpointable
from lightning_rotor.discovery import discover_chain
from lightning_rotor.lightning import RotorStrategy

W = 16

# how models make tensors from the batch size `b` and the length `t` of `h` ([b, t, W]); each raised GuardFailed
# on another shape, or failed to trace, before
FORMS = {
    "eye: each token's own position": lambda m, h, b, t: h + torch.eye(t, W),
    "randperm: the tokens shuffled": lambda m, h, b, t: h[:, torch.randperm(t)],
    "a plain tensor attribute sliced to the length": lambda m, h, b, t: h + m.table[:t],
    "a constant made in the forward, expanded": lambda m, h, b, t: h + torch.full((1, 1, W), 0.5).expand(b, t, -1),
    "ones imported by name": lambda m, h, b, t: h * ones(b, t, 1),
    "new_zeros of a torch.Size": lambda m, h, b, t: h + h.new_zeros(torch.Size([b, t, W])),
    "a tensor of the sizes": lambda m, h, b, t: h * torch.tensor([b, t]).sum(),
    "a share of the length, rounded": lambda m, h, b, t: h * (torch.arange(t) < round(t * 0.75))[:, None],
}


class Mixer(nn.Module):
    """Per-token layers with one of `FORMS` after the first: the sizes come from the input, as `B, T, _ = x.shape`."""

    def __init__(self, form: str, layers: int = 6):
        super().__init__()
        torch.manual_seed(0)
        self.form = form
        self.table = torch.randn(64, W)  # positions: a plain attribute, not a buffer (older models keep them so)
        self.layers = nn.ModuleList(nn.Linear(W, W) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = torch.tanh(self.layers[0](x))
        h = FORMS[self.form](self, h, b, t)
        for layer in self.layers[1:]:
            h = torch.tanh(layer(h))
        return h


SHAPES = ((8, 16), (8, 16), (3, 16), (8, 12), (5, 9))  # a partial batch, then other lengths


def batch(shape: tuple[int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens of W features and one of W classes per token."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, W, generator=g), torch.randint(0, W, shape, generator=g)


def token_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


@pytest.mark.parametrize("form", FORMS)
def test_each_form_traces_with_the_input_sizes_and_trains_bitwise_over_new_shapes(form):
    """One graph for every shape (no fallback, no guard on the sizes); each step bitwise plain training's gradients,
    measured within its plan's budget and near its prediction."""
    found = discover_chain(Mixer(form), (batch(SHAPES[0], 0)[0],))
    assert found.graph is not None and found.notes[0] == "graph: 6 stages, 1 shape guard(s)", found.notes  # len(shape)
    plain, rotor = Mixer(form), Checkpointable(Mixer(form), "60%", discover="graph", repeats=1)
    for step, shape in enumerate(SHAPES):
        x, y = batch(shape, step)
        plain.zero_grad()
        torch.manual_seed(step)
        token_loss(plain(x), y).backward()
        rotor.zero_grad()
        if step:  # the first step discovers and profiles (a profiling step is not held to the budget)
            rotor.prepare_for(x)
        torch.manual_seed(step)
        with rotor.measure_step() as m:
            token_loss(rotor(x), y).backward()
        assert_same_state(plain, rotor)
        if step:
            check_measured_peak(rotor, m.peak)
    assert len(rotor.entries) == 4  # one plan per shape


class AllForms(Mixer):
    """Every form of `FORMS` but the random one, one after another between layers."""

    def __init__(self):
        super().__init__("eye: each token's own position", layers=8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = x
        forms = [f for f in FORMS if not f.startswith("randperm")]
        for k, layer in enumerate(self.layers):
            h = torch.tanh(layer(h))
            if k < len(forms):
                h = FORMS[forms[k]](self, h, b, t)
        return h


class Tokens(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = AllForms()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return token_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def test_the_trainer_trains_over_partial_batches_and_new_lengths_bitwise_and_within_budget(tmp_path):
    """Batches of other sizes and lengths in one fit: the weights after it are plain training's, and no step sampled
    measured above its budget (the callback warns of one)."""
    batches = [batch(shape, seed) for seed, shape in enumerate(SHAPES)]
    plain, rotor = Tokens(), Tokens()
    rotor.load_state_dict(copy.deepcopy(plain.state_dict()))
    fit_like_plain(tmp_path, plain, rotor, RotorStrategy(mem_limit="60%", discover="graph"), batches)


# -- litgpt's GPT (a tiny Llama config): its rotary tables are plain attributes, sliced as `self.cos[:T]` -------------
LENGTHS = ((2, 64), (2, 64), (1, 64), (2, 48), (2, 33))  # a partial batch, then shorter sequences


def token_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(256, (b, t), generator=g), torch.randint(256, (b * t,), generator=g)) for b, t in LENGTHS]


def test_litgpt_trains_over_a_partial_batch_and_shorter_sequences_bitwise_within_budget():
    """One graph chain for every length (before: `GuardFailed` at litgpt's `self.cos[:T]` on the first shorter
    batch); each step bitwise plain training's gradients, measured within its plan's budget."""
    plain = litgpt_case()[0]
    rotor = Checkpointable(copy.deepcopy(plain), "50%", repeats=1, warmup=0)
    for step, (idx, targets) in enumerate(token_batches()):
        plain.zero_grad()
        tokens_loss(plain(idx), targets).backward()
        rotor.zero_grad()
        if step:
            rotor.prepare_for(idx)
        with rotor.measure_step() as m:
            tokens_loss(rotor(idx), targets).backward()
        assert_same_state(plain, rotor)
        assert not step or m.peak <= rotor.plan.budget
    assert rotor.discovery.kind == "graph" and len(rotor.entries) == 4
    assert sum(r > 1 for r in rotor.last_entry.runs) > 0


class LitTask(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = litgpt_case()[0]

    def training_step(self, batch, batch_idx):
        idx, targets = batch
        return tokens_loss(self.model(idx), targets)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def test_litgpt_in_a_trainer_over_changing_lengths_bitwise_within_budget(tmp_path):
    """A fit over batches of other lengths and a partial batch: the weights after it are plain training's, and no
    sampled step measured above its budget."""
    batches = token_batches()
    plain, rotor = LitTask(), LitTask()
    fit_like_plain(tmp_path, plain, rotor, RotorStrategy(mem_limit="50%"), batches)
