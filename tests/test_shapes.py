"""Changing input shapes (dynamic padding): each budget kind's meaning per shape, through Checkpointable
and a real Trainer; gradients bitwise equal to plain training, each step's measured peak within its shape's budget."""

from __future__ import annotations

import copy
import warnings

import lightning.pytorch as pl
import pytest
import torch
from fitting import KeepRotorModules, quiet_trainer
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, Dataset
from training import assert_same_state

from lightning_rotor.budget import resolve_budget
from lightning_rotor.checkpointable import Checkpointable
from lightning_rotor.lightning import RotorCallback, RotorStrategy
from lightning_rotor.lightning.callback import LIGHTNING_BOOKKEEPING
from lightning_rotor.lightning.state import rotor_modules
from lightning_rotor.memory import MemoryProbe
from lightning_rotor.models.gpt import gpt, lm_loss
from lightning_rotor.planner import min_feasible_budget, plan
from lightning_rotor.profile import Profile, profile_chain
from lightning_rotor.shapes import InfeasibleShape, _weights, predicted_chain, stage_flops
from lightning_rotor.simulate import no_recompute_peak, simulate

LENGTHS = (4, 12, 24)  # shortest first: the order dynamic padding meets them in a sorted epoch


def small_gpt():
    torch.manual_seed(0)
    return gpt(vocab_size=64, block_size=32, n_layer=4, n_head=2, n_embd=32, dropout=0.1)


def batch(length: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + length)
    return torch.randint(0, 64, (2, length), generator=g), torch.randint(0, 64, (2, length), generator=g)


@pytest.mark.parametrize("mem_limit", ["60%", None])
def test_fraction_and_automatic_budgets_follow_each_shape(mem_limit):
    plain, rotor = small_gpt(), Checkpointable(small_gpt(), mem_limit, repeats=1)
    for step, length in enumerate(LENGTHS):
        x, y = batch(length)
        plain.zero_grad()
        torch.manual_seed(step)
        lm_loss(plain(x), y).backward()
        rotor.zero_grad()
        rotor.prepare_for(x)  # profiled here: profiling is no part of the step measured
        torch.manual_seed(step)
        with rotor.measure_step() as m:
            lm_loss(rotor(x), y).backward()
        assert_same_state(plain, rotor)
        need = no_recompute_peak(rotor.chain)
        expected = need if mem_limit is None else max(resolve_budget(mem_limit, need), min_feasible_budget(rotor.chain))
        assert rotor.plan.budget == expected == rotor.budget  # this shape's own bytes
        assert m.peak <= rotor.plan.budget
    assert len(rotor.entries) == len(LENGTHS)


def test_byte_budget_holds_and_a_shape_it_cannot_meet_is_named():
    rotor = Checkpointable(small_gpt(), "60%", repeats=1)
    x, y = batch(LENGTHS[0])
    lm_loss(rotor(x), y).backward()
    nbytes = rotor.budget
    rotor = Checkpointable(small_gpt(), nbytes, repeats=1)
    lm_loss(rotor(x), y).backward()
    x, y = batch(LENGTHS[-1])
    with pytest.raises(InfeasibleShape, match=r"for input shape \(2, 24\); use mem_limit >= \d+") as err:
        rotor(x)
    assert err.value.budget == nbytes and err.value.min_feasible > nbytes
    assert len(str(err.value).splitlines()) == 1


class Padded(Dataset):
    """Token batches of growing length, as a length-sorted dynamic-padding loader yields them."""

    def __len__(self):
        return 2 * len(LENGTHS)  # twice: the second round runs known plans, which the callback measures

    def __getitem__(self, i):
        return batch(LENGTHS[i % len(LENGTHS)], seed=i)


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


class PeaksOfKnownShapes(pl.Callback):
    """Measures every step of the second round (shapes planned already) by independent tensor accounting
    of the whole training step, as RotorCallback counts it, against the budget of the plan the step ran."""

    def __init__(self):
        self.steps: list[tuple[int, int]] = []  # (measured peak, budget)
        self.probe = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx >= len(LENGTHS):
            self.probe = MemoryProbe([pl_module, trainer.strategy.model], bookkeeping=LIGHTNING_BOOKKEEPING)
            self.probe.__enter__()

    def on_after_backward(self, trainer, pl_module):
        if self.probe is not None:
            self.probe.__exit__(None, None, None)
            rotor = rotor_modules(pl_module)["net"]
            self.steps.append((self.probe.peak, rotor.last_entry.plan.budget))
            self.probe = None


@pytest.mark.parametrize("strategy", ["rotor", RotorStrategy(mem_limit="60%")], ids=["auto", "fraction"])
def test_trainer_with_dynamic_padding_trains_every_shape(tmp_path, strategy):
    loader = DataLoader(Padded(), batch_size=None)
    runs = {}
    keep, peaks = KeepRotorModules(), PeaksOfKnownShapes()
    for name, strat in (("plain", "auto"), ("rotor", copy.deepcopy(strategy))):
        model = LM()
        torch.manual_seed(7)
        callbacks = [keep, peaks] if name == "rotor" else []
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            quiet_trainer(tmp_path / name, strat, max_steps=len(Padded()), callbacks=callbacks).fit(model, loader)
        runs[name] = model
    # the callback measured each plan once (MemoryProbe over the whole step) and found no peak above its budget
    assert not [w for w in seen if "above the budget" in str(w.message)]
    callback = next(c for c in model.trainer.callbacks if type(c).__name__ == "RotorCallback")
    assert callback.sampler.measured_once  # steps of known plans were measured
    assert len(runs["rotor"].grads) == len(Padded())
    for a_step, b_step in zip(runs["rotor"].grads, runs["plain"].grads, strict=True):
        for a, b in zip(a_step, b_step, strict=True):
            assert torch.equal(a, b)
    assert len(peaks.steps) == len(LENGTHS)
    assert all(0 < peak <= budget for peak, budget in peaks.steps), peaks.steps  # each shape within its own bytes
    assert len({budget for _, budget in peaks.steps}) == len(LENGTHS)
    rotor = keep.modules["net"]
    assert len(rotor.entries) == len(LENGTHS)
    for entry in rotor.entries.values():  # each shape planned within its own bytes
        assert entry.plan.peak <= entry.plan.budget
        assert entry.plan.budget <= max(no_recompute_peak(entry.chain), min_feasible_budget(entry.chain))


def test_a_later_shape_measures_its_sizes_and_derives_its_times_from_flops():
    rotor = Checkpointable(small_gpt(), "60%", repeats=1)
    for length in LENGTHS[:2]:
        x, y = batch(length)
        lm_loss(rotor(x), y).backward()
    timed, derived = (e.profile for e in rotor.entries.values())
    assert timed.repeats == 1 and derived.repeats == 0  # no timing rounds for the later shape
    sample = batch(LENGTHS[1])[0]
    full = profile_chain(rotor.stages, sample, names=rotor.stage_names, repeats=1).chain
    times = ("fwd_time", "bwd_time")
    assert {k: v for k, v in derived.chain.to_dict().items() if k not in times} == {
        k: v for k, v in full.to_dict().items() if k not in times
    }  # sizes exactly as a full profile measures them
    before, after = stage_flops(rotor.stages, batch(LENGTHS[0])[0]), stage_flops(rotor.stages, sample)
    block = 1  # a transformer block: its times scale with its FLOPs
    assert after[block] > before[block] > 0
    ratio = after[block] / before[block]
    assert derived.chain.fwd_time[block] == pytest.approx(timed.chain.fwd_time[block] * ratio)
    assert derived.chain.bwd_time[block] == pytest.approx(timed.chain.bwd_time[block] * ratio)
    plain = Checkpointable(small_gpt(), "60%", repeats=1, derive_shapes=False)
    for length in LENGTHS[:2]:
        x, y = batch(length)
        lm_loss(plain(x), y).backward()
    assert [e.profile.repeats for e in plain.entries.values()] == [1, 1]


def test_shape_buckets_run_fewer_plans_within_each_plans_budget():
    plain = small_gpt()
    rotor = Checkpointable(small_gpt(), "60%", repeats=1, shape_buckets={1: [16, 32]})
    for step, length in enumerate((4, 12, 24, 16, 9)):
        x, y = batch(length)
        plain.zero_grad()
        torch.manual_seed(step)
        lm_loss(plain(x), y).backward()
        rotor.zero_grad()
        rotor.prepare_for(x)  # profiled here: profiling is no part of the step measured
        torch.manual_seed(step)
        with rotor.measure_step() as m:
            lm_loss(rotor(x), y).backward()
        assert_same_state(plain, rotor)  # the input itself is not padded
        assert m.peak <= rotor.plan.budget
    assert sorted(e.chain.input_size for e in rotor.entries.values()) == [2 * 16 * 8, 2 * 32 * 8]  # two plans
    with pytest.raises(ValueError, match=r"shape_buckets takes \{dimension: \[sizes\]\}"):
        Checkpointable(small_gpt(), shape_buckets={1: [0]})


class CountProbed(RotorCallback):
    """RotorCallback that counts the steps it ran under the memory probe."""

    probed = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        self.probed += bool(self._measurements)


class Lengths(Dataset):
    """Six distinct lengths, twice over."""

    def __len__(self):
        return 12

    def __getitem__(self, i):
        return batch(3 + i % 6, seed=i)


def test_the_probe_samples_each_schedule_not_each_shape(tmp_path):
    counting = CountProbed()
    quiet_trainer(tmp_path, "rotor", max_steps=len(Lengths()), callbacks=[counting]).fit(
        LM(), DataLoader(Lengths(), batch_size=None)
    )
    # the automatic budget off CUDA: every shape runs the one schedule without recomputation. Step 2 is
    # probed but profiles a new shape (no clean sample); the next try waits for a step of known shapes
    # (step 8, after step 7 ran one): 2 probed steps of 12, not one after each new shape
    assert counting.probed == 2
    assert len(counting.sampler.measured_once) == 1


def test_rotor_strategy_takes_shape_buckets(tmp_path):
    keep, loader = KeepRotorModules(), DataLoader(Padded(), batch_size=None)
    runs = {}
    for name, strategy in (("plain", "auto"), ("rotor", RotorStrategy(mem_limit="60%", shape_buckets={1: [32]}))):
        model = LM()
        torch.manual_seed(7)
        callbacks = [keep] if name == "rotor" else []
        quiet_trainer(tmp_path / name, strategy, max_steps=len(Padded()), callbacks=callbacks).fit(model, loader)
        runs[name] = model
    assert len(keep.modules["net"].entries) == 1  # every length (4, 12, 24) runs the plan of 32
    for a_step, b_step in zip(runs["rotor"].grads, runs["plain"].grads, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(a_step, b_step, strict=True))
    with pytest.raises(ValueError, match="shape_buckets takes"):
        RotorStrategy(shape_buckets=[32])


def test_a_fraction_too_small_for_a_later_shape_plans_it_at_its_smallest_with_one_warning():
    # the smallest feasible budget is 30% of the no-recomputation peak at length 32, 41% at length 4
    rotor = Checkpointable(small_gpt(), "31%", repeats=1)
    x, y = batch(32)
    lm_loss(rotor(x), y).backward()
    x, y = batch(4)
    with pytest.warns(UserWarning, match=r"input shape \(2, 4\) needs at least .* is raised to that") as seen:
        rotor.prepare_for(x)  # profiled and planned here: profiling is no part of the step measured below
    assert len([w for w in seen if "raised to that" in str(w.message)]) == 1
    rotor.zero_grad()
    with rotor.measure_step() as m:
        lm_loss(rotor(x), y).backward()
    assert rotor.plan.budget == min_feasible_budget(rotor.chain)
    assert m.peak <= rotor.plan.budget


# -- predicted shapes (predict_shapes=True) ----------------------------------------------------------------
@settings(max_examples=300, deadline=None)
@given(
    coefficients=st.lists(st.integers(0, 10**6), min_size=3, max_size=3),
    sizes=st.lists(st.integers(1, 300), min_size=3, max_size=3, unique=True),
)
def test_weights_bound_every_non_negative_quadratic_at_a_third_size(coefficients, sizes):
    c0, c1, c2 = coefficients
    x1, x2, x = sizes
    x1, x2 = sorted((x1, x2))

    def q(n: int) -> int:
        return c0 + c1 * n + c2 * n * n

    peaks = (q(x1), q(x2))
    up = _weights(x1, x2, x, 2, peaks, upper=True)
    assert up is not None and min(up) >= 0  # non-negative: a chain measured above its real figures still bounds
    assert up[0] * q(x1) + up[1] * q(x2) >= q(x)
    for c in ((1, 0, 0), (0, 1, 0), (0, 0, 1)):  # the same weights bound every such polynomial, not only q
        assert up[0] * (c[0] + c[1] * x1 + c[2] * x1**2) + up[1] * (c[0] + c[1] * x2 + c[2] * x2**2) >= (
            c[0] + c[1] * x + c[2] * x**2
        )
    down = _weights(x1, x2, x, 2, peaks, upper=False)
    if down is not None:
        assert down[0] * q(x1) + down[1] * q(x2) <= q(x)


def profiled(length: int):
    stages = list(small_gpt())
    return profile_chain(stages, batch(length)[0], repeats=1, timed=False).chain


def test_a_predicted_chain_bounds_the_measured_one_for_every_plan():
    """Between, above and below measured lengths: every plan of the measured chain replays at or below its
    replay on the predicted chain, op by op; the lower estimate of the peak is at or below the measured peak."""
    measured = {n: profiled(n) for n in (4, 12, 20, 24, 30)}
    points = [(n, measured[n], no_recompute_peak(measured[n])) for n in (12, 24)]
    for x in (20, 30, 4):  # between, above, below
        chain, floor = predicted_chain(points, x, dims=1)
        real = measured[x]
        assert floor <= no_recompute_peak(real) <= no_recompute_peak(chain)
        for fraction in (1.0, 0.8, 0.6, 0.0):
            budget = max(min_feasible_budget(chain), int(fraction * no_recompute_peak(chain)))
            ops = plan(chain, budget).ops
            bound, exact = simulate(chain, ops), simulate(real, ops)
            assert all(r <= b for r, b in zip(exact.curve, bound.curve, strict=True)), x
            assert exact.peak <= bound.peak <= budget


def test_predicted_shapes_run_no_profile_and_train_bitwise_within_each_budget():
    plain, rotor = small_gpt(), Checkpointable(small_gpt(), "60%", repeats=1, predict_shapes=True, fit_shapes=False)
    lengths = (16, 32, 24, 20, 28, 8, 30)
    for step, length in enumerate(lengths):
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
        if length in (24, 20, 28, 30):  # between 16 and 32, or just above: bounded, not profiled
            key = next(k for k, e in rotor.entries.items() if e is entry)
            assert {16, 32} <= set(rotor.predicted[key]) <= {8, 16, 32}  # the measured lengths it came from
            assert entry.profile.repeats == 0
            exact = profiled(length)  # its own chain, measured here only to check the bound
            assert no_recompute_peak(exact) <= no_recompute_peak(entry.chain)
            assert entry.plan.budget <= 0.6 * no_recompute_peak(exact)  # a fraction of a lower estimate
    assert len(rotor.predicted) >= 4


def test_the_trainer_with_predict_shapes_profiles_fewer_shapes(tmp_path):
    keep, loader = KeepRotorModules(), DataLoader(Lengths(), batch_size=None)
    runs = {}
    for name, strategy in (
        ("plain", "auto"),
        ("rotor", RotorStrategy(mem_limit="60%", predict_shapes=True, fit_shapes=False)),
    ):
        model = LM()
        torch.manual_seed(7)
        callbacks = [keep] if name == "rotor" else []
        quiet_trainer(tmp_path / name, strategy, max_steps=len(Lengths()), callbacks=callbacks).fit(model, loader)
        runs[name] = model
    rotor = keep.modules["net"]
    assert rotor.predict_shapes and len(rotor.entries) == 6
    assert len(rotor.predicted) >= 3  # lengths 3..8: after 3 and 4, the others from bounds
    for a_step, b_step in zip(runs["rotor"].grads, runs["plain"].grads, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(a_step, b_step, strict=True))


def test_a_predicted_shape_measured_above_its_budget_turns_prediction_off_and_is_measured_again():
    """The bound rests on how the model's memory grows; a step that proves it wrong (here: a predicted
    entry replaced by one planned on a smaller shape's chain, an under-estimate) forgets every predicted
    shape, warns once, and the shape is profiled when met again."""
    rotor = Checkpointable(small_gpt(), "60%", repeats=1, predict_shapes=True, fit_shapes=False)
    for length in (8, 32):
        x, y = batch(length)
        lm_loss(rotor(x), y).backward()
    x, y = batch(24)
    rotor.prepare_for(x)
    lm_loss(rotor(x), y).backward()  # a plan's first step measures the real loss (loss_watch.py): not the one tested
    key = next(k for k in rotor.entries if k in rotor.predicted)
    small = profile_chain(list(rotor.stages), batch(8)[0], repeats=1, timed=False).chain
    rotor.plan_cache.add(
        key, rotor.plan_cache.build(Profile(small, seconds=0.0), plan(small, no_recompute_peak(small)))
    )
    rotor.plan_cache.forget_call_plans()  # the smallest budgets found for the entry replaced
    rotor.zero_grad()
    with pytest.warns(UserWarning, match=r"\(2, 24\) was planned from a bound .* every shape is measured from now on"):
        with rotor.measure_step() as m:
            lm_loss(rotor(x), y).backward()
    assert m.chain_peak > m.entry.plan.budget
    assert not rotor.predict_shapes and not rotor.predicted and key not in rotor.entries
    rotor.prepare_for(x)
    assert key not in rotor.predicted and rotor.entries[key].chain.out_size != small.out_size  # measured this time


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_predicted_shapes_on_hugging_face_models_train_bitwise_within_budget(family):
    """Hugging Face causal LMs from configs (module-level chains: position ids, causal masks and rotary
    tables grow with the length too), lengths in random order: the predicted ones run no profile, every
    step is bitwise equal to plain training and measured within the budget of the plan it ran."""
    transformers = pytest.importorskip("transformers")

    def build():
        torch.manual_seed(0)
        if family == "gpt2":
            config = transformers.GPT2Config(
                n_layer=3, n_embd=32, n_head=2, vocab_size=64, n_positions=64, use_cache=False
            )
            return transformers.GPT2LMHeadModel(config)
        config = transformers.LlamaConfig(
            num_hidden_layers=3, hidden_size=32, intermediate_size=64, num_attention_heads=2,
            num_key_value_heads=1, vocab_size=64, max_position_embeddings=64, use_cache=False,
        )  # fmt: skip
        return transformers.LlamaForCausalLM(config)

    plain, rotor = (
        build(),
        Checkpointable(build(), "60%", repeats=1, predict_shapes=True, fit_shapes=False, discover="modules"),
    )
    for step, length in enumerate((16, 48, 32, 24, 56, 40)):
        x = torch.randint(0, 64, (2, length), generator=torch.Generator().manual_seed(step))
        for model in (plain, rotor):
            model.zero_grad(set_to_none=True)
        torch.manual_seed(step)
        plain(input_ids=x, labels=x).loss.backward()
        torch.manual_seed(step)
        if step < 2:  # the first two lengths are profiled (inside the step: not a clean measurement)
            rotor(input_ids=x, labels=x).loss.backward()
        else:
            with rotor.measure_step() as m:
                rotor(input_ids=x, labels=x).loss.backward()
            entry = rotor.last_entry
            assert next(k for k, e in rotor.entries.items() if e is entry) in rotor.predicted
            assert 0 < m.peak <= entry.plan.budget
        assert_same_state(plain, rotor)


@pytest.mark.parametrize("predict", [False, True], ids=["derived", "predicted"])
def test_every_length_holds_its_budget_from_its_first_step(predict):
    """A GPT whose causal masks (64 x 64 per block) outweigh its shortest length's activations: every step,
    the first one included, holds at most its plan's budget. Preparing the first shape also checks the stages
    for in-place writes (`join_in_place`: every buffer copied, one pass without grad), not the step after it."""
    torch.manual_seed(0)
    model = gpt(vocab_size=64, block_size=64, n_layer=6, n_head=2, n_embd=16, dropout=0.1)
    rotor = Checkpointable(model, "50%", repeats=1, predict_shapes=predict)
    for step, length in enumerate((2, 3, 4, 8)):
        x, y = batch(length)
        rotor.prepare_for(x)  # profiled here: profiling is no part of the step measured
        torch.manual_seed(step)
        with rotor.measure_step() as m:
            lm_loss(rotor(x), y).backward()
        assert m.peak <= rotor.last_entry.plan.budget, (length, m.peak, rotor.last_entry.plan.budget)


def test_a_small_chain_is_planned_on_one_thread_and_a_long_one_on_the_planners_default():
    """A changing shape's chain is planned on every new shape: one thread where starting another costs what it
    saves (the plan does not depend on it: test_planner_threads.py)."""
    from lightning_rotor.discretize import auto_slots
    from lightning_rotor.planner import _threads_for

    assert _threads_for(7, auto_slots(7)) == 1  # the small GPT's chain
    assert _threads_for(150, auto_slots(150)) == 0


class LastPartial(Dataset):
    """Epochs of three full batches and a last partial one of a short sequence: the partial one's times, derived
    from the full one's by FLOPs, are far too small (per-op overhead dominates there). Five epochs: the partial
    batch profiles (1), is sampled by the memory probe (2), steps timed twice prove its times wrong (3, 4), and it
    is timed when met again (5)."""

    def __len__(self):
        return 20

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        rows, length = (8, 32) if i % 4 != 3 else (1, 2)
        return torch.randint(0, 64, (rows, length), generator=g), torch.randint(0, 64, (rows, length), generator=g)


def test_a_shape_whose_steps_prove_its_derived_times_wrong_is_timed_and_trains_bitwise_within_budget(tmp_path):
    loader = DataLoader(LastPartial(), batch_size=None)
    runs, keep = {}, KeepRotorModules()
    for name, strategy in (("plain", "auto"), ("rotor", RotorStrategy(mem_limit="60%", repeats=1))):
        model = LM()
        torch.manual_seed(7)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            trainer = quiet_trainer(tmp_path / name, strategy, max_steps=len(LastPartial()), callbacks=[keep])
            trainer.fit(model, loader)
        runs[name] = model
    rotor = keep.modules["net"]
    full, partial = (next(k for k in rotor.entries if f"({rows}, {n})" in k) for rows, n in ((8, 32), (1, 2)))
    assert list(rotor.retimed) == [partial] and rotor.retimed[partial] > 2  # the full batch's times were measured
    assert rotor.entries[partial].profile.repeats > 0  # timed when met again, no longer derived
    assert rotor.entries[full].profile.repeats > 0
    assert len([w for w in seen if "the time its plan predicts" in str(w.message)]) == 1
    assert not [w for w in seen if "above the budget" in str(w.message)]  # the callback's samples
    for a_step, b_step in zip(runs["rotor"].grads, runs["plain"].grads, strict=True):
        for a, b in zip(a_step, b_step, strict=True):
            assert torch.equal(a, b)
    assert len(runs["rotor"].grads) == len(LastPartial())


def test_derived_times_are_timed_after_two_steps_in_a_row_far_from_the_timed_shapes_pace():
    from lightning_rotor.shapes import ShapeTimes

    times = ShapeTimes()
    assert times.step("small", True, 1.0, 0.1) is None  # no timed shape's pace yet: nothing to compare with
    times.step("timed", False, 1.0, 1.0)
    times.step("timed", False, 1.2, 1.0)
    assert times.step("small", True, 0.5, 0.1) is None  # 4.5x the expected pace, once
    assert times.step("small", True, 0.15, 0.1) is None  # within 2x: the count starts again
    assert times.step("small", True, 0.5, 0.1) is None
    assert times.step("small", True, 0.5, 0.1) == pytest.approx(5 / 1.1)
    assert times.retime == {"small": pytest.approx(5 / 1.1)} and "small" not in times.off
    first, small = (object(), [1000, 2000]), (object(), [10, 20])
    times.timed = [first, small]  # once timed, a small shape's times are what the next small ones derive from
    assert times.nearest([12, 30], first) is small and times.nearest([900, 900], first) is first
