"""A module-level chain whose tail uses a parameter the chain or the code before it also uses (tied weights):
autograd holds the tail's part of its gradient until the chain's backward returns, and the budget must
charge it (docs/memory-model.md, "A gradient waiting in the engine").

Plans are forced (uniform times, fixed budgets, or ops written out) so that each case runs the same
schedule whatever the measured times; every step is measured op by op against the simulator.
"""

from __future__ import annotations

import copy
import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from fitting import quiet_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from training import uniform_times

from lightning_rotor import Checkpointable
from lightning_rotor.lightning import RotorCallback, RotorStrategy
from lightning_rotor.ops import forward_counts, parse_ops
from lightning_rotor.planner import Plan, min_feasible_budget, plan
from lightning_rotor.simulate import no_recompute_peak, simulate

transformers = pytest.importorskip("transformers")


def gpt2(n_embd: int, n_positions: int, vocab_size: int) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=6, n_embd=n_embd, n_positions=n_positions, n_head=4, vocab_size=vocab_size, use_cache=False
    )
    return transformers.GPT2LMHeadModel(config)


def loss_of(rotor: Checkpointable, *inputs: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
    """The loss alone, as a training step holds it into the backward (not the logits beside it)."""
    out = rotor(*inputs, **kwargs)
    return out if isinstance(out, torch.Tensor) else out.loss


def first_step(rotor: Checkpointable, *inputs: torch.Tensor, **kwargs: torch.Tensor) -> None:
    """Discover, measure outside the run and profile (the first training call)."""
    loss_of(rotor, *inputs, **kwargs).backward()


def run_plan(rotor: Checkpointable, ops: list, *inputs: torch.Tensor, **kwargs: torch.Tensor):
    """One measured step of `ops` on the profiled chain (times made uniform); the measurement and the simulation."""
    chain = uniform_times(rotor.last_entry.chain)
    sim = simulate(chain, ops)
    state = rotor.plan_state()
    state["entries"][0]["chain"] = chain.to_dict()
    ops = parse_ops(ops)
    state["entries"][0]["plan"] = Plan(budget=sim.peak, time=sim.time, peak=sim.peak, ops=ops).to_dict()
    rotor.load_plan_state(state)
    rotor.zero_grad(set_to_none=True)
    with rotor.measure_step() as measured:
        loss_of(rotor, *inputs, **kwargs).backward()
    assert measured.entry is not None and measured.entry.plan.ops == ops  # the step ran the plan given
    return measured, sim


def check_op_by_op(measured, sim, exact_until_loss: bool = True) -> None:
    """Never above the simulator, after any op nor during it; equal to it before the loss."""
    labels = [label for label, _ in measured.curve]
    after = [nbytes for _, nbytes in measured.curve]
    assert len(after) == len(sim.curve)
    for label, got, predicted in zip(labels, after, sim.curve, strict=True):
        assert got <= predicted, (label, got, predicted)
    for label, got, predicted in zip(labels, measured.op_peaks, sim.op_peaks, strict=True):
        assert got <= predicted, (label, got, predicted)
    assert measured.peak <= sim.peak  # the plan's budget is its peak: the tightest one it meets
    if exact_until_loss:
        loss = labels.index("Loss")
        assert after[:loss] == sim.curve[:loss]
        assert measured.op_peaks[:loss] == sim.op_peaks[:loss]


@pytest.fixture(scope="module")
def small_gpt2():
    """A GPT-2 whose tied token embedding (vocab 512 x 32) outweighs the forward's locals before the run."""
    model = gpt2(n_embd=32, n_positions=32, vocab_size=512)
    rotor = Checkpointable(model, None, discover="modules", repeats=1)
    x = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(1))
    first_step(rotor, x, labels=x)
    return rotor, x


@pytest.mark.parametrize("fraction", [1.0, 0.8, 0.6, 0.45, 0.35])
def test_gpt2_measured_within_the_prediction_at_each_budget(small_gpt2, fraction):
    rotor, x = small_gpt2
    chain = uniform_times(rotor.last_entry.chain)
    chosen = plan(chain, int(fraction * no_recompute_peak(chain)))
    measured, sim = run_plan(rotor, chosen.ops, x, labels=x)
    check_op_by_op(measured, sim)
    assert measured.peak <= chosen.budget


def test_gpt2_tied_gradient_is_charged_from_the_loss_to_the_end(small_gpt2):
    """The plan of the report ([2, 2, 1, 2, 1, 2] forward runs): after the loss, the step holds the LM head's part of
    the tied weight's gradient (vocab x n_embd floats) until the embedding's backward, after B 0."""
    rotor, x = small_gpt2
    ops = [("Fc", 0), ("Fc", 1), ("Fe", 2), ("Fc", 3), ("Fe", 4), ("Fc", 5), ("Loss",), ("Fe", 5), ("B", 5)]
    ops += [("B", 4), ("Fe", 3), ("B", 3), ("B", 2), ("Fe", 1), ("B", 1), ("Fe", 0), ("B", 0)]
    assert forward_counts(parse_ops(ops), 6) == [2, 2, 1, 2, 1, 2]
    measured, sim = run_plan(rotor, ops, x, labels=x)
    check_op_by_op(measured, sim)
    tied = 512 * 32 * 4
    assert rotor.last_entry.chain.loss_value >= tied


@pytest.mark.slow
def test_gpt2_of_the_report_within_its_budget():
    """The report's GPT-2 (n_embd 128, T 128, batch 4, vocab 1024) measured 36,725,768 B against a 36,596,228 B
    budget with this plan; every op now within the simulator's figures."""
    model = gpt2(n_embd=128, n_positions=128, vocab_size=1024)
    rotor = Checkpointable(model, "50%", discover="modules", repeats=1)
    x = torch.randint(0, 1024, (4, 128), generator=torch.Generator().manual_seed(1))
    first_step(rotor, x, labels=x)
    ops = [("Fc", 0), ("Fc", 1), ("Fe", 2), ("Fc", 3), ("Fe", 4), ("Fc", 5), ("Loss",), ("Fe", 5), ("B", 5)]
    ops += [("B", 4), ("Fe", 3), ("B", 3), ("B", 2), ("Fe", 1), ("B", 1), ("Fe", 0), ("B", 0)]
    measured, sim = run_plan(rotor, ops, x, labels=x)
    check_op_by_op(measured, sim)


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.a, self.b = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.b(torch.tanh(self.a(h)))


class TiedBehindWideHead(nn.Module):
    """The embedding is the chain's first stage and the output projection: the tail (a wide transform, then the
    tied projection) peaks after it has made the embedding's gradient."""

    def __init__(self, vocab: int = 512, width: int = 32, wide: int = 1024, blocks: int = 4):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.up, self.down = nn.Linear(width, wide), nn.Linear(wide, width)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        logits = self.down(torch.tanh(self.up(h))) @ self.emb.weight.t()
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())


@pytest.mark.parametrize("smallest", [False, True])
def test_weight_tied_between_a_stage_and_the_tail_waits_for_the_chain(smallest):
    """A stage's parameter used after the run waits too (the executor's Function takes the stages' parameters as
    inputs), and it waits from the moment the tail's backward makes it, through the rest of that backward."""
    torch.manual_seed(0)
    rotor = Checkpointable(TiedBehindWideHead(), None, discover="modules", repeats=1)
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 512, (2, 4), generator=generator), torch.randint(0, 512, (2, 4), generator=generator)
    first_step(rotor, x, y)
    assert rotor.last_entry.chain.names[0] == "emb"  # the tied weight is a stage's
    chain = uniform_times(rotor.last_entry.chain)
    chosen = plan(chain, min_feasible_budget(chain) if smallest else no_recompute_peak(chain))
    assert forward_counts(chosen.ops, chain.length) != [1] * chain.length or not smallest  # recomputes
    measured, sim = run_plan(rotor, chosen.ops, x, y)
    check_op_by_op(measured, sim)


class TiedTask(pl.LightningModule):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def training_step(self, batch, _):
        x, y = batch
        return self.model(x, y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_stage_tied_head_trains_in_a_trainer_within_the_smallest_budget_as_plain(tmp_path):
    """Through a real Trainer with `RotorStrategy` at the smallest budget, every step measured: no step above the
    budget, parameters bitwise those of plain training."""
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 512, (8, 4), generator=generator), torch.randint(0, 512, (8, 4), generator=generator)
    torch.manual_seed(0)
    model = TiedBehindWideHead()
    probe = Checkpointable(copy.deepcopy(model), None, discover="modules", repeats=1)
    first_step(probe, x[:2], y[:2])
    smallest = min_feasible_budget(probe.last_entry.chain)
    runs = {}
    for name, strategy in (
        ("plain", "auto"),
        ("rotor", RotorStrategy(smallest, include=["model"], discover="modules")),
    ):
        task = TiedTask(copy.deepcopy(model))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer = quiet_trainer(tmp_path / name, strategy, callbacks=[RotorCallback(measure_every_n_steps=1)])
            trainer.fit(task, DataLoader(TensorDataset(x, y), batch_size=2))
        assert not [str(w.message) for w in caught if "above the budget" in str(w.message)]
        runs[name] = task
    for (n, a), b in zip(runs["plain"].named_parameters(), runs["rotor"].parameters(), strict=True):
        assert torch.equal(a, b), n
