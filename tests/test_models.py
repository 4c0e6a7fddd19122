"""The ready models: standard sizes, shapes, causality, and that the registry is coherent."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_rotor.models import MODELS, example_input, get_model, get_spec, resnet
from lightning_rotor.stages import sequential_stages


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    "name, expected",
    # the parameter counts of the standard torchvision networks of the same layout
    [("resnet18", 11_689_512), ("resnet50", 25_557_032), ("resnet101", 44_549_160), ("vgg11", 132_863_336)],
)
def test_standard_sizes_match_the_reference_networks(name: str, expected: int) -> None:
    with torch.device("meta"):
        assert n_params(get_model(name)) == expected


def test_gpt_default_is_gpt2_small_untied() -> None:
    with torch.device("meta"):
        model = get_model("gpt")
    # GPT-2 small has 124,439,808 parameters with the LM head tied to the token embedding
    assert n_params(model) == 124_439_808 + 50257 * 768


@pytest.mark.parametrize("name", list(MODELS))
def test_every_model_is_a_sequential_that_trains_on_its_sample(name: str) -> None:
    spec = get_spec(name)
    torch.manual_seed(0)
    model = get_model(name, **spec.tiny)
    assert isinstance(model, nn.Sequential)
    x, y = example_input(name, 3, **spec.tiny)
    out = model(x)
    assert out.shape[0] == 3
    loss = spec.loss(out, y)
    assert loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    stages = sequential_stages(model)
    assert len(stages) >= 5  # a chain worth checkpointing


def test_samples_are_deterministic_per_seed() -> None:
    a = example_input("gpt", 2, seed=1, **MODELS["gpt"].tiny)
    b = example_input("gpt", 2, seed=1, **MODELS["gpt"].tiny)
    c = example_input("gpt", 2, seed=2, **MODELS["gpt"].tiny)
    assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))
    assert not torch.equal(a[0], c[0])
    x, y = a
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the next tokens


def test_resnet_shapes_and_stages() -> None:
    model = get_model("resnet50", width=8, num_classes=7)
    x, _ = example_input("resnet50", 2, width=8, num_classes=7, image_size=64)
    assert model(x).shape == (2, 7)
    names = list(sequential_stages(model).names)
    # conv, bn fused with its in-place relu, pool, 16 bottlenecks, pool, flatten, fc
    assert len(names) == 3 + 16 + 3
    assert names[1] == "stem.1+stem.2"
    assert "layer3.5" in names


def test_gpt_is_causal() -> None:
    cfg = dict(vocab_size=50, block_size=12, n_layer=2, n_head=2, n_embd=16, dropout=0.0)
    torch.manual_seed(0)
    model = get_model("gpt", **cfg).eval()
    x, _ = example_input("gpt", 2, **cfg)
    changed = x.clone()
    changed[:, 7:] = (changed[:, 7:] + 1) % 50
    with torch.no_grad():
        a, b = model(x), model(changed)
    assert a.shape == (2, 12, 50)
    torch.testing.assert_close(a[:, :7], b[:, :7], rtol=0, atol=0)
    assert not torch.allclose(a[:, 7:], b[:, 7:])


def test_gpt_rejects_too_long_sequences() -> None:
    model = get_model("gpt", vocab_size=10, block_size=4, n_layer=1, n_head=1, n_embd=4)
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 5, dtype=torch.long))


@pytest.mark.parametrize("name, ratio", [("hetero", 8), ("hetero2", 32)])
def test_hetero_stages_differ_in_size(name: str, ratio: int) -> None:
    spec = get_spec(name)
    model = get_model(name, **spec.tiny)
    x, _ = spec.sample(2, **spec.tiny)
    sizes = []
    for stage in sequential_stages(model).modules:
        x = stage(x)
        sizes.append(x.numel())
    assert max(sizes) >= ratio * min(sizes[:-1])  # the last stage is the classifier


def test_unknown_model_and_bad_depth_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="unknown model 'resnet7'.*resnet50"):
        get_model("resnet7")
    with pytest.raises(ValueError, match="depth must be one of"):
        resnet(depth=7)
