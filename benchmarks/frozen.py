"""Fine-tuning with frozen layers: plain training's measured activation peak against rotor's, on a GPT
with its embeddings and all blocks but the last frozen (`requires_grad_(False)`).

    python benchmarks/frozen.py --n-layer 6 --n-embd 64 --batch 8 --seq 64

Prints plain's measured peak (MemoryProbe, the whole step), rotor's predicted no-recompute peak, and
at a budget of plain's peak and at the smallest feasible budget: rotor's measured peak, its plan's
recomputed stages, and whether the trainable parameters' gradients equal plain's (torch.equal).
Memory only, so one run suffices (MemoryProbe counts storages: deterministic).
"""

from __future__ import annotations

import argparse
import copy

import torch

from lightning_rotor import Checkpointable, MemoryProbe
from lightning_rotor.models.gpt import gpt, lm_loss
from lightning_rotor.planner import min_feasible_budget
from lightning_rotor.simulate import no_recompute_peak


def step(model, x, y, rotor: bool) -> tuple[int, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    if rotor:
        with model.measure_step() as m:
            lm_loss(model(x), y).backward()
        peak = m.peak
    else:
        with MemoryProbe(model) as probe:
            probe.track(x)
            lm_loss(model(x), y).backward()
        peak = probe.peak
    return peak, [p.grad for p in model.parameters() if p.requires_grad]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-layer", type=int, default=6)
    parser.add_argument("--n-embd", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = gpt(
        vocab_size=args.vocab, block_size=args.seq, n_layer=args.n_layer, n_head=4, n_embd=args.n_embd, dropout=0.1
    )
    model.embed.requires_grad_(False)
    for block in model.blocks[:-1]:
        block.requires_grad_(False)
    x = torch.randint(0, args.vocab, (args.batch, args.seq))
    y = torch.randint(0, args.vocab, (args.batch, args.seq))
    plain, grads = step(model, x, y, rotor=False)
    print(f"plain training, measured peak: {plain} bytes")
    probe = Checkpointable(copy.deepcopy(model), mem_limit=plain).train()
    probe.prepare_for(x)
    chain = probe.chain
    frozen = getattr(chain, "frozen", 0)  # 0 before chain version 4
    print(
        f"rotor chain: {chain.length} stages, frozen prefix {frozen}; predicted no-recompute peak "
        f"{no_recompute_peak(chain)} bytes ({no_recompute_peak(chain) / plain:.3f}x plain), smallest feasible "
        f"budget {min_feasible_budget(chain)}"
    )
    for label, budget in (("plain's peak", plain), ("smallest feasible", min_feasible_budget(chain))):
        rotor = Checkpointable(copy.deepcopy(model), mem_limit=budget).train()
        step(rotor, x, y, rotor=True)  # profiles and plans
        peak, got = step(rotor, x, y, rotor=True)
        same = all(torch.equal(a, b) for a, b in zip(grads, got, strict=True))
        runs = rotor.last_entry.runs
        print(
            f"budget {label} ({budget}): measured {peak} bytes ({peak / plain:.3f}x plain), predicted "
            f"{rotor.plan.peak}, recomputed stages {[n for n, r in zip(chain.names, runs, strict=True) if r > 1]}, "
            f"gradients equal: {same}"
        )


if __name__ == "__main__":
    main()
