"""Options profiled (`Checkpointable(options=True)`): the profiler measures each stage's option "sac", the
planner may choose `Fs k:1`, and training stays plain training, bitwise, within the budget.

The budget is the smallest feasible one: where an option saves bytes no other schedule can, every plan at
that budget records some stage by its option (chosen by memory alone, whatever the timings say).
"""

import copy
import dataclasses
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import yaml
from fitting import quiet_trainer
from torch.utils.data import DataLoader, TensorDataset
from training import grads, tokens_loss, train

from lightning_rotor import Checkpointable
from lightning_rotor.lightning import RotorStrategy
from lightning_rotor.lightning.cli import main
from lightning_rotor.memory import MemoryProbe
from lightning_rotor.models.gpt import Block, gpt
from lightning_rotor.ops import OpKind
from lightning_rotor.planner import min_feasible_budget
from lightning_rotor.selective import measure_sac_memory
from lightning_rotor.simulate import no_recompute_peak

VOCAB, SEQ = 64, 32


def tiny_gpt():
    torch.manual_seed(0)
    return gpt(vocab_size=VOCAB, block_size=SEQ, n_layer=4, n_head=2, n_embd=32, dropout=0.1)


def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (4, SEQ), generator=g), torch.randint(0, VOCAB, (4 * SEQ,), generator=g)


def with_fs_at_the_floor(model, x):
    """`model` wrapped with options profiled, planned at its smallest feasible budget, which lies below the
    smallest without options: its plan records some stage by option "sac"."""
    rotor = Checkpointable(model, options=True, repeats=1)
    rotor.prepare_for(x)
    chain = rotor.chain
    floor = min_feasible_budget(chain)
    assert floor < min_feasible_budget(dataclasses.replace(chain, options=None))
    rotor.replan(floor)
    assert any(op.kind is OpKind.FS for op in rotor.plan.ops), rotor.plan.ops
    return rotor


def test_profiler_offers_sac_on_blocks_only_saving_less_than_recording_all():
    model, (x, _) = tiny_gpt(), batch()
    rotor = Checkpointable(copy.deepcopy(model), options=True, repeats=1)
    rotor.prepare_for(x)
    chain = rotor.chain
    stages = [model.embed, *model.blocks, model.ln_f, model.lm_head]
    assert [bool(o) for o in chain.options] == [isinstance(s, Block) for s in stages]
    with torch.no_grad():
        a_1 = model.embed(x)
    option = chain.options[1][0]
    # the standalone measurement does not know a_k, so it also counts views of it: the profiler's is at most it
    saved, _, _ = measure_sac_memory(model.blocks[0], a_1, chain.sizes[1])
    assert option.name == "sac" and option.saved_size <= saved and option.saved_size < chain.saved_size[1]
    assert option.fwd_time > 0 and option.bwd_time > 0
    plain_chain = Checkpointable(copy.deepcopy(model), repeats=1)
    plain_chain.prepare_for(x)
    assert not plain_chain.chain.has_options  # the default profiles no options: plans as before


def test_fs_plan_trains_bitwise_like_plain_within_the_budget():
    plain, (x, y) = tiny_gpt(), batch()
    rotor = with_fs_at_the_floor(copy.deepcopy(plain), x)
    assert torch.equal(train(plain, x, y, tokens_loss), train(rotor, x, y, tokens_loss))
    assert all(torch.equal(a, b) for a, b in zip(grads(plain), grads(rotor), strict=True))
    rotor.zero_grad()
    with rotor.measure_step(MemoryProbe(rotor)) as m:
        tokens_loss(rotor(x), y).backward()
    assert m.peak <= rotor.plan.peak <= rotor.plan.budget, (m.peak, rotor.plan.peak, rotor.plan.budget)
    assert rotor.plan.budget < no_recompute_peak(rotor.chain)


class Lm(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = tiny_gpt()
        self.grads: list[list[torch.Tensor]] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return tokens_loss(self.model(x), y.reshape(-1))

    def on_before_optimizer_step(self, optimizer):
        self.grads.append([p.grad.detach().clone() for p in self.parameters()])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Plans(pl.Callback):
    def on_train_end(self, trainer, pl_module):
        self.rotor = pl_module.model  # wrapped while training (the strategy unwraps at teardown)


def test_trainer_with_options_runs_fs_bitwise_like_plain(tmp_path):
    x, y = batch()
    data = DataLoader(TensorDataset(x, y.reshape(4, SEQ)), batch_size=4)
    probe = with_fs_at_the_floor(tiny_gpt(), x)  # the same chain's floor, in bytes, for the strategy
    floor = probe.plan.budget
    plain, rotor = Lm(), Lm()
    torch.manual_seed(3)
    quiet_trainer(tmp_path / "plain").fit(plain, data)
    plans = Plans()
    torch.manual_seed(3)
    trainer = quiet_trainer(tmp_path / "rotor", RotorStrategy(floor, options=True), callbacks=[plans])
    trainer.fit(rotor, data)
    assert isinstance(plans.rotor, Checkpointable) and plans.rotor.options
    assert any(op.kind is OpKind.FS for op in plans.rotor.plan.ops), plans.rotor.plan.ops
    assert len(plain.grads) == len(rotor.grads) == 3
    for mine, theirs in zip(plain.grads, rotor.grads, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))


def test_yaml_turns_options_on_through_lightning_cli(tmp_path, capsys):
    quickstart = Path(__file__).resolve().parent.parent / "configs" / "quickstart.yaml"
    extra = tmp_path / "options.yaml"
    extra.write_text("trainer:\n  strategy:\n    class_path: rotor\n    init_args:\n      options: true\n")
    assert main(["fit", "--config", str(quickstart), "--config", str(extra), "--print_config"]) == 0
    strategy = yaml.safe_load(capsys.readouterr().out)["trainer"]["strategy"]
    assert strategy["class_path"] == "lightning_rotor.lightning.RotorStrategy"
    assert strategy["init_args"]["options"] is True


def test_a_later_shape_derives_its_options_times_from_the_first():
    model, (x, _) = tiny_gpt(), batch()
    rotor = Checkpointable(model, options=True, repeats=1)
    first = rotor.prepare_for(x).chain
    later = rotor.prepare_for(x[:, : SEQ // 2]).chain  # sizes measured, times derived (lightning_rotor/shapes.py)
    assert [len(o) for o in later.options] == [len(o) for o in first.options]
    for k, opts in enumerate(later.options):
        for mine, theirs in zip(opts, first.options[k], strict=True):
            assert mine.saved_size < theirs.saved_size
            assert mine.fwd_time > 0 and mine.bwd_time > 0
            # the option's times scale with its stage's
            ratio = later.fwd_time[k] / first.fwd_time[k]
            assert mine.fwd_time == pytest.approx(theirs.fwd_time * ratio)
