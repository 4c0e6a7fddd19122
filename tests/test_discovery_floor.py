"""Default graph discovery splits the stage that sets the floor (docs/discovery.md, "The floor").

A timm-style ConvNeXt keeps `ConvNeXtStage` whole by default (a class used four times), so a whole
resolution level was one stage and rotor's smallest budget was far above the model's own per-block
checkpointing. Discovery now traces into the blocks of the heaviest stages while that lowers it.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from training import assert_same_state, measured_step, train

from lightning_rotor import Checkpointable, MemoryProbe
from lightning_rotor.discovery import discover_chain
from lightning_rotor.models.convnext import ConvNeXt, ConvNeXtBlock
from lightning_rotor.planner import InfeasibleBudget


def convnext(drop_path_rate=0.0):
    torch.manual_seed(0)
    model = ConvNeXt(depths=(2, 2, 2, 1), dims=(24, 48, 96, 128), num_classes=10, drop_path_rate=drop_path_rate)
    return model, torch.randn(4, 3, 32, 32), torch.randint(10, (4,))


def peak(model, x, y, forward):
    model.zero_grad(set_to_none=True)
    with MemoryProbe(exclude=model) as probe:
        probe.track(x)
        F.cross_entropy(forward(x), y).backward()
    model.zero_grad(set_to_none=True)
    return probe.peak


def smallest_budget(model, x, y):
    try:
        F.cross_entropy(Checkpointable(model, 1, repeats=1, warmup=0)(x), y).backward()
    except InfeasibleBudget as err:
        return err.min_feasible
    raise AssertionError("a 1-byte budget was accepted")


def test_default_minimum_is_below_the_models_own_checkpointing():
    model, x, y = convnext()
    model.set_grad_checkpointing(True)
    own = peak(model, x, y, model)
    model.set_grad_checkpointing(False)
    assert smallest_budget(model, x, y) <= 0.8 * own


def test_the_split_builds_only_the_chain_it_keeps(monkeypatch):
    """The floor split weighs each candidate chain on the trace's own values: only the chain it keeps is
    built into GraphModules (it built every candidate's stages, 120 on ConvNeXt-Atto, to run them)."""
    model, x, _ = convnext()
    built = []
    init = torch.fx.GraphModule.__init__

    def counted(self, *args, **kwargs):
        built.append(type(self).__name__)
        init(self, *args, **kwargs)

    monkeypatch.setattr(torch.fx.GraphModule, "__init__", counted)
    found = discover_chain(model, x)
    assert any(n.startswith("traced into to lower the floor") for n in found.notes)
    assert len(built) == len(found.stages)


def test_the_split_runs_a_block_left_whole_once_per_purpose():
    """Each trace of the floor split runs every op on the sample; a block it leaves whole (the lightest
    level) ran again in every trace and every weighing. Now: once in the first trace, once weighed."""
    model, x, _ = convnext()
    calls = []
    model.stages[3].register_forward_hook(lambda *_: calls.append(1))
    found = discover_chain(model, x)
    assert "stages.3" in found.stages.names
    assert len(calls) == 2


def test_split_reaches_inside_the_heaviest_blocks_only():
    model, x, _ = convnext()
    found = discover_chain(model, x)
    names = found.stages.names
    assert any(n.startswith("traced into to lower the floor") and "stages.0" in n for n in found.notes)
    assert "stages.0.blocks.0.mlp.act" in names  # the full-resolution blocks set the floor: cut inside them
    assert "stages.3" in names  # the lightest level stays one stage
    whole = discover_chain(model, x, checkpoint_modules=[ConvNeXtBlock]).stages.names
    assert "stages.0.blocks.0" in whole  # the user's choice is kept as it is


@pytest.mark.parametrize("at", ["min", "50%"])
def test_split_chain_trains_like_plain_within_budget(at):
    plain, x, y = convnext(drop_path_rate=0.2)  # drop path: recomputed stages replay their random numbers
    model = copy.deepcopy(plain)
    budget = smallest_budget(copy.deepcopy(plain), x, y) if at == "min" else at
    rotor = Checkpointable(model, budget, repeats=1, warmup=0)
    losses = train(rotor, x, y, F.cross_entropy, lr=0.05)
    assert torch.equal(train(plain, x, y, F.cross_entropy, lr=0.05), losses)
    assert_same_state(plain, rotor)
    assert rotor.plan.recomputed_stages > 0
    m = measured_step(rotor, x, y, F.cross_entropy)
    assert m.peak <= rotor.plan.budget
