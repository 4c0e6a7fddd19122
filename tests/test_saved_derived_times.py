"""Saved plans say which shapes had their times derived (by FLOPs from a timed shape's) rather than measured, so
that a resumed run still checks those times against its training steps (lightning_rotor/shapes.py, `ShapeTimes`).
A state saved before the flag existed loads as timed; a malformed flag is refused in one line."""

from __future__ import annotations

import json

import lightning.pytorch as pl
import pytest
import torch
from fitting import KeepRotorModules, SaveAtEnd, quiet_trainer
from torch.utils.data import DataLoader, Dataset

from lightning_rotor.checkpointable import Checkpointable
from lightning_rotor.lightning import RotorStrategy
from lightning_rotor.models.gpt import gpt, lm_loss


def small_gpt():
    torch.manual_seed(0)
    return gpt(vocab_size=64, block_size=32, n_layer=4, n_head=2, n_embd=32, dropout=0.1)


def batch(rows: int, length: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (rows, length), generator=g), torch.randint(0, 64, (rows, length), generator=g)


def trained_on_two_shapes() -> Checkpointable:
    """The first shape timed, the second (a last partial batch) with its times derived from the first's."""
    rotor = Checkpointable(small_gpt(), "60%", repeats=1)
    for rows in (4, 1):
        x, y = batch(rows, 16)
        lm_loss(rotor(x), y).backward()
    return rotor


def saved(rotor: Checkpointable) -> dict:
    return json.loads(json.dumps(rotor.plan_state()))  # plain data, as in a checkpoint


def test_which_shapes_had_derived_times_is_saved_and_loaded():
    rotor = trained_on_two_shapes()
    state = saved(rotor)
    assert [e.get("times_derived") for e in state["entries"]] == [False, True]
    full, partial = rotor.entries  # in the order met
    assert rotor.chain_state.plans.times_derived == {partial}
    fresh = Checkpointable(small_gpt(), "60%", repeats=1)
    fresh.load_plan_state(state)
    assert fresh.chain_state.plans.times_derived == {partial}
    assert saved(fresh) == state


def test_a_state_saved_before_the_flag_loads_as_timed():
    state = saved(trained_on_two_shapes())
    for entry in state["entries"]:
        del entry["times_derived"]
    fresh = Checkpointable(small_gpt(), "60%", repeats=1)
    fresh.load_plan_state(state)
    assert len(fresh.entries) == 2 and not fresh.chain_state.plans.times_derived


def test_a_malformed_flag_is_refused_in_one_line_and_nothing_is_loaded():
    state = saved(trained_on_two_shapes())
    state["entries"][1]["times_derived"] = "yes"
    fresh = Checkpointable(small_gpt(), "60%", repeats=1)
    with pytest.raises(ValueError, match=r"^saved plan state: entries\[1\]\.times_derived is 'yes', not true or false"):
        fresh.load_plan_state(state)
    assert not fresh.entries


class LastPartial(Dataset):
    def __len__(self):
        return 3

    def __getitem__(self, i):
        return batch(4 if i < 2 else 1, 16, seed=i)


class LM(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = small_gpt()

    def training_step(self, b, batch_idx):
        x, y = b
        return lm_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_resumed_trainer_knows_the_partial_batch_s_times_were_derived(tmp_path):
    """Fit an epoch, checkpoint, resume for another: the resumed chain has the partial batch's derived flag."""
    loader = DataLoader(LastPartial(), batch_size=None)
    first, resumed = KeepRotorModules(), KeepRotorModules()
    path = tmp_path / "end.ckpt"
    strategy = RotorStrategy(mem_limit="60%", repeats=1)
    quiet_trainer(tmp_path / "a", strategy, max_steps=3, callbacks=[first, SaveAtEnd(path)]).fit(LM(), loader)
    derived = first.modules["net"].chain_state.plans.times_derived
    assert len(derived) == 1
    strategy = RotorStrategy(mem_limit="60%", repeats=1)
    trainer = quiet_trainer(tmp_path / "b", strategy, max_steps=4, callbacks=[resumed])
    trainer.fit(LM(), loader, ckpt_path=path)
    assert resumed.modules["net"].chain_state.plans.times_derived == derived


def test_a_loaded_state_s_derived_shapes_are_checked_on_training_steps_again():
    """The flag reaches `ShapeTimes`, which re-times a derived shape its steps prove wrong: loaded, the partial batch
    is among the shapes it checks, as it was before the save; a timed one is not."""
    state = saved(trained_on_two_shapes())
    fresh = Checkpointable(small_gpt(), "60%", repeats=1)
    fresh.load_plan_state(state)
    full, partial = fresh.entries
    with pytest.warns(UserWarning, match=r"took 10\.0x the time its plan predicts"):
        for rows, pace in ((4, 1.0), (4, 1.0), (1, 10.0), (1, 10.0), (4, 10.0), (4, 10.0)):  # timed by the callback
            x, y = batch(rows, 16)
            lm_loss(fresh(x), y).backward()
            fresh.chain_state.step_timed(pace * fresh.last_entry.plan.time)
    assert fresh.chain_state.retimed == {partial: pytest.approx(10.0)}  # the full batch's times are its own
    assert partial not in fresh.entries and not fresh.chain_state.plans.times_derived
