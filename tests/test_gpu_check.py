"""benchmarks/gpu_check.py, the one-command check of every CUDA path, run here on CPU at tiny sizes (`--cpu`).

It must run start to finish and write its report; every check that can run on CPU passes, and the CUDA-only
ones are reported as SKIP with their reason, never as a pass. A section that fails or runs past its time is
recorded and the next one still runs.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
TITLES = [
    "Allocator probe against torch.cuda.max_memory_allocated",
    "CUDA RNG replay with dropout",
    "bf16 autocast",
    "Offloading: copy stream, events, pinned pool",
    "Measured against predicted step time and peak",
    "rotor against each model's own checkpointing at equal memory",
]
# per section, promises that must be among its passed checks on CPU
PROMISES = {
    1: ["tensor-accounted peak", "bytes alive <= the simulator's"],
    2: ["[alone] rotor bitwise equal", "[another thread alive] rotor bitwise equal", "control: plain training"],
    3: ["[bf16 autocast] rotor bitwise equal", "[bf16 autocast] tensor-accounted peak"],
    4: ["[gpt] control", "[gpt] gradients bitwise equal", "[resnet18] gradients bitwise", "back to 0 after every step"],
    5: ["[GPT-2-small-like at min] tensor-accounted", "[ResNet-50 at 0.5] tensor-accounted"],
    6: ["[ResNet-50, per-block checkpointing] every method ran", "[GPT-2-small-like, per-block"],
}
# what only CUDA can check: skipped on CPU with the reason, never passed
CUDA_ONLY = {1: "CudaMemoryProbe against torch.cuda.max_memory_allocated: needs CUDA", 4: "pinned pool"}


def gpu_check():
    """The script as a module (benchmarks/ on the path: it imports offload_gpu beside it)."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        return importlib.import_module("gpu_check")
    finally:
        sys.path.remove(str(SCRIPT.parent))


def sections(report: str) -> dict[int, list[tuple[str, str]]]:
    """Per section number, its check lines as (status, text)."""
    found: dict[int, list[tuple[str, str]]] = {}
    for part in re.split(r"^## (?=\d\. )", report, flags=re.M)[1:]:
        number = int(part.split(".", 1)[0])
        found[number] = re.findall(r"^- (PASS|FAIL|SKIP|HOLDS|MISSES): (.*)$", part, flags=re.M)
    return found


@pytest.mark.slow
def test_the_cpu_run_passes_every_check_it_can_and_skips_the_cuda_ones(tmp_path):
    out = tmp_path / "gpu_check.md"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, str(SCRIPT), "--cpu", "--out", str(out), "--limit", "1200"]  # load must not fail it
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:] + (out.read_text()[-3000:] if out.exists() else "")
    report = out.read_text()
    assert re.findall(r"^## \d\. (.+)$", report, flags=re.M) == TITLES
    rows = [line for line in report.splitlines() if re.match(r"\| \d\. ", line)]
    summary = [[c.strip() for c in line.split("|")[1:-1]] for line in rows]
    assert [(row[1], row[3]) for row in summary] == [("PASS", "0")] * 6, summary  # verdict, failed checks
    assert re.search(r"^Total wall time: \d+ s ", report, flags=re.M)
    found = sections(report)
    for number, lines in found.items():
        assert lines, number
        assert not [text for status, text in lines if status == "FAIL"], (number, lines)
        passed = [text for status, text in lines if status == "PASS"]
        for promise in PROMISES[number]:
            assert any(promise in text for text in passed), (number, promise, lines)
        for status, text in lines:  # what needs the allocator or a CUDA stream is never claimed on CPU
            if status in ("PASS", "HOLDS"):
                assert "allocator" not in text and "CudaMemoryProbe" not in text and "pinned" not in text, text
            if "judged on CUDA only" in text:
                assert status == "SKIP", text
    for number, reason in CUDA_ONLY.items():
        assert any(status == "SKIP" and reason in text for status, text in found[number]), (number, found[number])
    skipped_targets = [text for lines in found.values() for status, text in lines if "judged on CUDA only" in text]
    assert any("measured / predicted step time" in text for text in skipped_targets)


def test_without_cuda_and_without_cpu_it_says_so_in_one_line(capsys):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here: the script would run")
    assert gpu_check().main(["--out", os.devnull]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "needs CUDA" in err and "--cpu" in err


def test_a_failing_or_overrunning_section_is_recorded_and_the_next_still_runs(monkeypatch):
    check = gpu_check()
    monkeypatch.setattr(check, "MIN_SECTION_S", 0.5)  # sections of a second, to keep the test short
    ctx = check.Context(torch.device("cpu"), False, check.CPU_SIZES, time.perf_counter() + 10)

    def broken(sec, ctx):
        sec.check(True, "a check before the error")
        raise RuntimeError("boom\nsecond line")

    def overrunning(sec, ctx):
        while True:
            time.sleep(0.01)

    def fine(sec, ctx):
        check.part(sec, ctx, "first model", lambda: 1 / 0)  # a part of a section fails: the next part runs
        sec.check(True, "ran")

    done = []
    for number, fn, share in ((1, broken, 0.5), (2, overrunning, 0.1), (3, fine, 0.5)):
        sec = check.Section(number, fn.__name__, share)
        check.run_section(sec, fn, ctx, limit=10)
        done.append(sec)
    broken_sec, over_sec, fine_sec = done
    assert broken_sec.verdict == "FAIL" and broken_sec.lines[0] == ("PASS", "a check before the error")
    assert re.match(r"error: RuntimeError: boom \(test_gpu_check\.py:\d+\)$", broken_sec.lines[1][1])
    assert over_sec.verdict == "FAIL" and over_sec.lines == [("FAIL", "stopped: ran past its time budget of 1 s")]
    assert 0.9 < over_sec.seconds < 3
    assert fine_sec.verdict == "FAIL" and fine_sec.lines[1] == ("PASS", "ran")
    assert re.match(r"\[first model\] error: ZeroDivisionError: division by zero \(test_gpu_check\.py:\d+\)$",
                    fine_sec.lines[0][1])  # fmt: skip
    late = check.Section(4, "late", 0.5)
    check.run_section(late, fine, check.Context(torch.device("cpu"), False, check.CPU_SIZES, time.perf_counter()), 10)
    assert late.verdict == "NOT RUN" and late.lines[0][1].startswith("not run: ")
