"""benchmarks/cuda_stage_times.py, run once on a GPU by hand, runs here on CPU (`--device cpu`, the same code at tiny
sizes): every part runs without an error, every variant gets its row, and the report ends with a conclusion. The
fresh processes' profiles are left out of the whole run (each child costs an interpreter's start); their entry point
runs in this process, its JSON lines read back as the parent reads them."""

import importlib
import json
import re
import sys
from pathlib import Path

import pytest
import torch

from lightning_rotor import profile

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def script(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    yield importlib.import_module("cuda_stage_times")
    sys.modules.pop("cuda_stage_times", None)


@pytest.mark.slow
def test_cuda_stage_times_runs_on_cpu(script, tmp_path, capsys):
    out = tmp_path / "report.md"
    warm_before = profile.CUDA_WARMUP_ROUNDS
    assert script.main(["--device", "cpu", "--models", "resnet18", "--no-fresh", "--out", str(out)]) == 0
    report = out.read_text()
    assert report in capsys.readouterr().out  # printed too
    assert "FAIL" not in report and "SKIP" not in report, report
    rows = [
        "| profile as now",
        "| second profile",
        "| profile with the fix",
        "| profile, 6 timing rounds",
        "| in-step |",
    ]
    rows += ["| sync per op", "| fix (1 warm-up round) after", "| with the fix: offloading allowed"]
    for row in rows:
        assert row in report, row
    assert re.search(r"\| profile, 6 timing rounds \|[^\n]*\| 6 \|", report)  # every round run, none settled
    assert "**Conclusion (ResNet-18)**: as now the profiled stages add up to" in report
    assert profile.CUDA_WARMUP_ROUNDS == warm_before and profile._timed_rounds.__module__ == profile.__name__


def test_child_prints_times_as_json(script, capsys, monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", torch.backends.cudnn.benchmark)  # the child sets it
    assert script.main(["--device", "cpu", "--child", "resnet18", "--warm", "1", "--cudnn-benchmark"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    profiled, steady = (script.Times(**fields) for fields in lines)  # what the parent makes of them
    assert len(profiled.fwd) == len(steady.bwd) == 14 and profiled.rounds >= profile.MIN_ROUNDS
    assert profiled.total > 0 and steady.total > 0
