"""The profiler measures the memory model's quantities exactly and leaves no trace."""

import statistics
import time

import pytest
import torch
from torch import nn

from lightning_rotor.profile import MIN_ROUNDS, profile_chain
from lightning_rotor.stages import sequential_stages


def test_sizes_of_known_stages():
    # batch 16, width 64, float32: every activation is 4096 bytes
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.5), nn.Flatten(), nn.Linear(64, 8))
    stages = sequential_stages(model)
    names = list(stages.names)
    x = torch.randn(16, 64)
    chain = profile_chain(stages, x, names=names).chain
    assert chain.names == ["0", "1", "2", "3", "4"]
    assert chain.out_size == [4096, 4096, 4096, 4096, 16 * 8 * 4]
    # Linear keeps its input (a_k, not counted): saved = output alone; ReLU keeps its output
    assert chain.saved_size[0] == 4096
    assert chain.saved_size[1] == 4096
    # Dropout keeps a float mask beside its output
    assert chain.saved_size[2] == 2 * 4096
    # Flatten returns a view of its input: a_k's storage, held beside ā_{k+1} anyway, adds nothing
    assert chain.saved_size[3] == 0
    assert chain.fwd_tmp[0] == 0
    # backward of the first Linear makes the weight gradient before it is stored in .grad; it is
    # a transient above δ_0 (charged apart by the model, not computed here as x needs no grad)
    assert chain.bwd_tmp[0] + 16 * 64 * 4 >= 64 * 64 * 4
    # what each stage's own graph does not keep of its output is released before its backward:
    # Linear and Dropout outputs (not saved), not ReLU's (saved) nor Flatten's (a view of its input)
    assert chain.out_free == [4096, 0, 4096, 0, 16 * 8 * 4]
    # the view's backward makes δ_3 (a copy of δ_4 in the input's .grad: the profiler measures B k on a leaf,
    # whose accumulator's copy the executor, catching δ_3 as a view, does not make; safe side)
    assert chain.bwd_tmp[3] == 0
    # cross-entropy keeps float32 log-probabilities and makes their gradient; a plain a_L handed to it is
    # freed after its forward (one output-sized tensor above a_L and δ_L), a kept one is not (two); the peak
    # comes in the loss's backward, where its value and the gradient backward() seeds it with exist
    value = 2 * 4  # two float32 scalars
    assert chain.loss_tmp == 16 * 8 * 4 + value
    assert chain.loss_tmp_kept == 2 * 16 * 8 * 4 + value
    # and they stay to the end of the step: loss_value, no longer counted with a_0 (chain version 3)
    assert chain.loss_value == value
    assert chain.input_size == 16 * 64 * 4


def test_profiling_leaves_parameters_grads_buffers_and_rng_untouched():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 2))
    for p in model.parameters():
        p.grad = torch.full_like(p, 7.0)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    grads = [p.grad for p in model.parameters()]
    rng = torch.get_rng_state()
    stages = sequential_stages(model)
    names = list(stages.names)
    profile_chain(stages, torch.randn(4, 8, generator=torch.Generator().manual_seed(1)), names=names)
    assert torch.equal(torch.get_rng_state(), rng)
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
    for p, g in zip(model.parameters(), grads, strict=True):
        assert p.grad is g and torch.equal(g, torch.full_like(p, 7.0))


def test_sizes_are_deterministic_and_times_are_reported_with_their_spread():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(inplace=True), nn.Flatten(), nn.Linear(288, 4))
    stages = sequential_stages(model)
    names = list(stages.names)
    x = torch.randn(2, 3, 8, 8)
    first = profile_chain(stages, x, names=names, repeats=4, warmup=2)
    second = profile_chain(stages, x, names=names, repeats=4, warmup=2)
    for field in ("out_size", "saved_size", "fwd_tmp", "bwd_tmp"):
        assert getattr(first.chain, field) == getattr(second.chain, field)
    assert all(t > 0 for t in first.chain.fwd_time + first.chain.bwd_time)
    assert len(first.fwd_spread) == first.chain.length and first.spread >= 0
    assert first.seconds > 0 and first.threads == torch.get_num_threads()
    # timing rounds: at least MIN_ROUNDS, at most `repeats`, each the sum of every stage's forward and backward
    assert MIN_ROUNDS <= first.repeats <= 4 and len(first.round_seconds) == first.repeats
    predicted = sum(first.chain.fwd_time) + sum(first.chain.bwd_time)
    assert statistics.median(first.round_seconds) == pytest.approx(predicted)


def test_bf16_autocast_profile_is_smaller_than_float32():
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    stages = sequential_stages(model)
    names = list(stages.names)
    x = torch.randn(32, 64)
    full = profile_chain(stages, x, names=names).chain
    with torch.autocast("cpu", dtype=torch.bfloat16):
        half = profile_chain(stages, x, names=names).chain
    assert half.out_size == [s // 2 for s in full.out_size]


def test_bad_arguments():
    stages = sequential_stages(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="repeats"):
        profile_chain(stages, torch.randn(1, 2), repeats=0)
    with pytest.raises(TypeError, match="tensor"):
        profile_chain(stages, "not a tensor")
    with pytest.raises(TypeError, match="nn.Sequential"):
        sequential_stages(nn.Linear(2, 2))


class Pair(nn.Module):
    def forward(self, x):
        return x * 2, x * 3


class TanhPlus(nn.Module):  # keeps tanh's output, neither input
    def forward(self, pair):
        a, b = pair
        return torch.tanh(a) + b


class SinPlus(nn.Module):  # keeps its first input (sin's backward needs it), not the second
    def forward(self, pair):
        a, b = pair
        return torch.sin(a) + b


@pytest.mark.parametrize(("second", "released"), [(TanhPlus, 2 * 4 * 8 * 4), (SinPlus, 0)])
def test_in_free_counts_a_stage_input_neither_graph_keeps_all_or_nothing(second, released):
    """`in_free[k]`: bytes of `a_k` that neither stage k-1's nor stage k's graph keeps (docs/memory-model.md).

    A tuple kept in part counts nothing: the executor lets go of a plain input whole or not at all.
    """
    model = nn.Sequential(nn.Linear(8, 8), Pair(), second(), nn.Linear(8, 8), nn.Flatten(0), nn.Tanh())
    chain = profile_chain(sequential_stages(model), torch.randn(4, 8)).chain
    # a_1: neither Linear 0 (keeps its input) nor Pair (x * 2 keeps nothing) keeps it; a_2, the pair: as the
    # parameter says; a_3: Linear 3 keeps its input; a_4: Flatten's output is a view of it, held with ā_5;
    # a_5: a view of a_4, no storage of its own
    assert chain.in_free == [0, 4 * 8 * 4, released, 0, 0, 0]


class Burst(nn.Module):
    """A Linear whose forward sleeps on `calls` calls in a row from call `at`, picked by a call counter."""

    def __init__(self, at: int, calls: int, seconds: float):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.stalled, self.seconds, self.calls = range(at, at + calls), seconds, 0

    def forward(self, x):
        self.calls += 1
        if self.calls in self.stalled:
            time.sleep(self.seconds)
        return self.linear(x)


@pytest.mark.parametrize("calls", [1, 2])
@pytest.mark.parametrize("at", [3, 4, 5])
def test_stalled_runs_of_one_stage_do_not_decide_the_plan(at, calls):
    # calls 1, 2 and 4 measure memory; call 3, the run that tells what the stage's graph keeps, is its first
    # timing sample (NOTE: [the first timing sample in the walk]), call 5 on are the timing rounds'. Stalled runs
    # of it, one or a burst of two one after the other, must not make it look dearer than its twin stage 0 (the
    # plan would change); a single one must not decide the predicted step either
    stall = 0.25
    burst = Burst(at, calls, stall)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), burst, nn.Tanh(), nn.Linear(8, 2))
    stages = sequential_stages(model)
    chain = profile_chain(stages, torch.randn(4, 8), names=list(stages.names)).chain
    assert burst.calls >= at + calls - 1  # the stall happened during profiling
    assert chain.fwd_time[2] < 50 * chain.fwd_time[0], chain.fwd_time  # twins: the stall would make it ~10^4
    if calls == 1:
        assert sum(chain.fwd_time) + sum(chain.bwd_time) < stall / 5


def test_a_measured_loss_with_parameters_of_its_own_leaves_their_grad_alone():
    head = nn.Linear(8, 3)
    held = [torch.full_like(p, 5.0) for p in head.parameters()]
    for p, g in zip(head.parameters(), held, strict=True):
        p.grad = g
    stages = sequential_stages(nn.Sequential(nn.Linear(8, 8), nn.Tanh()))
    profile_chain(
        stages,
        torch.randn(4, 8),
        names=list(stages.names),
        loss_tmp=lambda out: nn.functional.cross_entropy(head(out), torch.zeros(4, dtype=torch.long)),
    )
    for p, g in zip(head.parameters(), held, strict=True):
        assert p.grad is g and torch.equal(g, torch.full_like(g, 5.0))


def test_a_sizes_only_profile_runs_each_stage_four_times():
    """NOTE: [the no-grad run comes last]: a stage's sizes take its two recorded runs (`Fe` then `B`, with and
    without stored gradients), the run that finds whether its graph keeps its input, and the no-grad run whose
    output is the next stage's input: four forwards, not five (a separate forward made the next input)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Dropout(0.1), nn.Linear(32, 8))
    calls = [0] * len(model)
    for k, layer in enumerate(model):
        layer.register_forward_pre_hook(lambda *_, k=k: calls.__setitem__(k, calls[k] + 1))
    profile_chain(sequential_stages(model), torch.randn(4, 32), timed=False)
    assert calls == [3, 4, 4, 4]  # stage 0's input is a_0, the caller's: never released, no run to tell


def test_timing_rounds_stop_once_every_stage_is_settled():
    """NOTE: [settled timing]: another round is run only while some stage's two fastest runs disagree by more than
    10% of the faster (and 1% of a round): a stalled run is then possibly its fastest."""
    from lightning_rotor.profile import _settled

    steady = [[1.00, 1.05], [2.00, 2.10]]  # forward runs of two stages, two rounds
    assert _settled(steady, [[2.0, 2.1], [4.0, 3.9]], 9.0)
    assert not _settled(steady, [[2.0, 2.1], [4.0, 6.0]], 9.0)  # a stage's backward stalled in one round
    third = [[1.00, 1.05, 1.02], [2.00, 2.10, 2.05]]
    assert _settled(third, [[2.0, 2.1, 2.0], [4.0, 6.0, 3.9]], 9.0)  # a third round: its two fastest agree
    assert _settled([[0.010, 0.018]], [[0.01, 0.01]], 9.0)  # a tiny stage: 8 ms apart is within 1% of a round


class Counted(nn.Module):
    """A module that counts its forward calls."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module, self.calls = module, 0

    def forward(self, x):
        self.calls += 1
        return self.module(x)


@pytest.mark.parametrize("repeats", [1, 2])
def test_a_timed_profile_takes_each_stage_first_sample_in_the_walk(repeats):
    """NOTE: [the first timing sample in the walk]: the run that tells what a stage's graph keeps of its input is
    timed, with its backward, as the stage's first sample, so that a timed profile runs one timing round fewer
    (its forward and the next input's): the middle stage runs 4 forwards for its figures and 2 per round after the
    first (its `Fe` and the next input). Figures as a sizes-only profile's; every stage has `repeats` samples."""
    stages = sequential_stages(nn.Sequential(nn.Linear(8, 8), Counted(nn.Linear(8, 8)), nn.Tanh(), nn.Linear(8, 2)))
    middle = stages[1]
    x = torch.randn(4, 8)
    sizes = profile_chain(stages, x, timed=False)
    assert middle.calls == 4
    middle.calls = 0
    timed = profile_chain(stages, x, repeats=repeats)
    assert timed.repeats == len(timed.round_seconds) == repeats
    assert middle.calls == 4 + 2 * (repeats - 1)
    assert all(t > 0 for t in timed.chain.fwd_time + timed.chain.bwd_time)
    as_sizes = {"fwd_time": [0.0] * 4, "bwd_time": [0.0] * 4}
    assert {**timed.chain.to_dict(), **as_sizes} == {**sizes.chain.to_dict(), **as_sizes}


class Entries(nn.Module):
    """A Linear that notes how each forward got its input: a leaf, entered through a node, or without grad."""

    def __init__(self):
        super().__init__()
        self.linear, self.seen = nn.Linear(8, 8), []

    def forward(self, x):
        self.seen.append("nograd" if not torch.is_grad_enabled() else ("leaf" if x.is_leaf else "entered"))
        return self.linear(x)


def test_warmup_runs_come_before_the_first_timing_sample():
    """`warmup` untimed runs of a stage come before any timed run of it, the first timing sample in the walk (the
    run entered through `EnterStage`, NOTE: [the first timing sample in the walk]) included: after the two
    recorded runs, then the next input made without grad; the round after the walk times it once more."""
    stage = Entries()
    stages = sequential_stages(nn.Sequential(nn.Linear(8, 8), stage, nn.Tanh()))
    profile_chain(stages, torch.randn(4, 8), repeats=2, warmup=2)
    assert stage.seen == ["leaf"] * 2 + ["leaf"] * 2 + ["entered", "nograd"] + ["leaf", "nograd"]
