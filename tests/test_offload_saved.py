"""Offloading what a recorded stage saved (OffloadSaved k / PrefetchSaved k) on real models: bitwise like plain
training (dropout replayed, BatchNorm statistics updated once), device memory within the simulator's op by op,
host memory exactly the simulator's, and `offloadable[k]` as profiled equal to the bytes the executor moves.

Schedules: the planner's own offloading plans, and its recompute-only plans with the saved-part family inserted
by hand where the simulator accepts it (spec: `Fe s, OffloadSaved s, … , PrefetchSaved s, B s+1, B s`), which
exercise the executor on placements the planner's choice of the moment does not make.
"""

import dataclasses

import pytest
import torch
from training import DROPOUT_GPT as GPT
from training import assert_same_state, grads, measured_step, train, uniform_times

from lightning_rotor.budget import format_bytes
from lightning_rotor.checkpointable import Checkpointable
from lightning_rotor.execute import PlanRunner
from lightning_rotor.memory import CudaMemoryProbe, MemoryProbe
from lightning_rotor.models import MODELS, get_model
from lightning_rotor.offload import SavedPart, TransferChannel, Transfers, buffer_sizes
from lightning_rotor.ops import Op, OpKind, parse_ops
from lightning_rotor.planner import min_feasible_budget, plan
from lightning_rotor.profile import profile_chain
from lightning_rotor.simulate import no_recompute_peak, simulate
from lightning_rotor.stages import sequential_stages

FAST = 1e12  # bytes/s: every copy of these tiny parts ends within the next forward


def with_saved_offloads(chain, ops):
    """`ops` with `OffloadSaved s` right after an `Fe s` and `PrefetchSaved s` right before a `B s+1` that `B s`
    follows (the planner family's placement), for each stage s with offloadable bytes, where the simulator
    accepts it."""
    ops = list(ops)
    for s in range(chain.length - 1):
        if not chain.offloadable[s]:
            continue
        for i, op in enumerate(ops):
            if op != Op(OpKind.FE, s) or Op(OpKind.B, s + 1) not in ops[i:]:
                continue
            b = ops.index(Op(OpKind.B, s + 1), i)
            if b + 1 == len(ops) or ops[b + 1] != Op(OpKind.B, s):
                continue
            offload, prefetch = Op(OpKind.OFFLOAD_SAVED, s), Op(OpKind.PREFETCH_SAVED, s)
            tried = [*ops[: i + 1], offload, *ops[i + 1 : b], prefetch, *ops[b:]]
            try:
                simulate(chain, tried)
            except ValueError:  # e.g. the part would still be on the host at another B
                continue
            ops = tried
            break
    return ops


CASES = {
    "gpt": (GPT, 0.3),
    "resnet18": (MODELS["resnet18"].tiny, 0.3),  # BatchNorm: running statistics updated once
    "mobilenet": (MODELS["mobilenet"].tiny, 0.3),
}


def saved_case(name):
    """(plain model, rotor model, stages, chain profiled with offloading, ops, recompute-only plan, x, y)."""
    kwargs, fraction = CASES[name]
    torch.manual_seed(0)
    plain = get_model(name, **kwargs)
    torch.manual_seed(0)
    rotor = get_model(name, **kwargs)
    x, y = MODELS[name].sample(4, **kwargs)
    stages = sequential_stages(rotor)
    profiled = profile_chain(stages, x, names=list(stages.names), offload=True).chain
    chain = uniform_times(profiled).with_transfer(FAST)
    low, high = min_feasible_budget(chain), no_recompute_peak(chain)
    recompute = plan(chain, int(low + fraction * (high - low)), bandwidth=0)  # no offloads: inserted below
    ops = with_saved_offloads(chain, recompute.ops)
    assert sum(op.kind is OpKind.OFFLOAD_SAVED for op in ops) >= 2, [op.label for op in recompute.ops]
    return plain, rotor, stages, chain, ops, recompute, x, y


def runner_for(stages, chain, ops):
    return PlanRunner(
        stages, ops, list(stages.names), in_free=chain.in_free, sizes=chain.sizes, offloadable=chain.offloadable
    )


def cuda_steps_bitwise(plain, rotor, runner, loss, x, y) -> list[CudaMemoryProbe]:
    """Two CUDA steps of plain training and of `runner` (rotor's ops) on the same seeds, gradients torch.equal
    after each; the probe of each rotor step."""
    probes = []
    for step in range(2):
        for model in (plain, rotor):
            model.zero_grad(set_to_none=False)
        torch.manual_seed(5 + step)
        loss(plain(x), y).backward()
        torch.manual_seed(5 + step)
        with CudaMemoryProbe() as probe:
            loss(runner(x), y).backward()
        for a, b in zip(grads(plain), grads(rotor), strict=True):
            assert torch.equal(a, b)
        probes.append(probe)
    return probes


def test_offloadable_is_profiled_only_with_offloading_and_within_the_saved_bytes():
    _, _, stages, chain, _, _, x, _ = saved_case("gpt")
    assert all(0 <= o <= s for o, s in zip(chain.offloadable, chain.saved_size, strict=True))
    blocks = [k for k, name in enumerate(stages.names) if chain.offloadable[k] > 0]
    assert len(blocks) >= 6  # every transformer block saves more than its input and output
    without, with_ = (profile_chain(stages, x, names=list(stages.names), timed=False, offload=o).chain for o in (0, 1))
    assert without.offloadable == [0] * chain.length and with_.offloadable == chain.offloadable
    # recording behind handles measures the very same program: every other figure as without offloading
    assert dataclasses.replace(with_, offloadable=without.offloadable) == without


@pytest.mark.parametrize("name", list(CASES))
def test_saved_offload_trains_bitwise_like_plain_within_the_simulated_memory(name):
    plain, rotor, stages, chain, ops, recompute, x, y = saved_case(name)
    loss = MODELS[name].loss
    torch.manual_seed(5)
    expected = loss(plain(x), y)
    expected.backward()
    rng_after_plain = torch.get_rng_state()

    sim = simulate(chain, ops)
    runner = runner_for(stages, chain, ops)
    runner.probe = probe = MemoryProbe(rotor)
    torch.manual_seed(5)
    with probe:
        probe.track(x)
        got = loss(runner(x), y)
        got.backward()
        same_loss = torch.equal(expected, got)
        del got
    assert same_loss
    assert torch.equal(torch.get_rng_state(), rng_after_plain)  # the RNG stream is plain training's
    for a, b in zip(grads(plain), grads(rotor), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(plain.buffers(), rotor.buffers(), strict=True):
        assert torch.equal(a, b)

    # device: never above the simulator, op by op; moving the saved parts lowers the peak
    measured = [nbytes for _, _, nbytes in probe.marks]
    assert [label for label, _, _ in probe.marks] == [op.label for op in ops]
    assert all(m <= s for m, s in zip(measured, sim.curve, strict=True)), [
        (op.label, m, s) for op, m, s in zip(ops, measured, sim.curve, strict=True) if m > s
    ]
    assert probe.peak == sim.peak < recompute.peak  # the peak itself to the byte (MemoryProbe is exact)
    # each saved part leaves the device and comes back with exactly offloadable[k] bytes, which the host holds
    for i, op in enumerate(ops):
        if op.kind is OpKind.OFFLOAD_SAVED:
            assert measured[i - 1] - measured[i] == chain.offloadable[op.stage] > 0, op.label
        elif op.kind is OpKind.PREFETCH_SAVED:
            assert measured[i] - measured[i - 1] == chain.offloadable[op.stage], op.label
    assert probe.host_peak == sim.host_peak > 0
    assert probe.host_current == 0


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("fraction", [0.1, 0.3])
def test_the_planners_saved_offload_plans_run_bitwise_within_the_simulated_memory(name, fraction):
    plain, rotor, stages, chain, _, _, x, y = saved_case(name)
    low, high = min_feasible_budget(chain), no_recompute_peak(chain)
    chosen = plan(chain, int(low + fraction * (high - low)))
    ops = chosen.ops
    assert any(op.kind is OpKind.OFFLOAD_SAVED for op in ops) and chosen.time < chosen.recompute_only_time
    probe, sim = run_measured(name, rotor, plain, stages, chain, ops, x, y, seed=9)
    assert probe.peak <= sim.peak <= chosen.budget
    assert probe.host_peak == sim.host_peak == chosen.host_peak > 0 and probe.host_current == 0


def run_measured(name, rotor, plain, stages, chain, ops, x, y, seed):
    """One step of `ops` beside plain training at `seed`: asserts bitwise equality, the device bytes never above
    the simulator's op by op, the host's exactly its peak and back to 0; returns (probe, simulation)."""
    loss = MODELS[name].loss
    torch.manual_seed(seed)
    loss(plain(x), y).backward()
    rng_after_plain = torch.get_rng_state()
    runner = runner_for(stages, chain, ops)
    runner.probe = probe = MemoryProbe(rotor)
    torch.manual_seed(seed)
    with probe:
        probe.track(x)
        loss(runner(x), y).backward()
    assert torch.equal(torch.get_rng_state(), rng_after_plain)
    assert_same_state(plain, rotor)
    sim = simulate(chain, ops)
    measured = [nbytes for _, _, nbytes in probe.marks]
    assert [label for label, _, _ in probe.marks] == [op.label for op in ops]
    assert all(m <= s for m, s in zip(measured, sim.curve, strict=True)), [
        (op.label, m, s) for op, m, s in zip(ops, measured, sim.curve, strict=True) if m > s
    ]
    assert probe.host_peak == sim.host_peak > 0 and probe.host_current == 0
    return probe, sim


def test_a_recomputed_stage_with_dropout_offloads_what_its_replay_saved():
    """Stage 1 (dropout) runs first as `Fc 1`, then is recorded again in the backward, replaying its random
    numbers, under the hooks: its saved part (the dropout masks too) moves and comes back bitwise."""
    plain, rotor, stages, chain, _, _, x, y = saved_case("gpt")
    low, high = min_feasible_budget(chain), no_recompute_peak(chain)
    ops = plan(chain, int(low + 0.1 * (high - low)), bandwidth=0).ops
    assert ops[-5:] == parse_ops([("Fe", 2), ("B", 2), ("Fe", 1), ("B", 1), ("B", 0)]) and Op(OpKind.FC, 1) in ops
    ops = ops[:-5] + parse_ops(
        [("Fe", 1), ("OffloadSaved", 1), ("Fe", 2), ("PrefetchSaved", 1), ("B", 2), ("B", 1), ("B", 0)]
    )
    sim = simulate(chain, ops)
    loss = MODELS["gpt"].loss
    torch.manual_seed(11)
    loss(plain(x), y).backward()
    rng_after_plain = torch.get_rng_state()
    runner = runner_for(stages, chain, ops)
    runner.probe = probe = MemoryProbe(rotor)
    torch.manual_seed(11)
    with probe:
        probe.track(x)
        loss(runner(x), y).backward()
    assert torch.equal(torch.get_rng_state(), rng_after_plain)
    for a, b in zip(grads(plain), grads(rotor), strict=True):
        assert torch.equal(a, b)
    at = ops.index(Op(OpKind.OFFLOAD_SAVED, 1))
    assert probe.marks[at - 1][2] - probe.marks[at][2] == chain.offloadable[1] > 0
    assert probe.peak <= sim.peak and probe.host_peak == sim.host_peak == chain.offloadable[1]


def test_several_steps_and_two_calls_per_step_match_plain_training():
    plain, rotor, stages, chain, ops, _, x, y = saved_case("gpt")
    loss = MODELS["gpt"].loss
    runner = runner_for(stages, chain, ops)
    x2 = torch.roll(x, 1, dims=0)
    results = []
    for model, run in ((plain, plain), (rotor, runner)):
        torch.manual_seed(7)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            opt.zero_grad()
            (loss(run(x), y) + loss(run(x2), y)).backward()  # two calls pending, one backward
            opt.step()
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_saved_offload_and_input_offload_together():
    """A plan moving stage inputs and saved parts on the one channel: still bitwise, host peak as simulated."""
    plain, rotor, stages, chain, _, _, x, y = saved_case("mobilenet")
    low, high = min_feasible_budget(chain), no_recompute_peak(chain)
    offloading = plan(chain, int(low + 0.05 * (high - low)))  # the planner's own offloads, more inserted
    ops = with_saved_offloads(chain, offloading.ops)
    assert any(op.kind is OpKind.OFFLOAD_SAVED for op in ops)
    loss = MODELS["mobilenet"].loss
    torch.manual_seed(3)
    loss(plain(x), y).backward()
    runner = runner_for(stages, chain, ops)
    runner.probe = probe = MemoryProbe(rotor)
    torch.manual_seed(3)
    with probe:
        probe.track(x)
        loss(runner(x), y).backward()
    assert_same_state(plain, rotor)
    sim = simulate(chain, ops)
    assert probe.peak <= sim.peak and probe.host_peak == sim.host_peak and probe.host_current == 0


class _Caches(torch.nn.Module):
    """Saves a tanh output for its backward and keeps it as an attribute: offloading it would free nothing."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.last = None

    def forward(self, x):
        h = torch.tanh(self.lin(x))  # tanh saves its output h
        self.last = h.detach()  # a second owner of h's storage
        return torch.sigmoid(h * 3)  # sigmoid saves its output, a_{k+1}


def test_settle_moves_only_storages_the_graph_alone_holds():
    stage = _Caches()
    x = torch.randn(4, 8, requires_grad=True)
    part = SavedPart(1, [*stage.parameters(), *stage.buffers()])
    with part.recording():
        out = stage(x)
    assert part.settle(x, out) == 0  # h is held by the module, x is a_k, the sigmoid's output is a_{k+1}
    stage.last = None
    part = SavedPart(1, [*stage.parameters(), *stage.buffers()])
    with part.recording():
        out = stage(x)
    stage.last = None
    assert part.settle(x, out) == 4 * 8 * 4  # h alone (the pre-activation is saved by no one)
    transfers = Transfers(TransferChannel())
    transfers.offload_saved(1, part)
    assert transfers.moved == {1: part.nbytes} and transfers.host_bytes == part.nbytes
    with pytest.raises(RuntimeError, match="reads what it saved while that is on the host"):
        out.sum().backward()
    transfers.prefetch_saved(1)
    assert transfers.host_bytes == 0


def test_lazy_conjugate_views_stay_and_the_gradient_is_plain_autograds():
    """A saved conjugate view (its conj bit is no size, stride or dtype) is not moved: gradients as plain."""
    w1 = torch.randn(4, dtype=torch.complex64, requires_grad=True)
    w2 = torch.randn(4, dtype=torch.complex64, requires_grad=True)
    x = torch.randn(3, 4, dtype=torch.complex64)

    def forward(x):
        h = x * w1
        return (h.conj() * w2 * h).real  # saves h.conj() (a lazy view) and h

    forward(x).sum().backward()
    expected = (w1.grad.clone(), w2.grad.clone())
    w1.grad = w2.grad = None
    part = SavedPart(1, [w1, w2])
    with part.recording():
        out = forward(x)
    assert part.settle(x, out) > 0  # h.conj() * w2 moves; h stays, held by its conjugate view saved as it is
    transfers = Transfers(TransferChannel())
    transfers.offload_saved(1, part)
    transfers.prefetch_saved(1)
    out.sum().backward()
    assert torch.equal(w1.grad, expected[0]) and torch.equal(w2.grad, expected[1])


def test_an_in_place_write_into_a_moved_tensor_fails_as_in_plain_training():
    """Autograd checks no version through saved-tensor hooks; the saved part does, as plain autograd would."""

    def forward(x, w):
        h = torch.sigmoid(x @ w)  # sigmoid saves h
        out = h * 2
        h.add_(1)  # corrupts what sigmoid's backward needs
        return out

    x, w = torch.randn(3, 4), torch.randn(4, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        forward(x, w).sum().backward()
    part = SavedPart(2, [w])
    with part.recording():
        out = forward(x, w)
    part.settle(x, out)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        Transfers(TransferChannel()).offload_saved(2, part)


def test_offload_saved_must_follow_its_fe():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    stages = sequential_stages(model)
    ops = [("Fc", 0), ("OffloadSaved", 0), ("Fe", 1), ("Fe", 2), ("Loss",), ("B", 2), ("B", 1), ("Fe", 0),
           ("B", 0)]  # fmt: skip
    with pytest.raises(ValueError, match="OffloadSaved 0 must follow the Fe 0 whose recorded graph it moves"):
        PlanRunner(stages, ops)


def test_host_buffers_count_saved_parts_apart_from_values():
    ops = [Op("Offload", 1), Op("OffloadSaved", 1), Op("Prefetch", 1), Op("PrefetchSaved", 1), Op("OffloadSaved", 2),
           Op("PrefetchSaved", 2)]  # fmt: skip
    assert buffer_sizes(ops, [0, 100, 0], [0, 60, 50]) == [100, 60]  # saved 2 reuses a free buffer


# -- Checkpointable(offload=...) -----------------------------------------------------------------------------------
def test_checkpointable_measures_offloadable_and_runs_saved_offloads_bitwise_like_plain():
    """Profiled through Checkpointable with offload= the chain carries offloadable; a plan with the saved-part
    family inserted by hand into a recompute-only plan runs through Checkpointable's own runner for several
    steps, bitwise like plain training, host memory as simulated."""
    kwargs = MODELS["resnet18"].tiny
    torch.manual_seed(0)
    plain = get_model("resnet18", **kwargs)
    torch.manual_seed(0)
    model = get_model("resnet18", **kwargs)
    x, y = MODELS["resnet18"].sample(4, **kwargs)
    rotor = Checkpointable(model, 0.6, offload="12GB/s")
    entry = rotor.prepare_for(x)
    assert any(rotor.chain.offloadable)
    assert Checkpointable(get_model("resnet18", **kwargs), 0.6).prepare_for(x).chain.offloadable == [0] * len(
        rotor.chain.offloadable
    )
    chain = uniform_times(rotor.chain)
    ops = with_saved_offloads(chain, plan(chain, entry.plan.budget, bandwidth=0).ops)
    assert any(op.kind is OpKind.OFFLOAD_SAVED for op in ops)
    sim = simulate(chain, ops)
    state = rotor.plan_state()
    state["entries"][0]["chain"] = chain.to_dict()
    state["entries"][0]["plan"] |= {"ops": [op.to_json() for op in ops], "peak": sim.peak, "time": sim.time}
    rotor.load_plan_state(state)

    loss = MODELS["resnet18"].loss
    expected = train(plain, x, y, loss, steps=3)
    got = train(rotor, x, y, loss, steps=3)
    assert rotor.plan.ops == ops
    assert torch.equal(expected, got)
    assert_same_state(plain, rotor)
    summary = rotor.summary()
    assert "(saved part offloaded)" in summary and "saved parts of " in summary
    assert f"host memory at most {format_bytes(sim.host_peak)}" in summary
    rotor.zero_grad(set_to_none=True)
    measured = measured_step(rotor, x, y, loss)
    ran = measured.entry  # the step's budget may give the call a plan of its own (lightning_rotor/calls.py)
    assert ran is not None
    ran_sim = simulate(ran.chain, ran.plan.ops)
    assert measured.peak <= ran_sim.peak <= rotor.plan.budget
    assert measured.host_peak == ran_sim.host_peak


@pytest.mark.parametrize("name", ["gpt", "resnet18"])
def test_checkpointable_with_offload_plans_saved_offloads_and_trains_bitwise_like_plain(name):
    """End to end: profiled, planned (the planner's own saved-part offloads) and run by Checkpointable for several
    steps, bitwise like plain training; the measured step within the prediction, host memory as planned."""
    kwargs = CASES[name][0]
    torch.manual_seed(0)
    plain = get_model(name, **kwargs)
    torch.manual_seed(0)
    model = get_model(name, **kwargs)
    x, y = MODELS[name].sample(4, **kwargs)
    rotor = Checkpointable(model, 0.8, offload="12GB/s")
    rotor.prepare_for(x)
    assert any(op.kind is OpKind.OFFLOAD_SAVED for op in rotor.plan.ops), [op.label for op in rotor.plan.ops]
    loss = MODELS[name].loss
    expected = train(plain, x, y, loss, steps=3)
    got = train(rotor, x, y, loss, steps=3)
    assert torch.equal(expected, got)
    assert_same_state(plain, rotor)
    rotor.zero_grad(set_to_none=True)
    measured = measured_step(rotor, x, y, loss)
    ran = measured.entry  # the step's budget may give the call a plan of its own (lightning_rotor/calls.py)
    assert ran is not None and any(op.kind is OpKind.OFFLOAD_SAVED for op in ran.plan.ops)
    assert measured.peak <= ran.plan.peak <= rotor.plan.budget
    assert measured.host_peak == ran.plan.host_peak > 0


# -- CUDA: copy stream, pinned buffers, events (skipped without a GPU) ---------------------------------------------
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@needs_gpu
@pytest.mark.parametrize("name", ["gpt", "resnet18"])
def test_cuda_saved_offload_trains_bitwise_like_plain(name, monkeypatch):
    """Deterministic kernels where the models need them; the prefetch's event orders B k after its copy."""
    plain, rotor, stages, _, _, _, x, y = saved_case(name)
    plain, rotor, x, y = plain.cuda(), rotor.cuda(), x.cuda(), y.cuda()
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    chain = uniform_times(profile_chain(stages, x, names=list(stages.names), offload=True).chain).with_transfer(FAST)
    low, high = min_feasible_budget(chain), no_recompute_peak(chain)
    recompute = plan(chain, int(low + CASES[name][1] * (high - low)), bandwidth=0)
    ops = with_saved_offloads(chain, recompute.ops)
    assert any(op.kind is OpKind.OFFLOAD_SAVED for op in ops)
    runner = runner_for(stages, chain, ops)
    for probe in cuda_steps_bitwise(plain, rotor, runner, MODELS[name].loss, x, y):  # the second reuses the buffers
        assert probe.host_peak == simulate(chain, ops).host_peak > 0 and probe.host_current == 0
    assert runner.channel is not None and runner.channel.pool is not None
    assert runner.channel.pool.allocations == len(buffer_sizes(ops, chain.sizes, chain.offloadable))
    assert all(b.is_pinned() for b in runner.channel.pool.buffers)


# the zoo models the cases above leave out, but the MLP: its stages (Linear, ReLU) save only their input or their
# output, so nothing of what they save can move, and with these uniform times no budget offloads an input
ZOO_REST = ["hetero", "hetero2", "resnet50", "vgg11"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ZOO_REST)
def test_every_zoo_model_trains_bitwise_within_budget_at_several_offloading_budgets(name):
    """The planner's own plans with offloading (values and saved parts, at a link no copy waits on) at three
    budgets of each remaining zoo model: bitwise like plain training, device memory within the simulator's op
    by op and within the budget, host memory the simulator's and back to 0."""
    spec = MODELS[name]
    torch.manual_seed(0)
    rotor = get_model(name, **spec.tiny)
    x, y = spec.sample(4, **spec.tiny)
    stages = sequential_stages(rotor)
    chain = uniform_times(profile_chain(stages, x, names=list(stages.names), offload=True).chain)
    chain = chain.with_transfer(FAST)
    low, high = min_feasible_budget(chain), no_recompute_peak(chain)
    offloading = 0
    for fraction in (0.1, 0.3, 0.6):
        chosen = plan(chain, int(low + fraction * (high - low)))
        offloading += any(op.kind.is_transfer for op in chosen.ops)
        torch.manual_seed(0)
        plain = get_model(name, **spec.tiny)
        plain.load_state_dict(rotor.state_dict())
        torch.manual_seed(9)
        spec.loss(plain(x), y).backward()
        rng_after_plain = torch.get_rng_state()
        runner = runner_for(stages, chain, chosen.ops)
        runner.probe = probe = MemoryProbe(rotor)
        rotor.zero_grad(set_to_none=True)
        torch.manual_seed(9)
        with probe:
            probe.track(x)
            spec.loss(runner(x), y).backward()
        assert torch.equal(torch.get_rng_state(), rng_after_plain), (name, fraction)
        assert_same_state(plain, rotor)
        sim = simulate(chain, chosen.ops)
        measured = [nbytes for _, _, nbytes in probe.marks]
        assert all(m <= s for m, s in zip(measured, sim.curve, strict=True)), (name, fraction)
        assert probe.peak <= sim.peak <= chosen.budget
        assert probe.host_peak == sim.host_peak and probe.host_current == 0
    assert offloading, f"{name}: no budget planned an offload; the test would check nothing of offloading"
