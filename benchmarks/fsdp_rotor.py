"""rotor under FSDP2 against FSDP2 alone and FSDP2 + per-block checkpointing (torchtitan's recipe), per rank.

python benchmarks/fsdp_rotor.py                      # CPU, gloo, 2 processes, a GPT of 8 blocks
python benchmarks/fsdp_rotor.py --device cuda --world 8 --layers 24 --width 1024 --seq 1024 --batch 8

Runs, each in the supported order (docs/sharded.md), every block a unit, the root last:
- `fsdp`: FSDP2 alone;
- `fsdp+ckpt`: every block wrapped for non-reentrant checkpointing first (`torch.utils.checkpoint`), then
  `fully_shard`ed, as torchtitan does ("full" activation checkpointing);
- `rotor`: `Checkpointable` first, at `fsdp+ckpt`'s measured peak (equal memory);
- `rotor-nr`: rotor at a budget above its no-recomputation peak (what it costs when nothing is recomputed).
Per run and rank: the median step time (after 2 warm-up steps; the runs take turns, one step each),
the peak beyond the persistent model state (CPU: tensor accounting with FSDP2's unsharded parameters,
`sharded.ShardedMemoryProbe`; CUDA: the
allocator's peak over the memory held at the step's start), and the all-gathers and reduce-scatters
per step. Printed as a table per rank.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.checkpoint import checkpoint

from lightning_rotor.bench.collectives import count_collectives as counting
from lightning_rotor.checkpointable import Checkpointable
from lightning_rotor.models.gpt import gpt, lm_loss
from lightning_rotor.sharded import ShardedMemoryProbe

COUNTS = {"all_gather": 0, "reduce_scatter": 0}


def count_collectives() -> None:
    """Count FSDP2's all-gathers and reduce-scatters in `COUNTS` (lightning_rotor/bench/collectives.py)."""
    counting(COUNTS)


class Checkpointed(nn.Module):
    """A block recomputed in the backward (non-reentrant checkpointing), torchtitan's per-block recipe."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=False)


def build(run: str, args, mem_limit: int | None) -> nn.Module:
    torch.manual_seed(0)
    model = gpt(
        vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads, n_embd=args.width,
        dropout=0.0,
    ).to(args.device)  # fmt: skip
    if run == "fsdp+ckpt":
        for k, block in enumerate(list(model.blocks)):
            model.blocks[k] = Checkpointed(block)
    root = Checkpointable(model, mem_limit=mem_limit) if run.startswith("rotor") else model
    for block in model.blocks:
        fully_shard(block)
    fully_shard(root)
    return root


def persistent(root: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    params = list(root.parameters())
    kept = [p.to_local().detach() for p in params] + [p.grad.to_local() for p in params if p.grad is not None]
    return kept + [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def step(root, opt, data, device: str, measure: bool) -> int:
    """One training step; its peak beyond what was held at its start, when `measure`."""
    if device == "cuda":
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    probe = ShardedMemoryProbe(root, persistent(root, opt)) if measure and device == "cpu" else None
    with probe if probe is not None else torch.enable_grad():
        lm_loss(root(data[:, :-1]), data[:, 1:]).backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    if device == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - held
    return probe.peak if probe is not None else 0


def prepared(run: str, args, rank: int, mem_limit: int | None) -> dict:
    """The run's model and optimizer after 2 warm-up steps (the first profiles and plans rotor's chain), and its
    second step's peak."""
    root = build(run, args, mem_limit)
    opt = torch.optim.AdamW(root.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randint(args.vocab, (args.batch, args.seq + 1), generator=g).to(args.device) for _ in range(4)]
    peak = 0
    for k in range(2):
        peak = step(root, opt, batches[k], args.device, measure=k == 1)
    seen = {"run": run, "peak": peak, "times": [], "all_gather": 0, "reduce_scatter": 0}
    if run.startswith("rotor"):
        seen.update(budget=root.plan.budget, recomputed=sum(r > 1 for r in root.last_entry.runs))
    return {"seen": seen, "root": root, "opt": opt, "batches": batches}


def timed_rounds(runs: list[dict], args) -> list[dict]:
    """`args.steps` rounds, each one step of every run in turn (a loaded machine slows all runs alike), then per
    run the median step time and the collectives per step."""
    for k in range(args.steps):
        for run in runs:
            COUNTS.update(all_gather=0, reduce_scatter=0)
            dist.barrier()
            start = time.perf_counter()
            step(run["root"], run["opt"], run["batches"][k % 4], args.device, measure=False)
            seen = run["seen"]
            seen["times"].append(time.perf_counter() - start)
            for key in ("all_gather", "reduce_scatter"):
                seen[key] += COUNTS[key] / args.steps
    for run in runs:
        run["seen"]["time"] = statistics.median(run["seen"].pop("times"))
    return [run["seen"] for run in runs]


def worker(rank: int, args, port: int, out: str) -> None:
    torch.set_num_threads(args.threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if args.device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=rank, world_size=args.world)
    count_collectives()
    runs = [prepared("fsdp", args, rank, None), prepared("fsdp+ckpt", args, rank, None)]
    equal = torch.tensor([runs[1]["seen"]["peak"]], device=args.device)
    dist.all_reduce(equal, op=dist.ReduceOp.MAX)  # one budget for every rank: fsdp+ckpt's largest peak
    runs.append(prepared("rotor", args, rank, int(equal.item())))
    runs.append(prepared("rotor-nr", args, rank, 2**50))
    torch.save(timed_rounds(runs, args), f"{out}.{rank}")
    dist.destroy_process_group()


def table(rank: int, rows: list[dict]) -> str:
    base = rows[1]["time"]
    lines = [
        f"rank {rank}",
        "| run | step (s) | x fsdp+ckpt | peak (B) | budget (B) | recomputed | all-gathers | reduce-scatters |",
    ]
    lines.append("|---|---|---|---|---|---|---|---|")
    for r in rows:
        lines.append(
            f"| {r['run']} | {r['time']:.4f} | {r['time'] / base:.3f} | {r['peak']:,} | {r.get('budget', '')!s} | "
            f"{r.get('recomputed', '')!s} | {r['all_gather']:g} | {r['reduce_scatter']:g} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.mktemp()
    mp.spawn(worker, args=(args, port, out), nprocs=args.world)
    for rank in range(args.world):
        print(table(rank, torch.load(f"{out}.{rank}", weights_only=False)))


if __name__ == "__main__":
    main()
