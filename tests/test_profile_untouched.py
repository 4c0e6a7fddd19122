"""Profiling a new input signature leaves the user's training state as plain training would.

The first training call for a new shape profiles the chain and, for a module-level chain,
measures the rest of the forward with a backward of its own (`pipeline.measure_outside`).
Neither may add into gradients already held in `.grad` (accumulation, `zero_grad(set_to_none=False)`),
replace those tensors, move buffers or consume random numbers.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from training import tokens_loss

from lightning_rotor import Checkpointable


class TiedNet(nn.Module):
    """A run of blocks between a stem (BatchNorm, dropout) and a head tied to the stem's weight.

    The stem's residual keeps it out of the run: the tied weight is used outside the run only,
    as GPT-2's token embedding and LM head are.
    """

    def __init__(self, width: int = 32, depth: int = 6):
        super().__init__()
        self.stem = nn.Linear(width, width)
        self.norm = nn.BatchNorm1d(width)
        self.drop = nn.Dropout(0.2)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.norm(self.stem(x) + x))
        for block in self.blocks:
            x = block(x)
        return F.linear(x, self.stem.weight)  # tied: the stem's weight gets two gradients


def tied_case(batch: int):
    g = torch.Generator().manual_seed(batch)
    return torch.randn(batch, 32, generator=g), torch.randint(32, (batch,), generator=g)


def gpt2_case(batch: int):
    g = torch.Generator().manual_seed(batch)
    x = torch.randint(64, (batch, 8 + batch), generator=g)
    return x, torch.randint(64, (x.numel(),), generator=g)


def gpt2_model():
    pytest.importorskip("transformers")
    from lightning_rotor.bench.any_models import gpt2

    return gpt2(n_layer=3, n_embd=16, n_positions=32)  # tied embedding and LM head, dropout everywhere


CASES = {
    "tied": (lambda: TiedNet(), tied_case, F.cross_entropy),
    "gpt2": (gpt2_model, gpt2_case, tokens_loss),
}


@pytest.mark.parametrize("name", list(CASES))
def test_new_shape_mid_accumulation_adds_nothing_to_held_gradients(name):
    build, case, loss_fn = CASES[name]
    torch.manual_seed(0)
    plain = build()
    plain.train()
    rotor = Checkpointable(copy.deepcopy(plain), mem_limit="70%", discover="modules", repeats=1, warmup=0)
    rotor.train()
    for model in (plain, rotor):  # gradients already held: zero_grad(set_to_none=False) then accumulation
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()))
    held = [p.grad for p in rotor.parameters()]
    for batch in (8, 6, 8, 4):  # new shapes arrive between accumulated micro-batches
        x, y = case(batch)
        torch.manual_seed(batch)
        loss_fn(plain(x), y).backward()
        rng = torch.get_rng_state()
        torch.manual_seed(batch)
        loss_fn(rotor(x), y).backward()
        assert torch.equal(torch.get_rng_state(), rng)  # profiling drew no random numbers from the stream
        for (n, a), b in zip(plain.named_parameters(), rotor.parameters(), strict=True):
            assert torch.equal(a.grad, b.grad), (batch, n)
        for (n, a), b in zip(plain.named_buffers(), rotor.buffers(), strict=True):
            assert torch.equal(a, b), (batch, n)
    assert len(rotor.entries) == 3 and rotor.discovery.run is not None
    # accumulated in place, as plain autograd does into a `.grad` it already holds
    assert all(p.grad is g for p, g in zip(rotor.parameters(), held, strict=True))


class LongSkip(TiedNet):
    """The input is used again after the run: the measuring backward reaches it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + x


def test_input_from_the_callers_graph_is_not_backpropagated_by_profiling():
    """The first call's measuring backward stops at the call's inputs: the caller's graph stays whole."""
    torch.manual_seed(0)
    pre, plain = nn.Linear(32, 32), LongSkip()
    rotor = Checkpointable(copy.deepcopy(plain), mem_limit="70%", discover="modules", repeats=1, warmup=0)
    pre_copy = copy.deepcopy(pre)
    x, y = tied_case(8)
    torch.manual_seed(1)
    F.cross_entropy(plain(pre(x)), y).backward()
    torch.manual_seed(1)
    F.cross_entropy(rotor(pre_copy(x)), y).backward()  # pre_copy's graph must still be there to run
    assert rotor.discovery.run is not None and rotor.outside
    assert torch.equal(pre.weight.grad, pre_copy.weight.grad)
    for a, b in zip(plain.parameters(), rotor.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
