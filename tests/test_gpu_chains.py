"""benchmarks/gpu_chains.py: sizes extended exactly from two profiled batches, blocks repeated, roofline times."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_rotor.chain import Chain
from lightning_rotor.models.gpt import gpt

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import gpu_chains  # noqa: E402


def tiny_gpt(depth: int) -> gpu_chains.Spec:
    return gpu_chains.Spec(
        lambda n: gpt(vocab_size=64, block_size=16, n_layer=n or depth, n_head=2, n_embd=16),
        4,
        gpu_chains.tokens(64, 16),
        gpu_chains.token_loss,
        "16 tokens",
        depth=depth,
        batches=(2, 3),
    )


def test_the_middle_block_stands_for_every_middle_block():
    names = ["embed", "blocks.0", "blocks.1", "blocks.2", "ln_f", "lm_head"]
    assert gpu_chains.stage_map(names, 5) == [0, 1, 2, 2, 2, 3, 4, 5]
    assert gpu_chains.stage_map(names, None) == list(range(6))


def test_a_roofline_op_costs_the_slower_of_compute_and_memory():
    with torch.device("meta"):
        layer = nn.Linear(1024, 1024, bias=False)
        x = torch.empty(64, 1024)
    with gpu_chains.Roofline() as mode:
        layer(x)
    flops = 2 * 64 * 1024 * 1024
    moved = 4 * (64 * 1024 + 1024 * 1024 + 64 * 1024)  # input, weight, output (the transposed weight is a view)
    assert mode.flops == flops
    assert mode.seconds == pytest.approx(max(flops / gpu_chains.RATE, moved / gpu_chains.HBM))


def test_the_chain_at_the_target_batch_matches_a_profile_there():
    spec = tiny_gpt(depth=4)
    gpu_chains.SPECS["tiny"] = spec
    try:
        chain, flops = gpu_chains.build_chain("tiny", check=True)  # check: batch 3 predicted to the byte
    finally:
        del gpu_chains.SPECS["tiny"]
    assert chain.length == 7 and flops > 0
    assert all(t > 0 for t in chain.fwd_time) and all(t > 0 for t in chain.bwd_time)
    whole = gpu_chains.measured_sizes(gpu_chains.Spec(lambda _: spec.build(4), 4, spec.sample, spec.loss, ""), 4)
    for name in (*gpu_chains.SIZE_FIELDS, *gpu_chains.SCALAR_FIELDS):  # the model at full depth, batch 4
        assert getattr(chain, name) == getattr(whole, name), name
    assert Chain.from_dict(chain.to_dict()) == chain
