"""A chain's state (lightning_rotor/chain_state.py): plans and budgets in a plain object, below the module.

The module routes calls to its chain state; the budget and the step measurement talk to the chain
state (`ShareHolder`, `StepMeasurement`'s functions), never back up to the module.
"""

import copy
import gc
import types

import torch
from torch import nn

from lightning_rotor import Checkpointable
from lightning_rotor.budget import resolve_budget
from lightning_rotor.chain_state import ChainState
from lightning_rotor.lightning.wrap import wrap
from lightning_rotor.own_checkpointing import OwnCheckpointing
from lightning_rotor.shared_budget import Budget
from lightning_rotor.simulate import no_recompute_peak
from lightning_rotor.stages import sequential_stages


def mlp(width: int = 32, depth: int = 6) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *(nn.Sequential(nn.Linear(width, 4 * width), nn.Tanh(), nn.Linear(4 * width, width)) for _ in range(depth))
    )


class TwoChains(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder, self.decoder = mlp(), mlp()

    def forward(self, x):
        return self.decoder(self.encoder(x))


SKIPPED = (torch.Tensor, type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType)


def reaches(root: object, kind: type) -> bool:
    """Whether an object of `kind` is reachable from `root` through Python references (tensors, classes,
    functions and modules left out: their namespaces are the whole program's)."""
    seen, todo = set(), [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, SKIPPED):
            continue
        seen.add(id(obj))
        if isinstance(obj, kind):
            return True
        todo.extend(gc.get_referents(obj))
    return False


def test_a_shared_budget_and_a_measured_step_reach_chain_states_never_the_modules():
    model = TwoChains()
    wrapped, _ = wrap(model, 0.6, include=["encoder", "decoder"])
    x = torch.randn(8, 32, requires_grad=True)
    encoder = wrapped[0].rotor
    with encoder.measure_step() as measurement:
        model(x).square().mean().backward()
        assert not reaches(measurement, Checkpointable)  # it reports to the chain state (`ChainState.measured`)
    budget = encoder.shared
    assert isinstance(budget, Budget) and sorted(budget.holders) == ["decoder", "encoder"]
    assert all(isinstance(holder, ChainState) for holder in budget.holders.values())
    assert not reaches(budget, Checkpointable)  # the budget tells chain states their shares (`ShareHolder`)
    assert measurement.peak > 0 and encoder.last_measurement is measurement


def test_a_chain_state_plans_without_a_module_around_it():
    seq = mlp()
    state = ChainState(seq, Budget("70%"), OwnCheckpointing())
    state.repeats = 1
    state.set_stages(sequential_stages(seq))
    x = torch.randn(8, 32, requires_grad=True)
    entry = state.entry_for(state.call_input(x))
    assert entry.plan.budget == resolve_budget("70%", no_recompute_peak(entry.chain)) == state.budget
    assert entry.plan.recomputed_stages > 0 and state.entries == {state.call_input(x).key: entry}
    rotor = Checkpointable(copy.deepcopy(seq), "70%", repeats=1)
    assert rotor.prepare_for(x).plan.budget == entry.plan.budget  # the module's chain state: the same bytes
