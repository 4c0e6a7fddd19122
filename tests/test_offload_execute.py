"""The executor with offloading (chain version 6): Offload k / Prefetch k on real models, bitwise like plain
training, device memory within the simulator's, host memory exactly the simulator's; the transfer channel itself.

Until the planner plans offloads, the schedules here are the planner's recompute plans with offloads inserted
the way the planner's family places them (spec: a kept `a_s` of a split `Fc s, Fn s+1 …` goes to the host after
`Fc s` and comes back before the right part's last op, `B s2`), each checked valid by the simulator.
"""

import sys

import pytest
import torch
from training import DROPOUT_GPT as GPT
from training import assert_same_state, grads, measured_step, train, uniform_times

from lightning_rotor.budget import format_bytes
from lightning_rotor.checkpointable import Checkpointable
from lightning_rotor.execute import PlanRunner
from lightning_rotor.memory import (
    CudaMemoryProbe,
    MemoryProbe,
    host_allocations,
    host_buffer_free,
    host_buffer_used,
    storage_bytes,
)
from lightning_rotor.models import MODELS, get_model
from lightning_rotor.offload import HostPool, TransferChannel, Transfers, buffer_sizes, measure_bandwidth
from lightning_rotor.ops import Op, OpKind
from lightning_rotor.planner import min_feasible_budget, plan
from lightning_rotor.profile import profile_chain
from lightning_rotor.simulate import no_recompute_peak, simulate
from lightning_rotor.stages import sequential_stages

FAST = 1e12  # bytes/s: every copy of these tiny values ends within one forward


def with_offloads(chain, ops):
    """`ops` with `Offload s` after each `Fc s, Fn s+1 …` split whose `a_s` is held plain, and `Prefetch s`
    before that split's `B s2`, where the simulator accepts it."""
    ops = list(ops)
    points = []
    for i, op in enumerate(ops):
        if op.kind is not OpKind.FC or op.stage < 1 or chain.sizes[op.stage] == 0:
            continue
        s, j = op.stage, i + 1
        while ops[j] == Op(OpKind.FN, s + j - i):
            j += 1
        if j > i + 1:  # a forward sweep to overlap the copy with
            points.append((i, s, ops.index(Op(OpKind.B, s + j - i), j)))
    for i, s, b in reversed(points):
        tried = [*ops[: i + 1], Op(OpKind.OFFLOAD, s), *ops[i + 1 : b], Op(OpKind.PREFETCH, s), *ops[b:]]
        try:
            simulate(chain, tried)
        except ValueError:  # a_s held with its graph, not plain: not an offload the family makes
            continue
        ops = tried
    return ops


CASES = {
    "gpt": (GPT, 0.02),
    "resnet18": (MODELS["resnet18"].tiny, 0.1),  # BatchNorm: running statistics updated once
    "mobilenet": (MODELS["mobilenet"].tiny, 0.02),
}


def offload_case(name):
    """(plain model, rotor model, stages, chain, ops with offloads, recompute-only plan, x, y)."""
    kwargs, fraction = CASES[name]
    spec = MODELS[name]
    torch.manual_seed(0)
    plain = get_model(name, **kwargs)
    torch.manual_seed(0)
    rotor = get_model(name, **kwargs)
    x, y = spec.sample(4, **kwargs)
    stages = sequential_stages(rotor)
    chain = uniform_times(profile_chain(stages, x, names=list(stages.names)).chain).with_transfer(FAST)
    low, high = min_feasible_budget(chain), no_recompute_peak(chain)
    recompute = plan(chain, int(low + fraction * (high - low)))
    ops = with_offloads(chain, recompute.ops)
    assert any(op.kind is OpKind.OFFLOAD for op in ops), [op.label for op in recompute.ops]
    return plain, rotor, stages, chain, ops, recompute, x, y


@pytest.mark.parametrize("name", list(CASES))
def test_offloaded_plan_trains_bitwise_like_plain_within_the_simulated_memory(name):
    plain, rotor, stages, chain, ops, recompute, x, y = offload_case(name)
    loss = MODELS[name].loss
    torch.manual_seed(5)
    expected = loss(plain(x), y)
    expected.backward()
    rng_after_plain = torch.get_rng_state()

    sim = simulate(chain, ops)
    runner = PlanRunner(stages, ops, list(stages.names), in_free=chain.in_free, sizes=chain.sizes)
    runner.probe = probe = MemoryProbe(rotor)
    torch.manual_seed(5)
    with probe:
        probe.track(x)
        got = loss(runner(x), y)
        got.backward()
        same_loss = torch.equal(expected, got)
        del got  # the loss value: the step's last activation
    assert same_loss
    assert torch.equal(torch.get_rng_state(), rng_after_plain)  # the RNG stream is plain training's
    for a, b in zip(grads(plain), grads(rotor), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(plain.buffers(), rotor.buffers(), strict=True):
        assert torch.equal(a, b)  # BatchNorm statistics updated once, as in plain training

    # device: never above the simulator, op by op; the peak within the budget
    measured = [nbytes for _, _, nbytes in probe.marks]
    assert [label for label, _, _ in probe.marks] == [op.label for op in ops]
    assert all(m <= s for m, s in zip(measured, sim.curve, strict=True)), [
        (op.label, m, s) for op, m, s in zip(ops, measured, sim.curve, strict=True) if m > s
    ]
    assert probe.peak == sim.peak <= recompute.budget  # the peak itself to the byte (MemoryProbe is exact)
    assert sim.peak <= recompute.peak  # offloading on a fast channel never raises the peak
    # host: exactly the simulator's peak, nothing left after the step
    assert sim.host_peak > 0
    assert probe.host_peak == sim.host_peak
    assert probe.host_current == 0


def test_after_offload_the_executor_holds_no_device_copy_and_after_prefetch_one():
    """The measured device bytes drop by s_k at `Offload k` and rise by s_k at `Prefetch k`, to the byte."""
    _, rotor, stages, chain, ops, _, x, y = offload_case("resnet18")
    runner = PlanRunner(stages, ops, list(stages.names), in_free=chain.in_free, sizes=chain.sizes)
    runner.probe = probe = MemoryProbe(rotor)
    with probe:
        probe.track(x)
        MODELS["resnet18"].loss(runner(x), y).backward()
    measured = [nbytes for _, _, nbytes in probe.marks]
    hosts = 0
    for i, op in enumerate(ops):
        if op.kind is OpKind.OFFLOAD:
            assert measured[i] == measured[i - 1] - chain.sizes[op.stage]
            hosts += 1
        elif op.kind is OpKind.PREFETCH:
            assert measured[i] == measured[i - 1] + chain.sizes[op.stage]
    assert hosts > 0


def test_several_steps_reuse_the_runner_and_match_plain_training():
    plain, rotor, stages, chain, ops, _, x, y = offload_case("gpt")
    loss = MODELS["gpt"].loss
    runner = PlanRunner(stages, ops, list(stages.names), in_free=chain.in_free, sizes=chain.sizes)
    results = []
    for model, run in ((plain, plain), (rotor, runner)):
        torch.manual_seed(7)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            opt.zero_grad()
            loss(run(x), y).backward()
            opt.step()
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_an_offload_while_the_stages_graph_holds_the_value_is_refused():
    """Stage 1 recorded from the plain a_1 keeps it on the device: offloading it then would free nothing the
    memory model charges, so the executor refuses in one line."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    stages = sequential_stages(model)
    ops = [("Fc", 0), ("Fe", 1), ("Offload", 1), ("Fe", 2), ("Loss",), ("B", 2), ("Prefetch", 1), ("B", 1),
           ("Fe", 0), ("B", 0)]  # fmt: skip
    runner = PlanRunner(stages, ops, list(stages.names), in_free=[0, 0, 0])  # a_1 stays after Fe 1
    with pytest.raises(RuntimeError, match=r"Offload 1: stage 1's recorded graph may keep a_1 on the device"):
        runner(torch.randn(3, 4)).sum().backward()


# -- the transfer channel -------------------------------------------------------------------------------
def test_a_value_comes_back_bitwise_equal_with_its_layout():
    base = torch.randn(6, 8)
    value = (base[:, :3], (base.t(), torch.arange(5)), 7, torch.randn(2, 2).to(torch.bfloat16))
    transfers = Transfers(TransferChannel())
    transfers.offload(1, value)
    assert transfers.host_bytes == storage_bytes(value)  # whole storages: what the chain's s_k counts
    back = transfers.prefetch(1)
    assert transfers.host_bytes == 0
    flat_a = [value[0], value[1][0], value[1][1], value[3]]
    flat_b = [back[0], back[1][0], back[1][1], back[3]]
    assert back[2] == 7
    for a, b in zip(flat_a, flat_b, strict=True):
        assert torch.equal(a, b) and a.dtype == b.dtype
        assert a.stride() == b.stride() and a.storage_offset() == b.storage_offset()
        assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()  # a new device copy
    assert back[0].untyped_storage().data_ptr() == back[1][0].untyped_storage().data_ptr()  # still one storage
    with pytest.raises(RuntimeError, match="without a value on the host"):
        transfers.prefetch(1)


def test_the_probe_counts_host_copies_as_host_memory():
    a = torch.randn(64)  # 256 bytes
    with MemoryProbe() as probe:
        probe.track(a)
        transfers = Transfers(TransferChannel())
        transfers.offload(1, a)
        del a
        probe.mark("offloaded")
        assert (probe.current, probe.host_current) == (0, 256)
        back = transfers.prefetch(1)
        probe.mark("prefetched")
        assert (probe.current, probe.host_current) == (256, 0)
        del back
    assert (probe.peak, probe.host_peak) == (256, 256)  # never both on the device


def test_reserved_host_buffers_count_only_while_they_hold_a_copy():
    with MemoryProbe() as probe:
        pool = HostPool(pin=False)
        pool.reserve([256])  # made inside the probe: not an activation, not a copy
        buf = pool.acquire(100)
        host_buffer_used(buf.untyped_storage(), 100)
        probe.mark("in use")
        assert (probe.current, probe.host_current) == (0, 100)
        host_buffer_free(buf.untyped_storage())
        pool.release(buf)
        probe.mark("free")
        assert (probe.current, probe.host_current) == (0, 0)
    assert (probe.peak, probe.host_peak) == (0, 100)


def test_host_allocations_outside_any_probe_cost_nothing():
    with host_allocations():
        t = torch.ones(3)
    assert t.sum().item() == 3.0


def test_host_buffers_are_reserved_once_per_plan_and_reused():
    # a_1 and a_3 are never on the host together: one buffer serves both; a_2 overlaps a_1 and needs its own
    ops = [Op("Offload", 1), Op("Offload", 2), Op("Prefetch", 1), Op("Offload", 3), Op("Prefetch", 3),
           Op("Prefetch", 2)]  # fmt: skip
    sizes = [0, 100, 40, 90]
    assert buffer_sizes(ops, sizes) == [100, 40]
    pool = HostPool(pin=False)
    pool.reserve(buffer_sizes(ops, sizes))
    for _ in range(3):  # steps
        held = {}
        for op in ops:
            if op.kind is OpKind.OFFLOAD:
                held[op.stage] = pool.acquire(sizes[op.stage])
                assert held[op.stage].numel() >= sizes[op.stage]
            else:
                pool.release(held.pop(op.stage))
    assert pool.allocations == 2
    pool.acquire(100), pool.acquire(40)
    pool.acquire(1)  # an unforeseen third value at once: one more buffer, kept
    assert pool.allocations == 3


def test_measure_bandwidth_gives_bytes_per_second():
    rate = measure_bandwidth("cpu", nbytes=2**20, repeats=3)
    assert 0 < rate < float("inf")
    with pytest.raises(ValueError, match="repeats and nbytes must be >= 1"):
        measure_bandwidth("cpu", repeats=0)


# -- CUDA: copy stream, pinned buffers, events (skipped without a GPU) ---------------------------------------
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@needs_gpu
def test_cuda_value_round_trip_through_pinned_buffers():
    value = (torch.randn(256, 256, device="cuda")[:, :100], torch.randn(1000, device="cuda"))
    expected = tuple(t.clone() for t in value)  # contiguous clones: the values, not their layout
    strides = [t.stride() for t in value]  # the layout comes back as it was: a view's strides included
    channel = TransferChannel(reserve=[storage_bytes(value)])
    transfers = Transfers(channel)
    for _ in range(3):
        transfers.offload(1, value)
        del value
        torch.cuda.empty_cache()  # the device copy's memory may go back: the copy stream read it first
        value = transfers.prefetch(1)
        transfers.ready(1)
        for a, b, stride in zip(expected, value, strides, strict=True):
            assert torch.equal(a, b) and b.stride() == stride
        assert all(t.device.type == "cuda" for t in value)
    assert channel.pool is not None and channel.pool.allocations == 1 and channel.pool.buffers[0].is_pinned()


@needs_gpu
def test_cuda_offloaded_plan_trains_bitwise_like_plain_and_reports_host_memory():
    plain, rotor, stages, chain, ops, _, x, y = offload_case("gpt")  # matmuls and dropout: deterministic on CUDA
    plain, rotor, x, y = plain.cuda(), rotor.cuda(), x.cuda(), y.cuda()
    loss = MODELS["gpt"].loss
    torch.manual_seed(5)
    loss(plain(x), y).backward()
    runner = PlanRunner(stages, ops, list(stages.names), in_free=chain.in_free, sizes=chain.sizes)
    torch.manual_seed(5)
    with CudaMemoryProbe() as probe:
        loss(runner(x), y).backward()
    for a, b in zip(grads(plain), grads(rotor), strict=True):
        assert torch.equal(a, b)
    assert probe.host_peak == simulate(chain, ops).host_peak and probe.host_current == 0
    assert runner.channel is not None and runner.channel.pool is not None
    assert runner.channel.pool.allocations == len(buffer_sizes(ops, chain.sizes))


# -- Checkpointable(offload=...) ------------------------------------------------------------------------
def resnet_pair():
    kwargs = MODELS["resnet18"].tiny
    torch.manual_seed(0)
    plain = get_model("resnet18", **kwargs)
    torch.manual_seed(0)
    rotor = get_model("resnet18", **kwargs)
    return plain, rotor, *MODELS["resnet18"].sample(4, **kwargs)


def test_checkpointable_with_offload_trains_bitwise_like_plain():
    """The bandwidth reaches the chain the planner reads; an offloading plan (saved plan state, as the planner
    will make them) runs through Checkpointable's own runner for several steps, bitwise like plain training."""
    plain, model, x, y = resnet_pair()
    rotor = Checkpointable(model, 0.7, offload="12GB/s", host_limit="1MiB")
    entry = rotor.prepare_for(x)
    assert rotor.chain.bandwidth == 12e9 and rotor.chain.host_limit == 2**20 and rotor.bandwidth == 12e9
    chain = uniform_times(rotor.chain)
    recompute = plan(chain, entry.plan.budget, bandwidth=0)  # no offloads: they are inserted below
    ops = with_offloads(chain, recompute.ops)
    assert any(op.kind is OpKind.OFFLOAD for op in ops)
    sim = simulate(chain, ops)
    state = rotor.plan_state()
    state["entries"][0]["chain"] = chain.to_dict()
    state["entries"][0]["plan"] |= {"ops": [op.to_json() for op in ops], "peak": sim.peak, "time": sim.time}
    rotor.load_plan_state(state)

    loss = MODELS["resnet18"].loss
    expected = train(plain, x, y, loss, steps=3)
    got = train(rotor, x, y, loss, steps=3)
    assert rotor.plan.ops == ops  # the plan the steps ran
    assert torch.equal(expected, got)
    assert_same_state(plain, rotor)
    summary = rotor.summary()
    assert "(input offloaded)" in summary and "offloading at 12 GB/s, host limit 1.00 MiB" in summary
    assert f"host memory at most {format_bytes(sim.host_peak)}" in summary
    rotor.zero_grad(set_to_none=True)
    measured = measured_step(rotor, x, y, loss)
    ran = measured.entry
    assert ran is rotor.entry  # a step of one call runs the plan loaded, at the whole budget (calls.step_budgets)
    ran_sim = simulate(ran.chain, ran.plan.ops)
    assert measured.peak <= ran_sim.peak <= rotor.plan.budget
    assert measured.host_peak == ran_sim.host_peak


def test_checkpointable_measures_the_bandwidth_when_offload_is_true():
    _, model, x, _ = resnet_pair()
    rotor = Checkpointable(model, 0.7, offload=True)
    assert rotor.bandwidth is None  # measured when the first signature is profiled
    rotor.prepare_for(x)
    assert rotor.bandwidth is not None and 0 < rotor.bandwidth < float("inf")
    assert rotor.chain.bandwidth == rotor.bandwidth
    assert Checkpointable(resnet_pair()[1], 0.7).prepare_for(x).chain.bandwidth == 0.0  # off by default


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(offload="fast"), r"^offload='fast' is neither True/False nor a bandwidth; .* \('12GB/s'"),
        (dict(offload=-1), r"^offload=-1 is neither True/False nor a bandwidth"),
        (dict(offload=0), r"^offload=0 is neither True/False nor a bandwidth"),
        (dict(offload="12GB"), r"^offload='12GB' is neither True/False nor a bandwidth"),
        (dict(offload=[1]), r"^offload=\[1\] is neither True/False nor a bandwidth"),
        (dict(offload="12GB/s", host_limit="half"), r"^host_limit='half' is not a size: give bytes or a size"),
        (dict(offload="12GB/s", host_limit=0.5), r"^host_limit=0.5 is not a size: .*is a fraction"),
        (dict(host_limit="2GiB"), r"^host_limit='2GiB' bounds offloaded copies; give offload= too"),
    ],
)
def test_bad_offload_settings_are_refused_in_one_line(settings, message):
    with pytest.raises(ValueError, match=message) as err:
        Checkpointable(torch.nn.Sequential(torch.nn.Linear(2, 2)), **settings)
    assert "\n" not in str(err.value)


# -- benchmarks/offload_gpu.py, exercised on CPU ---------------------------------------------------------
def _offload_benchmark():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "offload_gpu.py"
    spec = importlib.util.spec_from_file_location("offload_gpu", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_offload_benchmark_runs_on_cpu_with_measured_peaks_as_predicted(capsys):
    bench = _offload_benchmark()
    assert bench.main(["--cpu", "--models", "resnet18", "--budgets", "0.8", "--repeats", "1"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.lstrip().startswith("resnet18 ")]
    # model, budget (3 words), schedule, offloads, 3 times, pred and meas peak (2 words each), peak/budget, hosts
    assert [row[4] for row in rows] == ["off", "on", "inserted", "saved", "both"]
    for row in rows:
        assert row[9:11] == row[11:13] and float(row[13]) <= 1.0 and row[14:16] == row[16:18]
    for row in rows:  # host memory exactly where a schedule offloads (whether one does depends on measured times)
        assert (int(row[5]) > 0) == (row[14] != "0")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here")
def test_offload_benchmark_needs_cuda_or_cpu_flag(capsys):
    assert _offload_benchmark().main(["--models", "resnet18"]) == 2
    assert "needs CUDA, which is not available here" in capsys.readouterr().err
