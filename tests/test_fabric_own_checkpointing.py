"""Fabric's strategies put the model's own checkpointing back, as the Trainer's do at the end of a fit.

Rotor turns a Hugging Face model's `gradient_checkpointing` flags off while it trains it (docs/checkpointable.md,
"The model's own checkpointing"). Fabric has no end of training: `strategy.teardown()` (or
`strategy.restore_own_checkpointing()`) turns them back on, on one device and under FSDP2.
"""

from __future__ import annotations

import contextlib
import socket
import warnings

import pytest
import torch
import torch.nn.functional as F
from hf_models import TINY_DECODER, tiny_llama
from lightning.fabric import Fabric
from torch import nn
from torch.distributed.fsdp import fully_shard

from lightning_rotor.fabric import RotorFabricModelParallelStrategy, RotorFabricStrategy


def llama_checkpointing_itself() -> tuple[nn.Module, list[nn.Module]]:
    model = tiny_llama()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers 5: the method's name is deprecated, the flag is not
        model.gradient_checkpointing_enable()
    return model, list(model.model.layers)


def one_step(fabric: Fabric, model: nn.Module) -> None:
    vocab = TINY_DECODER["vocab_size"]
    data = torch.randint(vocab, (2, 9), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # rotor's own note on the flags it turned off
        logits = model(data[:, :-1]).logits
        fabric.backward(F.cross_entropy(logits.reshape(-1, vocab), data[:, 1:].reshape(-1)))


def flags(layers: list[nn.Module]) -> list[bool]:
    return [layer.gradient_checkpointing for layer in layers]


def test_fabric_teardown_turns_the_models_own_checkpointing_back_on():
    model, layers = llama_checkpointing_itself()
    strategy = RotorFabricStrategy(mem_limit="90%", print_summary=False)
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy)
    one_step(fabric, fabric.setup_module(model))
    assert flags(layers) == [False] * 4  # rotor plans the whole chain while it trains it
    strategy.teardown()
    assert flags(layers) == [True] * 4


def _shard(module: nn.Module, mesh) -> nn.Module:
    for layer in module.module.model.layers:  # module: the Checkpointable around the Llama
        fully_shard(layer, mesh=mesh["data_parallel"])
    fully_shard(module, mesh=mesh["data_parallel"])
    return module


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # a one-process gloo group and FSDP2
def test_fabric_fsdp2_teardown_turns_the_models_own_checkpointing_back_on(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    model, layers = llama_checkpointing_itself()
    strategy = RotorFabricModelParallelStrategy(_shard, mem_limit="90%")
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy)
    fabric.launch()
    try:
        one_step(fabric, fabric.setup_module(model))
        assert flags(layers) == [False] * 4
        with contextlib.suppress(NotImplementedError):  # Fabric's ModelParallelStrategy has no CheckpointIO
            strategy.teardown()
        assert flags(layers) == [True] * 4
    finally:
        torch.distributed.destroy_process_group()
