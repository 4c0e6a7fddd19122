"""The executor follows `Wait k` / `WaitSaved k` and the planner's debt runs (issue 28): bitwise like plain training,
device memory within the simulator's op by op (so within the budget), host memory the simulator's, and back to 0.

On the CPU a copy is done when issued, so a wait has nothing to wait for; on CUDA the host waits for the copy's event
(`Transfers.wait`), so that the allocator may reuse the bytes before the next op allocates.
"""

import pytest
import torch
from test_offload_saved import (
    CASES,
    FAST,
    cuda_steps_bitwise,
    needs_gpu,
    run_measured,
    runner_for,
    saved_case,
    with_saved_offloads,
)
from training import uniform_times

from lightning_rotor.models import MODELS
from lightning_rotor.ops import Op, OpKind
from lightning_rotor.planner import min_feasible_budget, plan
from lightning_rotor.profile import profile_chain
from lightning_rotor.simulate import no_recompute_peak, simulate


def with_waits(ops):
    """`ops` with a wait right after every offload: each copy ends before the next op, whatever its length."""
    out = []
    for op in ops:
        out.append(op)
        if op.kind is OpKind.OFFLOAD_SAVED:
            out.append(Op(OpKind.WAIT_SAVED, op.stage))
        elif op.kind is OpKind.OFFLOAD:
            out.append(Op(OpKind.WAIT, op.stage))
    return out


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n == "gpt" else n for n in CASES]
)  # the GPT case takes 6 s here
def test_waits_run_bitwise_within_the_simulated_memory(name):
    plain, rotor, stages, chain, ops, _, x, y = saved_case(name)
    waited = with_waits(ops)
    assert any(op.kind is OpKind.WAIT_SAVED for op in waited)
    probe, sim = run_measured(name, rotor, plain, stages, chain, waited, x, y, seed=7)
    assert probe.peak <= sim.peak


def test_the_planners_debt_runs_and_waits_run_bitwise_within_budget():
    """A link at which a GPT block's saved part takes about three forwards to copy (forwards 1 s, backwards 2 s):
    the plan moves parts over several ops and waits where the memory needs it; the run keeps to the budget."""
    plain, rotor, stages, chain, _, _, x, y = saved_case("gpt")
    parts = [p for p in chain.offloadable if p > 0]
    slow = chain.with_transfer(max(parts) / 3.0)
    low, high = min_feasible_budget(slow), no_recompute_peak(slow)
    assert low < min_feasible_budget(slow, bandwidth=0) or low == min_feasible_budget(slow, bandwidth=0)
    budget = int(low + 0.2 * (high - low))
    chosen = plan(slow, budget)
    ops = chosen.ops
    assert any(op.kind is OpKind.OFFLOAD_SAVED for op in ops)
    runs = [i for i, op in enumerate(ops) if op.kind is OpKind.OFFLOAD_SAVED and ops[i + 1].kind is OpKind.FE]
    assert runs  # a part moving while later stages run forward
    probe, sim = run_measured("gpt", rotor, plain, stages, slow, ops, x, y, seed=7)
    assert probe.peak <= sim.peak <= budget


@needs_gpu
def test_cuda_waits_train_bitwise_like_plain(monkeypatch):
    """On CUDA a wait blocks the host on the copy's event; gradients stay bitwise, the host memory goes back."""
    plain, rotor, stages, _, _, _, x, y = saved_case("gpt")
    plain, rotor, x, y = plain.cuda(), rotor.cuda(), x.cuda(), y.cuda()
    chain = uniform_times(profile_chain(stages, x, names=list(stages.names), offload=True).chain).with_transfer(FAST)
    low, high = min_feasible_budget(chain), no_recompute_peak(chain)
    recompute = plan(chain, int(low + CASES["gpt"][1] * (high - low)), bandwidth=0)
    waited = with_waits(with_saved_offloads(chain, recompute.ops))
    assert any(op.kind is OpKind.WAIT_SAVED for op in waited)
    for probe in cuda_steps_bitwise(plain, rotor, runner_for(stages, chain, waited), MODELS["gpt"].loss, x, y):
        assert probe.host_peak == simulate(chain, waited).host_peak > 0 and probe.host_current == 0


def wide_run_at(ops) -> int | None:
    """Where a run moves two parts at once: `Fe k, OffloadSaved k, Fe k+1, OffloadSaved k+1` with no wait between."""
    for i in range(len(ops) - 3):
        a, b, c, d = ops[i : i + 4]
        k = a.stage
        if (a.kind, b, c, d) == (
            OpKind.FE,
            Op(OpKind.OFFLOAD_SAVED, k),
            Op(OpKind.FE, k + 1),
            Op(OpKind.OFFLOAD_SAVED, k + 1),
        ):
            return i
    return None


def test_wide_runs_run_bitwise_within_budget():
    """ResNet-18 (BatchNorm) at a link where its largest saved part takes three forwards to copy: the plan's run
    moves the parts of several consecutive stages, queued on the channel, and brings them back ahead of their
    backwards; the step is bitwise plain training's, within the simulator op by op, the host back to 0."""
    plain, rotor, stages, chain, _, _, x, y = saved_case("resnet18")
    slow = chain.with_transfer(max(chain.offloadable) / 3.0)
    low, high = min_feasible_budget(slow), no_recompute_peak(slow)
    budget = int(low + 0.6 * (high - low))
    chosen = plan(slow, budget)
    ops = chosen.ops
    assert wide_run_at(ops) is not None
    assert chosen.recompute_only_time is not None and chosen.time < chosen.recompute_only_time
    probe, sim = run_measured("resnet18", rotor, plain, stages, slow, ops, x, y, seed=7)
    assert probe.peak <= sim.peak <= budget
    on_host = [k for k, part in enumerate(slow.offloadable) if part]
    assert sim.host_peak > max(slow.offloadable[k] for k in on_host)  # several parts on the host at once


@needs_gpu
def test_cuda_wide_runs_train_bitwise_like_plain(monkeypatch):
    """On CUDA the run's copies queue on the copy stream, `WaitSaved e` waits for the last of them, each backward
    for its own part's prefetch event: gradients stay bitwise over two steps, the host memory goes back to 0. The
    ops are the CPU-profiled chain's plan (the op sequence is valid whatever the device's sizes)."""
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)  # plain and rotor pick the same kernels
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    plain, rotor, stages, chain, _, _, x, y = saved_case("resnet18")
    slow = chain.with_transfer(max(chain.offloadable) / 3.0)
    low, high = min_feasible_budget(slow), no_recompute_peak(slow)
    ops = plan(slow, int(low + 0.6 * (high - low))).ops
    assert wide_run_at(ops) is not None
    plain, rotor, x, y = plain.cuda(), rotor.cuda(), x.cuda(), y.cuda()
    for probe in cuda_steps_bitwise(plain, rotor, runner_for(stages, slow, ops), MODELS["resnet18"].loss, x, y):
        assert probe.host_peak > 0 and probe.host_current == 0
