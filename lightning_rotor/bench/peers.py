"""Models by name from transformers (`hf:NAME`) and timm (`timm:NAME`), and the checkpointing they ship.

Both are built from configs, nothing downloaded: `hf:gpt2` is `AutoConfig.for_model("gpt2",
**sizes)` and `AutoModelForCausalLM.from_config` on random tokens (next-token cross-entropy on the
logits), `timm:convnext_atto` is `timm.create_model("convnext_atto", pretrained=False, **sizes)` on
random images (cross-entropy on random labels). The bench compares rotor with each model's own
checkpointing at equal memory:

- `own`: what the library turns on (Hugging Face's `gradient_checkpointing_enable` with
  `use_reentrant=False`, timm's `set_grad_checkpointing()`), on for one call at a time so that the
  same model serves every method;
- `sac`: torch's selective activation checkpointing around each of those blocks, saving matmul,
  convolution and attention outputs (`lightning_rotor.selective.save_expensive`).
"""

from __future__ import annotations

import importlib.util
import warnings
from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from lightning_rotor.selective import save_expensive

PREFIXES = ("hf:", "timm:")


class PeerError(ValueError):
    """A model name the bench cannot build (package missing, unknown name, bad sizes): one line."""


def is_peer_model(name: str) -> bool:
    return name.startswith(PREFIXES)


def _need(package: str, name: str) -> None:
    if importlib.util.find_spec(package) is None:
        raise PeerError(f"model {name!r} needs {package}, which is not installed (pip install {package})")


def _whole(value: Any, key: str, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PeerError(f"{name}: --set {key}= takes a positive integer, got {value!r}")
    return value


def _tokens_loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


def build_hf(name: str, batch_size: int, sizes: dict[str, Any]) -> tuple[nn.Module, torch.Tensor, torch.Tensor, Any]:
    """A transformers causal LM from `AutoConfig.for_model(name, **sizes)`; `seq` (default 128): tokens per row."""
    _need("transformers", f"hf:{name}")
    import transformers

    sizes = dict(sizes)
    seq = _whole(sizes.pop("seq", 128), "seq", f"hf:{name}")
    try:
        if "vocab_size" in sizes:  # special token ids past a smaller vocabulary: none (transformers warns)
            default = transformers.AutoConfig.for_model(name)
            for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
                token = getattr(default, key, None)
                if key not in sizes and isinstance(token, int) and token >= int(sizes["vocab_size"]):
                    sizes[key] = None
        config = transformers.AutoConfig.for_model(name, **sizes)
    except ValueError as err:
        raise PeerError(f"unknown transformers model type {name!r} (hf:{name}): {str(err).splitlines()[0]}") from None
    config.use_cache = False  # training: no key-value cache, as gradient checkpointing requires
    try:
        model = transformers.AutoModelForCausalLM.from_config(config)
    except ValueError as err:
        raise PeerError(f"hf:{name} has no causal-LM head in transformers: {str(err).splitlines()[0]}") from None
    g = torch.Generator().manual_seed(0)
    data = torch.randint(config.vocab_size, (batch_size, seq + 1), generator=g)
    return model, data[:, :-1].contiguous(), data[:, 1:].contiguous(), _tokens_loss


def build_timm(name: str, batch_size: int, sizes: dict[str, Any]) -> tuple[nn.Module, torch.Tensor, torch.Tensor, Any]:
    """`timm.create_model(name, pretrained=False, **sizes)`; `image` (default: `img_size` or 224): pixels a side."""
    _need("timm", f"timm:{name}")
    try:
        import timm  # type: ignore[import-not-found]
    except Exception as err:  # noqa: BLE001 - e.g. a torchvision built for another torch
        raise PeerError(f"timm cannot be imported here ({type(err).__name__}: {str(err).splitlines()[0]})") from None

    sizes = dict(sizes)
    image = _whole(sizes.pop("image", sizes.get("img_size", 224)), "image", f"timm:{name}")
    if not timm.is_model(name):
        raise PeerError(f"unknown timm model {name!r} (timm:{name}); see timm.list_models()")
    try:
        model = timm.create_model(name, pretrained=False, **sizes)
    except TypeError as err:
        raise PeerError(f"bad size arguments for timm:{name}: {err}") from None
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch_size, 3, image, image, generator=g)
    y = torch.randint(model.num_classes, (batch_size,), generator=g)
    return model, x, y, F.cross_entropy


def build_peer_model(name: str, batch_size: int, sizes: dict[str, Any]) -> tuple:
    """`(model, input, target, loss_fn)` for `hf:NAME` or `timm:NAME`."""
    family, _, model_name = name.partition(":")
    if not model_name:
        raise PeerError(f"{name!r} names no model; e.g. hf:gpt2, hf:llama, timm:convnext_atto")
    torch.manual_seed(0)
    return (build_hf if family == "hf" else build_timm)(model_name, batch_size, sizes)


# -- the blocks the model's own checkpointing wraps ------------------------------------------------
def own_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's layer list, as its library's checkpointing wraps it: Hugging Face's checkpointing
    layers, else (timm) the most numerous kind of non-leaf module held in a Sequential or ModuleList."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer

        found: list[nn.Module] = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
        if found:
            return found
    except ImportError:
        pass
    held = [
        child
        for m in model.modules()
        if isinstance(m, nn.Sequential | nn.ModuleList)
        for child in m.children()
        if any(True for _ in child.children())
    ]
    if not held:
        return []
    kind, _ = Counter(type(m) for m in held).most_common(1)[0]
    return [m for m in held if type(m) is kind]


def sac_per_block(model: nn.Module, blocks: list[nn.Module]) -> Callable[..., Any]:
    """The model's forward with every block under torch's selective checkpointing (matmul, convolution and
    attention outputs saved, the rest recomputed in the backward), for this call only."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        originals = [b.__dict__.get("forward") for b in blocks]
        for b in blocks:
            run = type(b).forward.__get__(b)
            b.forward = partial(
                checkpoint,
                run,
                use_reentrant=False,
                context_fn=partial(create_selective_checkpoint_contexts, save_expensive),
            )
        try:
            return model(*args, **kwargs)
        finally:
            restore_forwards(blocks, originals)

    return forward


def own_checkpointing(model: nn.Module) -> Callable[..., Any] | None:
    """The model's forward with its library's own checkpointing on for this call only; None: it has none."""
    lib: Any = model  # the library's own methods, untyped to torch
    if hasattr(lib, "gradient_checkpointing_enable") and getattr(lib, "supports_gradient_checkpointing", False):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            lib.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        layers = [m for m in model.modules() if hasattr(m, "gradient_checkpointing") and m is not model]

        def set_hf(on: bool) -> None:
            for m in layers:
                setattr(m, "gradient_checkpointing", on)  # noqa: B010 - a library flag, not a torch attribute

        set_hf(False)
        return _switched(model, set_hf)
    if hasattr(lib, "set_grad_checkpointing"):
        try:
            lib.set_grad_checkpointing(False)
        except (AssertionError, NotImplementedError):
            return None
        return _switched(model, lambda on: lib.set_grad_checkpointing(on))
    return None


def _switched(model: nn.Module, switch: Callable[[bool], None]) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        switch(True)  # the backward's recomputation calls the block's function directly: off again is fine
        try:
            return model(*args, **kwargs)
        finally:
            switch(False)

    return forward


def restore_forwards(blocks: list[nn.Module], originals: list[Any]) -> None:
    """Each block's own `forward` back as it was before a method wrapped it (`originals`: what its
    instance dict held, None where the class's forward ran)."""
    for b, original in zip(blocks, originals, strict=True):
        if original is None:
            del b.forward
        else:
            b.forward = original
