"""Train a small GPT with Lightning Fabric within an activation-memory budget.

    python examples/fabric_gpt.py --mem-limit 50% --steps 10
    python examples/fabric_gpt.py --logdir runs   # TensorBoard: the rotor/... scalars
    python examples/fabric_gpt.py --layers 2 --width 16 --batch-size 2 --steps 2   # a smoke run

The only change to a Fabric loop is `strategy="rotor"` (or `RotorFabricStrategy(...)` for a
budget): `fabric.setup` swaps rotor in, the first training batch profiles and plans, and
every `fabric.backward` runs the plan. `fabric.strategy.metrics` holds the same `rotor/...`
scalars as the Trainer's callback logs. Runs on the CPU in seconds (`--accelerator gpu` for CUDA).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric

from lightning_rotor import RotorFabricStrategy, format_bytes
from lightning_rotor.models.as_written import GPT


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mem-limit", default="50%", help="bytes, '64MiB', or a fraction of the no-recompute peak")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--logdir", default=None, help="write TensorBoard logs here")
    args = parser.parse_args()

    loggers = []
    if args.logdir:
        from lightning.fabric.loggers import TensorBoardLogger

        loggers.append(TensorBoardLogger(args.logdir, name="fabric_gpt"))
    fabric = Fabric(
        strategy=RotorFabricStrategy(mem_limit=args.mem_limit, measure_every_n_steps=5),
        accelerator=args.accelerator,
        devices=1,
        loggers=loggers,
    )
    fabric.seed_everything(0)
    model = GPT(vocab_size=128, block_size=32, n_layer=args.layers, n_head=2, n_embd=args.width)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = fabric.setup(model, optimizer)

    data = torch.randint(128, (args.steps, args.batch_size, 33), generator=torch.Generator().manual_seed(0))
    model.train()
    for step, batch in enumerate(data):
        x, y = fabric.to_device((batch[:, :-1], batch[:, 1:]))
        loss = lm_loss(model(x), y)  # no name for the logits: a kept output would outlive the budget
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()
        fabric.log_dict({"loss": loss.item(), **fabric.strategy.metrics}, step=step)
        fabric.print(f"step {step}: loss {loss.item():.3f}")

    metrics = fabric.strategy.metrics
    fabric.print(
        f"budget {format_bytes(int(metrics['rotor/budget_bytes']))}, "
        f"measured peak {format_bytes(int(metrics.get('rotor/measured_peak_bytes', 0)))}, "
        f"{int(metrics['rotor/recomputed_stages'])} stages recomputed, "
        f"predicted overhead {metrics.get('rotor/predicted_overhead', 0.0):.1%}"
    )


if __name__ == "__main__":
    main()
