"""Offloading under FSDP2 (docs/sharded.md, "Offloading under FSDP2"), over a real 2-process gloo group.

One spawn runs every case on both ranks and writes what each rank saw. Plain PyTorch: the GPT of
tests/test_sharded.py trained 3 AdamW steps by FSDP2 alone and by rotor under FSDP2 with `offload=` (a fast
link given, and the link measured on each rank), at a budget where the plan offloads; through a real Trainer:
`RotorModelParallelStrategy(offload=...)` beside Lightning's `ModelParallelStrategy`. The local shards must be
torch.equal, each rank's measured peak (`ShardedMemoryProbe`) within the budget, the host copies all gone at the
step's end, and every rank's plan the same: planned on the slowest rank's bandwidth.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallelStrategy
from lightning.pytorch.strategies import ModelParallelStrategy
from test_sharded import _gpt, _loss, _persistent
from test_sharded_fabric import _fit as _fabric_fit
from test_sharded_fabric import _shard
from test_sharded_lightning import _fit, _free_ports
from torch import nn
from torch.distributed.fsdp import fully_shard

from lightning_rotor.chain import Chain
from lightning_rotor.checkpointable import Checkpointable
from lightning_rotor.fabric import RotorFabricModelParallelStrategy
from lightning_rotor.lightning import RotorModelParallelStrategy
from lightning_rotor.ops import OpKind
from lightning_rotor.sharded import ShardedMemoryProbe, same_chain_on_ranks

pytestmark = pytest.mark.slow  # one spawn of two processes for the whole file's cases

FAST = "1000GB/s"  # a copy of these activations always hides behind a forward


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(128, 128)

    def forward(self, x):
        return torch.tanh(self.linear(x))


def _blocks():
    """Sixteen blocks whose inputs are as big as what they save: the plans offload stage inputs (`Offload k`),
    where the GPT's offload what a stage saved (`OffloadSaved k`)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(16)], nn.Linear(128, 5))
    return model, list(model)[:-1], 5


def _batch(vocab: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    if vocab == 5:  # `_blocks`: features and classes
        return torch.randn(64, 128, generator=g), torch.randint(0, 5, (64,), generator=g)
    data = torch.randint(vocab, (4, 17), generator=g)
    return data[:, :-1], data[:, 1:]


def _train(rank: int, build=_gpt, **settings) -> dict:
    """3 AdamW steps of FSDP2 alone (no settings) or rotor under FSDP2 with `settings`; steps 2-3 measured."""
    model, blocks, vocab = build()
    root = Checkpointable(model, **settings) if settings else model
    for block in blocks:
        fully_shard(block)
    fully_shard(root)
    opt = torch.optim.AdamW(root.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(100 + rank)
    seen: dict = {"peak": 0, "host_left": 0}
    for step in range(3):
        x, y = _batch(vocab, g)
        probe = ShardedMemoryProbe(root, _persistent(root, opt))
        with probe:
            _loss(root(x), y).backward()
        if step:
            seen["peak"] = max(seen["peak"], probe.peak)
            seen["host_left"] = max(seen["host_left"], probe.host_current)
        opt.step()
        opt.zero_grad(set_to_none=False)
    seen["shards"] = [p.to_local().detach().clone() for p in root.parameters()]
    if settings:
        entry = root.last_entry
        seen.update(ops=list(entry.plan.ops), budget=entry.plan.budget, bandwidth=entry.chain.bandwidth)
    return seen


def _reduced(rank: int) -> Chain:
    """A chain whose bandwidth and stage 1's offloadable bytes differ between the ranks, reduced across them."""
    chain = Chain(
        input_size=16,
        out_size=[16, 16, 16],
        saved_size=[16, 16, 16],
        fwd_time=[1.0] * 3,
        bwd_time=[1.0] * 3,
        fwd_tmp=[0] * 3,
        bwd_tmp=[0] * 3,
        bandwidth=1e9 * (rank + 1),
        offloadable=[8, 8 + rank, 0],
    )
    return same_chain_on_ranks(chain)


def _lightning(rank: int, ports: list[int], folder: str) -> list[dict]:
    """Lightning's ModelParallelStrategy, then RotorModelParallelStrategy offloading, 3 steps each."""
    os.environ.update(MASTER_ADDR="127.0.0.1", WORLD_SIZE="2", NODE_RANK="0", RANK=str(rank), LOCAL_RANK=str(rank))
    sizes = dict(data_parallel_size=2, tensor_parallel_size=1)
    seen = []
    for port, strategy in zip(
        ports, (ModelParallelStrategy(**sizes), RotorModelParallelStrategy(0.5, offload=FAST, **sizes)), strict=True
    ):
        os.environ["MASTER_PORT"] = str(port)
        seen.append(_fit(strategy, folder, 3))
    return seen


def _fabric(rank: int, ports: list[int]) -> list[dict]:
    """Fabric's ModelParallelStrategy, then RotorFabricModelParallelStrategy offloading (tests/test_sharded_fabric.py:
    a Llama, two micro-batches a step, 3 steps)."""
    sizes = dict(data_parallel_size=2, tensor_parallel_size=1)
    seen = []
    for port, strategy in zip(
        ports,
        (
            FabricModelParallelStrategy(_shard, **sizes),
            RotorFabricModelParallelStrategy(_shard, 0.5, offload=FAST, **sizes),
        ),
        strict=True,
    ):
        os.environ["MASTER_PORT"] = str(port)
        seen.append(_fabric_fit(strategy, rank))
    return seen


def _worker(rank: int, ports: list[int], store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    seen: dict = {"plain": _train(rank)}
    seen["given"] = _train(rank, mem_limit=0.5, offload=FAST)
    seen["measured"] = _train(rank, mem_limit=0.5, offload=True)
    seen["plain_blocks"] = _train(rank, _blocks)
    seen["stage_inputs"] = _train(rank, _blocks, mem_limit=0.6, offload=FAST)
    seen["reduced"] = _reduced(rank)
    dist.destroy_process_group()
    with tempfile.TemporaryDirectory() as folder:
        seen["lightning"] = _lightning(rank, ports[:2], folder)
    seen["fabric"] = _fabric(rank, ports[2:])
    torch.save(seen, f"{store}.rank{rank}")


@pytest.fixture(scope="module")
def ranks():
    store = tempfile.mktemp()
    mp.spawn(_worker, args=(_free_ports(4), store), nprocs=2)
    return [torch.load(f"{store}.rank{rank}", weights_only=False) for rank in (0, 1)]


def _offloads(ops) -> bool:
    return any(op.kind.is_transfer for op in ops)


@pytest.mark.parametrize("case", ["given", "measured", "stage_inputs"])
def test_offloading_under_fsdp2_is_bitwise_within_budget_and_frees_its_host_copies(ranks, case):
    kinds = (OpKind.OFFLOAD,) if case == "stage_inputs" else (OpKind.OFFLOAD_SAVED,)
    for seen in ranks:
        plain, rotor = seen["plain_blocks" if case == "stage_inputs" else "plain"], seen[case]
        assert any(op.kind in kinds for op in rotor["ops"]), [op.label for op in rotor["ops"]]
        assert all(torch.equal(a, b) for a, b in zip(plain["shards"], rotor["shards"], strict=True))
        assert 0 < rotor["peak"] <= rotor["budget"]
        assert rotor["host_left"] == 0


def test_a_measured_link_is_the_slowest_ranks_and_every_rank_plans_alike(ranks):
    """Each rank measures its own link (`offload=True`): planned on one bandwidth, the plans are the same."""
    rank0, rank1 = (seen["measured"] for seen in ranks)
    assert rank0["bandwidth"] == rank1["bandwidth"] > 0
    assert rank0["ops"] == rank1["ops"]


def test_ranks_plan_on_the_slowest_link_and_offload_no_saved_part_they_disagree_on(ranks):
    for seen in ranks:
        chain = seen["reduced"]
        assert chain.bandwidth == 1e9  # rank 0's: a faster one would let rank 0's copies outlast their plan
        assert chain.offloadable == [8, 0, 0]  # stage 1: 8 bytes on rank 0, 9 on rank 1


def test_rotor_model_parallel_strategy_offloading_is_bitwise_with_model_parallel(ranks):
    for seen in ranks:
        plain, rotor = seen["lightning"]
        assert _offloads(rotor["ops"])
        assert all(torch.equal(a, b) for a, b in zip(plain["shards"], rotor["shards"], strict=True))
    assert ranks[0]["lightning"][1]["ops"] == ranks[1]["lightning"][1]["ops"]


def test_rotor_fabric_model_parallel_offloading_is_bitwise_with_model_parallel(ranks):
    for seen in ranks:
        plain, rotor = seen["fabric"]
        assert _offloads(rotor["ops"])
        assert all(torch.equal(a, b) for a, b in zip(plain["shards"], rotor["shards"], strict=True))
    assert ranks[0]["fabric"][1]["ops"] == ranks[1]["fabric"][1]["ops"]
