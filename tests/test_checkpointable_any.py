"""Checkpointable on models as users write them: the chain is discovered on the first training call.

For each acceptance model (tests/models_any.py, lightning_rotor/models/as_written.py) at 25/50/75%
and unlimited: loss, gradients and buffers bitwise equal to plain training over 3 steps, the
measured activation peak within the budget and at least 0.85 of the prediction. A budget below
the smallest feasible one must say so.
"""

import copy

import pytest
import torch
from models_any import GPT, Block, Gated, ReluUNet, ResNet, UNet, gpt2
from torch import nn
from training import assert_same_state, measured_step, tokens_loss, train

from lightning_rotor.checkpointable import Checkpointable
from lightning_rotor.discovery import ChainDiverged, GuardFailed
from lightning_rotor.planner import InfeasibleBudget


def classes_loss(out, y):
    return nn.functional.cross_entropy(out, y)  # per image, or per pixel for the U-Net


def gpt_case():
    model = GPT(n_layer=6, n_embd=32, block_size=64)
    x = torch.randint(64, (4, 64))
    return model, x, torch.randint(64, (x.numel(),)), tokens_loss


def resnet_case():
    return ResNet(layers=(2, 2, 2, 2)), torch.randn(8, 3, 64, 64), torch.randint(10, (8,)), classes_loss


def unet_case():
    return UNet(width=8), torch.randn(2, 3, 64, 64), torch.randint(2, (2, 64, 64)), classes_loss


def relu_unet_case():
    return ReluUNet(), torch.randn(4, 3, 32, 32), torch.randint(0, 2, (4, 32, 32)), classes_loss


def gpt2_case():
    pytest.importorskip("transformers")
    model = gpt2(n_layer=6, n_embd=32, n_positions=64)
    x = torch.randint(64, (4, 64))
    return model, x, torch.randint(64, (x.numel(),)), tokens_loss


# (builder, discovery kind, sensible stage counts)
CASES = {
    "resnet": (resnet_case, "graph", range(8, 20)),
    "gpt": (gpt_case, "graph", range(7, 12)),
    "unet": (unet_case, "graph", range(7, 14)),
    "relu_unet": (relu_unet_case, "graph", range(18, 26)),  # segfaulted at 50% and 60% (issue 15)
    "gpt2": (gpt2_case, "modules", range(6, 7)),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("label", ["25%", "50%", "60%", "75%", "unlimited"])
def test_any_model_trains_like_plain_within_budget(name, label):
    build, kind, counts = CASES[name]
    torch.manual_seed(0)
    plain, x, y, loss_fn = build()
    model = copy.deepcopy(plain)
    rotor = Checkpointable(model, 10**12 if label == "unlimited" else label, repeats=1, warmup=0)
    assert list(rotor.state_dict()) == list(plain.state_dict())
    try:
        losses = train(rotor, x, y, loss_fn, lr=0.05)
    except InfeasibleBudget as err:
        # the only acceptable failure: the budget is below the smallest feasible one, which is stated
        assert f"use mem_limit >= {err.min_feasible}" in str(err)
        assert label == "25%" or (label in ("50%", "60%") and name == "resnet"), str(err)
        pytest.skip(f"{label} is below the smallest feasible budget {err.min_feasible}")
    assert rotor.discovery.kind == kind and len(rotor.stages) in counts, rotor.stages.names
    assert torch.equal(train(plain, x, y, loss_fn, lr=0.05), losses)
    assert_same_state(plain, rotor)
    m = measured_step(rotor, x, y, loss_fn)
    assert m.peak <= rotor.plan.budget
    # the relu_unet's view-like stages are profiled on leaves whose accumulator copies δ_k, which the executor
    # does not (docs/memory-model.md, "Stage inputs enter through EnterStage"): safe, but less tight
    tight = 0.8 if name == "relu_unet" else 0.85
    assert m.peak >= tight * rotor.plan.peak, (m.peak, rotor.plan.peak)


def test_parameters_are_the_models_and_eval_runs_the_users_forward():
    torch.manual_seed(0)
    model, x, _, _ = gpt_case()
    params = {n: p for n, p in model.named_parameters()}
    rotor = Checkpointable(model, "50%", repeats=1, warmup=0)
    assert {n: id(p) for n, p in rotor.named_parameters()} == {n: id(p) for n, p in params.items()}
    rotor(x).sum().backward()
    assert rotor.discovery is not None and rotor.plan.recomputed_stages > 0
    rotor.eval()
    with torch.no_grad():
        torch.manual_seed(1)
        expected = model(x)
        torch.manual_seed(1)
        assert torch.equal(rotor(x), expected)
        # the traced graph froze training=True (dropout on); eval must not use it
        assert torch.equal(rotor(x), rotor(x))


def test_a_longer_sequence_than_discovered_fails_the_users_assert_or_a_guard():
    torch.manual_seed(0)
    model, x, _, _ = gpt_case()
    rotor = Checkpointable(model, "50%", repeats=1, warmup=0)
    rotor(x).sum().backward()
    shorter = x[:, :32]
    rotor(shorter).sum().backward()  # another length that passes the assert: same graph, its own plan
    assert len(rotor.entries) == 2
    with pytest.raises(GuardFailed, match=r"as_written.py:\d+"):
        rotor(torch.randint(64, (4, 65)))


def test_checkpoint_modules_keep_blocks_whole():
    torch.manual_seed(0)
    model, x, y, loss_fn = gpt_case()
    rotor = Checkpointable(model, "50%", checkpoint_modules={Block}, repeats=1, warmup=0)
    loss_fn(rotor(x), y).backward()
    blocks = [n for n in rotor.stage_names if n.startswith("transformer.h.")]
    assert blocks == [f"transformer.h.{i}" for i in range(6)]


@pytest.mark.parametrize("label", ["25%", "50%", "75%", "unlimited"])
def test_value_branch_at_top_level_falls_back_to_modules_and_fails_clearly_on_the_other_branch(label):
    torch.manual_seed(0)
    plain = Gated(width=64)
    with torch.no_grad():
        plain.a.bias.fill_(5.0)  # the branch is taken
    x, y = torch.randn(512, 64), torch.randint(64, (512,))
    model = copy.deepcopy(plain)
    rotor = Checkpointable(model, 10**12 if label == "unlimited" else label, repeats=1, warmup=0)
    loss_fn = classes_loss
    try:
        losses = train(rotor, x, y, loss_fn)
    except InfeasibleBudget as err:
        assert label in ("25%", "50%") and f"use mem_limit >= {err.min_feasible}" in str(err)
        pytest.skip(f"{label} is below the smallest feasible budget {err.min_feasible}")
    assert torch.equal(train(plain, x, y, loss_fn), losses)
    assert_same_state(plain, rotor)
    assert rotor.discovery.kind == "modules" and "graph discovery failed" in rotor.discovery.notes[0]
    assert rotor.stage_names == ["b", "blocks.0", "blocks.1", "blocks.2", "c"]
    m = measured_step(rotor, x, y, loss_fn)
    assert m.peak <= rotor.plan.budget
    with torch.no_grad():
        rotor.a.bias.fill_(-50.0)  # now the branch is skipped: `b` is not called before the blocks
    with pytest.raises(ChainDiverged):
        loss_fn(rotor(x), y).backward()


def test_bad_arguments_are_one_line_errors():
    model = GPT()
    with pytest.raises(ValueError, match="discover='bogus' is not a discovery method; use one of auto"):
        Checkpointable(model, discover="bogus")
    with pytest.raises(TypeError, match="discover='sequential' needs a plain nn.Sequential, got GPT"):
        Checkpointable(model, discover="sequential")
    with pytest.raises(TypeError, match="checkpoint_modules must be nn.Module classes"):
        Checkpointable(model, checkpoint_modules=["Block"])
    with pytest.raises(TypeError, match="wraps an nn.Module, got function"):
        Checkpointable(lambda x: x)


def test_conversion_after_discovery_finds_the_chain_again_on_the_new_tensors():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
            self.register_buffer("scale", torch.full((8,), 3.0))
            self.bias = nn.Parameter(torch.zeros(8))

        def forward(self, x):
            return self.b(self.a(x) * self.scale + self.bias)

    torch.manual_seed(0)
    plain = Scaled()
    rotor = Checkpointable(copy.deepcopy(plain), 10**9, repeats=1, warmup=0)
    x = torch.randn(4, 8)
    rotor(x).sum().backward()
    assert rotor.discovery is not None
    plain.double()
    rotor.double()
    assert rotor.scale is rotor.module.scale and rotor.scale.dtype == torch.float64
    assert rotor.bias is rotor.module.bias and rotor.discovery is None  # found again on the next call
    out = rotor(x.double())
    assert out.dtype == torch.float64 and torch.equal(out, plain(x.double()))
    assert list(rotor.state_dict()) == list(plain.state_dict())


@pytest.mark.parametrize("how", ["graph", "modules"])
def test_tied_weights_are_fine_alone_and_refused_under_ddp(how):
    # each stage's backward accumulates into .grad on its own: DDP would all-reduce a tied weight's
    # gradient after the first of its stages (measured: the embedding differed by 2.6e-3 after 3 steps)
    torch.manual_seed(0)
    model, x, y, loss_fn = gpt_case()
    rotor = Checkpointable(model, "50%", discover=how, repeats=1, warmup=0)
    loss_fn(rotor(x), y).backward()  # one process: fine (and bitwise, see above)
    users = rotor.shared_parameters()["transformer.wte.weight"]
    assert "lm_head" in users and len(users) == 2
    again = Checkpointable(copy.deepcopy(model), "50%", discover=how, repeats=1, warmup=0)
    again.distributed = True  # what RotorDDPStrategy sets
    with pytest.raises(
        RuntimeError,
        match=r"rotor under DDP: parameter 'transformer.wte.weight' is used by stages "
        r".*lm_head.*\(tied weights\).*Untie it",
    ):
        loss_fn(again(x), y).backward()


def test_tied_weights_accumulated_over_micro_batches_stay_bitwise():
    """issue 15: with `.grad` stored, each stage added its part on its own ((g+b)+a, not g+(a+b))."""
    torch.manual_seed(0)
    plain, x, y, loss_fn = gpt_case()
    assert plain.lm_head.weight is plain.transformer.wte.weight
    rotor = Checkpointable(copy.deepcopy(plain), "50%", repeats=1, warmup=0)
    micro = [
        (x[i::4], torch.randint(64, (x[i::4].numel(),), generator=torch.Generator().manual_seed(i))) for i in range(4)
    ]
    for model in (plain, rotor):
        torch.manual_seed(1)
        for _step in range(2):  # the second step accumulates onto gradients left by the first
            for xb, yb in micro:
                (loss_fn(model(xb), yb) / 4).backward()
    assert rotor.plan.recomputed_stages > 0
    assert any(len(users) > 1 for users in rotor.shared_parameters().values()), "the test needs a tied weight"
    assert_same_state(plain, rotor)
