"""Deterministic generated data for the quickstart configs: no download, same bytes every run.

`SyntheticImages`: each class is a fixed random image template; samples are a
template plus Gaussian noise, so a network can learn them and the loss falls.
`SyntheticTokens`: each sequence follows `t_{i+1} = (a * t_i + b) mod vocab` with
a per-sequence start and one of a few `(a, b)` rules, so a language model can
learn to predict the next token.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


class _Synthetic(pl.LightningDataModule):
    def __init__(self, num_samples: int, val_samples: int, batch_size: int, seed: int):
        super().__init__()
        _check_positive(num_samples=num_samples, val_samples=val_samples, batch_size=batch_size)
        self.num_samples, self.val_samples, self.batch_size, self.seed = num_samples, val_samples, batch_size, seed
        self.train: TensorDataset | None = None
        self.val: TensorDataset | None = None

    def make(self, count: int, generator: torch.Generator) -> TensorDataset:
        raise NotImplementedError

    def setup(self, stage: str) -> None:
        if self.train is None:
            generator = torch.Generator().manual_seed(self.seed)
            self.train = self.make(self.num_samples, generator)
            self.val = self.make(self.val_samples, generator)

    def _made(self) -> tuple[TensorDataset, TensorDataset]:
        """The training and validation sets `setup` made (Lightning calls it before asking for loaders)."""
        if self.train is None or self.val is None:
            raise RuntimeError(f"{type(self).__name__}: call setup() before asking for a dataloader")
        return self.train, self.val

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(self.seed)
        train, _ = self._made()
        return DataLoader(train, batch_size=self.batch_size, shuffle=True, generator=generator, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        _, val = self._made()
        return DataLoader(val, batch_size=self.batch_size)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader:
        return self.val_dataloader()


class SyntheticImages(_Synthetic):
    """Images `(channels, image_size, image_size)` in `num_classes` learnable classes."""

    def __init__(
        self,
        num_samples: int = 1024,
        val_samples: int = 128,
        image_size: int = 32,
        channels: int = 3,
        num_classes: int = 10,
        noise: float = 1.0,
        batch_size: int = 32,
        seed: int = 0,
    ):
        super().__init__(num_samples, val_samples, batch_size, seed)
        _check_positive(image_size=image_size, channels=channels, num_classes=num_classes)
        self.image_size, self.channels, self.num_classes, self.noise = image_size, channels, num_classes, noise

    def make(self, count: int, generator: torch.Generator) -> TensorDataset:
        shape = (self.channels, self.image_size, self.image_size)
        templates = torch.Generator().manual_seed(self.seed + 1)
        classes = torch.randn((self.num_classes, *shape), generator=templates)
        labels = torch.randint(0, self.num_classes, (count,), generator=generator)
        images = classes[labels] + self.noise * torch.randn((count, *shape), generator=generator)
        return TensorDataset(images, labels)


class SyntheticTokens(_Synthetic):
    """Token sequences of `seq_len` over `vocab_size`; targets are the inputs shifted by one."""

    def __init__(
        self,
        num_samples: int = 1024,
        val_samples: int = 128,
        seq_len: int = 64,
        vocab_size: int = 256,
        rules: int = 4,
        batch_size: int = 16,
        seed: int = 0,
    ):
        super().__init__(num_samples, val_samples, batch_size, seed)
        _check_positive(seq_len=seq_len, vocab_size=vocab_size, rules=rules)
        self.seq_len, self.vocab_size, self.rules = seq_len, vocab_size, rules

    def make(self, count: int, generator: torch.Generator) -> TensorDataset:
        rule_gen = torch.Generator().manual_seed(self.seed + 1)
        a = torch.randint(1, self.vocab_size, (self.rules,), generator=rule_gen)
        b = torch.randint(0, self.vocab_size, (self.rules,), generator=rule_gen)
        which = torch.randint(0, self.rules, (count,), generator=generator)
        tokens = torch.empty((count, self.seq_len + 1), dtype=torch.long)
        tokens[:, 0] = torch.randint(0, self.vocab_size, (count,), generator=generator)
        for i in range(self.seq_len):
            tokens[:, i + 1] = (a[which] * tokens[:, i] + b[which]) % self.vocab_size
        return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
