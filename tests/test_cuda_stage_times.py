"""benchmarks/cuda_stage_times.py, run once on a GPU by hand, runs here on CPU (`--device cpu`, the same code at tiny
sizes): every part runs without an error, every variant gets its row, and the report ends with a conclusion."""

import importlib
import re
import sys
from pathlib import Path

import pytest

from lightning_rotor import profile

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.slow
def test_cuda_stage_times_runs_on_cpu(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    script = importlib.import_module("cuda_stage_times")
    out = tmp_path / "report.md"
    warm_before = profile.CUDA_WARMUP_ROUNDS
    assert script.main(["--device", "cpu", "--models", "resnet18", "--out", str(out)]) == 0
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
    rows += [
        "| sync per op",
        "| profile, cudnn.benchmark on",
        "| fresh process, with the fix",
        "| with the fix: offloading",
    ]
    for row in rows:
        assert row in report, row
    assert re.search(r"\| profile, 6 timing rounds \|[^\n]*\| 6 \|", report)  # every round run, none settled
    assert "**Conclusion (ResNet-18)**: as now the profiled stages add up to" in report
    assert profile.CUDA_WARMUP_ROUNDS == warm_before and profile._timed_rounds.__module__ == profile.__name__
    sys.modules.pop("cuda_stage_times", None)
