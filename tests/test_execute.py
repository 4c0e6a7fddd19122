"""The executor: plans run with the memory model's frees, RNG replay, autocast, buffers, in-place checks."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from training import grads

from lightning_rotor.chain import Chain
from lightning_rotor.engine import InplaceError
from lightning_rotor.execute import PlanRunner
from lightning_rotor.memory import MemoryProbe
from lightning_rotor.ops import no_recompute_ops
from lightning_rotor.profile import profile_chain
from lightning_rotor.simulate import simulate
from lightning_rotor.stages import sequential_stages

# every stage recomputed at least once, with checkpoints kept and dropped
RECOMPUTE_ALL = [("Fc", 0), ("Fn", 1), ("Fn", 2), ("Fe", 3), ("Loss",), ("B", 3), ("Fc", 0), ("Fn", 1), ("Fe", 2),
                 ("B", 2), ("Fe", 0), ("Fe", 1), ("B", 1), ("B", 0)]  # fmt: skip
RECOMPUTE_3 = [("Fc", 0), ("Fn", 1), ("Fe", 2), ("Loss",), ("B", 2), ("Fc", 0), ("Fe", 1), ("B", 1), ("Fe", 0),
               ("B", 0)]  # fmt: skip


class DropLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.5)
        self.lin = nn.Linear(32, 32)

    def forward(self, x):
        return self.lin(self.drop(x))


def model4():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), DropLinear(), nn.BatchNorm1d(32), nn.Linear(32, 5))


def test_a_plan_for_another_chain_length_is_rejected():
    stages = sequential_stages(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    names = list(stages.names)
    with pytest.raises(ValueError, match="2 stages"):
        PlanRunner(stages, RECOMPUTE_ALL, names)


def step(run, model, x, y):
    loss = F.cross_entropy(run(x), y)
    loss.backward()
    return loss.detach()


def test_recomputed_plan_matches_plain_bitwise_with_dropout_and_batchnorm():
    x, y = torch.randn(8, 16), torch.randint(0, 5, (8,))
    plain, rotor = model4(), model4()
    torch.manual_seed(3)
    expected = step(plain, plain, x, y)
    rng_after_plain = torch.get_rng_state()
    stages = sequential_stages(rotor)
    names = list(stages.names)
    runner = PlanRunner(stages, RECOMPUTE_ALL, names)
    assert runner.recomputed == {0, 1, 2}
    torch.manual_seed(3)
    got = step(runner, rotor, x, y)
    assert torch.equal(torch.get_rng_state(), rng_after_plain)  # the RNG stream is the unwrapped one
    assert torch.equal(expected, got)
    for a, b in zip(grads(plain), grads(rotor), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(plain.buffers(), rotor.buffers(), strict=True):
        assert torch.equal(a, b)  # running stats and num_batches_tracked updated once
    assert rotor[2].num_batches_tracked.item() == 1


@pytest.mark.parametrize("requires_grad", [False, True])
def test_gradient_reaches_the_input_only_when_it_requires_grad(requires_grad):
    x = torch.randn(8, 16, requires_grad=requires_grad)
    y = torch.randint(0, 5, (8,))
    plain, rotor = model4(), model4()
    plain.eval(), rotor.eval()  # no dropout: compare the input gradient alone
    step(plain, plain, x, y)
    expected = None if x.grad is None else x.grad.clone()
    x.grad = None
    stages = sequential_stages(rotor)
    names = list(stages.names)
    step(PlanRunner(stages, RECOMPUTE_ALL, names), rotor, x, y)
    if requires_grad:
        assert torch.equal(x.grad, expected)
    else:
        assert x.grad is None


def test_bf16_autocast_is_reentered_on_recompute():
    x, y = torch.randn(8, 16), torch.randint(0, 5, (8,))
    plain, rotor = model4(), model4()
    stages = sequential_stages(rotor)
    names = list(stages.names)
    runner = PlanRunner(stages, RECOMPUTE_ALL, names)
    results = []
    for run, model in ((plain, plain), (runner, rotor)):
        torch.manual_seed(3)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = run(x)
            assert out.dtype == torch.bfloat16
            loss = F.cross_entropy(out, y)
        loss.backward()
        results.append((loss.detach(), grads(model)))
    assert torch.equal(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1], strict=True):
        assert torch.equal(a, b)


def profiled(model, x):
    """The model's stages, their names and the chain profiled on `x`."""
    stages = sequential_stages(model)
    names = list(stages.names)
    return stages, names, profile_chain(stages, x, names=names).chain


def assert_runner_trains_like_plain(make, ops, x, y):
    """One step of a fresh model, plainly and through a PlanRunner of `ops`: every gradient bitwise equal."""
    plain, rotor = make(), make()
    step(plain, plain, x, y)
    stages = sequential_stages(rotor)
    step(PlanRunner(stages, ops, list(stages.names)), rotor, x, y)
    for a, b in zip(grads(plain), grads(rotor), strict=True):
        assert torch.equal(a, b)
    return stages


class Split(nn.Module):
    def forward(self, x):
        return x[:, :8] * 2, x[:, 8:].relu()


class Join(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, pair):
        a, b = pair
        return self.lin(a) + b


def test_tuple_values_flow_through_the_chain():
    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 16), Split(), Join(), nn.Linear(8, 5))

    x, y = torch.randn(4, 16), torch.randint(0, 5, (4,))
    stages = assert_runner_trains_like_plain(make, RECOMPUTE_ALL, x, y)
    profile = profile_chain(stages, x, names=list(stages.names))
    assert profile.chain.out_size[1] == 4 * 8 * 4 * 2  # both tensors of the pair


def test_measured_memory_after_each_op_follows_the_simulator():
    x, y = torch.randn(64, 16), torch.randint(0, 5, (64,))
    rotor = model4()
    stages, names, chain = profiled(rotor, x)
    runner = PlanRunner(stages, RECOMPUTE_ALL, names)
    runner.probe = probe = MemoryProbe(rotor)
    with probe:
        step(runner, rotor, x, y)
    sim = simulate(chain, RECOMPUTE_ALL)
    measured = [nbytes for _, _, nbytes in probe.marks]
    assert [label for label, _, _ in probe.marks] == [" ".join(map(str, op)) for op in RECOMPUTE_ALL]
    assert all(m <= p for m, p in zip(measured, sim.curve, strict=True))
    assert probe.peak <= sim.peak
    assert probe.peak >= 0.9 * sim.peak


class AddOne(nn.Module):
    def forward(self, x):
        return x.add_(1)


def test_in_place_stage_at_a_boundary_fails_with_a_clear_error():
    model = nn.Sequential(nn.Linear(4, 4), AddOne(), nn.Linear(4, 2))
    stages = sequential_stages(model)
    names = list(stages.names)
    with pytest.raises(InplaceError, match=r"stage 1 \(1\) modified its input in place"):
        profile_chain(stages, torch.randn(2, 4), names=names)


def test_in_place_modules_are_fused_into_the_stage_before():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(inplace=True), nn.Sequential(nn.ReLU()))
    stages = sequential_stages(model)
    names = list(stages.names)
    assert names == ["0", "1+2", "3.0"]
    rotor = copy.deepcopy(model)
    x = torch.randn(2, 3, 6, 6)
    model(x).sum().backward()
    stages = sequential_stages(rotor)
    names = list(stages.names)
    out = PlanRunner(
        stages,
        [("Fc", 0), ("Fn", 1), ("Fe", 2), ("Loss",), ("B", 2), ("Fc", 0), ("Fe", 1), ("B", 1), ("Fe", 0), ("B", 0)],
        names,
    )(x)
    out.sum().backward()
    for a, b in zip(model.parameters(), rotor.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


def test_executor_refuses_an_op_it_has_no_rule_for():
    from lightning_rotor.execute import PlanRunner, _Step
    from lightning_rotor.ops import Op, OpKind, OpNote, no_recompute_ops

    stages = [nn.Linear(2, 2), nn.Linear(2, 2)]
    runner = PlanRunner(stages, no_recompute_ops(2))
    step = _Step(runner, torch.ones(1, 2), None)
    with pytest.raises(RuntimeError, match="no rule for op Loss"):
        step.run([OpNote(Op(OpKind.LOSS))])
    with pytest.raises(RuntimeError, match="Wait 1 in a plan without transfers"):
        step.run([OpNote(Op(OpKind.WAIT, 1))])


def _peak_of(run, model, x, y):
    model.zero_grad(set_to_none=True)
    probe = MemoryProbe(model)
    with probe:
        probe.track(x)
        loss = F.cross_entropy(run(x), y)
        loss.backward()
        del loss
    return probe.peak


class LinearGelu(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        return F.gelu(self.lin(x))


def wide_chain():
    # the peaks are in the backwards: a_{k+1} not saved by its stage must be gone before B k, δ_{k+1} once
    # the node receiving it ran (GELU's, before the Linear makes its gradients), the logits with the loss
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 256), LinearGelu(256), nn.Linear(256, 200))


def test_no_recompute_plan_holds_what_plain_autograd_holds():
    """Releasing unsaved outputs, consumed gradients and the handed-over a_L: the plan uses what autograd uses."""
    x, y = torch.randn(512, 16), torch.randint(0, 200, (512,))
    model = wide_chain()
    stages, names, chain = profiled(model, x)
    ops = no_recompute_ops(len(names))
    plain = _peak_of(model, model, x, y)
    runner = _peak_of(PlanRunner(stages, ops, names), model, x, y)
    assert runner == plain
    assert simulate(chain, ops).peak == plain
    assert chain.out_free == [512 * 256 * 4, 512 * 256 * 4, 512 * 200 * 4]


def test_recomputed_stages_run_exactly_as_simulated():
    x, y = torch.randn(512, 16), torch.randint(0, 200, (512,))
    model = wide_chain()
    stages, names, chain = profiled(model, x)
    assert _peak_of(PlanRunner(stages, RECOMPUTE_3, names), model, x, y) == simulate(chain, RECOMPUTE_3).peak


class Twice(nn.Module):
    def forward(self, x):
        return x * 2, x * 2


class Both(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, pair):
        a, b = pair
        return self.lin(a) * b


def test_gradients_shared_by_several_outputs_are_not_freed_early():
    """δ tensors that share storage (or are one tensor for two outputs) stay until every receiving node ran."""

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 16), Twice(), Both(), nn.Linear(16, 5))

    x, y = torch.randn(8, 16), torch.randint(0, 5, (8,))
    assert_runner_trains_like_plain(make, no_recompute_ops(4), x, y)


# -- chain version 3: a stage input let go after its stage's last forward (in_free) ------------------
def tanh_mlp():
    torch.manual_seed(0)  # cut between Linear and Tanh: neither keeps the Linear's output (Tanh keeps its own)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 5))


def test_without_recomputation_the_executor_and_the_model_hold_exactly_what_plain_autograd_holds():
    x, y = torch.randn(64, 16), torch.randint(0, 5, (64,))
    model = tanh_mlp()
    stages, names, chain = profiled(model, x)
    assert chain.in_free == [0, 64 * 64 * 4, 0, 64 * 64 * 4, 0]
    plain = _peak_of(model, model, x, y)
    ops = no_recompute_ops(len(stages))
    assert _peak_of(PlanRunner(stages, ops, names, in_free=chain.in_free), model, x, y) == plain
    assert simulate(chain, ops).peak == plain
    # version 2 kept both Linear outputs until their backward
    v2 = chain.to_dict() | {"version": 2}
    v2["input_size"] += v2.pop("loss_value")  # version 2 counted the loss value with a_0
    del v2["in_free"]
    assert simulate(Chain.from_dict(v2), ops).peak > plain


def test_a_plain_stage_input_goes_exactly_when_the_chain_says():
    x, y = torch.randn(64, 16), torch.randint(0, 5, (64,))
    model = tanh_mlp()
    stages, names, chain = profiled(model, x)
    # a_1, a_2, a_3 reach their stages' last forward plain; a_1 and a_3 are released, a_2 (Tanh's output) is not
    ops = [("Fc", 0), ("Fn", 1), ("Fn", 2), ("Fn", 3), ("Fe", 4), ("Loss",), ("B", 4), ("Fc", 0), ("Fn", 1),
           ("Fn", 2), ("Fe", 3), ("B", 3), ("Fc", 0), ("Fn", 1), ("Fe", 2), ("B", 2), ("Fc", 0), ("Fe", 1), ("B", 1),
           ("Fe", 0), ("B", 0)]  # fmt: skip
    predicted = simulate(chain, ops)
    # Fc 0 … Fe 0, B 0 would recompute stage 0 with early stop (lower than the curve at Fe 0): off here
    runner = PlanRunner(stages, ops, names, in_free=chain.in_free, early_stop=False)
    runner.probe = probe = MemoryProbe(model)
    with probe:
        probe.track(x)
        F.cross_entropy(runner(x), y).backward()
    measured = [nbytes for _, _, nbytes in probe.marks]
    # to the byte, after every op (after B 0 the model holds δ_0, which an input without grad never gets)
    assert measured[:-1] == predicted.curve[:-1]
    assert probe.peak == predicted.peak
    # without the chain's figures every plain input goes: never more than predicted
    assert _peak_of(PlanRunner(stages, ops, names), model, x, y) <= predicted.peak
    assert _peak_of(PlanRunner(stages, ops, names, in_free=chain.in_free), model, x, y) <= predicted.peak


def test_consecutive_backwards_of_recorded_stages_run_in_one_engine_call(monkeypatch):
    import lightning_rotor.engine as engine

    calls = []
    real = engine.run_backward

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    x, y = torch.randn(64, 16), torch.randint(0, 5, (64,))
    expected = tanh_mlp()
    step(expected, expected, x, y)
    model = tanh_mlp()
    stages, names, chain = profiled(model, x)
    monkeypatch.setattr(engine, "run_backward", counted)
    # B 4 … B 2 after recording 2, 3, 4; then B 1, B 0 after recomputing from a_0
    ops = [("Fc", 0), ("Fn", 1), ("Fe", 2), ("Fe", 3), ("Fe", 4), ("Loss",), ("B", 4), ("B", 3), ("B", 2),
           ("Fe", 0), ("Fe", 1), ("B", 1), ("B", 0)]  # fmt: skip
    model.zero_grad(set_to_none=True)
    runner = PlanRunner(stages, ops, names, in_free=chain.in_free)
    runner.probe = probe = MemoryProbe(model)
    with probe:
        probe.track(x)
        step(runner, model, x, y)
    assert len(calls) == 2
    assert [label for label, _, _ in probe.marks] == [" ".join(map(str, op)) for op in ops]
    assert [nbytes for _, _, nbytes in probe.marks][:-1] == simulate(chain, ops).curve[:-1]  # to the byte
    for a, b in zip(grads(expected), grads(model), strict=True):
        assert torch.equal(a, b)


# -- a skip carried unchanged through a stage entered by EnterStage (issue 15, point 1) ---------------
class SkipOut(nn.Module):
    """(main, skip): the skip is a ReLU's output, which the ReLU saves for its own backward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        h = torch.relu(self.lin(x))
        return h * 2, h


class Carry(nn.Module):
    """Works on the main tensor and passes the skip on as the very same tensor."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, pair):
        a, skip = pair
        return torch.relu(self.lin(a)), skip


class Merge(nn.Module):
    """Uses the skip on a path of its own, so that its gradient has a storage of its own."""

    def __init__(self):
        super().__init__()
        self.lin, self.skip = nn.Linear(16, 5), nn.Linear(16, 5)

    def forward(self, pair):
        a, skip = pair
        return self.lin(a) + self.skip(skip)


def test_a_skip_passed_through_an_entered_stage_keeps_its_gradient_for_the_stage_below():
    """δ of a skip that a stage passes on untouched lands in EnterStage's slot as the very root gradient.

    The joined backward freed it as "consumed" (the slot's reference does not count on the storage),
    and the next backward read freed memory: the U-Net segfault of issue 15.
    """

    def make():
        torch.manual_seed(0)
        return nn.Sequential(SkipOut(), Carry(), Carry(), Merge())

    x, y = torch.randn(8, 16), torch.randint(0, 5, (8,))
    # Fe1 enters a plain a_1 through EnterStage; Fe2 after B3 is joined to it, so B2 B1 is one call whose
    # roots (a_3) include the skip as EnterStage's own output
    ops = [("Fc", 0), ("Fe", 1), ("Fc", 2), ("Fe", 3), ("Loss",), ("B", 3), ("Fe", 2), ("B", 2), ("B", 1), ("Fe", 0),
           ("B", 0)]  # fmt: skip
    assert_runner_trains_like_plain(make, ops, x, y)
