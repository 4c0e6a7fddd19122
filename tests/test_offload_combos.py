"""Offloading combined with what else rotor does, on one process (docs/checkpointable.md, "Offloading with the rest"):
shapes fitted without a run (`fit_shapes`, the default), per-stage options, a frozen prefix, compiled stages, and a
real DistributedDataParallel through a Trainer's `RotorDDPStrategy`. Each trains bitwise like plain training, with
the measured peak within the budget, the plans offloading, and no host copy left at the step's end.
FSDP2 with offloading: tests/test_offload_combos_sharded.py.
"""

from __future__ import annotations

import copy
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from fitting import KeepRotorModules, quiet_trainer
from lightning.fabric import Fabric
from test_frozen import frozen_gpt
from test_lightning_offload import Wide, loader, wide_net
from test_shapes import batch, small_gpt
from torch import nn

from lightning_rotor import pipeline
from lightning_rotor.chain import Chain
from lightning_rotor.checkpointable import Checkpointable
from lightning_rotor.fabric import RotorFabricStrategy
from lightning_rotor.lightning import RotorDDPStrategy
from lightning_rotor.memory import MemoryProbe
from lightning_rotor.models.gpt import lm_loss
from lightning_rotor.ops import OpKind
from lightning_rotor.planner import min_feasible_budget
from lightning_rotor.profile import profile_chain
from lightning_rotor.simulate import no_recompute_peak, simulate

FAST = "1000GB/s"  # a copy of these activations always hides behind a forward
GPU_CHAINS = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "gpu_chains"


def same_grads(plain: nn.Module, rotor: nn.Module) -> bool:
    pairs = zip(plain.parameters(), rotor.parameters(), strict=True)
    return all((a.grad is None and b.grad is None) or torch.equal(a.grad, b.grad) for a, b in pairs)


def step_beside_plain(plain: nn.Module, rotor: Checkpointable, x, y, loss_fn, seed: int) -> MemoryProbe:
    """One step of each from zero gradients, the same seed (dropout); rotor's measured with a probe of its own."""
    plain.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss_fn(plain(x), y).backward()
    rotor.zero_grad(set_to_none=True)
    rotor.prepare_for(x)
    torch.manual_seed(seed)
    probe = MemoryProbe(rotor)
    with rotor.measure_step(probe):
        loss_fn(rotor(x), y).backward()
    return probe


def check_step(plain: nn.Module, rotor: Checkpointable, probe: MemoryProbe) -> None:
    entry = rotor.last_entry
    assert same_grads(plain, rotor)
    assert probe.peak <= entry.plan.budget, (probe.peak, entry.plan.budget)
    assert probe.host_current == 0 and probe.host_peak <= entry.plan.host_peak


def offloads(rotor: Checkpointable) -> bool:
    return any(op.kind.is_transfer for entry in rotor.entries.values() for op in entry.plan.ops)


def test_fitted_shapes_offload_the_bytes_a_profile_measures_and_train_bitwise():
    """A length between measured ones gets its sizes fitted without a run, its offloadable bytes too (they were a
    constant to the trace: every shape was measured again, fitting off with one warning)."""
    plain, rotor = small_gpt(), Checkpointable(small_gpt(), "50%", repeats=1, offload=FAST)
    for step, length in enumerate((4, 32, 12, 24, 8, 28)):
        x, y = batch(length)
        check_step(plain, rotor, step_beside_plain(plain, rotor, x, y, lm_loss, step))
    assert len(rotor.fitted) >= 2 and offloads(rotor)
    for key in rotor.fitted:
        chain = rotor.entries[key].chain
        length = next(n for n in (12, 8, 24, 28) if f"(2, {n})" in key)
        x = batch(length)[0]
        measured = profile_chain(list(rotor.stages), x, names=rotor.stage_names, repeats=1, timed=False, offload=True)
        assert chain.offloadable == measured.chain.offloadable and any(chain.offloadable)
        assert chain.bandwidth == 1e12


def test_stage_options_and_offloading_plan_together_and_train_bitwise():
    plain, rotor = small_gpt(), Checkpointable(small_gpt(), "50%", repeats=1, offload=FAST, options=True)
    x, y = batch(16)
    for step in range(2):
        check_step(plain, rotor, step_beside_plain(plain, rotor, x, y, lm_loss, step))
    assert rotor.chain.options and offloads(rotor)


def test_a_frozen_prefix_runs_once_while_the_rest_offloads():
    model, x, y, loss_fn = frozen_gpt()
    plain, rotor = copy.deepcopy(model), Checkpointable(copy.deepcopy(model), "95%", repeats=1, offload=FAST)
    for step in range(2):
        check_step(plain, rotor, step_beside_plain(plain, rotor, x, y, loss_fn, step))
    chain, ops = rotor.chain, rotor.plan.ops
    assert chain.frozen > 0 and offloads(rotor)
    assert all(op.stage is None or op.stage >= chain.frozen for op in ops if op.kind.is_transfer)
    assert rotor.last_entry.runs[: chain.frozen] == [1] * chain.frozen


@pytest.mark.slow  # compiles each stage
def test_compiled_stages_offload_and_train_bitwise():
    plain, rotor = small_gpt(), Checkpointable(small_gpt(), "50%", repeats=1, offload=FAST, compile=True)
    x, y = batch(16)
    for step in range(2):
        check_step(plain, rotor, step_beside_plain(plain, rotor, x, y, lm_loss, step))
    assert offloads(rotor)


def ddp_offloading_case(folder: str) -> None:
    """Plain DDP and RotorDDPStrategy with offloading, 3 steps each, parameters torch.equal (run in a child)."""
    plain, rotor, keep = Wide(), Wide(), KeepRotorModules()
    quiet_trainer(Path(folder) / "plain", "ddp", devices=1, max_steps=3).fit(plain, loader())
    strategy = RotorDDPStrategy(mem_limit="60%", offload=FAST)
    quiet_trainer(Path(folder) / "rotor", strategy, devices=1, max_steps=3, callbacks=[keep]).fit(rotor, loader())
    (chain,) = keep.modules.values()
    assert any(op.kind in (OpKind.OFFLOAD, OpKind.OFFLOAD_SAVED) for op in chain.plan.ops)
    for a, b in zip(plain.net.state_dict().values(), rotor.net.state_dict().values(), strict=True):
        assert torch.equal(a, b)


CHILD = """
import os, sys, traceback
sys.path[:0] = [{tests!r}]
import conftest, test_offload_combos
try:
    test_offload_combos.ddp_offloading_case({folder!r})
except BaseException:
    traceback.print_exc()
    os._exit(1)
os._exit(0)
"""


@pytest.mark.slow  # a child interpreter, two fits each starting a process group
def test_ddp_strategy_offloading_trains_like_plain_ddp(tmp_path):
    """A real DistributedDataParallel (Lightning's, one process: its reducer and accumulator hooks run as with
    several) around a chain whose plan offloads. In a child that leaves by `os._exit`: freeing a DDP reducer
    joins its gloo group's threads, which hung the whole suite at times (torch 2.13), and the group Lightning
    leaves up would make later tests of this process run as distributed."""
    code = CHILD.format(tests=str(Path(__file__).resolve().parent), folder=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def _fabric_fit(strategy) -> tuple[nn.Module, object]:
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=1)
    model = wide_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    wrapped, opt = fabric.setup(model, opt)
    for step, (x, y) in enumerate(loader()):
        if step == 3:
            break
        opt.zero_grad()
        fabric.backward(F.cross_entropy(wrapped(x), y))
        opt.step()
    return model, strategy


def test_fabric_offloading_trains_like_plain_fabric():
    plain, _ = _fabric_fit("auto")
    rotor, strategy = _fabric_fit(RotorFabricStrategy(mem_limit="60%", offload=FAST, measure_every_n_steps=0))
    assert any(op.kind.is_transfer for op in strategy.chains["model"].last_entry.plan.ops)
    for a, b in zip(plain.state_dict().values(), rotor.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def _sped_up(chain: Chain, factor: float) -> Chain:
    return dataclasses.replace(
        chain, fwd_time=[t * factor for t in chain.fwd_time], bwd_time=[t * factor for t in chain.bwd_time]
    )


@pytest.mark.parametrize("name", ["resnet101", "gpt2_medium"])
def test_a_plan_holds_its_peak_when_its_ops_run_faster_or_its_copies_slower_than_planned(name):
    """An offload frees its bytes when its copy ends: a plan whose ops counted on the times for that ran above its
    peak, and its budget, when compute ran faster than profiled (under FSDP2, every rank but the slowest: the ranks
    plan on the largest times) or the link slower (before: GPT-2-medium 10% above at 0.8x its times). The plan
    rotor runs waits for such a copy where the times alone ended it: the same peak and time as planned."""
    chain = Chain.load(GPU_CHAINS / f"{name}.json").with_transfer(12e9)
    low, high = min_feasible_budget(chain), no_recompute_peak(chain)
    chosen = pipeline.plan_chain(chain, int(low + 0.3 * (high - low)))
    planned = simulate(chain, chosen.ops)
    assert planned.peak == chosen.peak and planned.time == pytest.approx(chosen.time, rel=1e-12)
    assert any(op.kind.is_transfer for op in chosen.ops)
    for factor in (0.9, 0.8, 0.5):
        assert simulate(_sped_up(chain, factor), chosen.ops).peak <= chosen.peak, factor
    assert simulate(chain.with_transfer(0.7 * 12e9), chosen.ops).peak <= chosen.peak
