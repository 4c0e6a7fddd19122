"""Several calls of one chain per training step: one budget covers the whole step (issue 15, point 3)."""

import copy
import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from fitting import quiet_trainer
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_rotor.checkpointable import Checkpointable, InfeasibleStep
from lightning_rotor.lightning import RotorCallback, RotorStrategy
from lightning_rotor.memory import MemoryProbe
from lightning_rotor.planner import min_feasible_budget
from lightning_rotor.simulate import no_recompute_peak

N = 128


def discriminator() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(64, 64), nn.LeakyReLU(0.2))], nn.Linear(64, 2))


def batches():
    torch.manual_seed(1)
    return torch.randn(N, 64), torch.randn(N, 64)


REAL, FAKE = torch.ones(N, dtype=torch.long), torch.zeros(N, dtype=torch.long)

LOSSES = {
    # two losses, one per call, summed: a GAN discriminator's usual loss
    "two losses summed": lambda d, real, fake: F.cross_entropy(d(real), REAL) + F.cross_entropy(d(fake), FAKE),
    # the calls' outputs combined before one loss (D(real) + D(fake))
    "outputs summed": lambda d, real, fake: F.cross_entropy(d(real) + d(fake), REAL),
    # three calls
    "three calls": lambda d, real, fake: (
        F.cross_entropy(d(real), REAL) + F.cross_entropy(d(fake), FAKE) + F.cross_entropy(d(real * 0.5), REAL)
    ),
}


def measured_steps(model, loss_fn, real, fake, steps=3):
    """Per step: (peak bytes of the whole step, exact tensor accounting, and the gradients)."""
    out = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        with MemoryProbe(model) as probe:
            probe.track(real, fake)
            loss_fn(model, real, fake).backward()
        out.append((probe.peak, [p.grad.clone() for p in model.parameters()]))
    return out


CASES = [(loss, budget) for loss in LOSSES for budget in ((0.8, 1.0) if loss == "three calls" else (0.6, 1.0))]


@pytest.mark.parametrize(("loss", "budget"), CASES)
def test_a_model_called_several_times_per_step_stays_within_one_budget(loss, budget):
    plain, (real, fake) = discriminator(), batches()
    rotor = Checkpointable(copy.deepcopy(plain), budget)
    rotor.prepare_for(real)  # profiles: the steps below are planned and run only
    assert min_feasible_budget(rotor.chain) < rotor.budget <= no_recompute_peak(rotor.chain)
    got = measured_steps(rotor, LOSSES[loss], real, fake)
    expected = measured_steps(plain, LOSSES[loss], real, fake)
    plain_peak = expected[0][0]
    assert plain_peak > rotor.budget  # plain training of the step does not fit: rotor must recompute
    for step, ((peak, grads), (_, plain_grads)) in enumerate(zip(got, expected, strict=True)):
        assert peak <= rotor.budget, (step, peak, rotor.budget)
        assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads, strict=True)), step
        assert rotor.calls.last_step_peak <= rotor.budget or step == 0
    assert rotor.last_entry.plan.recomputed_stages > 0


def test_a_call_whose_graph_is_dropped_or_in_eval_mode_holds_nothing_afterwards():
    plain, (real, fake) = discriminator(), batches()
    rotor = Checkpointable(copy.deepcopy(plain), 0.6)
    rotor.prepare_for(real)
    for _ in range(2):
        LOSSES["two losses summed"](rotor, real, fake).backward()
    first = [budget for _, budget in rotor.calls.step]  # the learned step: each call's budget
    rotor(real)  # under grad, output discarded: its graph is gone, so is what it held
    assert rotor.calls.held() == 0
    kept = rotor(real)
    assert rotor.calls.held() > 0
    del kept
    assert rotor.calls.held() == 0
    rotor.eval()
    with torch.enable_grad():
        evaluated = rotor(real)  # the module's own forward: not a planned call
    rotor.train()
    assert evaluated.requires_grad and rotor.calls.held() == 0
    rotor.zero_grad(set_to_none=True)
    ((peak, _),) = measured_steps(rotor, LOSSES["two losses summed"], real, fake, steps=1)
    assert [budget for _, budget in rotor.calls.step] == first  # planned as if the dropped calls never ran
    assert peak <= rotor.budget


def test_a_budget_too_small_for_two_calls_is_one_line_before_any_optimizer_step():
    plain, (real, fake) = discriminator(), batches()
    rotor = Checkpointable(copy.deepcopy(plain), 1.0)
    rotor.prepare_for(real)
    rotor.replan(min_feasible_budget(rotor.chain))  # one call fits; two do not
    before = copy.deepcopy(rotor.state_dict())
    opt = torch.optim.SGD(rotor.parameters(), lr=0.1)
    with pytest.raises(InfeasibleStep) as err:
        (F.cross_entropy(rotor(real), REAL) + F.cross_entropy(rotor(fake), FAKE)).backward()
        opt.step()
    message = str(err.value)
    assert "\n" not in message and "call 2 of this step" in message
    assert err.value.min_feasible > rotor.budget and f"mem_limit >= {err.value.min_feasible}" in message
    assert all(p.grad is None for p in rotor.parameters())
    assert all(torch.equal(v, before[k]) for k, v in rotor.state_dict().items())
    # the smallest budget named fits the step, measured
    fits = Checkpointable(copy.deepcopy(plain), err.value.min_feasible)
    fits.prepare_for(real)
    for peak, _ in measured_steps(fits, LOSSES["two losses summed"], real, fake):
        assert peak <= err.value.min_feasible


def test_a_call_more_than_steps_so_far_made_is_refused_once_then_planned_for():
    plain, (real, fake) = discriminator(), batches()
    rotor = Checkpointable(copy.deepcopy(plain), 0.6)
    for _ in range(2):  # steps of one call: each gets the whole budget
        F.cross_entropy(rotor(real), REAL).backward()
    assert rotor.last_entry.plan.budget == rotor.budget
    with pytest.raises(InfeasibleStep, match="planned together from now on: run the step again") as err:
        LOSSES["two losses summed"](rotor, real, fake).backward()
    assert "\n" not in str(err.value) and err.value.min_feasible <= rotor.budget
    del err
    for peak, _ in measured_steps(rotor, LOSSES["two losses summed"], real, fake):  # the same step again
        assert peak <= rotor.budget


def test_backwards_run_out_of_order_are_refused_when_they_do_not_fit():
    plain, (real, fake) = discriminator(), batches()
    small, small_target = fake[:16].clone(), FAKE[:16]
    rotor = Checkpointable(copy.deepcopy(plain), 0.6)
    rotor.prepare_for(real)
    rotor.prepare_for(small)  # profiled here: profiling is no part of the steps measured below

    def calls():
        return F.cross_entropy(rotor(real), REAL), F.cross_entropy(rotor(small), small_target)

    for _ in range(2):  # learn the step: a large call, then a small one, one backward of their sum
        rotor.zero_grad(set_to_none=True)
        with MemoryProbe(rotor) as probe:
            probe.track(real, small)
            sum(calls()).backward()
        assert probe.peak <= rotor.budget
    rotor.zero_grad(set_to_none=True)
    first, second = calls()
    with pytest.raises(RuntimeError, match="backpropagate the sum of the step's losses once") as err:
        first.backward()  # call 1's backward while call 2 still holds its graph: over the budget (measured: 1.03x)
    assert "\n" not in str(err.value) and "call 2 of this step (input (16, 64))" in str(err.value)
    assert all(p.grad is None for p in rotor.parameters())
    del first, second, err  # the error's traceback holds the loss, and with it the graphs
    assert rotor.calls.held() == 0


# -- a real Trainer ---------------------------------------------------------------------------------
class Critic(pl.LightningModule):
    """A GAN discriminator's step: the model called on real and on fake samples, two losses summed."""

    def __init__(self, manual: bool = False):
        super().__init__()
        self.net = discriminator()
        self.automatic_optimization = not manual
        self.losses: list[float] = []
        self.grads: list[list[torch.Tensor]] = []

    def loss(self, batch):
        real, fake = batch
        n = real.shape[0]
        return F.cross_entropy(self.net(real), REAL[:n]) + F.cross_entropy(self.net(fake), FAKE[:n])

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.losses.append(loss.item())
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        self.grads.append([p.grad.detach().clone() for p in self.parameters()])
        opt.step()
        return None

    def on_before_optimizer_step(self, optimizer):
        if self.automatic_optimization:
            self.grads.append([p.grad.detach().clone() for p in self.parameters()])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def gan_loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(
        TensorDataset(torch.randn(5 * N, 64, generator=g), torch.randn(5 * N, 64, generator=g)), batch_size=N
    )


@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
def test_a_trainer_step_calling_the_model_twice_logs_a_measured_peak_within_the_budget(tmp_path, manual):
    runs = {}
    for name, strategy in (("plain", "auto"), ("rotor", RotorStrategy(mem_limit=0.6))):
        logger = TensorBoardLogger(tmp_path / name, name="tb")
        model = Critic(manual)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            quiet_trainer(
                tmp_path / name,
                strategy,
                max_steps=5,
                logger=logger,
                log_every_n_steps=1,
                callbacks=[RotorCallback(measure_every_n_steps=1)],
            ).fit(model, gan_loader())
        runs[name] = (model, logger)
        # the over-budget warning compares with the step's budget (both calls), as the logged scalars do
        assert not [w for w in caught if "is above the budget" in str(w.message)], name
    (plain, _), (rotor, logger) = runs["plain"], runs["rotor"]
    assert len(rotor.losses) == 5 and rotor.losses == plain.losses
    for a, b in zip(rotor.grads, plain.grads, strict=True):
        assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))
    acc = EventAccumulator(str(logger.log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    limits = {e.step: e.value for e in acc.Scalars("rotor/budget_bytes")}
    measured = {e.step: e.value for e in acc.Scalars("rotor/measured_peak_bytes")}
    recomputed = [e.value for e in acc.Scalars("rotor/recomputed_stages")]
    assert len(measured) >= 3 and max(recomputed) > 0
    for step, peak in measured.items():  # each sample covers the whole step: both calls, both backwards
        assert 0 < peak <= limits[step], (step, peak, limits[step])


def test_a_trainer_budget_too_small_for_two_calls_is_one_line_before_any_optimizer_step(tmp_path):
    probe = Checkpointable(discriminator(), 1.0)
    probe.prepare_for(batches()[0])
    least = min_feasible_budget(probe.chain)  # one call fits, two do not
    model = Critic()
    before = copy.deepcopy(model.state_dict())
    trainer = quiet_trainer(tmp_path, RotorStrategy(mem_limit=least), max_steps=2)
    with pytest.raises(InfeasibleStep, match=r"call 2 of this step .* use mem_limit >= \d+$") as err:
        trainer.fit(model, gan_loader())
    assert "\n" not in str(err.value) and err.value.min_feasible > least
    assert model.losses == [] and all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


class Gan(Critic):
    """Two chains under one shared budget: a generator, and the discriminator called twice per step."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.gen = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))

    def loss(self, batch):
        real, noise = batch
        n = real.shape[0]
        on_real = F.cross_entropy(self.net(real), REAL[:n])  # first, while the generator holds nothing
        return on_real + F.cross_entropy(self.net(self.gen(noise[:, :16])), FAKE[:n])


def test_a_shared_budget_is_split_again_for_a_chain_called_twice(tmp_path):
    runs, keep = {}, {}

    class Keep(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            keep.setdefault("shares", []).append((pl_module.net.budget, pl_module.gen.budget))

    for name, strategy in (("plain", "auto"), ("rotor", RotorStrategy(mem_limit=0.7))):
        logger = TensorBoardLogger(tmp_path / name, name="tb")
        model = Gan()
        quiet_trainer(
            tmp_path / name,
            strategy,
            max_steps=4,
            logger=logger,
            log_every_n_steps=1,
            callbacks=[RotorCallback(measure_every_n_steps=1)] + ([Keep()] if name == "rotor" else []),
        ).fit(model, gan_loader())
        runs[name] = (model, logger)
    (plain, _), (rotor, logger) = runs["plain"], runs["rotor"]
    assert rotor.losses == plain.losses
    for a, b in zip(rotor.grads, plain.grads, strict=True):
        assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))
    shares = keep["shares"]
    assert shares[-1][0] > shares[0][0] and shares[-1][1] < shares[0][1]  # the discriminator's share grew
    assert sum(shares[-1]) <= sum(shares[0])  # within the same total
    acc = EventAccumulator(str(logger.log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    limits = {e.step: e.value for e in acc.Scalars("rotor/budget_bytes")}
    measured = {e.step: e.value for e in acc.Scalars("rotor/measured_peak_bytes")}
    assert len(measured) >= 2
    for step, peak in measured.items():
        assert 0 < peak <= limits[step], (step, peak, limits[step])


def test_an_automatic_budget_on_cpu_recomputes_nothing_however_many_calls():
    plain, (real, fake) = discriminator(), batches()
    rotor = Checkpointable(copy.deepcopy(plain), None)
    got = measured_steps(rotor, LOSSES["two losses summed"], real, fake)
    expected = measured_steps(plain, LOSSES["two losses summed"], real, fake)
    for (peak, grads), (_, plain_grads) in zip(got, expected, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads, strict=True))
        assert rotor.budget < peak <= rotor.step_limit  # two calls: more than one call's peak, as predicted
    assert rotor.last_entry.plan.recomputed_stages == 0
