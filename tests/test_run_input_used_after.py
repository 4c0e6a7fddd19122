"""A module-level run whose input is used again after the run (issue 25).

`h = embed(x); y = blocks(h); return head(y + h)`, the first block using `h` twice itself (T5's
`x + dropout(FF(ln(x)))`): plain autograd adds the three parts of `h`'s gradient in the order their
backwards run, `(g + p1) + p2`, `g` from the add after the run first. The chain hands back stage 0's
parts one per edge of its autograd node (NOTE: [a run's input gradient in parts] in
lightning_rotor/engine.py), so the sum is the same; it was `g + (p1 + p2)`, about 1e-8 off.
Checked at a recomputing budget and an unlimited one, through `Checkpointable` and a real
Trainer: parameters after several steps bitwise equal to plain training, the measured peak
within the budget. The gradient the code after the run sends to `h` waits for the chain's δ_0
through every `B k`, and is charged so (NOTE: [the outside gradient of the run's input] in
lightning_rotor/pipeline.py).
"""

import copy

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from fitting import KeepRotorModules, quiet_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from training import assert_same_state, check_measured_peak, measured_step, train

from lightning_rotor.checkpointable import Checkpointable
from lightning_rotor.lightning import RotorStrategy

WIDTH = 32


class Block(nn.Module):
    """A residual MLP block: its input used twice (the residual and the branch), dropout on the branch."""

    def __init__(self, dropout: float):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return x + self.drop(self.down(torch.tanh(self.up(self.norm(x)))))


class Net(nn.Module):
    """The run's input `h` used inside the first block twice and after the run once (a residual around it)."""

    def __init__(self, dropout: float = 0.0, blocks: int = 4):
        super().__init__()
        self.embed = nn.Linear(8, WIDTH)
        self.blocks = nn.ModuleList(Block(dropout) for _ in range(blocks))
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, x):
        h = self.embed(x)
        y = h
        for block in self.blocks:
            y = block(y)
        return self.head(y + h)


def data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(64, 8, generator=g), torch.randint(4, (64,), generator=g)


def loss_fn(out, y):
    return F.cross_entropy(out, y)


BUDGETS = {"recompute": "60%", "unlimited": 10**12}


@pytest.mark.parametrize("discover", ["modules", "graph"])
@pytest.mark.parametrize("dropout", [0.0, 0.2])
@pytest.mark.parametrize("label", list(BUDGETS))
def test_a_run_whose_input_is_used_after_it_trains_like_plain(discover, dropout, label):
    torch.manual_seed(0)
    plain = Net(dropout)
    x, y = data()
    rotor = Checkpointable(copy.deepcopy(plain), BUDGETS[label], repeats=1, warmup=0, discover=discover)
    losses = train(rotor, x, y, loss_fn, steps=4)
    assert torch.equal(train(plain, x, y, loss_fn, steps=4), losses)
    assert_same_state(plain, rotor)
    recomputed = sum(r > 1 for r in rotor.last_entry.runs)
    assert recomputed > 0 if label == "recompute" else recomputed == 0, rotor.last_entry.runs
    if discover == "modules":  # the run's input h, used twice by its first stage, goes back in two parts
        assert rotor.discovery.kind == "modules"
        assert rotor.last_entry.runner.input_uses == [2]
    m = measured_step(rotor, x, y, loss_fn)
    if discover == "modules":
        check_measured_peak(rotor, m.peak)
    else:  # graph discovery predicts this step 15% high at 60% (h carried as a skip): within the budget only
        assert m.peak <= rotor.plan.budget


class Gated(Block):
    """Its input used three times: the residual, the branch and a gate."""

    def forward(self, x):
        return x + self.drop(self.down(torch.tanh(self.up(self.norm(x))))) * x


def test_a_run_input_used_three_times_in_the_first_stage():
    torch.manual_seed(0)
    plain = Net(0.1, blocks=3)
    plain.blocks[0] = Gated(0.1)
    x, y = data()
    rotor = Checkpointable(copy.deepcopy(plain), "60%", repeats=1, warmup=0, discover="modules")
    losses = train(rotor, x, y, loss_fn, steps=4)
    assert torch.equal(train(plain, x, y, loss_fn, steps=4), losses)
    assert_same_state(plain, rotor)
    assert rotor.last_entry.runner.input_uses == [3]
    assert sum(r > 1 for r in rotor.last_entry.runs) > 0
    m = measured_step(rotor, x, y, loss_fn)
    check_measured_peak(rotor, m.peak)


class Scaled(Net):
    """The run's input used after the run twice, its gradient from there a tensor of its own (not δ_L)."""

    def forward(self, x):
        h = self.embed(x)
        y = h
        for block in self.blocks:
            y = block(y)
        return self.head(y * h + h)


@pytest.mark.parametrize("budget", ["60%", "80%"])
def test_the_gradient_sent_to_the_run_input_after_the_run_is_charged(budget):
    # it waits for the chain's δ_0 through every B k: 4.5 KiB over the budget at 60%, 6 KiB at 80% until it was
    # charged (NOTE: [the outside gradient of the run's input] in lightning_rotor/pipeline.py)
    torch.manual_seed(0)
    plain = Scaled(0.1, blocks=3)
    x, y = data()
    rotor = Checkpointable(copy.deepcopy(plain), budget, repeats=1, warmup=0, discover="modules")
    losses = train(rotor, x, y, loss_fn, steps=2)
    assert torch.equal(train(plain, x, y, loss_fn, steps=2), losses)
    assert_same_state(plain, rotor)
    assert sum(r > 1 for r in rotor.last_entry.runs) > 0
    m = measured_step(rotor, x, y, loss_fn)
    check_measured_peak(rotor, m.peak)


class Task(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = Net(dropout=0.1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return loss_fn(self.model(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def fit(tmp_path, task, strategy="auto", callbacks=()):
    x, y = data()
    trainer = quiet_trainer(tmp_path, strategy, callbacks=list(callbacks), max_steps=4)
    torch.manual_seed(7)
    trainer.fit(task, DataLoader(TensorDataset(x, y), batch_size=32))


@pytest.mark.parametrize("budget", ["60%", None])  # None: the automatic budget (nothing recomputed here)
def test_a_run_whose_input_is_used_after_it_through_a_trainer(tmp_path, budget):
    plain, rotor, keep = Task(), Task(), KeepRotorModules()
    fit(tmp_path / "plain", plain)
    fit(tmp_path / "rotor", rotor, RotorStrategy(mem_limit=budget, discover="modules"), callbacks=[keep])
    (wrapped,) = keep.modules.values()
    assert wrapped.last_entry.runner.input_uses == [2]
    recomputed = sum(r > 1 for r in wrapped.last_entry.runs)
    assert recomputed > 0 if budget else recomputed == 0
    for (key, a), b in zip(rotor.state_dict().items(), plain.state_dict().values(), strict=True):
        assert torch.equal(a, b), key


def test_t5_feed_forward_run_with_its_residual_trains_like_plain():
    # T5's sublayers are `x + dropout(FF(layer_norm(x)))`; discovery finds a run of the first FF sublayer
    # (layer_norm, DenseReluDense, dropout): its input is used after the run by the residual, and twice
    # inside T5LayerNorm (the variance and the scaling). `use_cache=False` as rotor runs it in training.
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        d_model=32, d_ff=64, d_kv=16, num_layers=2, num_heads=2, vocab_size=64, dropout_rate=0.1,
        decoder_start_token_id=0, pad_token_id=0, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    plain = T5ForConditionalGeneration(config)
    g = torch.Generator().manual_seed(0)
    ids, labels = torch.randint(1, 64, (4, 12), generator=g), torch.randint(1, 64, (4, 8), generator=g)
    rotor = Checkpointable(copy.deepcopy(plain), "95%", repeats=1, warmup=0)  # 60% is below the smallest feasible

    def steps(model, n=3):  # the labels go into the forward: T5 computes its loss there
        torch.manual_seed(2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        losses = []
        for _ in range(n):
            opt.zero_grad()
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return torch.stack(losses)

    assert torch.equal(steps(plain), steps(rotor))
    # the tied embedding is named `encoder.embed_tokens.weight` in the wrapper (`shared.weight` plainly): in order
    for a, b in zip(plain.parameters(), rotor.parameters(), strict=True):
        assert torch.equal(a, b) and torch.equal(a.grad, b.grad)
    assert rotor.discovery.kind == "modules"
    if rotor.stage_names[0] == "encoder.block.0.layer.1.layer_norm":  # the run discovery finds today
        assert rotor.last_entry.runner.input_uses == [2]
        assert sum(r > 1 for r in rotor.last_entry.runs) > 0
    rotor.zero_grad()
    with rotor.measure_step() as m:
        rotor(input_ids=ids, labels=labels).loss.backward()
    assert m.peak <= rotor.plan.budget
