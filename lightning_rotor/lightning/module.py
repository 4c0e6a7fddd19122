"""`ModelTask`: a LightningModule training a model from `lightning_rotor.models` with its own loss.

It is what the configs train: the model is an `nn.Sequential` (`self.model`), so
`RotorStrategy` finds it as the chain to checkpoint. Image models give
`(batch, classes)` logits; language models give `(batch, tokens, vocab)`, scored
against next-token targets.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch

from lightning_rotor.models import get_model, get_spec


class ModelTask(pl.LightningModule):
    """`model` names an entry of `lightning_rotor.models.MODELS`; `model_kwargs` are its size arguments."""

    def __init__(
        self,
        model: str = "resnet18",
        model_kwargs: dict[str, Any] | None = None,
        lr: float = 0.05,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.model = get_model(model, **(model_kwargs or {}))
        self.loss = get_spec(model).loss

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def _loss(self, batch: Any, stage: str) -> torch.Tensor:
        x, target = batch
        logits = self.model(x)
        loss = self.loss(logits, target)
        self.log(f"{stage}/loss", loss, prog_bar=stage == "train")
        if logits.dim() == 2:
            self.log(f"{stage}/accuracy", (logits.argmax(-1) == target).float().mean())
        return loss

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._loss(batch, "train")

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._loss(batch, "val")

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._loss(batch, "test")

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(batch[0]).argmax(-1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(
            self.parameters(),
            lr=self.hparams["lr"],
            momentum=self.hparams["momentum"],
            weight_decay=self.hparams["weight_decay"],
        )
