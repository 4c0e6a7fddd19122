"""Discovery on models written as users write them: the stages found, run one after another, are the forward."""

import copy

import pytest
import torch
from models_any import GPT, Gated, ResNet, UNet, WithInnerBranch, gpt2
from torch import nn
from training import assert_same_state, measured_step, train

from lightning_rotor.checkpointable import Checkpointable
from lightning_rotor.discovery import (
    ChainDiverged,
    DiscoveryError,
    GuardFailed,
    ValueBranch,
    discover,
    discover_chain,
)
from lightning_rotor.planner import InfeasibleBudget


def run_graph(found, *args, **kwargs):
    """The graph chain's stages one after another on a call's arguments."""
    import inspect

    module_forward = found.graph
    bound = inspect.signature(found.owner.forward).bind(*args, **kwargs)
    bound.apply_defaults()
    value = module_forward.chain_input(dict(bound.arguments))
    for stage in found.stages:
        value = stage(value)
    return value


def graph_of(model, *args, **kwargs):
    found = discover_chain(model, args, discover="graph", sample_kwargs=kwargs)
    found.owner = model
    return found


def same_forward(model, found, *args, seed=0):
    torch.manual_seed(seed)
    expected = model(*args)
    torch.manual_seed(seed)
    got = run_graph(found, *args)
    return torch.equal(expected, got)


def resnet_case():
    torch.manual_seed(0)
    return ResNet(layers=(2, 1, 1, 1)), torch.randn(2, 3, 32, 32)


def gpt_case(n_layer=3):
    torch.manual_seed(0)
    return GPT(n_layer=n_layer), torch.randint(64, (2, 12))


def unet_case():
    torch.manual_seed(0)
    return UNet(), torch.randn(2, 3, 16, 16)


CASES = {"resnet": (resnet_case, 10), "gpt": (gpt_case, 8), "unet": (unet_case, 11)}


@pytest.mark.parametrize("name", list(CASES))
def test_graph_stages_equal_the_forward_bitwise(name):
    build, stages = CASES[name]
    model, x = build()
    model.train()
    found = graph_of(model, x)
    assert found.kind == "graph" and len(found.stages) == stages, found.stages.names
    assert same_forward(model, found, x)
    assert same_forward(model, found, x, seed=3)  # dropout draws the same numbers in the same order


def test_graph_stages_call_the_users_modules_and_leave_no_trace():
    model, x = resnet_case()
    keys = list(model.state_dict())
    stats = {n: b.clone() for n, b in model.named_buffers()}
    rng = torch.get_rng_state()
    found = graph_of(model, x)
    assert list(model.state_dict()) == keys
    assert all(torch.equal(stats[n], b) for n, b in model.named_buffers())  # BatchNorm statistics untouched
    assert torch.equal(rng, torch.get_rng_state())
    ours = {id(p) for p in model.parameters()}
    in_stages = {id(p) for s in found.stages for p in s.parameters()}
    assert in_stages == ours  # the same Parameter objects, none copied
    bns = [m for s in found.stages for m in s.modules() if isinstance(m, nn.BatchNorm2d)]
    assert bns and all(any(m is b for b in model.modules()) for m in bns)  # BatchNorm stays the user's module


def test_gpt_assert_on_length_becomes_a_guard_and_a_longer_input_fails_clearly():
    model, x = gpt_case()
    found = graph_of(model, x)
    assert "2 shape guard(s)" in found.notes[0] or "shape guard" in found.notes[0]
    short = torch.randint(64, (2, 5))
    assert same_forward(model, found, short)  # other lengths that pass the assert run the same graph

    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            x = self.a(x)
            if x.shape[0] > 2:
                x = x * 2
            return self.b(x)

    branchy = Branchy()
    found = graph_of(branchy, torch.randn(4, 4))
    assert same_forward(branchy, found, torch.randn(5, 4))
    with pytest.raises(GuardFailed, match=r"test_discovery.py:\d+"):
        run_graph(found, torch.randn(2, 4))


def test_value_branch_in_top_level_forward_names_file_and_line():
    model = Gated()
    with pytest.raises(ValueBranch, match=r"models_any.py:\d+: a Python branch depends on tensor values"):
        discover(model, torch.randn(4, 16), discover="graph")


def test_value_branch_falls_back_to_modules_and_a_diverging_call_fails_clearly():
    torch.manual_seed(0)
    model = Gated()
    x = torch.randn(4, 16)
    with torch.no_grad():
        model.a.bias.fill_(5.0)  # the branch is taken on the sample
    found = discover_chain(model, (x,))
    assert found.kind == "modules" and "graph discovery failed" in found.notes[0]
    run = found.run
    assert run.names[0] == "b"  # `a`'s output feeds the branch, so the run starts after it
    run.install(lambda v: chain(found, v))
    try:
        torch.manual_seed(0)
        got = model(x)
        with torch.no_grad():
            model.a.bias.fill_(-5.0)  # now the branch is skipped: the blocks are called otherwise
        with pytest.raises(ChainDiverged, match="expected b"):
            model(x)
    finally:
        run.uninstall()
    with torch.no_grad():
        model.a.bias.fill_(5.0)
    torch.manual_seed(0)
    assert torch.equal(model(x), got)


def chain(found, value):
    for stage in found.stages:
        value = stage(value)
    return value


def test_value_branch_inside_a_submodule_makes_it_one_stage():
    torch.manual_seed(0)
    model = WithInnerBranch()
    found = graph_of(model, torch.randn(4, 16))
    assert found.stages.names == ("inp", "clamp", "out")
    assert any("clamp" in n for n in found.notes)
    for scale in (0.01, 100.0):  # both sides of the inner branch
        assert same_forward(model, found, scale * torch.randn(4, 16))


def test_unet_carries_the_skips_as_a_tuple():
    model, x = unet_case()
    found = graph_of(model, x)
    crossing = [c for c in found.notes if c.startswith("after down3.1")][0]
    assert crossing.count("[") == 4  # three skips and the bottleneck cross together


def test_too_many_crossing_tensors_stay_inside_one_stage():
    model, x = unet_case()
    found = discover_chain(model, (x,), discover="graph", max_carry=2)
    found.owner = model
    assert len(found.stages) < 11
    assert same_forward(model, found, x)


def test_no_cut_before_an_in_place_write_into_what_would_cross():
    class Inplace(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            h = self.a(x)
            y = self.b(h)
            h.mul_(2)  # writes into h after b ran: no cut may carry h across
            return self.c(y + h)

    model = Inplace()
    found = graph_of(model, torch.randn(3, 4))
    assert found.stages.names[0] == "a..b"
    assert same_forward(model, found, torch.randn(3, 4))


def test_non_tensor_arguments_are_fixed_and_checked():
    class Args(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x, y, scale=2, mask=None):
            h = self.a(x) * scale
            if mask is not None:
                h = h * mask
            return self.b(h + y)

    model = Args()
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    found = graph_of(model, x, y)
    assert torch.equal(model(x, y), run_graph(found, x, y))
    with pytest.raises(GuardFailed, match="scale=3"):
        run_graph(found, x, y, scale=3)


def test_a_module_used_twice_runs_twice():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = nn.Linear(4, 4)
            self.out = nn.Linear(4, 4)

        def forward(self, x):
            return self.out(self.block(torch.tanh(self.block(x))))

    model = Twice()
    found = graph_of(model, torch.randn(2, 4))
    assert len(found.stages) == 3
    assert same_forward(model, found, torch.randn(2, 4))


def test_checkpoint_modules_choose_the_blocks():
    from models_any import Block

    model, x = gpt_case()
    found = discover_chain(model, (x,), discover="graph", checkpoint_modules={Block})
    assert [n for n in found.stages.names if n.startswith("transformer.h.")] == [
        "transformer.h.0",
        "transformer.h.1",
        "transformer.h.2",
    ]


def test_bad_how_and_bad_checkpoint_modules_are_one_line_errors():
    model, x = gpt_case()
    with pytest.raises(ValueError, match="discover='bogus' is not a discovery method; use one of auto, sequential"):
        discover(model, x, discover="bogus")
    with pytest.raises(TypeError, match="checkpoint_modules must be nn.Module classes"):
        discover(model, x, checkpoint_modules=["Block"])
    with pytest.raises(DiscoveryError, match="needs a plain nn.Sequential"):
        discover(model, x, discover="sequential")


def test_sequential_is_found_as_before():
    seq = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 4))
    stages = discover(seq, torch.randn(2, 4))
    assert stages.kind == "sequential" and len(stages) == 2


@pytest.mark.parametrize("name", ["resnet", "gpt", "unet"])
@pytest.mark.parametrize("label", ["25%", "50%", "75%", "unlimited"])
def test_graph_chain_trains_like_plain_within_budget(name, label):
    build, _ = CASES[name]
    plain, x = build()
    model = copy.deepcopy(plain)
    stages = discover(model, x, discover="graph")
    ckpt = Checkpointable(model, 10**12 if label == "unlimited" else label, stages=stages, repeats=1, warmup=0)
    try:
        ckpt.prepare_for(x)
    except InfeasibleBudget as err:
        assert str(err.min_feasible) in str(err)
        pytest.skip(f"{label} is below the smallest feasible budget {err.min_feasible}")
    if name == "gpt":
        y = torch.randint(64, (x.shape[0] * x.shape[1],))

        def loss_fn(out, y):
            return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y)
    else:
        # class targets (per image, or per pixel for the U-Net's segmentation)
        y = torch.zeros_like(x[:, 0, 0, 0], dtype=torch.long) if name == "resnet" else torch.randint(2, (2, 16, 16))

        def loss_fn(out, y):
            return nn.functional.cross_entropy(out, y)

    assert torch.equal(train(plain, x, y, loss_fn, lr=0.05), train(ckpt, x, y, loss_fn, lr=0.05))
    assert_same_state(plain, ckpt)
    m = measured_step(ckpt, x, y, loss_fn)
    assert m.peak <= ckpt.plan.budget
    assert m.peak >= 0.85 * ckpt.plan.peak, (m.peak, ckpt.plan.peak)


def test_transformers_gpt2_falls_back_to_blocks_and_runs_them_exactly():
    pytest.importorskip("transformers")
    model = gpt2(n_layer=3)
    model.train()
    x = torch.randint(64, (2, 12))
    found = discover_chain(model, (x,))
    assert found.kind == "modules"
    assert found.stages.names == ("transformer.h.0", "transformer.h.1", "transformer.h.2")
    torch.manual_seed(0)
    expected = model(x).logits
    found.run.install(lambda v: chain(found, v))
    try:
        torch.manual_seed(0)
        got = model(x).logits
        assert torch.equal(expected, got)
        with pytest.raises(ChainDiverged, match=r"^output_hidden_states=True records the output of every block"):
            model(x, output_hidden_states=True)
    finally:
        found.run.uninstall()
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(x).logits, model(x).logits)


def test_how_is_the_old_name_of_discover():
    """`discover=` names the discovery method everywhere; `how=` (deprecated in 0.2.0) still works, with a warning."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    x = torch.randn(2, 8)
    with pytest.warns(DeprecationWarning, match="discover="):
        old = discover(model, x, how="sequential")
    assert old.names == discover(model, x, discover="sequential").names


class TimeNet(nn.Module):
    """A diffusion-style net: a timestep that may be a tensor or a number, skips gathered with `skips += res`
    from blocks that return their skips as a tuple (diffusers' down blocks)."""

    def __init__(self):
        super().__init__()
        self.temb, self.inp, self.out = nn.Linear(1, 8), nn.Linear(4, 8), nn.Linear(8, 4)
        self.blocks = nn.ModuleList(Down() for _ in range(3))

    def forward(self, x, t):
        if not torch.is_tensor(t):  # diffusers' UNet2DModel: a Python number becomes a tensor
            t = torch.tensor([t], dtype=x.dtype)
        emb = self.temb(t.reshape(-1, 1).to(x.dtype))
        h = self.inp(x)
        skips = (h,)
        for block in self.blocks:
            h, res = block(h, emb)
            skips += res  # a new tuple each time: no write into what an earlier stage holds
        for s in skips:
            h = h + s
        return self.out(h)


class Down(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, h, emb):
        h = torch.tanh(self.lin(h) + emb)
        return h, (h,)


def test_torch_is_tensor_on_an_argument_is_answered_from_the_sample():
    model, x, t = TimeNet(), torch.randn(3, 4), torch.rand(3)
    found = graph_of(model, x, t)  # fx alone takes the number path on the proxy: torch.tensor([proxy]) fails
    assert torch.equal(model(x, t), run_graph(found, x, t))
    with pytest.raises(GuardFailed, match="argument t=0.5 is not a tensor"):
        run_graph(found, x, 0.5)


def test_a_tuple_grown_with_plus_equals_does_not_block_cuts():
    model, x, t = TimeNet(), torch.randn(3, 4), torch.rand(3)
    found = graph_of(model, x, t)
    assert {"blocks.0", "blocks.1", "blocks.2"} <= set(found.stages.names)  # `skips += (h,)` makes a new tuple
    assert any("iadd=(3: [3, 8], [3, 8], [3, 8])" in n for n in found.notes)  # the skips cross as one tuple


class NormActConv(nn.Module):
    """diffusers' `ResnetBlock2D` in small: one activation module applied three times in one forward."""

    def __init__(self, c=8):
        super().__init__()
        self.norm1, self.norm2 = nn.GroupNorm(2, c), nn.GroupNorm(2, c)
        self.conv1, self.conv2 = nn.Conv2d(c, c, 3, padding=1), nn.Conv2d(c, c, 3, padding=1)
        self.proj = nn.Linear(c, c)
        self.act = nn.SiLU()

    def forward(self, x, temb):
        h = self.conv1(self.act(self.norm1(x)))
        h = h + self.proj(self.act(temb))[:, :, None, None]
        return x + self.conv2(self.act(self.norm2(h)))


class OneBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = NormActConv()

    def forward(self, x, temb):
        return self.block(x, temb)


def test_a_run_never_holds_a_module_called_twice_in_its_parent():
    from lightning_rotor.discovery.modules import find_runs

    model, x, temb = OneBlock(), torch.randn(2, 8, 6, 6), torch.randn(2, 8)
    runs = find_runs(model, (x, temb))
    assert not any(model.block.act in r.blocks for r in runs)  # was [norm1, act, conv1]: act is called again on temb
    with pytest.raises(DiscoveryError, match="no run of two or more sibling blocks"):
        discover_chain(model, (x, temb), discover="modules")
