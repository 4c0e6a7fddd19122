"""A new input shape's sizes without running it (lightning_rotor/symbolic_sizes.py): from traced profiles of two
measured shapes per axis (every dimension a monomial of the input's sizes) or, where that law is refused, three
along one axis (every dimension affine in it), every size of the chain at another shape equals the one a profile
measures there, to the byte, or the shape is refused (and measured): on the project's GPT across lengths where a
stage's largest op changes, a ConvNeXt at other resolutions, batch sizes and both, Hugging Face's GPT-2 and Llama
from configs through `Checkpointable` and a real Trainer; no law for `x + 1` from two shapes, none at a size a
padding to a multiple could change unseen, none for a data-dependent stage."""

from __future__ import annotations

import contextlib
import dataclasses

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from fitting import KeepRotorModules, fit_both, quiet_trainer
from hf_models import tiny_llama
from test_shapes import LM, batch, small_gpt  # the small GPT, its batches and its LightningModule
from torch import nn
from torch.utils.data import DataLoader, Dataset
from training import assert_same_state, check_measured_peak

from lightning_rotor.checkpointable import Checkpointable
from lightning_rotor.lightning import RotorCallback, RotorStrategy
from lightning_rotor.lightning.state import rotor_modules
from lightning_rotor.models.convnext import ConvNeXt
from lightning_rotor.models.gpt import gpt, lm_loss
from lightning_rotor.planner import plan
from lightning_rotor.profile import Profile, profile_chain
from lightning_rotor.simulate import no_recompute_peak
from lightning_rotor.size_trace import traced
from lightning_rotor.symbolic_sizes import ShapeLaws

TIMES = ("fwd_time", "bwd_time")


def sizes(chain):
    """Every field of a chain but its times (what a law gives)."""
    return {k: v for k, v in chain.to_dict().items() if k not in TIMES}


def laws_of(stages, inputs, **options):
    """The laws of `stages` traced on `inputs` (one family along one axis)."""
    laws = ShapeLaws()
    for x in inputs:
        with traced() as trace:
            chain = profile_chain(stages, x, repeats=1, timed=False, **options).chain
        laws.add("family", tuple(tuple(t.shape) for t in [x]), trace, chain, None)
    return laws


def derived_against_measured(laws, stages, inputs, **options):
    """Per input: True where the law gave its chain (checked to the byte against a profile), False where refused."""
    found = []
    for x in inputs:
        got = laws.chain_for("family", (tuple(x.shape),))
        if not isinstance(got, str):
            measured = profile_chain(stages, x, repeats=1, timed=False, **options).chain
            assert sizes(got[0]) == sizes(measured), tuple(x.shape)
        found.append(not isinstance(got, str))
    return found


def tokens(batch, length):
    return torch.randint(0, 64, (batch, length), generator=torch.Generator().manual_seed(length))


def gpt_stages():
    torch.manual_seed(0)
    return list(gpt(vocab_size=64, block_size=128, n_layer=2, n_head=2, n_embd=32, dropout=0.1))


def test_a_traced_profile_measures_what_an_untraced_one_does_every_size_a_sum_of_storage_sizes():
    from lightning_rotor.size_trace import Sym

    stages, x = gpt_stages(), tokens(2, 20)
    with traced() as trace:
        chain = profile_chain(stages, x, repeats=1, timed=False).chain
    assert sizes(chain) == sizes(profile_chain(stages, x, repeats=1, timed=False).chain)
    assert all(isinstance(v, Sym) for v in chain.out_size + chain.saved_size) and trace.guards


def test_traced_sizes_give_a_gpt_chain_at_other_lengths_to_the_byte():
    """Three measured lengths; lengths from 4 to 37 get the chain a profile measures there, to the byte, though
    the largest op of several stages changes across them (the embedding's backward peaks at its weight's
    gradient below about 22 tokens, at the tokens' above). Above the measured lengths, where an op none of them had
    largest overtakes: refused (measured; beyond the measured sizes every peak's top must stay its largest, NOTE:
    [peak variables] in lightning_rotor/size_trace.py)."""
    stages = gpt_stages()
    laws = laws_of(stages, [tokens(2, n) for n in (40, 15, 24)])  # any order; gcd 1: every length
    found = derived_against_measured(laws, stages, [tokens(2, n) for n in range(4, 82, 11)])
    assert found == [True] * 4 + [False] * 4  # 4, 15, 26, 37; from 48 on the attention's square overtakes
    assert laws.chain_for("family", ((2, 120),)) == "no traced shape's branches hold at size 120"


def test_a_length_between_two_measured_ones_in_a_regime_neither_had_is_derived_to_the_byte():
    """NOTE: [peak variables] Lengths 8 and 81 measured: between them the largest op of some stages is neither
    8's nor 81's (from about 25 to 42 tokens), so no trace's peaks keep their tops there; each peak is the largest
    of its levels at each length, and every length between gets the chain a profile measures there, to the byte."""
    stages = gpt_stages()
    laws = laws_of(stages, [tokens(2, n) for n in (8, 81)])
    assert derived_against_measured(laws, stages, [tokens(2, n) for n in (9, 25, 30, 33, 38, 42, 60, 80)]) == [True] * 8


def test_two_measured_lengths_give_a_gpt_chain_between_them_and_a_third_beyond_to_the_byte():
    """Every dimension of the GPT's storages is a monomial of the length (`L`, `L` twice in attention's scores,
    none `L + 1`): two measured lengths give each one's exponent, and the lengths between them that are multiples
    of 8, as 16 and 40 are, get the chain a profile measures there, to the byte. At 12 what a padding to a
    multiple of 8 or a stride would do went unseen by both; beyond them a dimension equal at both (a floor, `k =
    0`) may grow: measured, until a third measured length confirms the law, which then derives beyond."""
    stages = gpt_stages()
    laws = laws_of(stages, [tokens(2, n) for n in (16, 40)])
    assert derived_against_measured(laws, stages, [tokens(2, n) for n in (24, 32, 8, 12)]) == [True, True, False, False]
    assert laws.chain_for("family", ((2, 12),)) == (
        "size 12 is not a multiple of 8, as every measured size along its axis is"
    )
    assert laws.chain_for("family", ((2, 8),)) == (
        "size 8 is beyond 16 and 40, and no third measured size confirms their law"
    )
    laws = laws_of(stages, [tokens(2, n) for n in (16, 40, 24)])
    assert derived_against_measured(laws, stages, [tokens(2, n) for n in (8, 32)]) == [True, True]


def test_a_gpt_chain_at_a_new_length_and_batch_size_together_from_three_measured_shapes():
    """Two axes, the batch and the length: the length's exponents from (2, 16) and (2, 40), the batch's from
    (2, 16) and (3, 16); a last partial batch at a new length (both axes new) is derived to the byte; a batch
    of 1, beyond the two measured, is not."""
    stages = gpt_stages()
    laws = laws_of(stages, [tokens(b, n) for b, n in ((2, 16), (2, 40), (3, 16))])
    found = derived_against_measured(laws, stages, [tokens(3, 24), tokens(2, 32), tokens(1, 32)])
    assert found == [True, True, False]


def test_a_derived_shape_s_flops_come_from_two_measured_ones_without_a_count():
    """FLOPs only scale a derived shape's times: from two counted shapes per axis, a power law per axis through
    them (`f1 * (s / s1) ** p`, multiplied over the axes), so no forward is run to count them. On the GPT (linear
    in the batch, between linear and quadratic in the length) within 5% of a count, per stage."""
    from lightning_rotor.shapes import stage_flops

    stages, laws = gpt_stages(), ShapeLaws()
    for b, n in ((2, 16), (2, 40), (3, 16)):
        x = tokens(b, n)
        with traced() as trace:
            chain = profile_chain(stages, x, repeats=1, timed=False).chain
        laws.add("family", ((b, n),), trace, chain, stage_flops(stages, x))
    for b, n in ((2, 24), (3, 24)):
        found = laws.chain_for("family", ((b, n),))
        assert not isinstance(found, str) and found[2] is not None
        counted = stage_flops(stages, tokens(b, n))
        assert all(abs(f - c) <= 0.05 * c for f, c in zip(found[2], counted, strict=True)), (found[2], counted)


def convnext_stages():
    torch.manual_seed(0)
    model = ConvNeXt(depths=(1, 1, 1, 1), dims=(8, 16, 32, 64), num_classes=10)
    return [model.stem, *model.stages]


def image(batch, side):
    return torch.randn(batch, 3, side, side, generator=torch.Generator().manual_seed(side))


def test_a_convnext_at_a_new_side_a_partial_batch_and_both_from_four_measured_shapes():
    """(2, 64), (2, 96), (2, 128) and (1, 64) measured (images, side): the side's exponents from the first two,
    confirmed by the third, the batch's from the first and the last; a new side, a partial batch at a measured
    side and one at a new side (two axes) get the chain a profile measures there, to the byte. At 80 the last
    stage's side (80/32) is no whole number: refused, measured."""
    stages = convnext_stages()
    laws = laws_of(stages, [image(b, s) for b, s in ((2, 64), (2, 96), (2, 128), (1, 64))], loss_tmp=0)
    shapes = [image(2, 224), image(1, 96), image(1, 160), image(1, 80)]
    assert derived_against_measured(laws, stages, shapes, loss_tmp=0) == [True, True, True, False]
    assert len(laws.measured) == 4


class ClassToken(nn.Module):
    """Puts a learned token before the sequence (as a ViT does): a dimension `L + 1`, no monomial of `L`."""

    def __init__(self):
        super().__init__()
        self.token = nn.Parameter(torch.randn(1, 1, 8))

    def forward(self, x):
        return torch.cat([self.token.expand(x.shape[0], 1, 8), x], dim=1)


def sequences(*lengths):
    return [torch.randn(2, n, 8, generator=torch.Generator().manual_seed(n)) for n in lengths]


def test_a_dimension_one_past_the_length_has_no_monomial_law_and_takes_the_affine_one_from_three_shapes():
    torch.manual_seed(0)
    stages = [nn.Linear(8, 8), ClassToken(), nn.Linear(8, 8)]
    laws = laws_of(stages, sequences(8, 16))
    assert laws.chain_for("family", ((2, 24, 8),)) == "a tensor's size at (8,) and (16,) is no monomial of their sizes"
    laws = laws_of(stages, sequences(8, 16, 12))
    assert derived_against_measured(laws, stages, sequences(24, 20, 40)) == [True] * 3


class PadToEight(nn.Module):
    """Pads the sequence to a multiple of 8 (as kernels that want aligned sizes do): nothing at 16 or 24."""

    def forward(self, x):
        return F.pad(x, (0, 0, 0, -x.shape[1] % 8)) * 2


def test_a_padding_to_a_multiple_is_never_derived_wrong():
    """Measured at 16, 24 and 40 the padded dimension looks like `L`: the law holds at multiples of 8 (derived, to
    the byte) and every other length is refused, measured. Measured at 20 as well, the padded size is off the
    law: refused for every length, and one warning says why."""
    torch.manual_seed(0)
    stages = [nn.Linear(8, 8), PadToEight(), nn.Linear(8, 8)]
    laws, others = laws_of(stages, sequences(16, 24, 40)), [n for n in range(9, 57) if n not in (16, 24, 40)]
    found = derived_against_measured(laws, stages, sequences(*others))
    assert [n for n, f in zip(others, found, strict=True) if f] == [32, 48, 56]
    laws = laws_of(stages, sequences(16, 24, 20))
    with pytest.warns(UserWarning, match=r"cannot be derived from measured ones \(a tensor's size at .*20"):
        assert not any(derived_against_measured(laws, stages, sequences(*range(9, 41))))


def test_a_convnext_at_other_resolutions_and_batch_sizes_gets_its_sizes_to_the_byte():
    """Height and width vary together (each tensor's side is affine in the input's): three resolutions that run
    the same ops make the law (at 32 the last stage is 1x1 and runs others: left out); 160 and 224 are derived,
    16 (other ops again) is not. The batch size is an axis of its own."""
    torch.manual_seed(0)
    model = ConvNeXt(depths=(1, 1, 1, 1), dims=(8, 16, 32, 64), num_classes=10)
    stages = [model.stem, *model.stages]

    def image(batch, side):
        return torch.randn(batch, 3, side, side, generator=torch.Generator().manual_seed(side))

    laws = laws_of(stages, [image(2, s) for s in (32, 64, 96, 128)], loss_tmp=0)  # at 32 the last stage is 1x1
    assert derived_against_measured(laws, stages, [image(2, 160), image(2, 224), image(2, 16)], loss_tmp=0) == [
        True,
        True,
        False,
    ]
    laws = laws_of(stages, [image(b, 32) for b in (2, 4, 3)], loss_tmp=0)
    assert derived_against_measured(laws, stages, [image(1, 32), image(5, 32)], loss_tmp=0) == [True, True]


@pytest.mark.slow
def test_a_convnext_at_changing_resolutions_and_a_partial_last_batch_trains_bitwise_within_its_budgets():
    """Variable image sizes through `Checkpointable` (the default: derived shapes): after three measured
    resolutions, the sides that are multiples of 32 get no run (the step's own probe, entered before a profile,
    counts plain bytes: it does not enter the profile's trace); 112 and 80 (where a stride-2 downsampling halves
    an odd side: a dimension off the line) are measured, and do not spoil the law for the others; a last batch
    of one image (an axis of its own) is measured. Every step bitwise equal to plain training and measured within
    its budget, each derived chain equal to a profile's."""

    def build():
        torch.manual_seed(0)
        return ConvNeXt(depths=(1, 1, 1, 1), dims=(8, 16, 32, 64), num_classes=10, drop_path_rate=0.1)

    plain, rotor = build(), Checkpointable(build(), "75%", repeats=1, loss_tmp=0)
    shapes = [(2, 64), (2, 96), (2, 128), (2, 160), (2, 112), (2, 192), (2, 224), (2, 80), (1, 224)]
    for step, (images, side) in enumerate(shapes):
        x = torch.randn(images, 3, side, side, generator=torch.Generator().manual_seed(step))
        plain.zero_grad()
        torch.manual_seed(step)
        plain(x).square().mean().backward()
        rotor.zero_grad()
        if step:  # the first step finds the chain and profiles it (a profiling step is not held to the budget)
            rotor.prepare_for(x)
        torch.manual_seed(step)
        with rotor.measure_step() as m:
            rotor(x).square().mean().backward()
        assert_same_state(plain, rotor)
        entry = rotor.last_entry
        assert m.peak <= entry.plan.budget or not step
        key = next((k for k, e in rotor.entries.items() if e is entry), None)
        if key in rotor.fitted:
            stages = list(rotor.stages)
            measured = profile_chain(stages, x, names=rotor.stage_names, repeats=1, timed=False, loss_tmp=0).chain
            assert sizes(entry.chain) == sizes(measured)
    derived = {rotor.chain_state._shapes[k] for k in rotor.fitted}
    assert derived == {f"(2, 3, {side}, {side})" for side in (160, 192, 224)}


class KeepPositive(nn.Module):
    """Keeps the tokens whose first feature is positive: how many depends on the data, not the length."""

    def forward(self, x):
        return x[x[..., 0] > 0]


def test_a_data_dependent_stage_has_no_law_and_says_so_once():
    torch.manual_seed(0)
    stages = [nn.Linear(8, 8), KeepPositive(), nn.Linear(8, 8)]
    inputs = [torch.randn(2, n, 8, generator=torch.Generator().manual_seed(n)) for n in (8, 16, 24, 32)]
    assert isinstance(laws_of(stages, inputs[:2]).chain_for("family", ((2, 32, 8),)), str)
    laws = laws_of(stages, inputs[:3])
    with pytest.warns(UserWarning, match=r"cannot be derived from measured ones \(a tensor's size at size \d+ is not"):
        assert "is not on the line through sizes" in laws.chain_for("family", ((2, 32, 8),))
    assert laws.refused is not None


def test_a_size_whose_constant_part_moves_between_shapes_has_no_law():
    """A figure that left the sums (here: the loss value plus the length in bytes, as a size computed from a
    product would) is a constant to its trace; one that differs between measured shapes is refused."""
    from lightning_rotor.size_trace import CONST, Sym

    stages, laws = gpt_stages(), ShapeLaws()
    for n in (16, 40, 24):
        x = tokens(2, n)
        with traced() as trace:
            chain = profile_chain(stages, x, repeats=1, timed=False).chain
        lost = Sym(chain.loss_value + n, {**chain.input_size.terms, CONST: chain.loss_value + n - chain.input_size})
        laws.add("family", (tuple(x.shape),), trace, dataclasses.replace(chain, loss_value=lost), None)
    with pytest.warns(UserWarning, match="loss_value is not a sum of storage sizes"):
        assert "loss_value is not a sum" in laws.chain_for("family", ((2, 30),))


def test_a_trace_with_more_guards_than_it_may_keep_is_abandoned_and_its_shapes_measured(monkeypatch):
    """A trace keeps its guards' terms up to `MAX_TERMS` (memory on large stages); beyond, it gives no sizes."""
    from lightning_rotor import size_trace

    monkeypatch.setattr(size_trace, "MAX_TERMS", 100)
    stages = gpt_stages()
    laws = laws_of(stages, [tokens(2, n) for n in (16, 40, 24)])
    assert laws.chain_for("family", ((2, 30),)) == "no measured shapes along one axis of this one"


def hf_chains(make, lengths, fit):
    """Per length, the chain `Checkpointable` planned it on (a real training step each), and which were derived."""
    rotor = Checkpointable(make(), "70%", repeats=1, fit_shapes=fit)
    chains = {}
    for n in lengths:
        x = tokens(2, n)
        rotor(input_ids=x, labels=x).loss.backward()
        chains[n] = rotor.last_entry.chain
    derived = {n for n, c in chains.items() if any(rotor.entries[k].chain is c for k in rotor.fitted)}
    return chains, derived, len(rotor.outside)


@pytest.mark.slow
def test_hugging_face_gpt2_at_derived_lengths_trains_bitwise_within_each_budget():
    """Real training steps of GPT-2 from a config, plain against rotor on the same seeds: every step bitwise equal;
    each derived length's step (no profile, no measure of the code around the run) measured within its budget."""
    pytest.importorskip("transformers")
    plain, rotor = tiny_gpt2(), Checkpointable(tiny_gpt2(), "70%", repeats=1)
    for step, n in enumerate((32, 44, 38, 50, 26, 62, 50)):
        x = tokens(2, n)
        for model in (plain, rotor):
            model.zero_grad()
            torch.manual_seed(step)
            with rotor.measure_step() if model is rotor else contextlib.nullcontext() as m:
                model(input_ids=x, labels=x).loss.backward()
        assert_same_state(plain, rotor)
        if step >= 3:
            assert m.peak <= rotor.last_entry.plan.budget
    assert len(rotor.fitted) == 3 and len(rotor.outside) == 3


@pytest.mark.slow
def test_a_trace_of_the_code_around_a_run_is_closed_when_its_call_ends_unprofiled():
    """A new call signature whose run's input is not new (another keyword, the same tokens): the code around the
    run is measured in a trace that no profile goes on with; it is closed as the call ends, so that no storage
    handle outlives it (a copy of the module would free it twice) and the copy trains on."""
    import copy

    pytest.importorskip("transformers")
    rotor = Checkpointable(tiny_gpt2(), "70%", repeats=1)
    x = tokens(2, 32)
    rotor(input_ids=x, labels=x).loss.backward()
    rotor(input_ids=x, labels=x, output_attentions=False).loss.backward()
    assert len(rotor.outside) == 2 and len(rotor.entries) == 1 and rotor.chain_state._laws._outside is None
    copy.deepcopy(rotor)(input_ids=x, labels=x).loss.backward()


def tiny_gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=128, use_cache=False)
    return transformers.GPT2LMHeadModel(config)


@pytest.mark.slow
@pytest.mark.parametrize("make", [tiny_gpt2, lambda: tiny_llama(max_position_embeddings=128)], ids=["gpt2", "llama"])
def test_hugging_face_chains_derived_at_other_lengths_equal_the_measured_ones(make):
    """GPT-2 and Llama from configs, a module-level chain (the code around it and the loss charged to it, traced
    with it, keyed by the call's arguments), real training steps: the lengths after the first three get their
    chains derived, to the byte, and the code around the run is measured for the three only. Three, not two:
    transformers' causal-LM loss pads the labels by one (`L + 1`, no monomial of the length), so the monomial law
    is refused and the affine law, which needs a third length, derives them."""
    pytest.importorskip("transformers")
    lengths = (32, 44, 40, 52, 28, 64, 68)
    derived, fitted, outsides = hf_chains(make, lengths, True)
    measured, _, _ = hf_chains(make, lengths, False)
    assert fitted == {52, 28, 64, 68} and outsides == 3
    for n in lengths:
        assert sizes(derived[n]) == sizes(measured[n]), n


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
    """Derived sizes rest on the stages running the same ops at every size; a step that proves them wrong (here: a
    derived entry replaced by one planned on a smaller shape's chain, an under-estimate) forgets every derived
    shape, warns once, and the shape is profiled when met again."""
    rotor = Checkpointable(small_gpt(), "60%", repeats=1)
    for length in (4, 14):
        x, y = batch(length)
        lm_loss(rotor(x), y).backward()
    x, y = batch(10)
    rotor.prepare_for(x)
    lm_loss(rotor(x), y).backward()  # a plan's first step measures the real loss (loss_watch.py): not the one tested
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


class LengthBatches(Dataset):
    """One batch per length, in the order given (dynamic padding's lengths)."""

    def __init__(self, lengths: tuple[int, ...]):
        self.lengths = lengths

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        return batch(self.lengths[i])


FITTED = (4, 14, 8, 12, 10, 6, 9, 11)  # random order: the ones between measured lengths whose sizes follow them fit
CHANGING = (20, 32, 28, 24, 8, 12, 16, 24, 32)  # dynamic padding's lengths in random order, some seen twice


def test_the_trainer_with_fit_shapes_fits_lengths_between_measured_ones_bitwise(tmp_path):
    keep, loader = KeepRotorModules(), DataLoader(LengthBatches(FITTED), batch_size=None)
    runs = {}
    for name, strategy in (("plain", "auto"), ("rotor", RotorStrategy(mem_limit="60%", fit_shapes=True))):
        model = LM()
        torch.manual_seed(7)
        callbacks = [keep] if name == "rotor" else []
        quiet_trainer(tmp_path / name, strategy, max_steps=len(FITTED), callbacks=callbacks).fit(model, loader)
        runs[name] = model
    rotor = keep.modules["net"]
    assert rotor.fit_shapes and len(rotor.entries) == len(FITTED)
    assert len(rotor.fitted) == 5  # 12, 10, 6, 9, 11: after the measured 4, 14, 8
    for a_step, b_step in zip(runs["rotor"].grads, runs["plain"].grads, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(a_step, b_step, strict=True))


class StepPeaks(pl.Callback):
    """After each training step (each measured by `RotorCallback(measure_every_n_steps=1)`), its peak by independent
    tensor accounting against the plan it ran (`check_measured_peak`)."""

    def __init__(self):
        self.checked = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        measured = rotor_modules(pl_module)["net"].last_measurement
        if batch_idx:  # the first step profiles the first shape: not held to its budget
            check_measured_peak(measured.entry, measured.peak)
            self.checked += 1


def test_the_trainer_on_changing_lengths_derives_between_two_measured_ones_bitwise_within_budget(tmp_path):
    """A real Trainer and `RotorStrategy` (the defaults), 7 lengths over 9 steps: 20 (numbered only, the first)
    and 32 measured, then 28 and 24 derived between them; 8 (beyond them) measured, after which 12 and 16 are
    derived too: 3 profiles for 7 shapes. Every step bitwise equal to plain training's and measured within its
    budget, at most its plan's predicted peak."""
    keep, loader, peaks = KeepRotorModules(), DataLoader(LengthBatches(CHANGING), batch_size=None), StepPeaks()
    measure = RotorCallback(measure_every_n_steps=1, log_curves=False, print_summary=False)
    runs = fit_both(tmp_path, LM, loader, len(CHANGING), RotorStrategy(mem_limit="60%"), [keep, measure, peaks])
    rotor = keep.modules["net"]
    assert peaks.checked == len(CHANGING) - 1
    assert len(rotor.entries) == 7 and sorted(rotor.chain_state._shapes[k] for k in rotor.fitted) == [
        f"(2, {n})" for n in (12, 16, 24, 28)
    ]
    for a_step, b_step in zip(runs["rotor"].grads, runs["plain"].grads, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(a_step, b_step, strict=True))


@pytest.mark.parametrize("op", ["<", "<=", ">", ">=", "==", "!="])
def test_a_guard_holds_exactly_where_its_comparison_has_the_outcome_it_had(op):
    from lightning_rotor.symbolic_sizes import _allowed

    compare = {"<": int.__lt__, "<=": int.__le__, ">": int.__gt__, ">=": int.__ge__, "==": int.__eq__, "!=": int.__ne__}
    for outcome in (True, False):
        held = _allowed(op, outcome)
        for sign, value in enumerate((-3, 0, 3)):
            assert held[sign] == (compare[op](value, 0) == outcome), (op, outcome, value)


def test_a_shape_measured_again_replaces_its_measurement_and_the_law_stands():
    """A shape profiled again (timed once its derived times proved wrong, shapes.ShapeTimes) is no second shape
    at its size: the law still derives the others to the byte."""
    stages = gpt_stages()
    laws = laws_of(stages, [tokens(2, n) for n in (40, 15, 24, 15)])
    assert len(laws.measured) == 3
    assert derived_against_measured(laws, stages, [tokens(2, 30)]) == [True]


def test_a_shape_derived_once_is_not_derived_again_until_another_is_measured():
    """A module-level chain asks for its call's chain on every step (its plan key is not known before the run):
    a shape seen before gets what it got, without evaluating the traces again; a new measurement starts over."""
    stages = gpt_stages()
    laws = laws_of(stages, [tokens(2, n) for n in (40, 15, 24)])
    first = laws.chain_for("family", ((2, 30),))
    assert not isinstance(first, str) and laws.chain_for("family", ((2, 30),)) is first
    with traced() as trace:
        chain = profile_chain(stages, tokens(2, 33), repeats=1, timed=False).chain
    laws.add("family", ((2, 33),), trace, chain, None)
    again = laws.chain_for("family", ((2, 30),))
    assert again is not first and sizes(again[0]) == sizes(first[0])
