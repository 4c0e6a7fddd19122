"""`RotorModelParallelStrategy` (Lightning's ModelParallelStrategy, FSDP2) over a real 2-process gloo group.

The LightningModule's `configure_model` shards as Lightning documents (each block, then the model) without
checkpointing; the strategy wrapped the model in a `Checkpointable` before. One spawn runs FSDP2 alone and
rotor on both ranks (each process is a Lightning rank launched externally, as torchrun would launch it);
the local parameter shards after 3 AdamW steps must be torch.equal, and the ranks' plans the same.
"""

from __future__ import annotations

import os
import socket
import tempfile

import lightning.pytorch as pl
import pytest
import torch
import torch.multiprocessing as mp
from fitting import quiet_trainer
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

from lightning_rotor.lightning import RotorModelParallelStrategy
from lightning_rotor.models.gpt import gpt, lm_loss
from lightning_rotor.ops import is_no_recompute


class LM(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = gpt(vocab_size=32, block_size=16, n_layer=4, n_head=2, n_embd=16, dropout=0.0)

    def configure_model(self):
        mesh = self.device_mesh["data_parallel"]
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        return lm_loss(self.model(tokens), targets)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _loader() -> DataLoader:
    data = torch.randint(32, (24, 17), generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=4)


def _fit(strategy, folder: str):
    lm = LM()
    quiet_trainer(folder, strategy, devices=2, enable_model_summary=False).fit(lm, _loader())
    seen = {"shards": [p.to_local().detach().clone() for p in lm.model.parameters()]}
    plan = getattr(lm.model, "plan", None) if hasattr(lm.model, "entries") else None
    if plan is not None:
        seen["ops"], seen["budget"] = list(plan.ops), plan.budget
    return seen


def _worker(rank: int, ports: tuple[int, int], store: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[0]), WORLD_SIZE="2", NODE_RANK="0")
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))  # launched externally: no launcher of Lightning's
    sizes = dict(data_parallel_size=2, tensor_parallel_size=1)
    with tempfile.TemporaryDirectory() as folder:
        plain = _fit(ModelParallelStrategy(**sizes), folder)
        torch.distributed.destroy_process_group()
        os.environ["MASTER_PORT"] = str(ports[1])
        rotor = _fit(RotorModelParallelStrategy(0.5, **sizes), folder)
    torch.save((plain, rotor), f"{store}.rank{rank}")


def _free_ports() -> tuple[int, int]:
    """A port per fit: the second process group's store does not meet the first's closing connections."""
    with socket.socket() as a, socket.socket() as b:
        a.bind(("127.0.0.1", 0))
        b.bind(("127.0.0.1", 0))
        return a.getsockname()[1], b.getsockname()[1]


@pytest.mark.slow  # one spawn of two processes, two fits each
def test_rotor_model_parallel_strategy_is_bitwise_with_model_parallel_on_every_rank():
    store = tempfile.mktemp()
    mp.spawn(_worker, args=(_free_ports(), store), nprocs=2)
    ranks = [torch.load(f"{store}.rank{rank}", weights_only=False) for rank in (0, 1)]
    for plain, rotor in ranks:
        assert all(torch.equal(a, b) for a, b in zip(plain["shards"], rotor["shards"], strict=True))
        assert not is_no_recompute(rotor["ops"])
    assert ranks[0][1]["ops"] == ranks[1][1]["ops"]


def test_rotor_model_parallel_is_registered_by_name():
    assert "rotor_model_parallel" in StrategyRegistry
    assert StrategyRegistry["rotor_model_parallel"]["strategy"] is RotorModelParallelStrategy
