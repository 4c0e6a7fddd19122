"""The step pipeline's functions on a small chain of stages, without a Checkpointable."""

import pytest
import torch
from torch import nn

from lightning_rotor import pipeline
from lightning_rotor.chain import Chain
from lightning_rotor.planner import InfeasibleBudget, min_feasible_budget
from lightning_rotor.simulate import no_recompute_peak

torch.set_num_threads(1)


def stages_and_sample(length=6, width=32, batch=16):
    torch.manual_seed(0)
    stages = [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(length)]
    return stages, torch.randn(batch, width, requires_grad=True)


def test_profile_gives_a_chain_of_the_stages():
    stages, x = stages_and_sample()
    measured = pipeline.profile(stages, x, names=[f"s{k}" for k in range(6)], repeats=1)
    chain = measured.chain
    assert chain.length == 6 and list(chain.names) == [f"s{k}" for k in range(6)]
    assert chain.input_size == x.numel() * 4
    assert chain.out_size == [16 * 32 * 4] * 6  # each stage's output: batch x width floats


def test_loss_tmp_bytes_are_charged_as_given():
    stages, x = stages_and_sample(length=3)
    chain = pipeline.profile(stages, x, repeats=1, loss_tmp=12345).chain
    assert chain.loss_tmp == chain.loss_tmp_kept == 12345


def test_charge_outside_adds_the_rest_of_the_forward():
    stages, x = stages_and_sample(length=3)
    chain = pipeline.profile(stages, x, repeats=1, loss_tmp=100).chain
    charged = pipeline.charge_outside(chain, (1000, chain.out_size[-1] + 5000))
    assert charged.input_size == chain.input_size + 1000
    assert charged.loss_tmp == charged.loss_tmp_kept == 5000
    # B 0's peak is unchanged: δ_0 is a_0's size, not the input's with what the forward keeps beside it
    assert charged.input_size + charged.bwd_tmp[0] == chain.input_size + chain.bwd_tmp[0]
    # the tail is the loss (no stand-in on the run's output beside it); bytes the caller gave are a floor
    assert pipeline.charge_outside(chain, (0, chain.out_size[-1])).loss_tmp == 0
    assert pipeline.charge_outside(chain, (0, 0), loss_tmp=100).loss_tmp == 100


def test_plan_chain_within_the_budget_and_refuses_below_the_minimum():
    stages, x = stages_and_sample()
    chain = pipeline.profile(stages, x, repeats=1).chain
    smallest = min_feasible_budget(chain)
    chosen = pipeline.plan_chain(chain, smallest)
    assert chosen.peak <= smallest and chosen.recomputed_stages > 0
    with pytest.raises(InfeasibleBudget, match="smallest feasible budget"):
        pipeline.plan_chain(chain, smallest - 1)


def test_prepare_takes_a_budget_of_the_chain_and_its_runner_trains_bitwise_as_plain():
    stages, x = stages_and_sample()
    seen: list[Chain] = []

    def half_of_peak(chain: Chain) -> int:
        seen.append(chain)
        return max(min_feasible_budget(chain), no_recompute_peak(chain) // 2)

    entry = pipeline.prepare(stages, x, half_of_peak, repeats=1)
    assert seen == [entry.chain] and entry.plan.budget == half_of_peak(entry.chain)
    assert max(entry.runs) > 1  # half the peak recomputes something

    out = entry.runner(x)
    out.square().mean().backward()
    ours = [p.grad.clone() for s in stages for p in s.parameters()] + [x.grad.clone()]
    for s in stages:
        s.zero_grad(set_to_none=True)
    x.grad = None
    pipeline.run_stages(stages, x).square().mean().backward()
    plain = [p.grad for s in stages for p in s.parameters()] + [x.grad]
    assert all(torch.equal(a, b) for a, b in zip(ours, plain, strict=True))


def test_plan_cache_keys_by_signature_and_saves_plans_with_fingerprints():
    import json

    from lightning_rotor.cache import PlanCache, plan_key, signature

    stages, x = stages_and_sample(length=4)
    names = [f"s{k}" for k in range(4)]
    cache = PlanCache(stages, names)
    entry = pipeline.prepare(stages, x, no_recompute_peak, names=names, repeats=1)
    key = plan_key(x, [True] * 8)
    assert key == signature(x) and plan_key(x, [False] + [True] * 7).endswith("requires_grad=01111111")
    assert plan_key(x[:8], [True] * 8) != key  # another batch size: another plan
    cache.add(key, entry)
    smaller = cache.plan_at(key, min_feasible_budget(entry.chain))
    assert smaller.peak <= min_feasible_budget(entry.chain) < entry.plan.budget

    state = json.loads(json.dumps(cache.state_dict()))  # plain data
    again = PlanCache(stages, names)
    again.load_state_dict(state)
    assert key in again and again.entry(key).plan.ops == entry.plan.ops and again.entry(key).chain == entry.chain

    other, _ = stages_and_sample(length=4, width=16)
    with pytest.raises(ValueError, match="saved plan is for other stages: s0, s1, s2, s3 differ"):
        PlanCache(other, names).load_state_dict(state)
