"""Train a ResNet from lightning_rotor.models with Lightning under an activation budget.

    python examples/lightning_resnet.py --mem-limit 75% --steps 100
    tensorboard --logdir lightning_logs      # rotor/ scalars, memory curve, stage table
    python examples/lightning_resnet.py --width 4 --image-size 16 --batch-size 4 --steps 2   # a smoke run

The whole integration is one argument: `Trainer(strategy=RotorStrategy(mem_limit=...))`.
The strategy finds the model's nn.Sequential, profiles it on the first batch, plans,
and the RotorCallback it adds logs what happened to TensorBoard.
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader, TensorDataset

from lightning_rotor import RotorStrategy, format_bytes
from lightning_rotor.models import get_model


class Classifier(pl.LightningModule):
    """Any LightningModule: rotor needs nothing from it."""

    def __init__(self, model: str, width: int, classes: int):
        super().__init__()
        self.model = get_model(model, width=width, num_classes=classes)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        loss = F.cross_entropy(self.model(images), labels)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def synthetic_images(samples: int, size: int, classes: int) -> TensorDataset:
    """Noisy copies of one random template per class: a task the model can learn."""
    g = torch.Generator().manual_seed(0)
    templates = torch.randn(classes, 3, size, size, generator=g)
    labels = torch.randint(classes, (samples,), generator=g)
    return TensorDataset(templates[labels] + torch.randn(samples, 3, size, size, generator=g), labels)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mem-limit", default="75%", help="bytes, '64MiB', or a fraction of the no-recompute peak")
    parser.add_argument("--model", default="resnet18", help="a name from lightning_rotor.models.MODELS")
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--accelerator", default="auto", help="cpu, gpu or auto")
    args = parser.parse_args()

    pl.seed_everything(0)
    data = synthetic_images(2048, args.image_size, classes=10)
    trainer = pl.Trainer(
        strategy=RotorStrategy(mem_limit=args.mem_limit),
        accelerator=args.accelerator,
        devices=1,
        max_steps=args.steps,
        log_every_n_steps=5,
        logger=TensorBoardLogger("lightning_logs", name="lightning_resnet"),
    )
    trainer.fit(Classifier(args.model, args.width, classes=10), DataLoader(data, args.batch_size, shuffle=True))
    metrics = trainer.callback_metrics
    print(
        f"trained {trainer.global_step} steps, loss {float(metrics['train/loss']):.3f}; "
        f"budget {format_bytes(int(metrics['rotor/budget_bytes']))}, "
        f"{int(metrics['rotor/recomputed_stages'])} stages recomputed"
    )
    print(f"logs in {trainer.logger.log_dir}; open them with: tensorboard --logdir lightning_logs")


if __name__ == "__main__":
    main()
