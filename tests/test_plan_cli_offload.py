"""`lightning-rotor plan --bandwidth`: offloading plans beside recompute-only ones (needs the planner of issue 19)."""

import json
from pathlib import Path

import pytest

from lightning_rotor.chain import Chain
from lightning_rotor.plan_cli import main
from lightning_rotor.planner import min_feasible_budget, plan
from lightning_rotor.simulate import no_recompute_peak, simulate

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
RESNET = EXAMPLES / "resnet50_b32.json"


def runway(path: Path) -> Chain:
    """Twelve equal stages: checkpoints of 100 bytes, each copied in 0.1 ms at 1 MB/s behind 1 s forwards."""
    chain = Chain(
        input_size=100,
        out_size=[100] * 12,
        saved_size=[150] * 12,
        fwd_time=[1.0] * 12,
        bwd_time=[2.0] * 12,
        fwd_tmp=[0] * 12,
        bwd_tmp=[0] * 12,
    )
    chain.save(path)
    return chain


def test_summary_puts_recompute_only_beside(capsys):
    assert main([str(RESNET), "--mem-limit", "40%", "--bandwidth", "12GB/s"]) == 0
    out = capsys.readouterr().out
    chain = Chain.load(RESNET)
    with_offload = plan(chain, "40%", bandwidth=12e9)
    recompute_only = plan(chain, "40%", bandwidth=0)
    assert with_offload.recompute_only_time == pytest.approx(recompute_only.time)
    assert with_offload.time <= recompute_only.time
    assert f"recompute-only: {recompute_only.time:.6g} s at the same budget" in out
    assert f"saves {with_offload.recompute_only_time - with_offload.time:.6g} s" in out
    assert "at 12 GB/s" in out and "host peak" in out


def test_json_carries_both_times_and_replays(capsys):
    assert main([str(RESNET), "--mem-limit", "35%", "--bandwidth", "25 GB/s", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["bandwidth"] == 25e9
    assert data["offload_saving"] == pytest.approx(data["recompute_only_time"] - data["time"])
    assert data["offload_saving"] >= 0
    chain = Chain.load(RESNET).with_transfer(25e9)
    sim = simulate(chain, data["ops"])
    assert sim.peak == data["peak"] <= data["budget"] == int(0.35 * no_recompute_peak(chain))
    assert sim.time == pytest.approx(data["time"]) and sim.host_peak == data["host_peak"]


def test_offload_and_prefetch_are_printed(tmp_path, capsys):
    path = tmp_path / "runway.json"
    chain = runway(path)
    # between the floor and the plain peak, checkpoints held through a right part cost memory that a copy
    # hidden behind the forwards gives back: somewhere the fastest plan offloads one
    budgets = range(min_feasible_budget(chain), no_recompute_peak(chain) + 1, 25)
    offloading = [b for b in budgets if any(op[0] == "Offload" for op in plan(chain, b, bandwidth=1e6).ops)]
    assert offloading, "the planner never offloads on the runway chain"
    result = plan(chain, offloading[0], bandwidth=1e6)
    assert main([str(path), "--mem-limit", str(offloading[0]), "--bandwidth", "1e6"]) == 0
    out = capsys.readouterr().out
    ops = out.split("ops (")[1]
    assert "Offload" in ops and "Prefetch" in ops
    moved = sum(1 for op in result.ops if op[0] == "Offload")
    assert f"offload: {moved} value(s) to host memory at 0.001 GB/s; host peak {result.host_peak} B" in out
    assert result.recompute_only_time > result.time
    assert "recompute-only:" in out and "% of its recomputation overhead" in out


def test_host_limit_below_any_value_means_no_offload(tmp_path, capsys):
    path = tmp_path / "runway.json"
    chain = runway(path)
    budget = min_feasible_budget(chain)
    assert main([str(path), "--mem-limit", str(budget), "--bandwidth", "1e6", "--host-limit", "99", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["host_peak"] == 0 and not any(op[0] == "Offload" for op in data["ops"])
    assert data["time"] == pytest.approx(plan(chain, budget).time)


def test_bandwidth_zero_turns_off_the_chains_own(tmp_path, capsys):
    path = tmp_path / "runway6.json"
    runway(path)
    chain = Chain.load(path).with_transfer(1e6)
    chain.save(path)
    budget = min_feasible_budget(chain)
    assert main([str(path), "--mem-limit", str(budget), "--json"]) == 0
    own = json.loads(capsys.readouterr().out)
    assert own["bandwidth"] == 1e6 and "recompute_only_time" in own
    assert main([str(path), "--mem-limit", str(budget), "--bandwidth", "0", "--json"]) == 0
    off = json.loads(capsys.readouterr().out)
    assert "offload_saving" not in off and not any(op[0] == "Offload" for op in off["ops"])


def test_below_recompute_onlys_floor_the_summary_still_speaks_of_offloading(tmp_path, capsys):
    """At 18 B only moving stage 0's saved part fits (recomputing only needs 22 B): the summary says what moved
    and that no recompute-only plan fits, rather than nothing on offloading."""
    from test_offload_debts import loss_bound_chain

    path = tmp_path / "loss_bound.json"
    loss_bound_chain().save(path)
    assert main([str(path), "--mem-limit", "18"]) == 0
    out = capsys.readouterr().out
    assert "offload: 0 value(s) and 1 saved part(s) to host memory at 8e-09 GB/s; host peak 8 B" in out
    assert "recompute-only: no plan fits this budget (its floor is 22 B, 22 bytes)" in out
