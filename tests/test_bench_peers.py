"""`lightning-rotor bench` on hf:/timm: models: rotor and rotor+options against each model's own checkpointing."""

import csv
import importlib.util
import io
import sys

import pytest
import torch

from lightning_rotor.bench import load_workload, main
from lightning_rotor.bench.peers import own_blocks, sac_per_block
from lightning_rotor.bench.workload import BenchError

FAST = ["--repeats", "1", "--warmup", "0", "--threads", "1", "--quiet"]
GPT2 = ["--model", "hf:gpt2", "--set", "n_layer=2", "--set", "n_embd=32", "--set", "n_head=2"]
GPT2 += ["--set", "vocab_size=128", "--set", "seq=16", "--set", "n_positions=32", "--batch-size", "2"]
LLAMA = ["--model", "hf:llama", "--set", "hidden_size=32", "--set", "intermediate_size=64"]
LLAMA += ["--set", "num_hidden_layers=3", "--set", "num_attention_heads=2", "--set", "num_key_value_heads=1"]
LLAMA += ["--set", "vocab_size=128", "--set", "seq=16", "--batch-size", "2"]


def _timm_ok() -> bool:
    try:
        import timm  # noqa: F401
    except Exception:  # noqa: BLE001 - e.g. torchvision built for another torch
        return False
    return True


def _rows(tmp_path, stem):
    with (tmp_path / f"{stem}.csv").open() as f:
        return list(csv.DictReader(f))


def _check_peer_rows(rows, out, ids_bytes=0):
    """`ids_bytes`: the token ids, which the probe counts and rotor's budget leaves out (the user's tensor)."""
    assert [r["method"] for r in rows][:3] == ["none", "own", "sac"]
    assert not any(r["method"] == "compile" for r in rows)  # opt-in for hf:/timm: models (--compile)
    peaks = {r["method"]: int(r["measured_peak"]) for r in rows if r["method"] in ("own", "sac")}
    for name in ("rotor", "rotor+options"):
        labels = [r["mem_limit"] for r in rows if r["method"] == name]
        assert labels[-2:] == ["own", "sac"], labels
        for r in rows:
            if r["method"] == name and r["mem_limit"] in peaks:  # planned for exactly the peer's measured peak
                assert int(r["budget_bytes"]) == peaks[r["mem_limit"]], r
    for r in rows:
        if r["step_ms"]:
            assert float(r["step_ms"]) > 0 and int(r["measured_peak"]) > 0, r
        if r["method"].startswith("rotor") and r["measured_peak"]:
            assert int(r["measured_peak"]) - ids_bytes <= int(r["budget_bytes"]), r  # within its budget, measured
    for name in ("rotor", "rotor+options"):  # one profile per method, every budget planned on it
        assert len({r["profile_s"] for r in rows if r["method"] == name and r["profile_s"]}) == 1
    assert "at own's peak" in out and "rotor+options" in out and "at sac's peak" in out


@pytest.mark.parametrize("args, stem", [(GPT2, "hf_gpt2"), (LLAMA, "hf_llama")])
def test_transformers_models_against_their_own_checkpointing(args, stem, tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    assert main([*args, *FAST, "--budgets", "1.0", "--out", str(tmp_path)]) == 0
    rows = _rows(tmp_path, stem)
    _check_peer_rows(rows, out.getvalue(), ids_bytes=2 * 16 * 8)  # batch 2 x 16 int64 tokens
    assert next(r for r in rows if r["method"] == "own")["note"].startswith(("2 blocks", "3 blocks"))


@pytest.mark.skipif(not _timm_ok(), reason="timm is not importable here")
def test_timm_convnext_against_its_own_checkpointing(tmp_path, monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    args = ["--model", "timm:convnext_atto", "--set", "image=32", "--set", "num_classes=10", "--batch-size", "2"]
    assert main([*args, *FAST, "--budgets", "1.0", "--out", str(tmp_path)]) == 0
    rows = _rows(tmp_path, "timm_convnext_atto")
    _check_peer_rows(rows, out.getvalue())
    assert next(r for r in rows if r["method"] == "own")["note"].startswith("12 blocks")  # atto: 2+2+6+2


def _grads(model):
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_peers_train_like_plain_and_leave_the_model_as_it_was():
    pytest.importorskip("transformers")
    w = load_workload(
        "hf:llama",
        batch_size=2,
        overrides=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, vocab_size=64, seq=8),
        device=torch.device("cpu"),
    )  # fmt: skip
    assert w.own is not None and len(w.blocks) == 2 and own_blocks(w.model) == w.blocks
    results = []
    for forward in (w.model, w.own, sac_per_block(w.model, w.blocks)):
        w.model.zero_grad(set_to_none=True)
        w.loss(forward(w.x), w.y).backward()
        results.append(_grads(w.model))
    for got in results[1:]:
        assert len(got) == len(results[0]) and all(torch.equal(a, b) for a, b in zip(got, results[0], strict=True))
    assert all("forward" not in b.__dict__ for b in w.blocks)  # the per-call wrapping is undone
    assert not any(getattr(m, "gradient_checkpointing", False) for m in w.model.modules())


@pytest.mark.parametrize(
    "model, words",
    [
        ("hf:no_such_model_type", "unknown transformers model type 'no_such_model_type'"),
        ("hf:", "names no model"),
        ("timm:no_such_net", "timm"),
    ],
)
def test_bad_peer_names_fail_in_one_line(model, words, tmp_path, capsys):
    if model.startswith("hf:") and importlib.util.find_spec("transformers") is None:
        words = "needs transformers"
    assert main(["--model", model, *FAST, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err, err
    if model.startswith("timm:") and not _timm_ok():
        assert "needs timm" in err or "cannot be imported" in err


def test_bad_sizes_for_a_transformers_model_are_one_line():
    pytest.importorskip("transformers")
    with pytest.raises(BenchError, match="hf:gpt2"):
        load_workload("hf:gpt2", batch_size=1, overrides={"seq": "long"})
