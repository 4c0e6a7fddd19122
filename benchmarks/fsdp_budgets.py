"""rotor under FSDP2 at several budgets: per rank, the measured peak against rotor's prediction and budget.

python benchmarks/fsdp_budgets.py          # CPU, gloo, 2 processes; GPT of 4 blocks, 16 wide, batch 8 of 16 tokens

FSDP2 alone, then rotor (the supported order, docs/sharded.md) at 40% and 60% of its no-recomputation
peak, at FSDP2's own measured peak (the largest over ranks, in bytes) and above its no-recomputation peak.
3 AdamW steps each; the peak of steps 2-3 beyond the persistent model state (tensor accounting with
FSDP2's unsharded parameters, `sharded.ShardedMemoryProbe`, through fsdp_rotor.step), the
all-gathers over steps 2-3, and whether the local shards are torch.equal to FSDP2 alone's.
"""

from __future__ import annotations

import os
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from fsdp_rotor import COUNTS, count_collectives, step  # the sibling script (run from benchmarks/)
from torch.distributed.fsdp import fully_shard

from lightning_rotor.checkpointable import Checkpointable
from lightning_rotor.models.gpt import gpt


def train(mem_limit, rank: int) -> dict:
    torch.manual_seed(0)
    model = gpt(vocab_size=32, block_size=16, n_layer=4, n_head=2, n_embd=16, dropout=0.0)
    root = model if mem_limit is None else Checkpointable(model, mem_limit=mem_limit)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(root)
    opt = torch.optim.AdamW(root.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(100 + rank)
    peak = 0
    for k in range(3):
        if k == 1:
            COUNTS.update(all_gather=0, reduce_scatter=0)
        peak = max(peak, step(root, opt, torch.randint(32, (8, 17), generator=g), "cpu", measure=k > 0))
    seen = {
        "peak": peak,
        "all_gather": COUNTS["all_gather"],
        "shards": [p.to_local().clone() for p in root.parameters()],
    }
    if mem_limit is not None:
        seen.update(predicted=root.plan.peak, budget=root.plan.budget)
    return seen


def worker(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    count_collectives()
    plain = train(None, rank)
    largest = torch.tensor([plain["peak"]])
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    rows = [("FSDP2 alone", plain)]
    for name, limit in (("0.4", 0.4), ("0.6", 0.6), ("FSDP2's peak", int(largest.item())), ("above", 2**50)):
        rows.append((f"rotor, {name}", train(limit, rank)))
    lines = [f"rank {rank}", "| run | measured peak (B) | predicted (B) | budget (B) | all-gathers | bitwise |"]
    lines.append("|---|---|---|---|---|---|")
    for name, r in rows:
        same = all(torch.equal(a, b) for a, b in zip(plain["shards"], r["shards"], strict=True))
        figures = f"{r['peak']:,} | {r.get('predicted', 0):,} | {r.get('budget', 0):,}"
        lines.append(f"| {name} | {figures} | {r['all_gather']} | {same} |")
    with open(f"{out}.{rank}", "w") as f:
        f.write("\n".join(lines))
    dist.destroy_process_group()


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    out = tempfile.mktemp()
    mp.spawn(worker, args=(free, out), nprocs=2)
    for rank in (0, 1):
        with open(f"{out}.{rank}") as f:
            print(f.read())
