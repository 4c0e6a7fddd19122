"""`lightning-rotor bench` on models as written: rotor (discovered chain) against per-block checkpointing."""

import csv
import io
import sys

import pytest

from lightning_rotor.bench import main

TINY_GPT = [
    "--model",
    "gpt_any",
    "--set",
    "n_layer=3",
    "--set",
    "n_embd=32",
    "--set",
    "block_size=32",
    "--set",
    "vocab_size=128",
    "--batch-size",
    "4",
]
FAST = ["--repeats", "1", "--warmup", "0", "--threads", "1", "--quiet", "--no-compile"]


def test_gpt_any_rows_rotor_within_budget_and_per_block(tmp_path, monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    assert main([*TINY_GPT, *FAST, "--budgets", "min,0.5,1.0", "--out", str(tmp_path)]) == 0
    with (tmp_path / "gpt_any.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["method"] for r in rows] == ["none", "rotor", "rotor", "rotor", "rotor", "per_block"]
    assert [r["mem_limit"] for r in rows if r["method"] == "rotor"] == ["min", "0.5", "1.0", "per_block"]
    per_block = next(r for r in rows if r["method"] == "per_block")
    for r in rows:
        assert float(r["step_ms"]) > 0 and int(r["measured_peak"]) > 0, r
        if r["method"] == "rotor":
            assert int(r["measured_peak"]) <= int(r["budget_bytes"]), r
    at_block = next(r for r in rows if r["mem_limit"] == "per_block")
    assert int(at_block["budget_bytes"]) == int(per_block["measured_peak"])  # planned for per-block's own peak
    assert "lowest peak: rotor" in out.getvalue() and "vs per_block" in out.getvalue()


def test_transformers_gpt2_is_a_bench_model(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    args = [
        "--model",
        "gpt2_hf",
        "--set",
        "n_layer=2",
        "--set",
        "n_embd=32",
        "--set",
        "n_positions=32",
        "--set",
        "vocab_size=128",
        "--batch-size",
        "2",
    ]
    assert main([*args, *FAST, "--budgets", "0.5", "--out", str(tmp_path)]) == 0
    with (tmp_path / "gpt2_hf.csv").open() as f:
        methods = [r["method"] for r in csv.DictReader(f)]
    assert methods == ["none", "rotor", "rotor", "per_block"]
