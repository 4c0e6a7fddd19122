"""Spike (issue 27): rotor's Checkpointable and FSDP2's fully_shard, 2 gloo processes on CPU.

python benchmarks/fsdp_spike.py CASE MODEL [MEM_LIMIT]  (CASE: plain | before | after | noshard; MODEL: seq | loop)
Prints per rank: the error (type, first line, the frame in lightning_rotor) or the parameters' digest
after 3 AdamW steps, and how many all-gathers / reduce-scatters each rank issued.
"""

from __future__ import annotations

import os
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import fully_shard

from lightning_rotor.bench.collectives import count_collectives as counting
from lightning_rotor.checkpointable import Checkpointable
from lightning_rotor.models.gpt import gpt, lm_loss

COUNTS = {"all_gather": 0, "reduce_scatter": 0}


def count_collectives() -> None:
    """Count FSDP2's all-gathers and reduce-scatters in `COUNTS` (lightning_rotor/bench/collectives.py)."""
    counting(COUNTS)


class Root(torch.nn.Module):
    """An FSDP root around rotor: its pre-forward unshards the parameters no block owns."""

    def __init__(self, rotor):
        super().__init__()
        self.rotor = rotor

    def forward(self, x):
        return self.rotor(x)


def build(case: str, kind: str, mem_limit):
    torch.manual_seed(0)
    if kind == "seq":  # lightning_rotor.models.gpt: one nn.Sequential (embed, blocks, ln_f, lm_head)
        model = gpt(vocab_size=32, block_size=16, n_layer=3, n_head=2, n_embd=16, dropout=0.0)
    else:  # a GPT whose forward loops over a ModuleList (a module-level chain is discovered)
        from lightning_rotor.bench.any_models import GPT

        model = GPT(vocab_size=32, block_size=16, n_layer=3, n_head=2, n_embd=16, dropout=0.0)
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())  # untied
    if case == "outer":  # Checkpointable first, blocks sharded, then a root of our own sharded around it
        rotor = Checkpointable(model, mem_limit=mem_limit)
        for block in model.blocks:
            fully_shard(block)
        root = Root(rotor)
        fully_shard(root)
        return root
    if case == "before":
        model = Checkpointable(model, mem_limit=mem_limit)
        inner = model.module
    else:
        inner = model
    if case != "noshard":
        for block in inner.blocks if kind == "seq" else inner.transformer.h:
            fully_shard(block)
        fully_shard(inner)
    if case == "after":
        model = Checkpointable(model, mem_limit=mem_limit)
    return model


def digest(model) -> list[str]:
    out = []
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out.append(f"{name}:{full.detach().double().sum().item():.17g}")
    return out


def worker(rank: int, world: int, case: str, kind: str, mem_limit, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    count_collectives()
    model = build(case, kind, mem_limit)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(100 + rank)
    try:
        for _ in range(3):
            data = torch.randint(32, (4, 17), generator=g)
            loss = lm_loss(model(data[:, :-1]), data[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
        result = "\n".join(digest(model))
    except Exception as err:  # noqa: BLE001 - the spike reports what failed
        frames = [f for f in traceback.extract_tb(err.__traceback__) if "lightning_rotor" in f.filename]
        where = " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno}({f.name})" for f in frames[::-1][:4])
        if os.environ.get("SPIKE_TRACE") and rank == 0:
            traceback.print_exc()
        result = f"ERROR {type(err).__name__}: {str(err).splitlines()[0][:300]}\n  rotor frames: {where}"
    with open(f"{store}.rank{rank}", "w") as f:
        f.write(f"{result}\ncollectives: {COUNTS}\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    case, kind = sys.argv[1], sys.argv[2]
    mem_limit = None if len(sys.argv) < 4 else float(sys.argv[3])
    store = tempfile.mktemp()
    mp.spawn(worker, args=(2, case, kind, mem_limit, store), nprocs=2)
    for r in (0, 1):
        print(f"--- {case} rank {r}")
        print(open(f"{store}.rank{r}").read())
