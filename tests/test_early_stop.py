"""Early-stopping recomputation: where a plan runs `Fc k`, keeps `a_k` and runs `Fe k` right before `B k`,
the executor records stage k under torch's non-reentrant checkpoint and `B k` reruns it only until its
backward's tensors are made again (NOTE: [early-stopping recomputation] in lightning_rotor/execute.py).

Each plan here trains bitwise like plain autograd with dropout on, and its measured memory stays within
what the simulator charges the plan; the forward hooks show that the blocks' reruns stop early.
"""

import copy
import threading

import pytest
import torch
from training import grads

from lightning_rotor import Checkpointable, MemoryProbe
from lightning_rotor.execute import PlanRunner
from lightning_rotor.models.gpt import gpt, lm_loss
from lightning_rotor.profile import profile_chain
from lightning_rotor.simulate import simulate
from lightning_rotor.stages import sequential_stages


def small_gpt():
    torch.manual_seed(0)
    return gpt(vocab_size=64, block_size=16, n_layer=6, n_head=2, n_embd=16, dropout=0.1).train()


def data():
    g = torch.Generator().manual_seed(1)
    return torch.randint(64, (4, 16), generator=g), torch.randint(64, (4, 16), generator=g)


def hf_schedule(length):
    """Hugging Face's schedule: every stage input kept in the forward, each stage recorded just before its backward."""
    ops = [("Fc", k) for k in range(length - 1)] + [("Fe", length - 1), ("Loss",), ("B", length - 1)]
    for k in range(length - 2, -1, -1):
        ops += [("Fe", k), ("B", k)]
    return ops


def mixed_schedule(length):
    """Stages 3 … L-2 and 0, 1 stop early (1 and 0 from an `Fc` that is itself a recomputation); stage 2 is
    recomputed as before (its `Fe 2` follows an `Fn 2`), stage L-1 is recorded in the forward."""
    ops = [("Fc", 0), ("Fn", 1), ("Fn", 2)] + [("Fc", k) for k in range(3, length - 1)]
    ops += [("Fe", length - 1), ("Loss",), ("B", length - 1)]
    for k in range(length - 2, 2, -1):
        ops += [("Fe", k), ("B", k)]
    return ops + [("Fc", 0), ("Fc", 1), ("Fe", 2), ("B", 2), ("Fe", 1), ("B", 1), ("Fe", 0), ("B", 0)]


def run_step(run, model, x, y, probe=None):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    if probe is None:
        lm_loss(run(x), y).backward()
        return
    with probe:
        probe.track(x)
        loss = lm_loss(run(x), y)
        loss.backward()
        del loss


def unfinished_forwards(model):
    """Per block, how many of its forwards started but did not run to the end: a rerun that torch's checkpoint
    stops early raises out of the forward, so the block's forward hook never fires for it."""
    counts = dict.fromkeys(range(len(model.blocks)), 0)

    def count(i, by):
        counts[i] += by

    for i, block in enumerate(model.blocks):
        block.register_forward_pre_hook(lambda *_, i=i: count(i, 1))
        block.register_forward_hook(lambda *_, i=i: count(i, -1))
    return counts


@pytest.mark.parametrize("schedule", [hf_schedule, mixed_schedule])
def test_early_stop_trains_bitwise_like_plain_within_the_plans_memory(schedule):
    x, y = data()
    plain, rotor = small_gpt(), small_gpt()
    run_step(plain, plain, x, y)
    stages = sequential_stages(rotor)
    names = list(stages.names)
    chain = profile_chain(stages, x, names=names).chain
    ops = schedule(len(stages))
    runner = PlanRunner(stages, ops, names, in_free=chain.in_free)
    expected_early = set(range(len(stages) - 1)) if schedule is hf_schedule else {0, 1, *range(3, len(stages) - 1)}
    assert runner.early == expected_early
    for _ in range(2):  # the second step replays what the first learnt (quiet stages, mutated buffers)
        counts = unfinished_forwards(rotor) if _ == 1 else None
        runner.probe = probe = MemoryProbe(rotor)
        run_step(runner, rotor, x, y, probe)
        for a, b in zip(grads(plain), grads(rotor), strict=True):
            assert torch.equal(a, b)
        predicted = simulate(chain, ops)
        assert probe.peak <= predicted.peak
        measured = [nbytes for _, _, nbytes in probe.marks]
        assert all(m <= p for m, p in zip(measured, predicted.curve, strict=True)), (measured, predicted.curve)
    # blocks.i is stage i+1: an early-stopped block's rerun stops before its end (the residual add after
    # the last dropout saves nothing); in the mixed plan blocks.1 (stage 2) is recomputed whole as before
    assert counts == {i: int(i + 1 in runner.early) for i in range(6)}


def test_with_another_thread_alive_the_rerun_draws_from_the_recorded_states():
    """An ordinary thread alive: no rewinding, each random op replayed from its recorded state (rng.py)."""
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        x, y = data()
        plain, rotor = small_gpt(), small_gpt()
        run_step(plain, plain, x, y)
        rng_after_plain = torch.get_rng_state()
        stages = sequential_stages(rotor)
        names = list(stages.names)
        chain = profile_chain(stages, x, names=names).chain
        runner = PlanRunner(stages, mixed_schedule(len(stages)), names, in_free=chain.in_free)
        assert runner.early
        run_step(runner, rotor, x, y)
        assert torch.equal(torch.get_rng_state(), rng_after_plain)  # the global stream as in plain training
        for a, b in zip(grads(plain), grads(rotor), strict=True):
            assert torch.equal(a, b)
    finally:
        stop.set()
        thread.join()


def test_without_early_stop_every_recomputation_runs_the_whole_stage():
    x, y = data()
    rotor = small_gpt()
    stages = sequential_stages(rotor)
    names = list(stages.names)
    chain = profile_chain(stages, x, names=names).chain
    runner = PlanRunner(stages, hf_schedule(len(stages)), names, in_free=chain.in_free, early_stop=False)
    assert runner.early == set()
    counts = unfinished_forwards(rotor)
    run_step(runner, rotor, x, y)
    assert counts == dict.fromkeys(range(6), 0)


def test_early_stop_replays_autocast():
    x, y = data()
    plain, rotor = small_gpt(), small_gpt()
    stages = sequential_stages(rotor)
    names = list(stages.names)
    chain = profile_chain(stages, x, names=names).chain
    runner = PlanRunner(stages, hf_schedule(len(stages)), names, in_free=chain.in_free)
    assert runner.early
    for run, model in ((plain, plain), (runner, rotor)):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(3)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = lm_loss(run(x), y)
        loss.backward()
    for a, b in zip(grads(plain), grads(rotor), strict=True):
        assert torch.equal(a, b)


def test_a_stage_input_the_plan_lets_go_at_fe_keeps_the_whole_recomputation():
    """`in_free[k] > 0`: the plan frees part of `a_k` at `Fe k`, which a checkpoint would hold through `B k`."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 5))
    x = torch.randn(8, 16)
    stages = sequential_stages(model)
    names = list(stages.names)
    chain = profile_chain(stages, x, names=names).chain
    assert chain.in_free[1] > 0 and chain.in_free[2] == 0  # Tanh keeps its output, not the Linear's
    ops = [("Fc", 0), ("Fc", 1), ("Fe", 2), ("Loss",), ("B", 2), ("Fe", 1), ("B", 1), ("Fe", 0), ("B", 0)]
    assert PlanRunner(stages, ops, names, in_free=chain.in_free).early == {0}
    assert PlanRunner(stages, ops, names).early == set()  # without the chain's figures: never


transformers = pytest.importorskip("transformers")


def hf_gpt2():
    config = transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=4, n_head=2, use_cache=False)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).train()  # dropout 0.1 everywhere


def labels_step(model, x):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    model(input_ids=x, labels=x).loss.backward()


def test_hugging_face_gpt2_at_its_own_checkpointing_peak_stops_early_bitwise_and_within_it():
    x = torch.randint(256, (4, 32), generator=torch.Generator().manual_seed(0))
    model = hf_gpt2()
    plain = copy.deepcopy(model)
    labels_step(plain, x)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with MemoryProbe(model) as probe:
        labels_step(model, x)
    hf_peak = probe.peak
    model.gradient_checkpointing_disable()
    rotor = Checkpointable(copy.deepcopy(model), hf_peak, discover="modules", repeats=1, early_stop=True)
    labels_step(rotor, x)  # profiles and plans
    assert rotor.last_entry is not None and rotor.last_entry.runner.early
    with MemoryProbe(rotor) as probe:
        labels_step(rotor, x)
    assert probe.peak <= hf_peak  # the budget
    off = Checkpointable(copy.deepcopy(model), hf_peak, discover="modules", repeats=1, early_stop=False)
    labels_step(off, x)
    assert off.last_entry is not None and not off.last_entry.runner.early
    for (n, a), (m, b) in zip(plain.named_parameters(), rotor.module.named_parameters(), strict=True):
        assert n == m and torch.equal(a.grad, b.grad), n
