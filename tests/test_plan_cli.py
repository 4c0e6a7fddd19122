"""`lightning-rotor plan`: summary, --json, exit codes, one-line errors without tracebacks."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_rotor.chain import Chain
from lightning_rotor.plan_cli import compact_ops, main
from lightning_rotor.planner import min_feasible_budget
from lightning_rotor.simulate import no_recompute_peak, simulate

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
RESNET = EXAMPLES / "resnet50_b32.json"


def test_summary(capsys):
    assert main([str(RESNET), "--mem-limit", "40%"]) == 0
    out = capsys.readouterr().out
    assert "without recomputation" in out and "of the budget" in out
    assert "recomputed stages:" in out and "Loss" in out and "B19..0" not in out.split("Loss")[0]
    chain = Chain.load(RESNET)
    assert f"({int(0.4 * no_recompute_peak(chain))} bytes)" in out


def test_json_is_the_plan(capsys):
    assert main([str(RESNET), "--mem-limit", "1.5GiB", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["budget"] == 3 * 2**29
    sim = simulate(Chain.load(RESNET), data["ops"])
    assert sim.peak == data["peak"] <= data["budget"]
    assert sim.time == data["time"]


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.json")))
def test_examples_plan_at_their_minimum(path, capsys):
    smallest = min_feasible_budget(Chain.load(path))
    assert main([str(path), "--mem-limit", str(smallest), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["peak"] <= smallest


def test_infeasible_exits_2_with_smallest_budget(capsys):
    smallest = min_feasible_budget(Chain.load(RESNET))
    assert main([str(RESNET), "--mem-limit", str(smallest - 1)]) == 2
    captured = capsys.readouterr()
    assert f"{smallest} bytes" in captured.out and f"{smallest} bytes" in captured.err
    assert len(captured.err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no such chain file"),
        ("{not json", "not valid JSON"),
        (
            '{"version": 1, "input_size": 1, "out_size": [1], "saved_size": [1], "fwd_time": [-1], "bwd_time": [1], '
            '"fwd_tmp": [0], "bwd_tmp": [0]}',
            "fwd_time[0]",
        ),
        ('{"version": 9}', "unknown chain version"),
    ],
)
def test_bad_chain_file_one_line_error(tmp_path, capsys, content, message):
    path = tmp_path / "chain.json"
    if content is not None:
        path.write_text(content)
    assert main([str(path), "--mem-limit", "1GiB"]) == 1
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_bad_budget_lists_accepted_forms(capsys):
    assert main([str(RESNET), "--mem-limit", "lots"]) == 1
    err = capsys.readouterr().err
    assert "accepted:" in err and len(err.strip().splitlines()) == 1


def test_bad_slots(capsys):
    assert main([str(RESNET), "--mem-limit", "50%", "--slots", "0"]) == 2
    assert "--slots" in capsys.readouterr().err


def test_console_script_no_traceback(tmp_path):
    missing = tmp_path / "absent.json"
    run = subprocess.run(
        [sys.executable, "-m", "lightning_rotor.cli", "plan", str(missing), "--mem-limit", "1GiB"],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 1 and "Traceback" not in run.stderr and "no such chain file" in run.stderr
    ok = subprocess.run(
        [sys.executable, "-m", "lightning_rotor.cli", "plan", str(RESNET), "--mem-limit", "2GiB", "--json"],
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0 and json.loads(ok.stdout)["budget"] == 2 * 2**30


def test_compact_ops():
    ops = [
        ("Fe", 0),
        ("Fe", 1),
        ("Fc", 2),
        ("Fn", 3),
        ("Fn", 4),
        ("Loss",),
        ("Fe", 2),
        ("B", 4),
        ("B", 3),
        ("B", 2),
        ("B", 1),
        ("B", 0),
    ]
    assert compact_ops(ops) == "Fe0-1 Fc2 Fn3-4 Loss Fe2 B4..0"


def test_negative_budget_reaches_our_error(capsys):
    assert main([str(EXAMPLES / "heterogeneous.json"), "--mem-limit", "-50%"]) == 1
    err = capsys.readouterr().err
    assert "must be positive" in err and "accepted:" in err and len(err.strip().splitlines()) == 1


def _one_line_error(capsys) -> str:
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    assert len(captured.err.strip().splitlines()) == 1
    return captured.err


@pytest.mark.parametrize("rate", ["12GB", "fast", "-12GB/s", "12 Gbit/s"])
def test_bad_bandwidth_is_one_line_listing_accepted_forms(rate, capsys):
    assert main([str(RESNET), "--mem-limit", "40%", "--bandwidth", rate]) == 1
    err = _one_line_error(capsys)
    assert "bandwidth" in err and "accepted:" in err and "12GB/s" in err


def test_host_limit_needs_a_bandwidth(capsys):
    assert main([str(RESNET), "--mem-limit", "40%", "--host-limit", "1GiB"]) == 2
    assert "--host-limit needs offloading" in _one_line_error(capsys)
    assert main([str(RESNET), "--mem-limit", "40%", "--bandwidth", "0", "--host-limit", "1GiB"]) == 2
    assert "--host-limit needs offloading" in _one_line_error(capsys)


@pytest.mark.parametrize(("limit", "message"), [("50%", "is a fraction"), ("lots", "cannot parse budget")])
def test_bad_host_limit(limit, message, capsys):
    assert main([str(RESNET), "--mem-limit", "40%", "--bandwidth", "12GB/s", "--host-limit", limit]) == 1
    assert message in _one_line_error(capsys)


def test_bandwidth_with_no_offloadable_value(tmp_path, capsys):
    one_stage = tmp_path / "one.json"
    Chain(
        input_size=100,
        out_size=[100],
        saved_size=[100],
        fwd_time=[1.0],
        bwd_time=[1.0],
        fwd_tmp=[0],
        bwd_tmp=[0],
    ).save(one_stage)
    assert main([str(one_stage), "--mem-limit", "100%", "--bandwidth", "12GB/s"]) == 2
    err = _one_line_error(capsys)
    assert "no value to offload" in err and "1 stage(s)" in err
