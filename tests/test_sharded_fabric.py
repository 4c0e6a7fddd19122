"""`RotorFabricModelParallelStrategy` (Fabric's ModelParallelStrategy, FSDP2) over a real 2-process gloo group.

One spawn trains a Hugging Face Llama (tiny config) with Fabric's ModelParallelStrategy and with rotor's, on
both ranks (each process a Fabric rank launched externally, as torchrun would), with gradient accumulation
(`fabric.no_backward_sync` over the first of two micro-batches): the local parameter shards after 3 AdamW
steps must be torch.equal, and the ranks' plans the same.
"""

from __future__ import annotations

import os
import socket
import tempfile

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from hf_models import TINY_DECODER, tiny_llama
from lightning.fabric import Fabric
from lightning.fabric.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard

from lightning_rotor.fabric import RotorFabricModelParallelStrategy
from lightning_rotor.ops import is_no_recompute


def _shard(model, mesh):
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["data_parallel"])
    fully_shard(model, mesh=mesh["data_parallel"])
    return model


def _fit(strategy, rank: int):
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    model = fabric.setup_module(tiny_llama())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    g = torch.Generator().manual_seed(100 + rank)
    vocab = TINY_DECODER["vocab_size"]
    for _ in range(3):
        for micro in range(2):
            data = torch.randint(vocab, (4, 17), generator=g)
            with fabric.no_backward_sync(model, enabled=micro == 0):
                logits = model(data[:, :-1]).logits
                fabric.backward(F.cross_entropy(logits.reshape(-1, vocab), data[:, 1:].reshape(-1)))
        optimizer.step()
        optimizer.zero_grad()
    seen = {"shards": [p.to_local().detach().clone() for p in model.parameters()]}
    rotor = getattr(strategy, "rotor", None)
    if rotor is not None:
        seen["ops"] = list(rotor.plan.ops)
    torch.distributed.destroy_process_group()
    return seen


def _worker(rank: int, ports: tuple[int, int], store: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[0]), WORLD_SIZE="2", NODE_RANK="0")
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))  # launched externally, as torchrun does
    sizes = dict(data_parallel_size=2, tensor_parallel_size=1)
    plain = _fit(ModelParallelStrategy(_shard, **sizes), rank)
    os.environ["MASTER_PORT"] = str(ports[1])
    rotor = _fit(RotorFabricModelParallelStrategy(_shard, 0.6, **sizes), rank)
    torch.save((plain, rotor), f"{store}.rank{rank}")


def _free_ports() -> tuple[int, int]:
    """A port per fit: the second process group's store does not meet the first's closing connections."""
    with socket.socket() as a, socket.socket() as b:
        a.bind(("127.0.0.1", 0))
        b.bind(("127.0.0.1", 0))
        return a.getsockname()[1], b.getsockname()[1]


@pytest.mark.slow  # one spawn of two processes
def test_rotor_fabric_model_parallel_is_bitwise_with_accumulation_on_every_rank():
    store = tempfile.mktemp()
    mp.spawn(_worker, args=(_free_ports(), store), nprocs=2)
    ranks = [torch.load(f"{store}.rank{rank}", weights_only=False) for rank in (0, 1)]
    for plain, rotor in ranks:
        assert all(torch.equal(a, b) for a, b in zip(plain["shards"], rotor["shards"], strict=True))
        assert not is_no_recompute(rotor["ops"])
    assert ranks[0][1]["ops"] == ranks[1][1]["ops"]
