"""`lightning-rotor bench` on tiny models: every method gives a row, the outputs are readable, bad input is one line."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from lightning_rotor.bench import main
from lightning_rotor.bench.workload import Workload, measure_peak
from lightning_rotor.memory import MemoryProbe

SMALL_MLP = ["--model", "mlp", "--size", "tiny", "--set", "hidden=128", "--set", "depth=4", "--batch-size", "32"]
FAST = ["--repeats", "2", "--warmup", "0", "--threads", "1", "--quiet"]


def read_rows(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("bench")
    capture = pytest.MonkeyPatch()
    import io
    import sys

    stdout = io.StringIO()
    capture.setattr(sys, "stdout", stdout)
    try:
        code = main([*SMALL_MLP, *FAST, "--budgets", "min,0.5,1.0", "--out", str(out)])
    finally:
        capture.undo()
    assert code == 0
    return out, stdout.getvalue()


@pytest.mark.slow
def test_every_method_produces_a_row(bench_run: tuple[Path, str]) -> None:
    out, _ = bench_run
    rows = read_rows(out / "mlp.csv")
    methods = [r["method"] for r in rows]
    assert methods.count("none") == 1
    assert [r["mem_limit"] for r in rows if r["method"] == "rotor"] == ["min", "0.5", "1.0"]
    # tiny mlp: Flatten, 4 x (Linear, ReLU), Linear = 10 stages -> segment counts 2..10
    assert [int(r["segments"]) for r in rows if r["method"] == "checkpoint_sequential"] == list(range(2, 11))
    assert methods.count("recompute_all") == 1
    compiled = [r for r in rows if r["method"] == "compile"]
    assert [r["mem_limit"] for r in compiled] == ["0.5", "1.0"]
    for r in compiled:  # where compile cannot run, the row says why
        assert r["step_ms"] or r["note"].startswith("torch.compile failed")
    for r in rows:
        if r["method"] in ("none", "checkpoint_sequential", "recompute_all") or (
            r["method"] == "rotor" and "infeasible" not in r["note"]
        ):
            assert float(r["step_ms"]) > 0 and int(r["measured_peak"]) > 0, r


@pytest.mark.slow
def test_rotor_rows_respect_their_budget_and_prediction(bench_run: tuple[Path, str]) -> None:
    out, _ = bench_run
    rows = read_rows(out / "mlp.csv")
    none = next(r for r in rows if r["method"] == "none")
    rotor = {r["mem_limit"]: r for r in rows if r["method"] == "rotor"}
    ran = [r for r in rotor.values() if "infeasible" not in r["note"]]
    assert ran
    for r in rotor.values():
        if "infeasible" in r["note"]:
            assert "smallest feasible budget" in r["note"]
            continue
        assert int(r["measured_peak"]) <= int(r["budget_bytes"])
        # the gap is reported, not asserted: it is an issue-5 target read from the benchmark
        assert float(r["peak_gap"]) == int(r["measured_peak"]) / int(r["predicted_peak"]) - 1
        assert float(r["profile_s"]) > 0 and float(r["plan_ms"]) > 0
    assert int(none["measured_peak"]) > 0


def test_checkpointing_lowers_the_measured_peak_of_a_transformer(tmp_path: Path) -> None:
    args = ["--model", "gpt", "--size", "tiny", "--set", "n_layer=4", "--batch-size", "8", "--budgets", "0.5",
            "--no-compile", "--out", str(tmp_path), *FAST]  # fmt: skip
    assert main(args) == 0
    rows = read_rows(tmp_path / "gpt.csv")
    peak = {(r["method"], r["mem_limit"] or r["segments"]): int(r["measured_peak"]) for r in rows}
    none = peak[("none", "")]
    rotor = next(r for r in rows if r["method"] == "rotor")
    assert peak[("rotor", "0.5")] <= int(rotor["budget_bytes"]) < 0.6 * none  # half the chain's predicted peak
    assert peak[("recompute_all", "7")] < none


@pytest.mark.slow
def test_csv_parses_and_markdown_and_png_are_written(bench_run: tuple[Path, str]) -> None:
    out, stdout = bench_run
    rows = read_rows(out / "mlp.csv")
    for r in rows:
        for col in ("measured_peak", "predicted_peak", "budget_bytes", "segments"):
            assert r[col] == "" or int(r[col]) >= 0
        for col in ("step_ms", "spread", "vs_none", "plan_ms", "profile_s", "peak_gap"):
            assert r[col] == "" or float(r[col]) == float(r[col])  # a number, not NaN
    png = (out / "mlp.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    table = [line for line in stdout.splitlines() if line.startswith("|")]
    assert table[0].startswith("| method | mem_limit |")
    assert len(table) == 2 + len(rows)


@pytest.mark.slow
def test_a_csv_is_reported_again(bench_run: tuple[Path, str], tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out, stdout = bench_run
    assert main(["--from-csv", str(out / "mlp.csv"), "--out", str(tmp_path)]) == 0
    again = capsys.readouterr().out
    table = [line for line in stdout.splitlines() if line.startswith("|")]
    assert [line for line in again.splitlines() if line.startswith("|")] == table
    assert "checks on medians" in again and "issue" not in again and (tmp_path / "mlp.png").exists()
    assert read_rows(tmp_path / "mlp.csv") == read_rows(out / "mlp.csv")


def test_import_path_factory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--model", "lightning_rotor.models.mlp:mlp", "--set", "in_features=12", "--set", "hidden=16",
            "--input-shape", "4,12", "--budgets", "1.0", "--no-compile", "--out", str(tmp_path), *FAST]  # fmt: skip
    assert main(args) == 0
    rows = read_rows(tmp_path / "lightning_rotor_models_mlp_mlp.csv")
    assert {r["method"] for r in rows} == {"none", "rotor", "checkpoint_sequential", "recompute_all"}


@pytest.mark.parametrize(
    "model, expected",
    [
        ("no_such_package.models:factory", "cannot import model 'no_such_package.models:factory'"),
        ("lightning_rotor.models:no_such_factory", "cannot import model"),
        ("resnet7", "unknown model 'resnet7'"),
    ],
)
def test_bad_model_path_is_a_one_line_error(
    model: str, expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--model", model, "--out", str(tmp_path), "--quiet"]) != 0
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0] and lines[0].startswith("lightning-rotor bench: error:")
    assert not list(tmp_path.iterdir())


def test_bad_budget_and_bare_sequential_without_shape_are_one_line_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*SMALL_MLP, "--budgets", "0.5,lots", "--out", str(tmp_path), "--quiet"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bad budget 'lots'" in err[0]
    assert main(["--model", "lightning_rotor.models.mlp:mlp", "--out", str(tmp_path), "--quiet"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--input-shape" in err[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_measure_peak_on_cuda_leaves_the_stored_parameter_gradients_out() -> None:
    """The allocator sees every allocation: the bench's CUDA peak must not count the gradients a step stores
    (tensor accounting leaves them out by itself), or rotor is planned at another method's peak plus them."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)]).cuda()  # 1 MiB of weight each
    w = Workload("linears", model, torch.randn(4, 512, device="cuda"), None, lambda out, _y: out.pow(2).mean(),
                 torch.device("cuda"))  # fmt: skip
    stored = sum(p.numel() * p.element_size() for p in model.parameters())
    exact = measure_peak(w, model, 0, MemoryProbe(model))
    assert measure_peak(w, model, 0) < exact + 2 * 2**20 < stored  # one gradient in flight above the activations
