"""Frozen layers (chain version 4): stages that need no backward cost what plain autograd makes them cost.

Stages before the first one that needs a backward (the chain input does not require grad and
no parameter of theirs does) run once as `Fn` ops, never recorded, recomputed nor backwarded;
the planner plans the rest (docs/memory-model.md, "Chain version 4").
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_rotor import Checkpointable, MemoryProbe
from lightning_rotor.models.gpt import gpt, lm_loss
from lightning_rotor.ops import is_no_recompute
from lightning_rotor.planner import InfeasibleBudget
from lightning_rotor.simulate import no_recompute_peak


def frozen_gpt():
    """Embeddings and 5 of 6 blocks frozen: fine-tuning the last block, the final norm and the head."""
    torch.manual_seed(0)
    model = gpt(vocab_size=64, block_size=32, n_layer=6, n_head=2, n_embd=32, dropout=0.1)
    model.embed.requires_grad_(False)
    for block in model.blocks[:5]:
        block.requires_grad_(False)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 64, (4, 32), generator=g), torch.randint(0, 64, (4, 32), generator=g)
    return model, x, y, lm_loss


def frozen_mlp():
    """A Sequential MLP of 24 Linear + ReLU pairs whose first half is frozen."""
    torch.manual_seed(0)
    layers = []
    for _ in range(24):
        layers += [nn.Linear(32, 32), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(32, 10))
    model[:24].requires_grad_(False)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(128, 32, generator=g), torch.randint(0, 10, (128,), generator=g)
    return model, x, y, F.cross_entropy


MODELS = {"gpt": frozen_gpt, "mlp": frozen_mlp}
QUICK = {"repeats": 1, "warmup": 0}  # timing runs when profiling: the plans here do not hinge on them


def plain_step(model, x, y, loss_fn):
    """(measured activation peak, trainable parameters' gradients) of one plain training step."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    with MemoryProbe(model) as probe:
        probe.track(x)
        loss_fn(model(x), y).backward()
    return probe.peak, [p.grad for p in model.parameters() if p.requires_grad]


def rotor_step(rotor, x, y, loss_fn):
    """The same step run by rotor's executor, measured with `measure_step`."""
    rotor.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    with rotor.measure_step() as m:
        loss_fn(rotor(x), y).backward()
    return m.peak, [p.grad for p in rotor.parameters() if p.requires_grad]


def assert_frozen_run_once(rotor):
    chain, runs = rotor.chain, rotor.last_entry.runs
    assert chain.frozen > 0 and runs[: chain.frozen] == [1] * chain.frozen
    assert all(op.stage is None or op.stage >= chain.frozen for op in rotor.plan.ops[chain.frozen:])


def assert_same_grads(expected, got):
    assert len(expected) == len(got) > 0
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_at_the_plain_peak_nothing_is_recomputed_and_the_peak_is_plains(name):
    model, x, y, loss_fn = MODELS[name]()
    plain, grads = plain_step(model, x, y, loss_fn)
    rotor = Checkpointable(copy.deepcopy(model), mem_limit=plain, **QUICK).train()
    rotor_step(rotor, x, y, loss_fn)  # the first step profiles and plans
    peak, got = rotor_step(rotor, x, y, loss_fn)
    assert is_no_recompute(rotor.plan.ops)
    assert_frozen_run_once(rotor)
    assert no_recompute_peak(rotor.chain) == rotor.plan.peak <= plain
    assert peak <= plain
    assert_same_grads(grads, got)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_below_the_plain_peak_grads_are_plains_and_frozen_stages_are_not_recomputed(name):
    model, x, y, loss_fn = MODELS[name]()
    _, grads = plain_step(model, x, y, loss_fn)
    rotor = Checkpointable(copy.deepcopy(model), mem_limit="50%", **QUICK).train()
    if name == "gpt":  # one trainable block is one stage: 50% of the peak is below what recording it needs
        with pytest.raises(InfeasibleBudget, match="smallest feasible budget") as err:
            rotor_step(rotor, x, y, loss_fn)
        rotor = Checkpointable(copy.deepcopy(model), mem_limit=err.value.min_feasible, **QUICK).train()
    rotor_step(rotor, x, y, loss_fn)
    peak, got = rotor_step(rotor, x, y, loss_fn)
    assert rotor.plan.recomputed_stages > 0
    assert_frozen_run_once(rotor)
    assert peak <= rotor.plan.mem_limit
    assert_same_grads(grads, got)
