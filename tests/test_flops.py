"""FLOP counts (`shapes.stage_flops`, which scales a measured shape's times to a new one): counted as torch's
`FlopCounterMode` counts them, without its per-module bookkeeping (`_torch_compat.GlobalFlops`)."""

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_rotor import Checkpointable
from lightning_rotor._torch_compat import GlobalFlops
from lightning_rotor.models.convnext import convnext_atto
from lightning_rotor.models.gpt import gpt
from lightning_rotor.shapes import stage_flops


def torch_counts(stages: list[nn.Module], sample: torch.Tensor) -> list[int]:
    """Per stage, `FlopCounterMode`'s total, as `stage_flops` runs the stages (their own mode, training, no grad)."""
    counts, value = [], sample
    with torch.no_grad(), torch.random.fork_rng():
        for stage in stages:
            with FlopCounterMode(display=False) as counter:
                value = stage(value)
            counts.append(counter.get_total_flops())
    return counts


def hf_gpt2() -> tuple[nn.Module, torch.Tensor]:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32, use_cache=False)
    return transformers.GPT2LMHeadModel(config), torch.randint(0, 64, (2, 16))


@pytest.mark.parametrize("name", ["gpt", "gpt2", "convnext"])
def test_stage_flops_are_torch_counts(name: str) -> None:
    """Each stage of a discovered chain counts what `FlopCounterMode` counts: matmuls, attention, convolutions."""
    torch.manual_seed(0)
    if name == "gpt":
        model: nn.Module = gpt(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32)
        sample = torch.randint(0, 64, (2, 16))
    elif name == "gpt2":
        model, sample = hf_gpt2()
    else:
        model, sample = convnext_atto(num_classes=10), torch.randn(2, 3, 32, 32)
    rotor = Checkpointable(model, "50%")
    if rotor.discover:
        rotor.discover_on(sample)
    stages = list(rotor.chain_state.stages)
    if name == "gpt2":  # a module-level chain: its stages are the blocks, which take hidden states
        sample = torch.randn(2, 16, 32)
    counted = stage_flops(stages, sample)
    assert counted is not None and sum(counted) > 0
    assert counted == torch_counts(stages, sample)


def test_an_op_reaching_the_counter_whole_is_decomposed_as_torch_does() -> None:
    """Under `inference_mode` a composite op (`linear`) reaches the counter undecomposed: counted through its
    decomposition (an `addmm`), as `FlopCounterMode` counts it, not skipped as an op without a formula."""
    layer = nn.Linear(16, 8)
    x = torch.randn(4, 16)
    with torch.inference_mode():
        with FlopCounterMode(display=False) as theirs:
            layer(x)
        counter = GlobalFlops()
        for _ in range(2):  # reused: each block counts from 0
            with counter:
                layer(x)
            assert counter.get_total_flops() == theirs.get_total_flops() == 2 * 4 * 16 * 8
