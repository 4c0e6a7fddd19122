"""The code around a module-level chain's run, measured with its probe told of stored gradients by autograd.

`pipeline.measure_outside` runs the module's whole forward (the blocks without grad) and the rest's backward under
a memory probe. NOTE: [gradients stored by autograd] in lightning_rotor/memory.py: a probe that read every
parameter's `.grad` before every op paid for parameters x ops; told by hooks, it reads each gradient autograd
stored, once. The figures are those of the probe that reads them all.
"""

import copy

import pytest
import torch
from torch import nn
from training import tokens_loss

import lightning_rotor.memory as memory
from lightning_rotor import Checkpointable, pipeline


class Head(nn.Module):
    """A caller's loss with a parameter of its own (outside the module: `grads_aside` sets its `.grad` aside)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, out):
        return tokens_loss(out.logits * self.scale, self.targets)


def discovered_gpt2():
    """A Hugging Face GPT-2 from a tiny config (tied embedding and LM head: a gradient waiting for the chain) with
    one frozen parameter and gradients already held, after the first step that found its run of blocks."""
    pytest.importorskip("transformers")
    from lightning_rotor.bench.any_models import gpt2

    torch.manual_seed(0)
    model = gpt2(n_layer=3, n_embd=16, n_positions=32)
    model.transformer.ln_f.bias.requires_grad_(False)
    head = Head()
    x = torch.randint(64, (2, 12), generator=torch.Generator().manual_seed(0))
    head.targets = x.flatten()
    rotor = Checkpointable(copy.deepcopy(model), mem_limit="70%", discover="modules", repeats=1, warmup=0)
    head(rotor(x)).backward()
    assert rotor.discovery.run is not None
    return rotor, head, x


def outside(rotor, head, x):
    state = rotor.chain_state
    return pipeline.measure_outside(rotor.module, state.discovery.run, state.stages, (x,), {}, head)


def test_outside_figures_are_those_of_a_probe_reading_every_gradient(monkeypatch):
    rotor, head, x = discovered_gpt2()
    told = outside(rotor, head, x)
    monkeypatch.setattr(pipeline, "Excluded", lambda module, by_autograd: memory.Excluded(module))
    read = outside(rotor, head, x)
    assert told == read and read.tail > 0
    assert read.loss_value >= 64 * 16 * 4  # the tied embedding's gradient waits for the chain, charged


def test_outside_reads_only_the_gradients_autograd_stored(monkeypatch):
    """Each gradient read once, when stored: not every parameter's before every op (some 3 us an op on GPT-2)."""
    rotor, head, x = discovered_gpt2()
    reads = []

    def gradient_keys(params):
        reads.append(len(params))
        return keys(params)

    keys = memory.gradient_keys
    monkeypatch.setattr(memory, "gradient_keys", gradient_keys)
    outside(rotor, head, x)
    trained = [p for p in rotor.parameters() if p.requires_grad]
    assert 0 < sum(reads) <= len(trained)
