"""Frozen layers (chain version 4): stages that need no backward cost what plain autograd makes them cost.

Stages before the first one that needs a backward (the chain input does not require grad and
no parameter of theirs does) run once as `Fn` ops, never recorded, recomputed nor backwarded;
the planner plans the rest (docs/memory-model.md, "Chain version 4").
"""

import copy
import dataclasses
import math

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from fitting import quiet_trainer
from hypothesis import given, settings
from hypothesis import strategies as st
from reference_planner import reference_min_budget, reference_plan
from test_planner import chains
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_rotor import Checkpointable, MemoryProbe
from lightning_rotor.chain import Chain, ChainError
from lightning_rotor.lightning import RotorStrategy
from lightning_rotor.lightning.state import rotor_modules
from lightning_rotor.models.gpt import gpt, lm_loss
from lightning_rotor.ops import Op, is_no_recompute, no_recompute_ops, shift_ops
from lightning_rotor.planner import InfeasibleBudget, min_feasible_budget, plan
from lightning_rotor.simulate import no_recompute_peak, simulate
from lightning_rotor.tables import stage_rows


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


def frozen_gpt_attention():
    """As `frozen_gpt`, with the last block's first norm and attention frozen too: that block (the first stage
    that needs a backward) saves nothing of its input, which plain autograd then frees after the forward."""
    model, x, y, loss_fn = frozen_gpt()
    model.blocks[5].ln_1.requires_grad_(False)
    model.blocks[5].attn.requires_grad_(False)
    return model, x, y, loss_fn


MODELS = {"gpt": frozen_gpt, "mlp": frozen_mlp, "gpt_attention": frozen_gpt_attention}
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
    assert all(op.stage is None or op.stage >= chain.frozen for op in rotor.plan.ops[chain.frozen :])


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
    if name.startswith("gpt"):  # one trainable block is one stage: 50% of the peak is below what recording it needs
        with pytest.raises(InfeasibleBudget, match="smallest feasible budget") as err:
            rotor_step(rotor, x, y, loss_fn)
        rotor = Checkpointable(copy.deepcopy(model), mem_limit=err.value.min_feasible, **QUICK).train()
    rotor_step(rotor, x, y, loss_fn)
    peak, got = rotor_step(rotor, x, y, loss_fn)
    assert rotor.plan.recomputed_stages > 0
    assert_frozen_run_once(rotor)
    assert peak <= rotor.plan.budget
    assert_same_grads(grads, got)


def test_unfreezing_mid_training_plans_again_and_trains_like_plain():
    model, x, y, loss_fn = frozen_mlp()
    rotor = Checkpointable(copy.deepcopy(model), mem_limit="50%", **QUICK).train()
    plain_opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rotor_opt = torch.optim.SGD(rotor.parameters(), lr=0.1)
    frozen = []
    for step in range(4):
        if step == 2:  # unfreeze the last frozen quarter of the layers in both
            model[12:24].requires_grad_(True)
            rotor[12:24].requires_grad_(True)
        _, grads = plain_step(model, x, y, loss_fn)
        peak, got = rotor_step(rotor, x, y, loss_fn)
        assert_same_grads(grads, got)
        assert peak <= rotor.plan.budget
        assert_frozen_run_once(rotor)
        frozen.append(rotor.chain.frozen)
        plain_opt.step()
        rotor_opt.step()
    assert frozen == [24, 24, 12, 12] and len(rotor.entries) == 2
    for a, b in zip(model.parameters(), rotor.parameters(), strict=True):
        assert torch.equal(a, b)


def test_saved_plans_of_a_frozen_model_load_and_run_without_profiling():
    model, x, y, loss_fn = frozen_mlp()
    _, grads = plain_step(model, x, y, loss_fn)
    first = Checkpointable(copy.deepcopy(model), mem_limit="50%", **QUICK).train()
    rotor_step(first, x, y, loss_fn)
    state = first.plan_state()
    assert state["entries"][0]["chain"]["frozen"] == 24
    again = Checkpointable(copy.deepcopy(model), mem_limit="50%", **QUICK).train()
    again.load_plan_state(state)
    peak, got = rotor_step(again, x, y, loss_fn)
    assert again.last_entry.profile.seconds == first.last_entry.profile.seconds  # loaded, not profiled again
    assert again.plan.ops == first.plan.ops and again.plan.recomputed_stages > 0
    assert peak <= again.plan.budget
    assert_same_grads(grads, got)


def test_a_frozen_view_of_the_input_adds_no_bytes():
    # Flatten makes a view of a_0: frozen (no parameter, input without grad), it holds nothing new, and the
    # first trainable stage's input is charged once, as a_0
    model = nn.Sequential(nn.Flatten(), nn.Linear(48, 32), nn.Tanh(), nn.Linear(32, 5))
    x, y = torch.randn(16, 3, 16), torch.randint(0, 5, (16,))
    plain, grads = plain_step(model, x, y, F.cross_entropy)
    rotor = Checkpointable(copy.deepcopy(model), mem_limit=plain, **QUICK).train()
    rotor_step(rotor, x, y, F.cross_entropy)
    peak, got = rotor_step(rotor, x, y, F.cross_entropy)
    assert rotor.chain.frozen == 1 and rotor.chain.out_size[0] == 0
    assert is_no_recompute(rotor.plan.ops) and rotor.plan.peak == peak == plain
    assert_same_grads(grads, got)


# -- the chain, the planners and the simulator -------------------------------------------------------------------
@st.composite
def frozen_chains(draw):
    """(whole chain with a frozen prefix, its trainable suffix drawn as an ordinary chain)."""
    suffix = draw(chains(max_length=5))
    frozen = draw(st.integers(1, 3))
    s_0 = draw(st.integers(0, suffix.input_size))
    s_f = suffix.input_size - s_0  # the suffix starts holding the caller's a_0 and a_F
    released = draw(st.sampled_from([0, s_f]))  # in_free[F]: a_F goes after the last Fe F when no graph keeps it
    suffix = dataclasses.replace(suffix, in_free=[released, *suffix.in_free[1:]])
    out = [*draw(st.lists(st.integers(0, 60), min_size=frozen - 1, max_size=frozen - 1)), s_f]
    nograd = draw(st.lists(st.sampled_from([0, 2, 9, 30]), min_size=frozen, max_size=frozen))
    unused = draw(st.integers(0, 1))  # a frozen stage's backward figures are never read: any valid value will do
    whole = Chain(
        input_size=s_0,
        out_size=out + suffix.out_size,
        saved_size=[o + 5 * unused for o in out] + suffix.saved_size,
        fwd_time=draw(st.lists(st.sampled_from([0.0, 0.25, 1.0, 3.0]), min_size=frozen, max_size=frozen))
        + suffix.fwd_time,
        bwd_time=[2.0 * unused] * frozen + suffix.bwd_time,
        fwd_tmp=[7 * unused] * frozen + suffix.fwd_tmp,
        fwd_tmp_nograd=nograd + suffix.fwd_tmp_nograd,
        bwd_tmp=[3 * unused] * frozen + [suffix.bwd_tmp[0] + s_0, *suffix.bwd_tmp[1:]],
        loss_tmp=suffix.loss_tmp,
        out_free=[0] * frozen + suffix.out_free,
        loss_tmp_kept=suffix.loss_tmp_kept,
        in_free=[0] * frozen + suffix.in_free,
        loss_value=suffix.loss_value,
        names=[f"frozen{k}" for k in range(frozen)] + suffix.names,
        frozen=frozen,
    )
    return whole, suffix


def prefix_peak_by_hand(whole):
    s, f = whole.sizes, whole.frozen
    return max(s[0] + (s[k] if k else 0) + s[k + 1] + whole.fwd_tmp_nograd[k] for k in range(f))


@settings(max_examples=200, deadline=None)
@given(pair=frozen_chains(), where=st.floats(0, 1.3))
def test_a_frozen_prefix_plans_like_its_suffix_with_the_prefix_peak_added(pair, where):
    whole, suffix = pair
    f = whole.frozen
    assert whole.suffix() == suffix
    assert whole.prefix_peak == prefix_peak_by_hand(whole)
    lowest = max(1, whole.prefix_peak, min_feasible_budget(suffix))
    assert min_feasible_budget(whole) == lowest
    assert reference_min_budget(whole) == max(whole.prefix_peak, reference_min_budget(suffix))
    assert no_recompute_peak(whole) == max(whole.prefix_peak, no_recompute_peak(suffix))
    budget = max(1, int(lowest + where * (no_recompute_peak(whole) - lowest)))
    if lowest > 1:
        with pytest.raises(InfeasibleBudget):
            plan(whole, lowest - 1)
    got, alone = plan(whole, budget), plan(suffix, budget)
    prefix = [Op("Fn", k) for k in range(f)]
    assert got.ops == prefix + shift_ops(alone.ops, f)
    sim, sim_alone = simulate(whole, got.ops), simulate(suffix, alone.ops)
    assert got.peak == sim.peak == max(whole.prefix_peak, alone.peak) <= budget
    assert got.time == sim.time == math.fsum([*whole.fwd_time[:f], *sim_alone_times(suffix, alone.ops)])
    assert sim.curve[f:] == sim_alone.curve and sim.op_peaks[f:] == sim_alone.op_peaks
    assert got.no_recompute_time == math.fsum([*whole.fwd_time, *suffix.bwd_time])
    expected = reference_plan(suffix, budget, slots=got.slots)
    assert reference_plan(whole, budget, slots=got.slots) == (
        None
        if expected is None
        else (
            expected[0],
            [("Fn", k) for k in range(f)] + [(op[0], op[1] + f) if len(op) == 2 else op for op in expected[1]],
        )
    )


def sim_alone_times(chain, ops):
    return [
        chain.fwd_time[op.stage] if op.kind.is_forward else chain.bwd_time[op.stage]
        for op in ops
        if op.stage is not None
    ]


def tiny_frozen_chain(**changes):
    fields = dict(
        input_size=4,
        out_size=[8, 8, 8],
        saved_size=[8, 12, 12],
        fwd_time=[1.0, 1.0, 1.0],
        bwd_time=[0.0, 2.0, 2.0],
        fwd_tmp=[0, 0, 0],
        bwd_tmp=[0, -8, 0],
        loss_tmp=0,
        frozen=1,
    )
    fields.update(changes)
    return Chain(**fields)


def test_frozen_chain_json_round_trip_and_older_versions_refuse_the_field():
    chain = tiny_frozen_chain()
    written = chain.to_dict()
    assert written["version"] == 4 and written["frozen"] == 1
    assert Chain.from_dict(written) == chain
    assert "frozen" not in tiny_frozen_chain(frozen=0).to_dict()
    for version in (1, 2, 3):
        with pytest.raises(ChainError, match="frozen need chain version 4; this file says version"):
            Chain.from_dict({**written, "version": version})


@pytest.mark.parametrize("frozen", [-1, 3, True, 1.0])
def test_frozen_must_leave_a_stage_to_backward(frozen):
    with pytest.raises(ChainError, match="frozen must be an integer from 0 to 2"):
        tiny_frozen_chain(frozen=frozen)


def test_b_of_the_first_trainable_stage_is_charged_without_its_input_gradient():
    # B 1 starts holding a_0 (4), a_1 (8), ā_2 (12) and δ_2 (8); bwd_tmp[1] = -8 as the profiler measures a
    # backward that makes no gradient for a_1: the peak is those 32 bytes, no δ_1 on top
    chain = tiny_frozen_chain()
    sim = simulate(chain, no_recompute_ops(3, 1))
    assert sim.op_peaks == [
        4 + 8,
        4 + 8 + 12,
        4 + 8 + 12 + 12,
        4 + 8 + 12 + 12 + 8,
        4 + 8 + 12 + 12 + 8 + 8,
        4 + 8 + 12 + 8,
    ]


@pytest.mark.parametrize(
    "ops, where",
    [
        (
            [("Fe", 0), ("Fe", 1), ("Fe", 2), ("Loss",), ("B", 2), ("B", 1), ("B", 0)],
            r"op 0 \(Fe 0\): stages 0..0 are "
            "frozen",
        ),
        (
            [("Fn", 0), ("Fc", 1), ("Fn", 2), ("Loss",), ("Fc", 0), ("Fe", 1), ("Fe", 2), ("B", 2), ("B", 1)],
            r"op 4 \(Fc 0\): stage 0 is frozen",
        ),
        (
            [("Fn", 0), ("Fe", 1), ("Fe", 2), ("Loss",), ("B", 2), ("B", 1), ("B", 0)],
            r"op 6 \(B 0\): stage 0 is frozen",
        ),
        ([("Fn", 0), ("Fe", 1), ("Fe", 2), ("Loss",), ("B", 2)], r"ends before B 1 \(next expected: B 1\)"),
        ([("Fn", 0), ("Fe", 1), ("Loss",)], r"op 2 \(Loss\): needs the chain output a_3"),
    ],
)
def test_plans_that_touch_a_frozen_stage_again_are_refused_by_name(ops, where):
    with pytest.raises(ValueError, match=where):
        simulate(tiny_frozen_chain(), ops)


# -- through a real Trainer ----------------------------------------------------------------------------------------
class FineTune(pl.LightningModule):
    """A frozen MLP (with BatchNorm statistics still updating in the frozen half) whose frozen layers are
    partly unfrozen from the third step on, as fine-tuning schedules do."""

    def __init__(self):
        super().__init__()
        model, *_ = frozen_mlp()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.BatchNorm1d(32), *model)
        self.net[:25].requires_grad_(False)
        self.losses: list[torch.Tensor] = []
        self.grads: list[list[torch.Tensor]] = []

    def on_train_batch_start(self, batch, batch_idx):
        if batch_idx == 2:
            self.net[13:25].requires_grad_(True)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.losses.append(loss.detach())
        return loss

    def on_before_optimizer_step(self, optimizer):
        self.grads.append([p.grad.detach().clone() for p in self.parameters() if p.grad is not None])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class Seen(pl.Callback):
    """Each step's frozen prefix and the number of plans made so far (the strategy unwraps at teardown)."""

    def __init__(self):
        self.frozen: list[int] = []
        self.plans: list[int] = []
        self.recomputed: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        rotor = rotor_modules(pl_module)["net"]
        self.frozen.append(rotor.chain.frozen)
        self.plans.append(len(rotor.entries))
        self.recomputed.append(rotor.plan.recomputed_stages)
        assert_frozen_run_once(rotor)
        decisions = [row[-1] for row in stage_rows(rotor.last_entry)]
        assert decisions[: rotor.chain.frozen] == ["frozen"] * rotor.chain.frozen
        assert "frozen" not in decisions[rotor.chain.frozen :]


def test_fine_tuning_through_a_trainer_equals_plain_training(tmp_path):
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(4 * 128, 32, generator=g), torch.randint(0, 10, (4 * 128,), generator=g))
    runs = {}
    for name, strategy in (("plain", "auto"), ("rotor", RotorStrategy(mem_limit=0.5))):
        model, seen = FineTune(), Seen()
        torch.manual_seed(7)
        quiet_trainer(tmp_path / name, strategy, max_steps=4, callbacks=[seen] if name == "rotor" else []).fit(
            model, DataLoader(data, batch_size=128)
        )
        runs[name] = (model, seen)
    (plain, _), (rotor, seen) = runs["plain"], runs["rotor"]
    assert seen.frozen == [25, 25, 13, 13] and seen.plans == [1, 1, 2, 2] and min(seen.recomputed) > 0
    assert len(rotor.losses) == 4
    for a, b in zip(rotor.losses, plain.losses, strict=True):
        assert torch.equal(a, b)
    for step_a, step_b in zip(rotor.grads, plain.grads, strict=True):
        assert_same_grads(step_b, step_a)
    for (name, a), b in zip(rotor.state_dict().items(), plain.state_dict().values(), strict=True):
        assert torch.equal(a, b), name  # weights and the frozen BatchNorm's statistics
