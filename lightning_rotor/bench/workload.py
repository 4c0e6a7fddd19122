"""The workload every bench method trains on: one model, one batch, one loss."""

from __future__ import annotations

import ast
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_rotor.bench.any_models import ANY_MODELS
from lightning_rotor.bench.peers import PeerError, build_peer_model, is_peer_model, own_blocks, own_checkpointing
from lightning_rotor.memory import CudaMemoryProbe, probe_for
from lightning_rotor.models import MODELS, ModelSpec
from lightning_rotor.stages import sequential_stages

LossFn = Callable[[Any, Any], torch.Tensor]  # (output, target) -> loss
Built = tuple[nn.Module, torch.Tensor, "torch.Tensor | None", LossFn]  # model, input, target, loss


class BenchError(ValueError):
    """Bad bench input (model path, budgets, sizes): reported as one line."""


# -- the workload ---------------------------------------------------------------------------
@dataclass
class Workload:
    """One model, one batch, one loss: what every method trains on."""

    name: str
    model: nn.Module  # an nn.Sequential, or a model as written (`any_models`: rotor discovers its chain)
    x: torch.Tensor
    y: torch.Tensor | None
    loss: LossFn
    device: torch.device
    stage_names: list[str] = field(default_factory=list)
    stages: list[nn.Module] = field(default_factory=list)  # empty for a model that is not a plain Sequential
    block: type | None = None  # the block class per-block checkpointing wraps (models as written)
    own: Callable[..., Any] | None = None  # hf:/timm: models: the forward with the library's own checkpointing
    blocks: list[nn.Module] = field(default_factory=list)  # hf:/timm: the blocks `own` wraps (and `sac`)

    def __post_init__(self) -> None:
        if isinstance(self.model, nn.Sequential) and type(self.model).forward is nn.Sequential.forward:
            found = sequential_stages(self.model)
            self.stage_names, self.stages = list(found.names), list(found.modules)
        self.model.train()


def _square_loss(output: Any, _target: Any) -> torch.Tensor:
    return output.float().pow(2).mean()


def parse_kwargs(items: list[str]) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise BenchError(f"--set expects KEY=VALUE (e.g. --set n_layer=4), got {item!r}")
        try:
            kwargs[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            kwargs[key] = value
    return kwargs


def _from_factory(path: str, kwargs: dict[str, Any], batch_size: int, input_shape: tuple[int, ...] | None) -> Built:
    module_name, _, attr = path.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise BenchError(
            f"cannot import model {path!r} ({type(err).__name__}: {err}); give a registered name or pkg.module:factory"
        ) from None
    try:
        made = factory(**kwargs)
    except TypeError as err:
        raise BenchError(f"{path} does not accept the size arguments {kwargs}: {err}") from None
    if isinstance(made, ModelSpec):
        return _from_spec(made, kwargs, batch_size)
    if isinstance(made, nn.Sequential):
        if input_shape is None:
            raise BenchError(f"{path} returned an nn.Sequential; give --input-shape (e.g. --input-shape 8,3,224,224)")
        return made, torch.randn(*input_shape, generator=torch.Generator().manual_seed(0)), None, _square_loss
    if isinstance(made, tuple) and made and isinstance(made[0], nn.Sequential) and len(made) in (2, 3):
        if len(made) == 2:
            return made[0], made[1], None, _square_loss
        own_loss = made[2]  # loss_fn(output), the target unused
        return made[0], made[1], None, lambda out, _y: own_loss(out)
    raise BenchError(
        f"{path} returned {type(made).__name__}; a factory returns a ModelSpec, an nn.Sequential, "
        "or (nn.Sequential, input[, loss_fn])"
    )


def _from_spec(spec: ModelSpec, kwargs: dict[str, Any], batch_size: int) -> Built:
    try:
        model = spec.build(**spec.model_kwargs(kwargs))
    except TypeError as err:
        raise BenchError(f"bad size arguments for model {spec.name!r}: {err}") from None
    x, y = spec.sample(batch_size, seed=0, **kwargs)
    return model, x, y, spec.loss


def load_workload(
    model: str,
    *,
    batch_size: int,
    size: str = "bench",
    overrides: dict[str, Any] | None = None,
    input_shape: tuple[int, ...] | None = None,
    device: torch.device | None = None,
    seed: int = 0,
) -> Workload:
    """Build MODEL (a registered name, or `pkg.module:factory`) and its batch on `device`."""
    if batch_size < 1:
        raise BenchError(f"--batch-size must be a positive integer, got {batch_size}")
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(seed)
    block = None
    if is_peer_model(model):
        try:
            built, x, y, loss = build_peer_model(model, batch_size, dict(overrides or {}))
        except PeerError as err:
            raise BenchError(str(err)) from None
        except TypeError as err:
            raise BenchError(f"bad size arguments for model {model!r}: {err}") from None
        built, x, y = built.to(device), x.to(device), y.to(device)
        own = own_checkpointing(built)
        return Workload(model, built, x, y, loss, device, own=own, blocks=own_blocks(built) if own else [])
    if ":" in model:
        built, x, y, loss = _from_factory(model, dict(overrides or {}), batch_size, input_shape)
    elif model in ANY_MODELS:
        try:
            built, x, y, loss, block = ANY_MODELS[model](batch_size, **dict(overrides or {}))
        except TypeError as err:
            raise BenchError(f"bad size arguments for model {model!r}: {err}") from None
        except ImportError as err:
            raise BenchError(
                f"model {model!r} needs {err.name or 'a missing package'} (pip install lightning-rotor[test-models])"
            ) from None
    elif model in MODELS:
        spec = MODELS[model]
        kwargs = {"tiny": spec.tiny, "bench": spec.bench, "full": {}}[size] | dict(overrides or {})
        built, x, y, loss = _from_spec(spec, kwargs, batch_size)
    else:
        raise BenchError(
            f"unknown model {model!r}; give a registered name ({', '.join([*MODELS, *ANY_MODELS])}) "
            "an import path pkg.module:factory, or hf:NAME / timm:NAME (transformers, timm)"
        )
    built = built.to(device)
    x = x.to(device)
    y = y.to(device) if isinstance(y, torch.Tensor) else y
    return Workload(model, built, x, y, loss, device, block=block)


def measure_peak(w: Workload, forward: Callable[[torch.Tensor], Any], seed: int, probe: Any = None) -> int:
    """Activation bytes at the step's peak, the chain input included (parameters and their gradients left out).

    `probe`: what measures (default: the allocator on CUDA, exact tensor accounting elsewhere). The allocator
    sees every allocation, so for it the parameter gradients are made (zeros) before the step, as
    `CudaMemoryProbe` asks: the gradients the step accumulates into them are then only transients, which the
    profiler measures too; tensor accounting leaves stored gradients out by itself.
    """
    w.model.zero_grad(set_to_none=True)
    probe = probe_for(w.device, exclude=w.model) if probe is None else probe
    if isinstance(probe, CudaMemoryProbe):
        for p in w.model.parameters():
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    with probe:
        probe.track(w.x)
        torch.manual_seed(seed)
        loss = w.loss(forward(w.x), w.y)
        loss.backward()
        del loss
    return probe.peak
