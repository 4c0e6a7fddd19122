"""The proof over every model of `lightning_rotor.models`, at tiny sizes.

For budgets from the smallest feasible one through 25%, 50% and 75% of the
no-recomputation peak to unlimited: after 3 optimizer steps, loss, every
parameter gradient and every buffer equal plain training bitwise, and a
steady-state step measured with exact tensor accounting stays within the
budget and within 10% of the plan's predicted peak.
"""

import copy

import pytest
import torch
from training import assert_same_state, check_measured_peak, train

from lightning_rotor.checkpointable import Checkpointable
from lightning_rotor.models import MODELS
from lightning_rotor.planner import InfeasibleBudget, min_feasible_budget
from lightning_rotor.simulate import no_recompute_peak

BATCH = 8
BUDGETS = ("min", "25%", "50%", "75%", "unlimited")


def build(name):
    spec = MODELS[name]
    torch.manual_seed(0)
    model = spec.build(**spec.model_kwargs(spec.tiny))
    x, y = spec.sample(BATCH, seed=1, **spec.tiny)
    return model, x, y, spec.loss


_chains = {}


def chain_of(name):
    if name not in _chains:
        model, x, _, _ = build(name)
        ckpt = Checkpointable(model, None, repeats=1, warmup=0)
        ckpt.prepare_for(x)
        _chains[name] = ckpt.chain
    return _chains[name]


def budget_for(name, label):
    chain = chain_of(name)
    if label == "min":
        return min_feasible_budget(chain)
    if label == "unlimited":
        return 10 * no_recompute_peak(chain)
    return label


@pytest.mark.parametrize("label", BUDGETS)
@pytest.mark.parametrize("name", list(MODELS))
def test_model_trains_like_plain_within_budget(name, label):
    plain, x, y, loss_fn = build(name)
    ckpt = Checkpointable(copy.deepcopy(plain), budget_for(name, label), repeats=1, warmup=0)
    try:
        ckpt.prepare_for(x)
    except InfeasibleBudget as err:
        assert label != "min", "planning at the smallest feasible budget must succeed"
        least = min_feasible_budget(chain_of(name))
        assert err.min_feasible == least and str(least) in str(err)
        pytest.skip(f"{label} of the no-recomputation peak is below the smallest feasible budget {least}")
    assert torch.equal(train(plain, x, y, loss_fn, lr=0.05), train(ckpt, x, y, loss_fn, lr=0.05))
    assert_same_state(plain, ckpt)
    ckpt.zero_grad()
    with ckpt.measure_step() as m:
        loss = loss_fn(ckpt(x), y)
        loss.backward()
    check_measured_peak(ckpt, m.peak)
