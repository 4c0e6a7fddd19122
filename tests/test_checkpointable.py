"""Checkpointable: same training as the plain model, within the budget, measured on real tensors."""

import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from training import assert_same_state, check_measured_peak, train

from lightning_rotor.budget import BudgetError, resolve_budget
from lightning_rotor.checkpointable import Checkpointable, auto_budget
from lightning_rotor.discovery import DiscoveryError
from lightning_rotor.planner import InfeasibleBudget, min_feasible_budget
from lightning_rotor.simulate import no_recompute_peak


class Block(nn.Module):
    """Residual conv block with BatchNorm and an in-place ReLU, like a ResNet's."""

    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c)

    def forward(self, x):
        return F.relu(x + self.bn(self.conv(x)))


class Attention(nn.Module):
    """Causal self-attention block with dropout, GPT-style."""

    def __init__(self, d, t):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.drop = nn.Dropout(0.2)
        self.mlp = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d), nn.Dropout(0.2))
        self.register_buffer("mask", torch.tril(torch.ones(t, t, dtype=torch.bool)))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln(x)).split(d, dim=-1)
        att = (q @ k.transpose(1, 2)) / math.sqrt(d)
        att = att.masked_fill(~self.mask[:t, :t], float("-inf")).softmax(-1)
        x = x + self.drop(self.proj(att @ v))
        return x + self.mlp(x)


class Embed(nn.Module):
    def __init__(self, vocab, d, t):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(t, d) * 0.02)

    def forward(self, idx):
        return self.tok(idx) + self.pos[: idx.shape[1]]


def mlp():
    hidden = [m for _ in range(4) for m in (nn.Linear(64, 64), nn.Tanh())]
    return nn.Sequential(
        nn.Linear(32, 64),
        nn.ReLU(),
        nn.Linear(64, 64),
        nn.BatchNorm1d(64),
        nn.ReLU(inplace=True),
        nn.Dropout(0.3),
        *hidden,
        nn.Linear(64, 10),
    )


def convnet():
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(inplace=True),
        nn.Sequential(Block(8), Block(8), Block(8)),
        nn.MaxPool2d(2),
        Block(8),
        Block(8),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 10),
    )


def gpt():
    blocks = [Attention(16, 8) for _ in range(4)]
    return nn.Sequential(Embed(50, 16, 8), *blocks, nn.LayerNorm(16), nn.Linear(16, 50))


MODELS = {
    "mlp": (mlp, lambda: torch.randn(256, 32), lambda: torch.randint(0, 10, (256,))),
    "convnet": (convnet, lambda: torch.randn(8, 3, 16, 16), lambda: torch.randint(0, 10, (8,))),
    "gpt": (gpt, lambda: torch.randint(0, 50, (16, 8)), lambda: torch.randint(0, 50, (16, 8))),
}


def build(name):
    factory, make_x, make_y = MODELS[name]
    torch.manual_seed(0)
    model = factory()
    torch.manual_seed(1)
    return model, make_x(), make_y()


def loss_of(out, y):
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def chain_of(name):
    model, x, _ = build(name)
    ckpt = Checkpointable(model, None)
    ckpt.prepare_for(x)
    return ckpt.chain


def budgets(name):
    chain = chain_of(name)
    least, full = min_feasible_budget(chain), no_recompute_peak(chain)
    return [("min", least), ("25%", "25%"), ("50%", "50%"), ("75%", "75%"), ("unlimited", 10 * full)]


CASES = [(name, label, budget) for name in MODELS for label, budget in budgets(name)]


@pytest.mark.parametrize(("name", "label", "budget"), CASES, ids=[f"{n}-{b}" for n, b, _ in CASES])
def test_training_equals_plain_and_stays_within_budget(name, label, budget):
    plain, x, y = build(name)
    model = copy.deepcopy(plain)
    ckpt = Checkpointable(model, budget)
    try:
        ckpt.prepare_for(x)
    except InfeasibleBudget as err:
        assert label != "min", "planning at the smallest feasible budget must succeed"
        least = min_feasible_budget(chain_of(name))
        assert err.min_feasible == least
        assert str(least) in str(err)
        pytest.skip(f"{label} is below the smallest feasible budget {least}; InfeasibleBudget raised as it must")
    expected = train(plain, x, y, loss_of)
    got = train(ckpt, x, y, loss_of)
    assert torch.equal(expected, got)
    assert_same_state(plain, ckpt)
    # a steady-state step, measured on real tensors
    ckpt.zero_grad()
    with ckpt.measure_step() as m:
        loss = loss_of(ckpt(x), y)
        loss.backward()
    # after every op, the memory alive is what the simulator predicts, or less
    assert len(m.curve) == len(ckpt.plan.ops)
    for (label_, measured), predicted in zip(m.curve, m.predicted, strict=True):
        assert measured <= predicted, label_
    check_measured_peak(ckpt, m.peak)


def test_state_dict_keys_are_the_wrapped_modules():
    model, _, _ = build("convnet")
    keys = list(model.state_dict())
    ckpt = Checkpointable(model, "50%")
    assert list(ckpt.state_dict()) == keys
    plain, _, _ = build("convnet")
    plain.load_state_dict(ckpt.state_dict())
    ckpt.load_state_dict(plain.state_dict())


def test_eval_and_no_grad_run_the_plain_module():
    model, x, _ = build("mlp")
    ckpt = Checkpointable(model, "50%")
    ckpt.eval()
    assert torch.equal(ckpt(x), model(x))
    ckpt.train()
    with torch.no_grad():
        ckpt(x)
    assert ckpt.entries == {}


def test_a_new_input_signature_gets_its_own_plan():
    model, x, y = build("mlp")
    ckpt = Checkpointable(model, "75%")
    loss_of(ckpt(x), y).backward()
    loss_of(ckpt(x[:5].clone()), y[:5]).backward()
    loss_of(ckpt(x), y).backward()
    assert len(ckpt.entries) == 2
    for e in ckpt.entries.values():  # a fraction of each shape's own no-recomputation peak (issue 18)
        expected = max(resolve_budget("75%", no_recompute_peak(e.chain)), min_feasible_budget(e.chain))
        assert e.plan.budget == expected
    batches = sorted(e.chain.input_size for e in ckpt.entries.values())
    assert batches[0] < batches[1]


def test_infeasible_budget_is_raised_before_any_step_with_the_minimum():
    model, x, _ = build("mlp")
    before = copy.deepcopy(model.state_dict())
    ckpt = Checkpointable(model, 1000)
    with pytest.raises(InfeasibleBudget) as err:
        ckpt(x)
    assert err.value.min_feasible == min_feasible_budget(chain_of("mlp"))
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    assert all(p.grad is None for p in model.parameters())


def test_bad_arguments_are_one_line_errors():
    single = Checkpointable(nn.Linear(2, 2))  # any module; its chain is found on the first training call
    with pytest.raises(DiscoveryError, match="nothing to checkpoint in Linear: the graph gave 1 stage, and no run"):
        single(torch.randn(3, 2))
    with pytest.raises(BudgetError, match="accepted"):
        Checkpointable(nn.Sequential(nn.Linear(2, 2)), "lots")
    with pytest.raises(ValueError, match="slots"):
        Checkpointable(nn.Sequential(nn.Linear(2, 2)), slots=0)


def test_summary_and_profiling_cost():
    model, x, y = build("convnet")
    ckpt = Checkpointable(model, "75%")
    with pytest.raises(RuntimeError, match="training forward"):
        ckpt.summary()
    loss_of(ckpt(x), y).backward()
    text = ckpt.summary()
    assert "predicted peak" in text and "profiling took" in text
    assert "recomputed" in text
    assert ckpt.profile_seconds > 0
    assert 2 <= ckpt.profile.repeats <= 5 and len(ckpt.profile.round_seconds) == ckpt.profile.repeats  # MIN_ROUNDS
    assert f"over {ckpt.profile.repeats} rounds" in text


def test_auto_budget_on_cpu_is_the_no_recompute_peak_never_free_ram():
    assert auto_budget(torch.device("cpu")) is None
    model, x, y = build("mlp")
    ckpt = Checkpointable(model)
    loss_of(ckpt(x), y).backward()
    assert ckpt.plan.budget == no_recompute_peak(ckpt.chain)
    assert ckpt.plan.recomputed_stages == 0


@pytest.mark.parametrize("name", list(MODELS))
def test_bf16_autocast_training_equals_plain_and_stays_within_budget(name):
    plain, x, y = build(name)
    ckpt = Checkpointable(copy.deepcopy(plain), "75%")

    def run(model):
        torch.manual_seed(2)
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_of(model(x), y)
        loss.backward()
        return loss.detach()

    assert torch.equal(run(plain), run(ckpt))
    for a, b in zip(plain.parameters(), ckpt.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    ckpt.zero_grad()
    with ckpt.measure_step() as m:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_of(ckpt(x), y)
        loss.backward()
    check_measured_peak(ckpt, m.peak)


def test_gradient_accumulation_over_two_batches_equals_plain():
    plain, x, y = build("convnet")
    ckpt = Checkpointable(copy.deepcopy(plain), "75%")
    for model in (plain, ckpt):
        torch.manual_seed(2)
        loss_of(model(x), y).backward()
        loss_of(model(x.flip(0)), y.flip(0)).backward()  # .grad already set: accumulated in place
    for a, b in zip(plain.parameters(), ckpt.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


def test_a_deep_copy_trains_its_own_parameters():
    model, x, y = build("mlp")
    ckpt = Checkpointable(model, "75%")
    loss_of(ckpt(x), y).backward()
    twin = copy.deepcopy(ckpt)
    twin.zero_grad()
    loss_of(twin(x), y).backward()
    assert all(p.grad is not None for p in twin.parameters())
    assert all(a is not b for a, b in zip(ckpt.parameters(), twin.parameters(), strict=True))
    assert twin.stages[0] is getattr(twin, "0")  # the copy's stages are the copy's modules
    assert all(s is t for s, t in zip(twin.stages, twin.entries[next(iter(twin.entries))].runner.stages, strict=True))


def test_saved_plans_are_reused_without_profiling(monkeypatch):
    model, x, y = build("mlp")
    ckpt = Checkpointable(model, "75%")
    loss_of(ckpt(x), y).backward()
    state = ckpt.plan_state()
    state = json.loads(json.dumps(state))  # plain data, as in a checkpoint
    fresh = Checkpointable(copy.deepcopy(model), "75%")
    fresh.load_plan_state(state)

    def no_profiling(*args, **kwargs):
        raise AssertionError("profiled although a saved plan matches")

    monkeypatch.setattr("lightning_rotor.pipeline.profile_chain", no_profiling)
    loss_of(fresh(x), y).backward()
    assert fresh.plan.ops == ckpt.plan.ops
    assert fresh.budget == ckpt.budget
    with pytest.raises(ValueError, match="stages"):
        Checkpointable(nn.Sequential(nn.Linear(32, 10))).load_plan_state(state)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_training_equals_plain_and_allocator_peak_stays_within_budget():
    plain, x, y = build("convnet")
    plain, x, y = plain.cuda(), x.cuda(), y.cuda()
    ckpt = Checkpointable(copy.deepcopy(plain), "75%")
    assert torch.allclose(train(plain, x, y, loss_of), train(ckpt, x, y, loss_of), rtol=1e-5, atol=1e-6)
    for a, b in zip(plain.parameters(), ckpt.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-6)
    ckpt.zero_grad(set_to_none=False)  # gradients stay allocated: the allocator then sees activations only
    with ckpt.measure_step() as m:
        loss = loss_of(ckpt(x), y)
        loss.backward()
    assert m.peak <= ckpt.plan.budget
    assert [label for label, _ in m.curve] == [" ".join(map(str, op)) for op in ckpt.plan.ops]


def test_infeasible_budget_inside_measure_step_is_not_masked():
    torch.manual_seed(0)
    ckpt = Checkpointable(nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 8)), 1)
    x = torch.randn(4, 8)
    with pytest.raises(InfeasibleBudget, match="smallest feasible budget"):
        with ckpt.measure_step():
            ckpt(x).sum().backward()


def test_replan_changes_the_budget_or_nothing():
    model, x, _ = build("mlp")
    ckpt = Checkpointable(model, 1.0)
    ckpt.prepare_for(x)
    least = min_feasible_budget(ckpt.chain)
    before = ckpt.plan
    with pytest.raises(InfeasibleBudget) as err:
        ckpt.replan(least - 1)
    assert err.value.min_feasible == least
    assert ckpt.plan is before and ckpt.mem_limit == 1.0  # nothing changed
    ckpt.replan(least)
    assert ckpt.plan.budget == least and ckpt.budget == least and ckpt.plan.peak <= least
    assert ckpt.plan.recomputed_stages > 0
    with pytest.raises(BudgetError):
        ckpt.replan("lots")


def test_measure_step_takes_a_probe_and_reports_the_chains_own_peak():
    from lightning_rotor.memory import MemoryProbe

    model, x, y = build("mlp")
    ckpt = Checkpointable(model, "50%")
    loss_of(ckpt(x), y).backward()  # the first step runs the smallest budget's plan; the next ones the whole budget's
    big = torch.ones(1_000_000)  # alive before the chain runs: the whole-step peak counts it
    wide = MemoryProbe(ckpt, record_curve=True)
    with ckpt.measure_step(probe=wide) as m:
        wide.track(big)
        assert m.is_open
        loss_of(ckpt(x), y).backward()
    assert not m.is_open and m.probe is None
    assert m.chain_peak == max(m.op_peaks) and len(m.op_peaks) == len(ckpt.plan.ops)
    assert storage_of(big) < m.chain_peak <= m.peak  # the wide probe counts `big` through the chain's ops
    with ckpt.measure_step() as own:
        loss_of(ckpt(x), y).backward()
    assert own.chain_peak <= own.peak <= ckpt.plan.budget < storage_of(big)
    assert own.chain_peak == m.chain_peak - storage_of(big)  # the same step, less `big`


def storage_of(t):
    return t.untyped_storage().nbytes()


@pytest.mark.parametrize("budget", ["min", 1.0])
def test_a_module_used_twice_trains_like_plain(budget):
    def build_repeated():
        torch.manual_seed(0)
        shared = nn.Linear(32, 32)
        return nn.Sequential(nn.Linear(32, 32), nn.Tanh(), shared, nn.Tanh(), shared, nn.Tanh(), nn.Linear(32, 10))

    x, y = torch.randn(64, 32), torch.randint(0, 10, (64,))
    plain = build_repeated()
    ckpt = Checkpointable(build_repeated(), None)
    assert len(ckpt.stages) == 7 and ckpt.stages[2] is ckpt.stages[4]
    assert list(ckpt.state_dict()) == list(plain.state_dict())
    ckpt.prepare_for(x)
    ckpt.replan(min_feasible_budget(ckpt.chain) if budget == "min" else budget)
    losses = train(ckpt, x, y, loss_of, steps=3)
    expected = train(plain, x, y, loss_of, steps=3)
    assert torch.equal(losses, expected)
    assert_same_state(plain, ckpt)
    assert (ckpt.plan.recomputed_stages > 0) == (budget == "min")


def test_loss_fn_is_measured_and_loss_tmp_function_is_deprecated():
    """`loss_fn=` takes the loss; a function given as `loss_tmp=` (the old form) still works, with a warning."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    x = torch.randn(16, 8)

    def loss(out):
        return out.square().mean()

    new = Checkpointable(copy.deepcopy(net), loss_fn=loss, repeats=1)
    new(x).sum().backward()
    with pytest.warns(DeprecationWarning, match="loss_fn="):
        old = Checkpointable(copy.deepcopy(net), loss_tmp=loss, repeats=1)
    old(x).sum().backward()
    assert old.loss_fn is loss and old.loss_tmp is None
    assert new.chain.loss_tmp == old.chain.loss_tmp
    with pytest.raises(ValueError, match="not both"):
        Checkpointable(net, loss_tmp=64, loss_fn=loss)
    with pytest.raises(TypeError, match="loss_tmp must be bytes"):
        Checkpointable(net, loss_tmp="64")
