"""`RotorModelParallelStrategy` (Lightning's ModelParallelStrategy, FSDP2) over a real 2-process gloo group.

The LightningModule's `configure_model` shards as Lightning documents (each block, then the model) without
checkpointing; the strategy wrapped the model in a `Checkpointable` before. One spawn runs FSDP2 alone and
rotor on both ranks (each process is a Lightning rank launched externally, as torchrun would launch it):
3 AdamW steps saved as a distributed checkpoint, then resumed from it to 6. The local parameter shards must
be torch.equal after 3 steps and after the resumed run, and the ranks' plans the same.
"""

from __future__ import annotations

import os
import socket
import tempfile

import lightning.pytorch as pl
import pytest
import torch
import torch.multiprocessing as mp
from fitting import SaveAtEnd, quiet_trainer
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


def _fit(strategy, folder: str, steps: int, ckpt_path: str | None = None):
    """`steps` steps (3 make an epoch on each rank), from `ckpt_path` when given; saved to folder/NAME.ckpt."""
    lm = LM()
    save = SaveAtEnd(f"{folder}/{type(strategy).__name__}.ckpt")
    quiet_trainer(folder, strategy, devices=2, max_steps=steps, callbacks=[save]).fit(
        lm, _loader(), ckpt_path=ckpt_path
    )
    seen = {"shards": [p.to_local().detach().clone() for p in lm.model.parameters()]}
    if hasattr(lm.model, "entries"):
        seen["ops"], seen["budget"] = list(lm.model.plan.ops), lm.model.plan.budget
    torch.distributed.destroy_process_group()
    return seen


def _worker(rank: int, ports: list[int], store: str) -> None:
    """FSDP2 alone and rotor: 3 steps saved (a distributed checkpoint), then resumed from it to 6 steps."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", WORLD_SIZE="2", NODE_RANK="0")
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))  # launched externally: no launcher of Lightning's
    sizes = dict(data_parallel_size=2, tensor_parallel_size=1)
    seen = []
    with tempfile.TemporaryDirectory() as folder:
        for k, make in enumerate(
            (lambda: ModelParallelStrategy(**sizes), lambda: RotorModelParallelStrategy(0.5, **sizes))
        ):
            os.environ["MASTER_PORT"] = str(ports[2 * k])
            first = _fit(make(), folder, 3)
            os.environ["MASTER_PORT"] = str(ports[2 * k + 1])
            saved = f"{folder}/{type(make()).__name__}.ckpt"
            seen.append((first, _fit(make(), folder, 6, saved)))
    torch.save(seen, f"{store}.rank{rank}")


def _free_ports(count: int = 4) -> list[int]:
    """A port per fit: a process group's store does not meet the previous one's closing connections."""
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


@pytest.mark.slow  # one spawn of two processes, four fits each
def test_rotor_model_parallel_strategy_is_bitwise_with_model_parallel_and_resumes_on_every_rank():
    store = tempfile.mktemp()
    mp.spawn(_worker, args=(_free_ports(), store), nprocs=2)
    ranks = [torch.load(f"{store}.rank{rank}", weights_only=False) for rank in (0, 1)]
    for (plain, plain_resumed), (rotor, rotor_resumed) in ranks:
        assert all(torch.equal(a, b) for a, b in zip(plain["shards"], rotor["shards"], strict=True))
        assert all(torch.equal(a, b) for a, b in zip(plain_resumed["shards"], rotor_resumed["shards"], strict=True))
        assert not is_no_recompute(rotor["ops"]) and rotor_resumed["ops"] == rotor["ops"]  # the plan restored
    assert ranks[0][1][0]["ops"] == ranks[1][1][0]["ops"]


def test_rotor_model_parallel_is_registered_by_name():
    assert "rotor_model_parallel" in StrategyRegistry
    assert StrategyRegistry["rotor_model_parallel"]["strategy"] is RotorModelParallelStrategy
