"""Changing shapes on CUDA (NOTE: [sizes on CUDA], lightning_rotor/allocator.py): a traced shape is profiled by tensor
accounting alone, whose law derives other shapes, and once more with the caching allocator's figures, which it is
planned on; a derived shape is charged the nearest measured shape's excess. On CPU the path runs with the allocator
read as on CUDA (it reads nothing there: every excess 0), so every chain is the one it is without it; on a GPU the
derived shapes train bitwise, within their budgets, never charged less than tensor accounting measures."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_shapes import batch, small_gpt
from test_symbolic_sizes import sizes
from test_twin_stages import gpt_stages

import lightning_rotor.chain_state as chain_state
from lightning_rotor.allocator import AllocatorExcess
from lightning_rotor.checkpointable import Checkpointable
from lightning_rotor.memory import MemoryProbe
from lightning_rotor.models.gpt import lm_loss
from lightning_rotor.profile import profile_chain

LENGTHS = (12, 20, 6, 16, 9, 24, 14, 20)  # three measured along the length, then derived ones


def tensors_chain(length):
    return profile_chain(gpt_stages(), batch(length)[0], repeats=1, timed=False).chain


def test_the_excess_is_what_the_allocator_s_profile_holds_above_and_a_larger_shape_is_charged_it_scaled():
    tensors = tensors_chain(12)
    raised = [v + 1000 for v in tensors.fwd_tmp]
    lowered = [v - 1 for v in tensors.bwd_tmp]  # a figure the allocator's profile has lower counts 0
    allocator = dataclasses.replace(tensors, fwd_tmp=raised, bwd_tmp=lowered)
    excess = AllocatorExcess.between(allocator, tensors)
    assert excess.excess["fwd_tmp"] == [1000] * tensors.length and excess.excess["bwd_tmp"] == [0] * tensors.length
    same = excess.charged(tensors)
    assert same.fwd_tmp == raised and same.bwd_tmp == tensors.bwd_tmp and same.saved_size == tensors.saved_size
    larger = tensors_chain(24)
    charged = excess.charged(larger)
    for k, (there, here) in enumerate(zip(larger.fwd_tmp, tensors.fwd_tmp, strict=True)):
        expected = 1000 * there / here if here and there > here else 1000
        assert charged.fwd_tmp[k] - there == pytest.approx(expected, abs=1)
    assert excess.distance(larger) > excess.distance(tensors) == 0


def train(model, lengths, check=True):
    """Plain training and `model` on `lengths`, on `model`'s device: gradients compared at every step, each step's
    peak measured (`check`) by tensor accounting and by `measure_step`."""
    device = next(model.parameters()).device
    plain = small_gpt().to(device)
    for step, length in enumerate(lengths):
        x, y = (t.to(device) for t in batch(length))
        for m in (plain, model):
            m.zero_grad(set_to_none=True)
            torch.manual_seed(step)
            lm_loss(m(x), y).backward()
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(), model.parameters(), strict=True))
        if check:  # the promise by tensor accounting; on CUDA `measure_step` reads the allocator, a target
            with MemoryProbe(model) as probe:
                probe.track(x)
                lm_loss(model(x), y).backward()
            assert probe.peak <= model.plan.budget
            model.zero_grad(set_to_none=False)  # gradients stay allocated: on CUDA the allocator sees activations only
            with model.measure_step() as measured:
                lm_loss(model(x), y).backward()
            assert measured.peak <= model.plan.budget  # on CUDA the allocator's peak (a derived excess may overcharge)


def test_on_cpu_read_as_on_cuda_every_chain_is_the_one_it_is_without(monkeypatch):
    """The CUDA path's plumbing on CPU: each traced shape profiled a second time outside its trace, derived shapes
    charged an excess of 0; the shapes derived, every chain, bitwise training and every budget as without it."""
    plain_path = Checkpointable(small_gpt(), "60%", repeats=1)
    train(plain_path, LENGTHS, check=False)
    monkeypatch.setattr(chain_state, "reads_allocator", lambda value: True)
    cuda_path = Checkpointable(small_gpt(), "60%", repeats=1)
    train(cuda_path, LENGTHS)
    assert cuda_path.fitted and cuda_path.fitted.keys() == plain_path.fitted.keys()
    measured = len(cuda_path.entries) - len(cuda_path.fitted)
    assert sum(map(len, cuda_path.chain_state._excesses.values())) == measured  # each measured shape, once more
    for key, entry in plain_path.entries.items():
        assert sizes(cuda_path.entries[key].profile.chain) == sizes(entry.profile.chain), key


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_cuda_derived_shapes_train_bitwise_within_budget_charged_at_least_tensor_accounting():
    model = Checkpointable(small_gpt().cuda(), "60%", repeats=1)
    train(model, LENGTHS)
    assert model.fitted, "no shape derived on CUDA"
    stages = list(model.stages)
    for key in model.fitted:
        chain = model.entries[key].profile.chain
        x = batch(chain.input_size // 16)[0].cuda()  # a batch of 2 int64 token rows: 16 bytes a position
        measured = profile_chain(stages, x, repeats=1, timed=False, allocator=False).chain
        for field in ("out_size", "in_free", "out_free"):
            assert getattr(chain, field) == getattr(measured, field), field
        for field in ("saved_size", "fwd_tmp", "fwd_tmp_nograd", "bwd_tmp"):
            assert all(c >= m for c, m in zip(getattr(chain, field), getattr(measured, field), strict=True)), field
