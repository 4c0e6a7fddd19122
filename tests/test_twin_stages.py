"""Twin stages (NOTE: [twin stages] in lightning_rotor/profile.py): a repeated block whose first recorded run holds
what an earlier block's did takes that block's other figures instead of running for them. Every figure of every
profile equals the one a profile measuring each stage in full gives, on the project's GPT, a ConvNeXt, Hugging Face
GPT-2 and Llama and litgpt from configs, traced and across shapes; a block that holds more on one index, one with a
hook of its own, and one routing by value are measured in full; FLOPs of twins are their counts; training through
the twins is bitwise and within budget."""

from __future__ import annotations

import pytest
import torch
from hf_models import tiny_llama
from test_shapes import batch, small_gpt
from test_symbolic_sizes import image, sizes, tokens
from torch import nn
from training import check_measured_peak, measured_step

import lightning_rotor.profile as profile
from lightning_rotor._torch_compat import GlobalFlops
from lightning_rotor.checkpointable import Checkpointable
from lightning_rotor.models.convnext import ConvNeXt
from lightning_rotor.models.gpt import gpt, lm_loss
from lightning_rotor.profile import profile_chain
from lightning_rotor.shapes import stage_flops
from lightning_rotor.size_trace import traced

torch.set_num_threads(1)


def gpt_stages():
    """The project's GPT with four blocks: embedding, blocks, final norm, head."""
    torch.manual_seed(0)
    embed, blocks, norm, head = gpt(vocab_size=64, block_size=128, n_layer=4, n_head=2, n_embd=32, dropout=0.1)
    return [embed, *blocks, norm, head]


def both(stages, x, **options):
    """(profile with twins, profile measuring every stage in full)."""
    return (
        profile_chain(stages, x, repeats=1, timed=False, **options),
        profile_chain(stages, x, repeats=1, timed=False, twins=False, **options),
    )


def deep_convnext_stages():
    torch.manual_seed(0)
    model = ConvNeXt(depths=(1, 3, 1, 1), dims=(8, 16, 32, 64), num_classes=10)
    second = model.stages[1]
    return [model.stem, model.stages[0], second.downsample, *second.blocks, model.stages[2], model.stages[3]]


@pytest.mark.parametrize("options", [{}, {"options": True}, {"offload": True}], ids=["plain", "sac", "offload"])
def test_a_gpt_s_repeated_blocks_take_the_second_block_s_figures_every_figure_as_measured(options):
    """Every block after the first takes the first's figures (its input from the embedding has the structure of
    a block's output), and every figure is the one a full profile measures, with option "sac" and offloading too."""
    stages = gpt_stages()
    for length in (9, 20):
        fast, full = both(stages, tokens(2, length), **options)
        assert fast.twins == {2: 1, 3: 1, 4: 1} and full.twins == {}
        assert sizes(fast.chain) == sizes(full.chain)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_cuda_a_gpt_s_blocks_are_twins_with_the_allocator_s_figures_as_measured():
    """On CUDA a profile keeps the caching allocator's figures where larger; a block whose allocator figures differ
    from its twin's is measured in full. After one warm profile (cuBLAS's workspace made), the GPT's blocks are
    twins and every figure equals a full profile's."""
    stages = [stage.cuda() for stage in gpt_stages()]
    profile_chain(stages, tokens(2, 9).cuda(), repeats=1, timed=False)  # cuBLAS's workspace, made once
    for length in (9, 20):
        fast, full = both(stages, tokens(2, length).cuda())
        assert fast.twins == {2: 1, 3: 1, 4: 1} and full.twins == {}
        assert sizes(fast.chain) == sizes(full.chain)


def test_a_convnext_s_repeated_blocks_take_their_twins_figures_at_several_sides_and_batches():
    stages = deep_convnext_stages()
    for n, side in ((2, 64), (3, 96), (1, 32)):
        fast, full = both(stages, image(n, side))
        assert fast.twins and sizes(fast.chain) == sizes(full.chain)


def test_a_traced_profile_with_twins_derives_the_chain_a_full_one_measures():
    """A twin's figures are its twin's terms: the chain derived from traced profiles at two lengths is the one a
    full profile measures between them."""
    from lightning_rotor.symbolic_sizes import ShapeLaws

    stages = gpt_stages()
    laws = ShapeLaws()
    for length in (16, 40):
        with traced() as trace:
            chain = profile_chain(stages, tokens(2, length), repeats=1, timed=False).chain
        laws.add("family", ((2, length),), trace, chain, None)
    got = laws.chain_for("family", ((2, 24),))
    assert not isinstance(got, str), got
    assert sizes(got[0]) == sizes(profile_chain(stages, tokens(2, 24), repeats=1, timed=False, twins=False).chain)


class Block(nn.Module):
    """A residual MLP block; `index` and `holds` make one of them differ in what it holds, not in its structure."""

    def __init__(self, index: int, holds: str = "") -> None:
        super().__init__()
        self.index, self.holds = index, holds
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        if self.index == 2 and self.holds == "saved":
            h = h * torch.sigmoid(h)  # saves two more tensors for backward
        if self.index == 2 and self.holds == "attribute":
            self.kept = h  # an output kept alive beyond the stage
        if self.holds == "routing":
            h = h[h.sum(-1) > 0].sum(0, keepdim=True).expand_as(h)  # a boolean mask: bytes follow values
        return x + self.fc2(h)


def blocks(holds: str = "") -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(8, 16), *(Block(i, holds) for i in range(1, 5))]


@pytest.mark.parametrize("holds", ["saved", "attribute"])
def test_a_block_that_holds_more_at_one_index_is_measured_in_full(holds):
    stages, x = blocks(holds), torch.randn(6, 8, requires_grad=True)
    fast, full = both(stages, x)
    assert fast.twins == {3: 1, 4: 1}
    assert sizes(fast.chain) == sizes(full.chain)


class Scaled(torch.autograd.Function):
    """`x * 2`, whose backward holds a scratch tensor at one index only: nothing its forward shows."""

    @staticmethod
    def forward(ctx, x, index):
        ctx.index = index
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        if ctx.index == 2:
            scratch = torch.ones(64, 1024)  # 256 KiB more in this block's backward
            grad = grad + scratch.sum() * 0
        return grad * 2, None


class FunctionBlock(Block):
    def forward(self, x):
        return Scaled.apply(super().forward(x), self.index)


def test_a_block_whose_backward_is_python_code_is_measured_in_full():
    """A custom autograd Function's backward may hold what its forward does not show: such a stage's backward is
    measured, never taken from a twin whose forward agrees."""
    torch.manual_seed(0)
    stages, x = [nn.Linear(8, 16), *(FunctionBlock(i) for i in range(1, 5))], torch.randn(6, 8, requires_grad=True)
    fast, full = both(stages, x)
    assert fast.twins == {}
    assert sizes(fast.chain) == sizes(full.chain) and full.chain.bwd_tmp[2] > full.chain.bwd_tmp[1]


def test_a_block_with_a_hook_of_its_own_is_no_twin():
    stages, x = blocks(), torch.randn(6, 8, requires_grad=True)
    outputs = []
    stages[4].register_forward_hook(lambda m, args, out: outputs.append(out))
    fast, full = both(stages, x)
    assert fast.twins == {2: 1, 3: 1}
    assert sizes(fast.chain) == sizes(full.chain)


def test_a_block_routing_by_value_is_never_a_twin():
    stages, x = blocks("routing"), torch.randn(6, 8, requires_grad=True)
    fast, full = both(stages, x)
    assert fast.twins == {}
    assert sizes(fast.chain) == sizes(full.chain)


def test_twin_stages_flops_are_their_own_counts():
    stages = gpt_stages()
    x = tokens(2, 24)
    counts, value = [], x
    with torch.no_grad():  # each stage in its own mode, as training runs it (NOTE: [FLOPs counted in the walk])
        for stage in stages:
            with GlobalFlops() as counter:
                value = stage(value)
            counts.append(int(counter.get_total_flops()))
    assert stage_flops(stages, x) == counts and counts[2] == counts[3] > 0


def gpt2_model():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=4, n_embd=32, n_head=2, vocab_size=64, n_positions=128, use_cache=False)
    return transformers.GPT2LMHeadModel(config)


def litgpt_model():
    pytest.importorskip("litgpt")
    from test_discovery_models import litgpt_case

    return litgpt_case()[0]


MODELS = {
    "gpt2": (gpt2_model, lambda m, x: m(input_ids=x, labels=x).loss),
    "llama": (lambda: tiny_llama(max_position_embeddings=128), lambda m, x: m(input_ids=x, labels=x).loss),
    "litgpt": (litgpt_model, lambda m, x: nn.functional.cross_entropy(m(x).flatten(0, 1), x.flatten())),
}


def profiles(make, loss, inputs, twins: bool, monkeypatch) -> list:
    """Each measured shape's profile of a `Checkpointable` stepping through `inputs` (every shape measured)."""
    with monkeypatch.context() as patch:
        if not twins:
            patch.setattr(profile, "_twin_key", lambda run, walk, ctx: None)
        rotor = Checkpointable(make(), "80%", repeats=1, fit_shapes=False)
        for x in inputs:
            loss(rotor, x).backward()
            rotor.zero_grad(set_to_none=True)
    return [entry.profile for entry in rotor.entries.values()]


@pytest.mark.parametrize("name", list(MODELS))
def test_models_from_configs_profile_with_twins_as_in_full(name, monkeypatch):
    make, loss = MODELS[name]
    inputs = [torch.randint(0, 64, (b, 64), generator=torch.Generator().manual_seed(b)) for b in (2, 3)]
    if name != "litgpt":  # its graph fixes the length: batch sizes there
        inputs = [tokens(2, n) for n in (40, 28)]
    fast = profiles(make, loss, inputs, True, monkeypatch)
    full = profiles(make, loss, inputs, False, monkeypatch)
    assert all(p.twins for p in fast) and not any(p.twins for p in full)
    assert [sizes(p.chain) for p in fast] == [sizes(p.chain) for p in full]


def test_training_through_twins_is_bitwise_and_within_budget_as_lengths_change():
    plain, rotor = small_gpt(), Checkpointable(small_gpt(), "60%", repeats=1)
    for step, length in enumerate((12, 20, 6, 16)):
        x, y = batch(length)
        for model in (plain, rotor):
            model.zero_grad(set_to_none=True)
            torch.manual_seed(step)
            lm_loss(model(x), y).backward()
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(), rotor.parameters(), strict=True))
        check_measured_peak(rotor, measured_step(rotor, x, y, lm_loss).peak)
    assert next(iter(rotor.entries.values())).profile.twins  # the first profile took twins' figures
