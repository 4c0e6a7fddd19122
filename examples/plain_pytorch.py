"""Train an nn.Sequential within an activation-memory budget, without Lightning.

    python examples/plain_pytorch.py --mem-limit 75% --steps 5
    python examples/plain_pytorch.py --width 4 --image-size 8 --batch-size 2 --steps 1   # a smoke run

The first training forward profiles the stages and plans; `summary()` shows
the plan; `measure_step()` measures one step's activation memory on real
tensors and compares it with the plan's prediction.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

from lightning_rotor import Checkpointable, format_bytes


def make_model(width: int = 16, classes: int = 10) -> nn.Sequential:
    def block(c_in: int, c_out: int) -> nn.Sequential:
        conv = nn.Conv2d(c_in, c_out, 3, padding=1, bias=False)
        return nn.Sequential(conv, nn.BatchNorm2d(c_out), nn.ReLU(inplace=True))

    return nn.Sequential(
        block(3, width), block(width, width), nn.MaxPool2d(2),
        block(width, 2 * width), block(2 * width, 2 * width), nn.MaxPool2d(2),
        block(2 * width, 4 * width), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * width, classes),
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mem-limit", default="75%", help="bytes, '64MiB', or a fraction of the no-recompute peak")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--width", type=int, default=16, help="channels of the first convolutions")
    parser.add_argument("--image-size", type=int, default=32)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = Checkpointable(make_model(args.width), args.mem_limit)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    y = torch.randint(0, 10, (args.batch_size,))

    for step in range(args.steps):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)  # do not keep the output alive through backward
        loss.backward()
        optimizer.step()
        if step == 0:
            print(model.summary())
        print(f"step {step}: loss {loss.item():.4f}")

    optimizer.zero_grad()
    with model.measure_step() as measured:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
    print(
        f"budget {format_bytes(model.plan.budget)}, predicted peak {format_bytes(model.plan.peak)}, "
        f"measured peak {format_bytes(measured.peak)}; profiling took {model.profile_seconds:.2f} s"
    )


if __name__ == "__main__":
    main()
