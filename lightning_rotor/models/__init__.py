"""Ready nn.Sequential models (no torchvision) and what it takes to train them.

`get_model(name, **kwargs)` builds a model; `MODELS[name]` is its `ModelSpec`, which
also makes a matching sample batch (`spec.sample(batch_size, **kwargs)` -> input,
target) and computes the loss (`spec.loss(output, target)`). The bench, the Lightning
quickstart and the tests share these, so "resnet50" means one thing everywhere.
Each spec carries `tiny` kwargs (a model that runs in milliseconds, for tests) and
`bench` kwargs (a CPU-friendly size for the published benchmarks).

`lightning_rotor.models.as_written` holds models written as users write them (a
hand-written ResNet, a nanoGPT-style GPT, a transformers GPT-2 from a small config),
whose chains rotor discovers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from lightning_rotor.models.gpt import gpt, lm_loss
from lightning_rotor.models.mlp import hetero, hetero2, mlp
from lightning_rotor.models.mobilenet import mobilenet
from lightning_rotor.models.resnet import resnet, resnet18, resnet50, resnet101
from lightning_rotor.models.vgg import vgg, vgg11


def _images(
    batch_size: int,
    *,
    image_size: int = 224,
    in_channels: int = 3,
    num_classes: int = 1000,
    generator: torch.Generator | None = None,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(batch_size, in_channels, image_size, image_size, generator=generator)
    return x, torch.randint(num_classes, (batch_size,), generator=generator)


def _tokens(
    batch_size: int,
    *,
    vocab_size: int = 50257,
    block_size: int = 1024,
    seq_len: int | None = None,
    generator: torch.Generator | None = None,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    t = block_size if seq_len is None else seq_len
    data = torch.randint(vocab_size, (batch_size, t + 1), generator=generator)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def _vectors(
    batch_size: int, *, in_features: int, num_classes: int = 10, generator: torch.Generator | None = None, **_: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(batch_size, in_features, generator=generator)
    return x, torch.randint(num_classes, (batch_size,), generator=generator)


def _mlp_sample(batch_size: int, *, in_features: int = 784, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return _vectors(batch_size, in_features=in_features, **kwargs)


def _hetero_sample(batch_size: int, *, in_features: int = 256, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return _vectors(batch_size, in_features=in_features, **kwargs)


def _classify(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target)


@dataclass(frozen=True)
class ModelSpec:
    """How to build a model, feed it a batch and compute its loss."""

    name: str
    build: Callable[..., nn.Sequential]
    sample_fn: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    tiny: dict[str, Any] = field(default_factory=dict)
    bench: dict[str, Any] = field(default_factory=dict)
    sample_only: tuple[str, ...] = ()  # kwargs that shape the batch but are not model arguments

    def model_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in kwargs.items() if k not in self.sample_only}

    def sample(self, batch_size: int, *, seed: int | None = 0, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """A deterministic (input, target) batch matching a model built with the same kwargs."""
        generator = None if seed is None else torch.Generator().manual_seed(seed)
        return self.sample_fn(batch_size, generator=generator, **kwargs)


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        *(
            ModelSpec(
                name,
                build,
                _images,
                _classify,
                tiny=dict(width=4, num_classes=10, image_size=32),
                bench=dict(image_size=64),
                sample_only=("image_size",),
            )
            for name, build in (("resnet18", resnet18), ("resnet50", resnet50), ("resnet101", resnet101))
        ),
        ModelSpec(
            "vgg11",
            vgg11,
            _images,
            _classify,
            tiny=dict(width=4, hidden=32, pool=1, num_classes=10, image_size=32),
            bench=dict(width=32, hidden=512, pool=2, image_size=64),
            sample_only=("image_size",),
        ),
        ModelSpec(
            "mobilenet",
            mobilenet,
            _images,
            _classify,
            tiny=dict(width=4, head=8, num_classes=10, image_size=32),
            bench=dict(width=16, head=40, image_size=64),
            sample_only=("image_size",),
        ),
        ModelSpec(
            "gpt",
            gpt,
            _tokens,
            lm_loss,
            tiny=dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16),
            bench=dict(vocab_size=4096, block_size=256, n_layer=6, n_head=6, n_embd=384),
            sample_only=("seq_len",),
        ),
        ModelSpec(
            "mlp",
            mlp,
            _mlp_sample,
            _classify,
            tiny=dict(in_features=12, hidden=16, depth=3, num_classes=5),
            bench=dict(hidden=2048, depth=8),
        ),
        ModelSpec(
            "hetero",
            hetero,
            _hetero_sample,
            _classify,
            tiny=dict(in_features=8, dim=8, num_classes=5),
            bench=dict(dim=256),
        ),
        ModelSpec(
            "hetero2",
            hetero2,
            _hetero_sample,
            _classify,
            tiny=dict(in_features=8, dim=8, num_classes=5),
            bench=dict(dim=1024),
        ),
    )
}


def get_spec(name: str) -> ModelSpec:
    """The registered spec for `name`; a clear error listing the names otherwise."""
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; registered models: {', '.join(MODELS)}") from None


def get_model(name: str, **kwargs: Any) -> nn.Sequential:
    """Build registered model `name` with `kwargs` (sample-only kwargs such as image_size are ignored)."""
    spec = get_spec(name)
    return spec.build(**spec.model_kwargs(kwargs))


def example_input(
    name: str, batch_size: int, *, seed: int | None = 0, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic (input, target) batch for registered model `name` built with `kwargs`."""
    return get_spec(name).sample(batch_size, seed=seed, **kwargs)


__all__ = [
    "MODELS",
    "ModelSpec",
    "example_input",
    "get_model",
    "get_spec",
    "gpt",
    "hetero",
    "hetero2",
    "lm_loss",
    "mlp",
    "mobilenet",
    "resnet",
    "resnet18",
    "resnet50",
    "resnet101",
    "vgg",
    "vgg11",
]
