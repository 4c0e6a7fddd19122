"""Spike (issue 27): rotor's way of recomputing (a custom autograd Function whose backward re-runs
blocks under grad and calls autograd.backward inside) on fully_shard'ed GPT blocks, 2 gloo processes.

python benchmarks/fsdp_reentrant.py
Modes: plain (FSDP2 alone), hooks (the Function's backward re-runs each block through its FSDP hooks),
explicit (the Function drives unshard()/reshard() and calls block.forward, bypassing the hooks),
profiled (hooks, after one standalone backward through a block inside the root's forward, like rotor's
profiler), profiled_outside (the same backward with the block unshard()ed, its forward called without hooks,
its gradients discarded, then reshard()).
Per rank: local shards after 3 AdamW steps torch.equal to plain, all-gathers, reduce-scatters.
"""

from __future__ import annotations

import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from fsdp_spike import COUNTS, count_collectives  # the sibling script (run from benchmarks/ as the spike is)
from torch import nn
from torch.distributed.fsdp import fully_shard

from lightning_rotor.models.gpt import gpt, lm_loss


class Recompute(torch.autograd.Function):
    """Forward: every block without grad, keeping each block's input. Backward: per block, last first,
    re-run it under grad and call autograd.backward on it (a nested engine call), as rotor's executor does."""

    @staticmethod
    def forward(ctx, x, blocks, explicit):
        ctx.blocks, ctx.explicit, inputs = blocks, explicit, []
        with torch.no_grad():
            for block in blocks:
                inputs.append(x)
                if explicit:
                    block.unshard()
                    x = block.forward(x)
                    block.reshard()
                else:
                    x = block(x)
        ctx.inputs = inputs
        return x

    @staticmethod
    def backward(ctx, grad):
        for block, inp in zip(reversed(ctx.blocks), reversed(ctx.inputs), strict=True):
            inp = inp.detach().requires_grad_()
            with torch.enable_grad():
                if ctx.explicit:
                    block.unshard()
                    out = block.forward(inp)
                else:
                    out = block(inp)
            torch.autograd.backward(out, grad)  # explicit: reduce-scattered by FSDP2's final callback
            grad = inp.grad
        return grad, None, None


class Net(nn.Module):
    def __init__(self, mode: str):
        super().__init__()
        torch.manual_seed(0)
        self.gpt = gpt(vocab_size=32, block_size=16, n_layer=3, n_head=2, n_embd=16, dropout=0.0)
        self.mode = mode
        self.profile = mode in ("profiled", "profiled_outside")

    def forward(self, idx):
        g = self.gpt
        x = g.embed(idx)
        if self.profile:  # like rotor's profiler on the first call: a backward of its own through one block
            self.profile = False
            if self.mode == "profiled":  # through the block's hooks
                g.blocks[0](x.detach().requires_grad_()).sum().backward()
            else:  # out of FSDP2's reach: unsharded explicitly, no hooks, its gradients discarded
                g.blocks[0].unshard()
                g.blocks[0].forward(x.detach().requires_grad_()).sum().backward()
                for p in g.blocks[0].parameters():
                    p.grad = None
                g.blocks[0].reshard()
        if self.mode == "plain":
            x = g.blocks(x)
        else:
            x = Recompute.apply(x, list(g.blocks), self.mode == "explicit")  # profiled: through the hooks
        return g.lm_head(g.ln_f(x))


def worker(rank: int, mode: str, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}.{mode}.pg", rank=rank, world_size=2)
    count_collectives()
    net = Net(mode)  # profiled, profiled_outside: recompute through the hooks, as `hooks`
    for block in net.gpt.blocks:
        fully_shard(block)
    fully_shard(net)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(100 + rank)
    status = "ok"
    try:
        for _ in range(3):
            data = torch.randint(32, (4, 17), generator=g)
            lm_loss(net(data[:, :-1]), data[:, 1:]).backward()
            opt.step()
            opt.zero_grad()
    except Exception as err:  # noqa: BLE001 - the spike reports what failed
        status = f"ERROR {type(err).__name__}: {str(err).splitlines()[0][:200]}"
    shards = {k: (v.to_local() if hasattr(v, "to_local") else v).detach().clone() for k, v in net.state_dict().items()}
    torch.save((status, dict(COUNTS), shards), f"{store}.{mode}.{rank}")
    dist.destroy_process_group()


if __name__ == "__main__":
    store = tempfile.mktemp(dir="/tmp/fsdp")
    modes = sys.argv[1:] or ["plain", "hooks", "explicit", "profiled"]
    for mode in modes:
        mp.spawn(worker, args=(mode, store), nprocs=2)
    for mode in modes:
        for rank in (0, 1):
            status, counts, shards = torch.load(f"{store}.{mode}.{rank}")
            _, _, plain = torch.load(f"{store}.plain.{rank}")
            differ = [k for k in plain if not torch.equal(plain[k], shards[k])]
            print(f"{mode:8} rank {rank}: {status}; {counts}; params differing from plain: {len(differ)}/{len(plain)}")
