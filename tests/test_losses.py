"""Losses other than cross-entropy hold the budget without the user saying anything (lightning_rotor/loss_watch.py).

The profiler charges a cross-entropy stand-in where the caller's loss is unknown. An MSE keeps `a_L` and its
value shares a buffer of `a_L`'s size until the step ends; a contrastive loss saves a B x B similarity: both
went over the budget with nothing said (an 8-layer tanh MLP with `F.mse_loss` at "70%": 1,266 B over). The
first step of a plan now measures the real loss and replans before the backward goes on.
"""

import copy

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from fitting import KeepRotorModules, quiet_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.flop_counter import FlopCounterMode
from training import assert_same_state, train

from lightning_rotor import Checkpointable, MemoryProbe, loss_watch
from lightning_rotor._torch_compat import dispatch_mode_stack
from lightning_rotor.lightning import RotorStrategy
from lightning_rotor.lightning.callback import LIGHTNING_BOOKKEEPING
from lightning_rotor.lightning.state import rotor_modules
from lightning_rotor.loss_watch import LossBytes, LossOverBudget, loss_bytes


class TanhMLP(nn.Module):
    """An 8-layer tanh MLP: each stage saves its output, so the plan keeps `a_L` through the loss."""

    def __init__(self, width: int = 32, depth: int = 8):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def contrastive(out, y):
    """An InfoNCE-style loss over the batch: a B x B similarity, saved for its backward."""
    z = F.normalize(out, dim=-1)
    return F.cross_entropy(z @ z.t() / 0.1, torch.arange(out.shape[0]))


def bce(out, y):
    return F.binary_cross_entropy_with_logits(out, (y > 0).float())


LOSSES = {"mse": F.mse_loss, "l1": F.l1_loss, "smooth_l1": F.smooth_l1_loss, "bce": bce, "contrastive": contrastive}


def data(batch: int = 16, width: int = 32):
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)


@pytest.mark.parametrize("budget", ["70%", "90%"])
@pytest.mark.parametrize("name", list(LOSSES))
def test_checkpointable_holds_the_budget_with_any_loss(name, budget):
    loss_fn, (x, y) = LOSSES[name], data()
    torch.manual_seed(0)
    plain = TanhMLP()
    rotor = Checkpointable(copy.deepcopy(plain), budget, discover="graph", repeats=1)
    assert torch.equal(train(plain, x, y, loss_fn), train(rotor, x, y, loss_fn))
    assert_same_state(plain, rotor)
    rotor.zero_grad()
    with rotor.measure_step() as measured:
        loss_fn(rotor(x), y).backward()
    assert rotor.plan.recomputed_stages > 0
    assert measured.peak <= rotor.plan.budget, (measured.peak, rotor.plan.budget)
    assert measured.peak <= rotor.plan.peak  # the prediction charges the real loss


def test_a_loss_that_no_plan_fits_is_refused_in_one_line_before_any_optimizer_step():
    """A B x B similarity of a large batch outweighs the chain: the first backward says so, naming loss_fn=.
    (A budget in bytes: a fraction is taken of the peak with the real loss, which it always meets.)"""
    x, y = data(batch=128, width=8)
    torch.manual_seed(0)
    probe = Checkpointable(TanhMLP(width=8, depth=4), "100%", discover="graph", repeats=1)
    probe.discover_on(x)
    probe.prepare_for(x)
    rotor = Checkpointable(TanhMLP(width=8, depth=4), probe.plan.budget, discover="graph", repeats=1)
    with pytest.raises(LossOverBudget, match="loss_fn=") as err:
        contrastive(rotor(x), y).backward()
    assert "\n" not in str(err.value) and all(p.grad is None for p in rotor.parameters())
    with pytest.raises(LossOverBudget):  # caught and trained on: the next step is measured and refused again
        contrastive(rotor(x), y).backward()


def test_loss_bytes_bound_the_figure_the_step_did_not_show():
    """A step that dropped `a_L` bounds the kept figure by its bytes more; one that kept it, the plain by the kept."""
    dropped = loss_bytes(peak=5000, current=10, alive=0, size=1000, grad=1000)
    assert dropped == LossBytes(tmp=3000, tmp_kept=4000, value=0)
    kept = loss_bytes(peak=5000, current=2010, alive=1000, size=1000, grad=1000)
    assert kept == LossBytes(tmp=3000, tmp_kept=3000, value=10)


class Regression(pl.LightningModule):
    """`net` trained on `loss_fn` by SGD; every step after the first (which profiles) measured."""

    def __init__(self, net: nn.Module, loss_fn):
        super().__init__()
        self.net, self.loss_fn = net, loss_fn

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.loss_fn(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class MeasureSteps(pl.Callback):
    """The measured peak, the plan's predicted peak and budget of every step but the first (the profiling step)."""

    def __init__(self):
        self.steps: list[tuple[int, int, int]] = []
        self._open = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        rotors = rotor_modules(pl_module)
        if batch_idx > 0 and rotors:
            self._open = next(iter(rotors.values()))
            probe = MemoryProbe(self._open, record_curve=True, bookkeeping=LIGHTNING_BOOKKEEPING)  # as RotorCallback's
            self._measuring = self._open.measure_step(probe)
            self._measuring.__enter__()

    def on_after_backward(self, trainer, pl_module):
        if self._open is not None:
            self._measuring.__exit__(None, None, None)
            plan = self._open.plan
            self.steps.append((self._measuring.peak, plan.peak, plan.budget))
            self._open = None


@pytest.mark.parametrize("name", ["mse", "l1", "contrastive"])
def test_trainer_holds_the_budget_with_any_loss(name, tmp_path):
    x, y = data(batch=64)
    loader = DataLoader(TensorDataset(x, y), batch_size=16)
    torch.manual_seed(0)
    plain = Regression(TanhMLP(), LOSSES[name])
    rotor = copy.deepcopy(plain)
    torch.manual_seed(2)
    quiet_trainer(tmp_path / "plain", max_steps=4).fit(plain, loader)
    keep, measure = KeepRotorModules(), MeasureSteps()
    torch.manual_seed(2)
    strategy = RotorStrategy("70%", discover="graph", repeats=1)
    quiet_trainer(tmp_path / "rotor", strategy, max_steps=4, callbacks=[keep, measure]).fit(rotor, loader)
    for a, b in zip(plain.parameters(), rotor.parameters(), strict=True):
        assert torch.equal(a, b)
    assert len(measure.steps) == 3 and keep.modules["net"].plan.recomputed_stages > 0
    assert all(peak <= predicted <= budget for peak, predicted, budget in measure.steps), measure.steps


def test_the_dispatch_mode_stack_is_left_as_found_with_a_probe_around_each_step():
    """The window's probe is left in `HandOver`'s backward, where the engine puts the stack back after the node:
    a probe of the caller's own around the step is left, as entered, with nothing above it, and the next shape's
    first step opens a window of its own (the stack stayed with a counting probe on it, every later op slowed)."""
    torch.manual_seed(0)
    rotor = Checkpointable(TanhMLP(), "70%", discover="graph", repeats=1)
    for batch in (16, 16, 8, 12):  # three plan keys, each with a first step that watches the loss
        x, y = data(batch=batch)
        rotor.zero_grad()
        with MemoryProbe(rotor) as probe:
            F.mse_loss(rotor(x), y).backward()
        assert dispatch_mode_stack() == []
        if batch != 16:  # the profiling step is bound by no budget
            assert probe.peak <= rotor.plan.budget, (batch, probe.peak, rotor.plan.budget)


def test_a_trainer_with_changing_shapes_leaves_no_dispatch_mode_behind(tmp_path):
    x, y = data(batch=40)
    loader = DataLoader(TensorDataset(x, y), batch_size=16)  # 16, 16, then a partial batch of 8
    torch.manual_seed(0)
    model = Regression(TanhMLP(), F.mse_loss)
    strategy = RotorStrategy("70%", discover="graph", repeats=1)
    quiet_trainer(tmp_path, strategy, max_epochs=2).fit(model, loader)
    assert dispatch_mode_stack() == []


def test_under_another_dispatch_mode_the_loss_is_not_measured_and_that_is_said_once():
    """A mode entered before the forward leaves the stack before the window would: no window, one warning."""
    x, y = data()
    torch.manual_seed(0)
    rotor = Checkpointable(TanhMLP(), "70%", discover="graph", repeats=1)
    F.mse_loss(rotor(x), y).backward()  # profiles
    loss_watch._WARNED.clear()
    rotor.zero_grad()
    with pytest.warns(UserWarning, match=r"not measured under _?FlopCounterMode.*loss_fn=") as seen:
        for batch in (8, 12):  # two new plan keys
            x, y = data(batch=batch)
            with FlopCounterMode(display=False) as flops:
                F.mse_loss(rotor(x), y).backward()
            assert flops.get_total_flops() > 0
    assert len([w for w in seen if "not measured" in str(w.message)]) == 1
    assert dispatch_mode_stack() == []


def test_a_head_after_the_chain_is_part_of_the_loss_and_its_gradients_are_not():
    """The window sees the head's activations (what the budget's probe counts) and the head's parameter
    gradients (parameter memory, which it does not): the first raise the chain, the second do not."""
    x, y = data()
    torch.manual_seed(0)
    plain = nn.Sequential(TanhMLP(), nn.Linear(32, 32))
    model = copy.deepcopy(plain)
    model[0] = Checkpointable(model[0], "70%", discover="graph", repeats=1)
    assert torch.equal(train(plain, x, y, F.mse_loss), train(model, x, y, F.mse_loss))
    assert_same_state(plain, model)
    model.zero_grad()
    with MemoryProbe(model) as probe:
        F.mse_loss(model(x), y).backward()
    rotor = model[0]
    assert rotor.plan.recomputed_stages > 0
    assert probe.peak <= rotor.plan.budget, (probe.peak, rotor.plan.budget)
    head_grads = sum(p.numel() * 4 for p in model[1].parameters())
    assert rotor.chain.loss_value < head_grads  # the value and its seed only


def test_a_loop_without_a_trainer_is_settled_by_its_optimizer_step():
    """Between a backward and the next chain call a loop may run anything (compiled code, which a mode left
    on the stack would leave eager for good): the optimizer step takes the ended window off first."""
    x, y = data()
    torch.manual_seed(0)
    rotor = Checkpointable(TanhMLP(), "70%", discover="graph", repeats=1)
    opt = torch.optim.SGD(rotor.parameters(), lr=0.1)
    for batch in (16, 8):  # the profiling step, then a new shape's first step
        x, y = data(batch=batch)
        F.mse_loss(rotor(x), y).backward()
        assert dispatch_mode_stack() != []  # the window's probe, put back by the engine
        opt.step()
        assert dispatch_mode_stack() == []


@pytest.mark.parametrize("name", ["mse", "contrastive"])
def test_a_new_shape_after_a_raise_is_charged_the_real_loss_from_its_first_step(name):
    """An earlier shape's real loss, per byte of the chain's output, is charged to shapes planned after it (measured
    or derived), so their own first step, which measures their loss in turn, holds the budget too (MSE went 194 to
    2,498 B over at "70%" on such steps, a contrastive loss 339 to 899 B, when the stand-in was charged there)."""
    loss_fn = LOSSES[name]
    torch.manual_seed(0)
    rotor = Checkpointable(TanhMLP(), "70%", discover="graph", repeats=1)
    for step, batch in enumerate((16, 32, 8, 24, 12, 20)):
        x, y = data(batch=batch)
        rotor.zero_grad()
        with rotor.measure_step() as measured:
            loss_fn(rotor(x), y).backward()
        assert not step or measured.peak <= rotor.last_entry.plan.budget, (batch, measured.peak)


def test_a_plain_run_s_output_stays_writable_in_place_while_its_loss_is_measured():
    """Nothing recomputed: plain autograd runs the chain, and a hook on its output ends the window (an identity
    node would make the output a view, which `out.mul_` may not change); gradients as plain training's."""

    def scaled_mse(out, y):
        return F.mse_loss(out.mul_(2), y)

    torch.manual_seed(0)
    plain = nn.Sequential(TanhMLP(), nn.Linear(32, 32))  # a linear output: no backward reads it
    rotor = Checkpointable(copy.deepcopy(plain), 1.0, discover="graph", repeats=1)
    for batch in (16, 8):  # the profiling step, then a new shape's first step, whose loss is measured
        x, y = data(batch=batch)
        assert torch.equal(train(plain, x, y, scaled_mse, steps=1), train(rotor, x, y, scaled_mse, steps=1))
        assert rotor.plan.recomputed_stages == 0
    assert_same_state(plain, rotor)
    assert rotor.chain.loss_value > rotor.chain.out_size[-1]  # the real MSE measured: its value holds a_L's size


def test_a_new_shape_is_profiled_with_no_window_left_on_the_stack():
    """A loop that calls backward twice before its optimizer step (gradient accumulation) meets the next shape with
    the last window's probe back on the stack: the chain call takes it off before profiling, not after (every op of
    the profile went through it, its dispatch paid twice)."""
    torch.manual_seed(0)
    rotor = Checkpointable(TanhMLP(), "70%", discover="graph", repeats=1)
    stacks: list[list] = []
    rotor.chain_state.on_profile_progress = lambda *_: stacks.append(list(dispatch_mode_stack()))
    for batch in (16, 8, 12):  # three plan keys, no optimizer step between them
        x, y = data(batch=batch)
        F.mse_loss(rotor(x), y).backward()
    assert len(stacks) >= 3 * len(rotor.chain.out_size) and all(stack == [] for stack in stacks)
