"""A new shape's first step plans that shape, and no other (issue 29: plans per shape cached and reused, the planner
called only where a shape's chain changed): a later shape whose real loss holds more than the stand-in charged
(lightning_rotor/loss_watch.py) is planned again alone, as a fresh plan of its raised chain; a module-level chain's
derived call opens no loss window at all (its chain charges the code around the run, measured at other calls)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from test_losses import TanhMLP, data
from training import assert_same_state

from lightning_rotor import Checkpointable, planner
from lightning_rotor.simulate import no_recompute_peak


def test_a_later_shape_whose_real_loss_holds_more_is_planned_again_alone_as_a_fresh_plan():
    """MSE keeps `a_L`: each shape's first step raises its chain. The first shape's raise plans every shape again
    (the others' bytes follow its peak); a later shape's plans it alone: every other entry stands, the same object,
    and its plan is a fresh plan of its raised chain at its own bytes. Bitwise equal to plain training, within the
    budget on the shape's next step."""
    torch.manual_seed(0)
    plain = TanhMLP()
    rotor = Checkpointable(copy.deepcopy(plain), "70%", discover="graph", repeats=1)
    popt, ropt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (plain, rotor))
    entries = []
    for batch in (16, 8, 12, 8):
        x, y = data(batch=batch)
        for model, opt in ((plain, popt), (rotor, ropt)):
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
        assert_same_state(plain, rotor)
        popt.step()
        ropt.step()
        entries.append(dict(rotor.entries))
    first, second, third = entries[0], entries[1], entries[2]
    (key16,), key8 = first, next(k for k in second if k not in first)
    key12 = next(k for k in third if k not in second)
    assert second[key16] is first[key16] and third[key16] is first[key16] and third[key8] is second[key8]
    for entry in (second[key8], third[key12]):
        assert entry.chain.loss_tmp_kept > entry.chain.loss_tmp  # raised to MSE's figures
        fresh = planner.plan(entry.chain, "70%", slots=entry.plan.slots)
        assert (fresh.ops, fresh.budget, fresh.peak) == (entry.plan.ops, entry.plan.budget, entry.plan.peak)
        assert entry.plan.budget == no_recompute_peak(entry.chain) * 7 // 10
    x, y = data(batch=8)
    rotor.zero_grad()
    with rotor.measure_step() as measured:
        F.mse_loss(rotor(x), y).backward()
    assert measured.peak <= rotor.plan.budget, (measured.peak, rotor.plan.budget)


def test_a_module_level_chain_s_derived_lengths_open_no_loss_window_and_hold_their_budget():
    """GPT-2 from a config at lengths after three measured ones: each derived call's chain is the measured one's
    (no window raises it, no shape is planned again), within its budget, bitwise equal to plain training."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=128, use_cache=False)
    plain = transformers.GPT2LMHeadModel(config)
    rotor = Checkpointable(copy.deepcopy(plain), "60%", repeats=1)
    for step, n in enumerate((32, 44, 40, 52, 28, 36)):
        x = torch.randint(0, 64, (2, n), generator=torch.Generator().manual_seed(n))
        before = dict(rotor.entries)
        for model in (plain, rotor):
            model.zero_grad()
            torch.manual_seed(step)
            if model is rotor and step >= 3:
                with rotor.measure_step() as measured:
                    model(input_ids=x, labels=x).loss.backward()
                assert measured.peak <= rotor.last_entry.plan.budget
            else:
                model(input_ids=x, labels=x).loss.backward()
        assert_same_state(plain, rotor)
        assert all(rotor.entries[k] is e for k, e in before.items())  # no other shape planned again
    assert len(rotor.fitted) == 3
