"""Train a ResNet from lightning_rotor.models with Lightning under an activation budget.

    python examples/lightning_resnet.py --mem-limit 75% --steps 100
    tensorboard --logdir lightning_logs      # rotor/ scalars, memory curve, stage table

The whole integration is one argument: `Trainer(strategy=RotorStrategy(mem_limit=...))`.
The strategy finds the model's nn.Sequential, profiles it on the first batch, plans,
and the RotorCallback it adds logs what happened to TensorBoard.
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_rotor.lightning import RotorStrategy
from lightning_rotor.lightning.data import SyntheticImages
from lightning_rotor.lightning.module import ModelTask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mem-limit", default="75%", help="bytes, '64MiB', or a fraction of the no-recompute peak")
    parser.add_argument("--model", default="resnet18", help="a name from lightning_rotor.models.MODELS")
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--accelerator", default="auto", help="cpu, gpu or auto")
    args = parser.parse_args()

    pl.seed_everything(0)
    model = ModelTask(args.model, {"width": args.width, "num_classes": 10}, lr=0.05)
    data = SyntheticImages(num_samples=2048, image_size=32, num_classes=10, batch_size=32)
    trainer = pl.Trainer(
        strategy=RotorStrategy(mem_limit=args.mem_limit),
        accelerator=args.accelerator,
        devices=1,
        max_steps=args.steps,
        log_every_n_steps=5,
        limit_val_batches=0,
        logger=TensorBoardLogger("lightning_logs", name="lightning_resnet"),
    )
    trainer.fit(model, data)
    print(f"logs in {trainer.logger.log_dir}; open them with: tensorboard --logdir lightning_logs")


if __name__ == "__main__":
    main()
