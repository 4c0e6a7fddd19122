"""A new input shape's sizes from a law of measured ones (lightning_rotor/symbolic_sizes.py): to the byte at
shapes the law was not made from, on the project's GPT, a ConvNeXt at several resolutions and Hugging Face's
GPT-2 from a config; no law where a size does not follow one polynomial (a data-dependent stage, a peak whose
largest op changes with the size)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from fitting import KeepRotorModules, quiet_trainer
from torch import nn
from torch.utils.data import DataLoader, Dataset
from training import assert_same_state

from lightning_rotor.checkpointable import Checkpointable
from lightning_rotor.lightning import RotorStrategy
from lightning_rotor.models.convnext import ConvNeXt
from lightning_rotor.models.gpt import gpt, lm_loss
from lightning_rotor.planner import plan
from lightning_rotor.profile import Profile, profile_chain
from lightning_rotor.simulate import no_recompute_peak
from lightning_rotor.symbolic_sizes import SizeLaw, size_law

TIMES = ("fwd_time", "bwd_time")


def sizes(chain):
    """Every field of a chain but its times (what a law gives)."""
    return {k: v for k, v in chain.to_dict().items() if k not in TIMES}


def gpt_stages():
    torch.manual_seed(0)
    return list(gpt(vocab_size=64, block_size=64, n_layer=2, n_head=2, n_embd=32, dropout=0.1))


def gpt_chain(stages, length):
    x = torch.randint(0, 64, (2, length), generator=torch.Generator().manual_seed(length))
    return profile_chain(stages, x, repeats=1, timed=False).chain


def test_a_law_of_measured_lengths_gives_each_size_of_another_length_to_the_byte():
    stages = gpt_stages()
    law = size_law([(n, gpt_chain(stages, n), None) for n in (28, 36, 32, 40)], dims=1)
    assert isinstance(law, SizeLaw) and law.nodes == (28, 36, 32) and law.checked == (40,)
    for length in (30, 47, 64):
        predicted = law.chain(length)
        assert predicted is not None
        assert sizes(predicted[0]) == sizes(gpt_chain(stages, length))


def test_a_peak_whose_largest_op_changes_with_the_length_has_no_law():
    """A transient is a peak over the ops of a stage: the largest of several polynomials, not one. Below
    about 22 tokens the embedding's backward peaks at its weight's gradient, above at the tokens' gradient."""
    stages = gpt_stages()
    law = size_law([(n, gpt_chain(stages, n), None) for n in (8, 16, 12, 24)], dims=1)
    assert law == "bwd_tmp[0] at size 24 is off the polynomial through sizes [8, 16, 12]"


def test_a_convnext_at_other_resolutions_gets_its_sizes_to_the_byte():
    """Height and width vary together (degree 4 in the side): six resolutions make the law and check it."""
    torch.manual_seed(0)
    model = ConvNeXt(depths=(1, 1, 1, 1), dims=(8, 16, 32, 64), num_classes=10)
    stages = [model.stem, *model.stages]

    def chain(side):
        x = torch.randn(2, 3, side, side, generator=torch.Generator().manual_seed(side))
        return profile_chain(stages, x, repeats=1, timed=False, loss_tmp=0).chain

    law = size_law([(s, chain(s), None) for s in (32, 64, 96, 128, 160, 192)], dims=2)
    assert isinstance(law, SizeLaw) and law.checked == (192,)
    for side in (224, 288):
        predicted = law.chain(side)
        assert predicted is not None and sizes(predicted[0]) == sizes(chain(side))


class KeepPositive(nn.Module):
    """Keeps the tokens whose first feature is positive: how many depends on the data, not the length."""

    def forward(self, x):
        return x[x[..., 0] > 0]


def test_a_data_dependent_stage_has_no_law():
    torch.manual_seed(0)
    stages = [nn.Linear(8, 8), KeepPositive(), nn.Linear(8, 8)]

    def chain(length):
        x = torch.randn(2, length, 8, generator=torch.Generator().manual_seed(length))
        return profile_chain(stages, x, repeats=1, timed=False).chain

    law = size_law([(n, chain(n), None) for n in (8, 16, 24, 32, 40, 48)], dims=1)
    assert isinstance(law, str) and "is off the polynomial through sizes [8, 16, 24]" in law


@pytest.mark.slow
def test_hugging_face_gpt2_chains_at_other_lengths_to_the_byte():
    """GPT-2 from a config as a module-level chain (the rest of the forward and the loss charged to it), the
    chains of real training steps: between 26 and 68 tokens no stage's largest op changes."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=128, use_cache=False)
    rotor = Checkpointable(transformers.GPT2LMHeadModel(config), None, repeats=1, discover="modules")
    chains = {}
    for length in (32, 44, 38, 50, 26, 62, 68):
        x = torch.randint(0, 64, (2, length), generator=torch.Generator().manual_seed(length))
        rotor(input_ids=x, labels=x).loss.backward()
        chains[length] = rotor.last_entry.chain
    law = size_law([(n, chains[n], None) for n in (32, 44, 38, 50)], dims=1)
    assert isinstance(law, SizeLaw)
    for length in (26, 62, 68):
        predicted = law.chain(length)
        assert predicted is not None and sizes(predicted[0]) == sizes(chains[length])


def batch(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(length)
    return torch.randint(0, 64, (2, length), generator=g), torch.randint(0, 64, (2, length), generator=g)


def small_gpt():
    torch.manual_seed(0)
    return gpt(vocab_size=64, block_size=32, n_layer=4, n_head=2, n_embd=32, dropout=0.1)


@pytest.mark.slow
def test_fitted_shapes_run_no_profile_train_bitwise_and_have_the_measured_sizes():
    """Checkpointable(fit_shapes=True), lengths in random order: a length between measured ones whose every
    size follows them gets no run; its sizes are those a profile measures, to the byte; every step is bitwise
    equal to plain training and measured within its budget."""
    plain, rotor = small_gpt(), Checkpointable(small_gpt(), "60%", repeats=1, fit_shapes=True)
    for step, length in enumerate((4, 32, 12, 24, 8, 28, 16, 30, 6, 26, 10, 14, 18, 9)):
        x, y = batch(length)
        plain.zero_grad()
        torch.manual_seed(step)
        lm_loss(plain(x), y).backward()
        rotor.zero_grad()
        rotor.prepare_for(x)
        torch.manual_seed(step)
        with rotor.measure_step() as m:
            lm_loss(rotor(x), y).backward()
        assert_same_state(plain, rotor)
        entry = rotor.last_entry
        assert m.peak <= entry.plan.budget
        key = next((k for k, e in rotor.entries.items() if e is entry), None)  # None: the first step's call plan
        if key in rotor.fitted:
            assert entry.profile.repeats == 0 and length not in rotor.fitted[key]
            measured = profile_chain(list(rotor.stages), x, names=rotor.stage_names, repeats=1, timed=False).chain
            assert sizes(entry.chain) == sizes(measured)
    assert len(rotor.fitted) >= 4


def test_a_fitted_shape_measured_above_its_budget_turns_fitting_off_and_is_measured_again():
    """Fitted sizes rest on each size following one polynomial; a step that proves one wrong (here: a fitted
    entry replaced by one planned on a smaller shape's chain, an under-estimate) forgets every fitted shape,
    warns once, and the shape is profiled when met again."""
    rotor = Checkpointable(small_gpt(), "60%", repeats=1, fit_shapes=True)
    for length in (4, 14, 8, 12):
        x, y = batch(length)
        lm_loss(rotor(x), y).backward()
    x, y = batch(10)
    rotor.prepare_for(x)
    (key,) = rotor.fitted
    small = profile_chain(list(rotor.stages), batch(4)[0], repeats=1, timed=False).chain
    rotor.plan_cache.add(
        key, rotor.plan_cache.build(Profile(small, seconds=0.0), plan(small, no_recompute_peak(small)))
    )
    rotor.plan_cache.forget_call_plans()
    rotor.zero_grad()
    with pytest.warns(UserWarning, match=r"\(2, 10\) had its sizes fitted .* every shape is measured from now on"):
        with rotor.measure_step() as m:
            lm_loss(rotor(x), y).backward()
    assert m.chain_peak > m.entry.plan.budget
    assert not rotor.fit_shapes and not rotor.fitted and key not in rotor.entries
    rotor.prepare_for(x)
    assert key not in rotor.fitted and rotor.entries[key].profile.repeats == 0  # measured: sizes only
    assert rotor.entries[key].chain.out_size != small.out_size


class Lengths(Dataset):
    """Lengths in random order: the ones between measured lengths whose sizes follow them get fitted."""

    LENGTHS = (4, 14, 8, 12, 10, 6, 9, 11)

    def __len__(self):
        return len(self.LENGTHS)

    def __getitem__(self, i):
        return batch(self.LENGTHS[i])


class LM(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = small_gpt()
        self.grads: list[list[torch.Tensor]] = []

    def training_step(self, b, batch_idx):
        x, y = b
        return lm_loss(self.net(x), y)

    def on_before_optimizer_step(self, optimizer):
        self.grads.append([p.grad.detach().clone() for p in self.parameters()])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def test_the_trainer_with_fit_shapes_fits_lengths_between_measured_ones_bitwise(tmp_path):
    keep, loader = KeepRotorModules(), DataLoader(Lengths(), batch_size=None)
    runs = {}
    for name, strategy in (("plain", "auto"), ("rotor", RotorStrategy(mem_limit="60%", fit_shapes=True))):
        model = LM()
        torch.manual_seed(7)
        callbacks = [keep] if name == "rotor" else []
        quiet_trainer(tmp_path / name, strategy, max_steps=len(Lengths()), callbacks=callbacks).fit(model, loader)
        runs[name] = model
    rotor = keep.modules["net"]
    assert rotor.fit_shapes and len(rotor.entries) == len(Lengths.LENGTHS)
    assert len(rotor.fitted) == 4  # 10, 6, 9, 11: between the measured 4, 8, 12, 14
    for a_step, b_step in zip(runs["rotor"].grads, runs["plain"].grads, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(a_step, b_step, strict=True))
