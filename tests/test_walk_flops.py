"""FLOPs counted in the profile's walk (NOTE: [FLOPs counted in the walk], lightning_rotor/profile.py): each stage's
count taken in the run without grad the walk makes anyway, so that a measured shape runs no FLOP pass of its own;
the counts as a separate count gives them, no figure of the profile changed, and training through changing shapes
bitwise equal to plain training and within budget (Checkpointable and a real Trainer)."""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
from fitting import fit_like_plain
from torch import nn
from torch.utils.flop_counter import register_flop_formula
from training import assert_same_state, tokens_loss

import lightning_rotor.chain_state as chain_state
from lightning_rotor import Checkpointable
from lightning_rotor._torch_compat import GlobalFlops
from lightning_rotor.lightning import RotorStrategy
from lightning_rotor.models.convnext import convnext_atto
from lightning_rotor.models.gpt import gpt, lm_loss
from lightning_rotor.profile import profile_chain
from lightning_rotor.shapes import stage_flops

TIMES = ("fwd_time", "bwd_time")


def small_gpt() -> nn.Module:
    torch.manual_seed(0)
    return gpt(vocab_size=64, block_size=32, n_layer=4, n_head=2, n_embd=32, dropout=0.1)


def hf_gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=3, n_embd=32, n_head=4, vocab_size=64, n_positions=32, use_cache=False)
    return transformers.GPT2LMHeadModel(config)  # attention dropout 0.1: another attention kernel in training mode


def tokens(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 64, (batch, length), generator=torch.Generator().manual_seed(seed + length))


def chain_of(name: str) -> tuple[list[nn.Module], torch.Tensor]:
    """A discovered chain's stages and their sample input (a module-level chain's: the blocks' hidden states)."""
    if name == "gpt":
        return list(small_gpt()), tokens(2, 16)
    if name == "frozen":  # the embedding and first block frozen: a frozen prefix, counted in its runs with grad enabled
        stages = list(small_gpt())
        stages[0].requires_grad_(False)
        stages[1].requires_grad_(False)
        return stages, tokens(2, 16)
    if name == "convnext":
        torch.manual_seed(0)
        rotor = Checkpointable(convnext_atto(num_classes=10), "50%")
        sample = torch.randn(2, 3, 32, 32)
        rotor.discover_on(sample)
        return list(rotor.chain_state.stages), sample
    rotor = Checkpointable(hf_gpt2(), "50%")
    rotor.discover_on(tokens(2, 16))
    return list(rotor.chain_state.stages), torch.randn(2, 16, 32)


def separate_counts(stages: list[nn.Module], sample: torch.Tensor, training: bool) -> list[int]:
    """Per stage, its own `GlobalFlops` count, each stage counted (none taking another's), without grad, in training
    mode (as the walk runs it) or in eval mode (as the FLOP pass before the walk counted)."""
    counts, value = [], sample
    modes = [(m, m.training) for stage in stages for m in stage.modules()]
    for m, _ in modes:
        m.training = training and m.training
    with torch.no_grad(), torch.random.fork_rng():
        for stage in stages:
            with GlobalFlops() as counter:
                value = stage(value)
            counts.append(int(counter.get_total_flops()))
    for m, was in modes:
        m.training = was
    return counts


def untimed(chain) -> dict:
    return {k: v for k, v in chain.to_dict().items() if k not in TIMES}


@pytest.mark.parametrize("name", ["gpt", "frozen", "convnext", "gpt2"])
def test_the_walk_counts_each_stage_as_a_separate_count_and_changes_no_figure(name: str) -> None:
    stages, sample = chain_of(name)
    counted = profile_chain(stages, sample, repeats=1, timed=False, flops=True)
    assert counted.flops is not None and len(counted.flops) == len(stages) and sum(counted.flops) > 0
    assert counted.flops == separate_counts(stages, sample, training=True)
    assert counted.flops == stage_flops(stages, sample)  # a shape no profile measured: counted the same way
    if name != "gpt2":  # no counted op follows `training`: the eval-mode pass's numbers
        assert counted.flops == separate_counts(stages, sample, training=False)
    plain = profile_chain(stages, sample, repeats=1, timed=False)
    assert plain.flops is None and counted.chain.frozen == (2 if name == "frozen" else 0)
    assert untimed(counted.chain) == untimed(plain.chain)  # the probe saw what it sees uncounted


def test_a_measured_shape_runs_no_flop_pass_and_derives_its_times_from_the_walks_counts(monkeypatch) -> None:
    passes = []

    def counted_pass(*args):
        passes.append(args)
        return stage_flops(*args)

    monkeypatch.setattr(chain_state, "stage_flops", counted_pass)
    rotor = Checkpointable(small_gpt(), "60%", repeats=1, fit_shapes=False)
    for length in (8, 16):
        x = tokens(2, length)
        lm_loss(rotor(x), tokens(2, length, seed=1)).backward()
    assert passes == []  # both profiles counted in their walks
    timed, derived = (e.profile for e in rotor.entries.values())
    assert timed.repeats == 1 and derived.repeats == 0  # the second shape's times derived, not timed
    assert timed.flops == stage_flops(rotor.stages, tokens(2, 8))
    assert derived.flops == stage_flops(rotor.stages, tokens(2, 16))
    for k in range(len(rotor.stages)):
        before, after = timed.flops[k], derived.flops[k]
        ratio = after / before if before > 0 else derived.chain.out_size[k] / timed.chain.out_size[k]
        assert derived.chain.fwd_time[k] == pytest.approx(timed.chain.fwd_time[k] * ratio)
        assert derived.chain.bwd_time[k] == pytest.approx(timed.chain.bwd_time[k] * ratio)


def test_hf_gpt2_trains_through_changing_lengths_bitwise_within_budget() -> None:
    plain = hf_gpt2()
    rotor = Checkpointable(copy.deepcopy(plain), "60%", repeats=1, fit_shapes=False)
    seen = set()
    for step, length in enumerate((12, 20, 12, 20, 16, 16)):
        x, y = tokens(2, length, seed=step), tokens(2, length, seed=step + 1)
        plain.zero_grad()
        torch.manual_seed(step)
        tokens_loss(plain(x), y.reshape(-1)).backward()
        rotor.zero_grad()
        torch.manual_seed(step)
        with rotor.measure_step() as m:
            tokens_loss(rotor(x), y.reshape(-1)).backward()
        assert_same_state(plain, rotor)
        assert m.peak <= rotor.last_entry.plan.budget or length not in seen  # a new length's step profiles
        seen.add(length)
    assert [e.profile.flops is not None for e in rotor.entries.values()] == [True, True, True]
    assert [e.profile.repeats > 0 for e in rotor.entries.values()] == [True, False, False]  # derived by FLOPs


class TinyLM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = hf_gpt2()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return tokens_loss(self.net(x), y.reshape(-1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def test_a_trainer_through_changing_lengths_trains_as_plain(tmp_path) -> None:
    batches = [(tokens(2, n, seed=i), tokens(2, n, seed=i + 1)) for i, n in enumerate((12, 20, 16, 12))]
    plain, rotor = TinyLM(), TinyLM()
    rotor.load_state_dict(copy.deepcopy(plain.state_dict()))
    fit_like_plain(tmp_path, plain, rotor, RotorStrategy(mem_limit="60%", fit_shapes=False), batches, seed=3)


# -- a counter that fails where the stage does not -----------------------------------------------------------------
@torch.library.custom_op("walk_flops_test::doubled", mutates_args=())
def doubled(x: torch.Tensor) -> torch.Tensor:
    """An op of the user's with a FLOP formula of theirs that refuses its argument (the stage itself runs)."""
    return x * 2


doubled.register_autograd(lambda ctx, grad: grad * 2)


REFUSED_ROWS = 10


@register_flop_formula(torch.ops.walk_flops_test.doubled)
def _refusing_formula(x_shape, out_shape=None) -> int:
    if x_shape[0] == REFUSED_ROWS:
        raise ValueError("no formula for this argument")
    return 0


class Doubled(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return doubled(x)


def doubling_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), Doubled(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))


def test_a_counter_that_fails_leaves_the_figures_and_times_derive_by_output_sizes() -> None:
    stages, x = list(doubling_net()), torch.randn(REFUSED_ROWS, 8)
    counted = profile_chain(stages, x, repeats=1, timed=False, flops=True)
    assert counted.flops is None  # the walk's counter gave up, the stage measured again uncounted
    assert untimed(counted.chain) == untimed(profile_chain(stages, x, repeats=1, timed=False).chain)
    assert stage_flops(stages, x) is None  # nor can a pass of its own count

    plain = doubling_net()
    rotor = Checkpointable(copy.deepcopy(plain), None, repeats=1, fit_shapes=False)
    for step, rows in enumerate((6, REFUSED_ROWS, 6, REFUSED_ROWS)):
        x, y = torch.randn(rows, 8, generator=torch.Generator().manual_seed(step)), torch.zeros(rows, dtype=torch.long)
        for model in (plain, rotor):
            model.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
        assert_same_state(plain, rotor)
    timed, derived = (e.profile for e in rotor.entries.values())
    assert timed.flops is not None and timed.repeats == 1
    assert derived.repeats == 0 and derived.flops is None  # derived, by the ratio of output sizes alone
    ratio = [b / a for a, b in zip(timed.chain.out_size, derived.chain.out_size, strict=True)]
    assert derived.chain.fwd_time == pytest.approx([t * r for t, r in zip(timed.chain.fwd_time, ratio, strict=True)])
