"""GPU-like chains for the offloading figures: the paper's models and two transformers, sizes measured, times modelled.

Rotor's NeurIPS 2021 offloading paper evaluates ResNet-101, DenseNet-121 and Inception-v3 at batch 16 on
500x500 images on a V100 over PCIe. No GPU is needed here: each chain is built from

- **sizes measured by the profiler** (`profile_chain(..., timed=False, offload=True)`, fp32, on CPU) at
  batches 2 and 3, and extended to the target batch: every held size the profiler reports is affine in
  the batch (activations scale with it; parameters, buffers and the loss value do not), so
  `size(B) = size(2) + (B - 2) * (size(3) - size(2))` is exact; `--check` profiles batch 4 as well and
  fails unless the extension predicts it to the byte. The transient peaks within an op (`fwd_tmp`,
  `bwd_tmp`, `fwd_tmp_nograd`) are maxima of affine terms, which may change hands as the batch grows:
  they are extended from the same two batches and `--check` prints their error at batch 4 (DenseNet-121:
  none; Inception-v3: 0.6 MB, ResNet-101: 2.1 MB, on one `bwd_tmp`; the tiny GPT of
  tests/test_gpu_chains.py: none, the full chain equal to a profile at the target batch). Transformer
  blocks are identical, so the profiler measures a model with
  3 blocks (first, middle, last) and the middle block's record stands for every middle block;
- **times from a per-operation roofline** on meta tensors at the target batch (nothing is allocated): each
  aten op of a stage's forward and of its backward costs `max(flops / RATE, bytes / HBM)`, FLOPs from
  `torch.utils.flop_counter`'s formulas (matmuls, convolutions, attention), bytes the sizes of its tensor
  inputs and outputs (views move nothing). The device is a V100 in fp32, the paper's GPU:
  RATE and HBM below are sustained figures, about 75% of its 15.7 TFLOP/s fp32 peak and 90% of its
  900 GB/s HBM2 (what a stream copy reaches). Eager PyTorch runs one kernel per op, so the sum is
  what a step costs without fusion; cuDNN's algorithm choice and launch gaps are not modelled. As a
  sanity check, ResNet-50 at 224x224 and batch 64 models to 354 images/s of training, the order of
  what V100s reach in fp32 (a few hundred images/s).

    python benchmarks/gpu_chains.py                       # every chain, into benchmarks/results/gpu_chains/
    python benchmarks/gpu_chains.py --models resnet101 --check

Writes `<name>.json` (chain version 6, `offloadable` measured) and `README.md` (origin, one row per chain).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_models import densenet121, image_loss, inception_v3, llama_like, token_loss  # noqa: E402

from lightning_rotor.budget import format_bytes  # noqa: E402
from lightning_rotor.chain import Chain  # noqa: E402
from lightning_rotor.models.gpt import gpt  # noqa: E402
from lightning_rotor.models.resnet import resnet101  # noqa: E402
from lightning_rotor.profile import profile_chain  # noqa: E402
from lightning_rotor.simulate import no_recompute_peak  # noqa: E402
from lightning_rotor.stages import sequential_stages  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "gpu_chains"
DEVICE = "V100 (fp32)"
RATE = 12e12  # sustained FLOP/s of matmuls and convolutions
HBM = 800e9  # sustained bytes/s of device memory
SIZE_FIELDS = ("out_size", "saved_size", "fwd_tmp", "bwd_tmp", "fwd_tmp_nograd", "out_free", "in_free", "offloadable")
SCALAR_FIELDS = ("input_size", "loss_tmp", "loss_tmp_kept", "loss_value")
TRANSIENTS = ("fwd_tmp", "bwd_tmp", "fwd_tmp_nograd")  # peaks within an op: a maximum of affine terms


@dataclass
class Spec:
    """One chain: how to build the model (at full depth, or at the depth profiled), its batch and sample."""

    build: Callable[[int | None], nn.Sequential]  # depth None: the full model; else that many blocks
    batch: int
    sample: Callable[[int, torch.device], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    shape: str  # what one sample is, for the README
    depth: int | None = None  # blocks of the full model (transformers); None: profiled whole
    batches: tuple[int, int] = (2, 3)  # the two batches profiled (consecutive)


def images(size: int) -> Callable[[int, torch.device], tuple[torch.Tensor, torch.Tensor]]:
    def make(batch: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(batch, 3, size, size, device=device), torch.randint(1000, (batch,), device=device)

    return make


def tokens(vocab: int, length: int) -> Callable[[int, torch.device], tuple[torch.Tensor, torch.Tensor]]:
    def make(batch: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        data = torch.randint(vocab, (batch, length + 1), device=device)
        return data[:, :-1].clone(), data[:, 1:].clone()  # own storages, at batch 1 too

    return make


SPECS: dict[str, Spec] = {
    "resnet101": Spec(lambda _: resnet101(), 16, images(500), image_loss, "3x500x500 image"),
    "densenet121": Spec(lambda _: densenet121(), 16, images(500), image_loss, "3x500x500 image"),
    "inception_v3": Spec(lambda _: inception_v3(), 16, images(500), image_loss, "3x500x500 image"),
    "gpt2_medium": Spec(
        lambda n: gpt(n_layer=n or 24, n_embd=1024, n_head=16, block_size=1024, dropout=0.1),
        4,
        tokens(50257, 1024),
        token_loss,
        "1024 tokens (GPT-2-medium shape: 24 blocks, width 1024, 16 heads, plain attention, dropout 0.1)",
        depth=24,
    ),
    "llama_1b": Spec(
        lambda n: llama_like(layers=n or 22),
        8,
        tokens(32000, 1024),
        token_loss,
        "1024 tokens (TinyLlama-1.1B shape: 22 blocks, width 2048, 32 heads, 4 KV heads, SwiGLU 5632, SDPA)",
        depth=22,
    ),
}


def measured_sizes(spec: Spec, batch: int) -> Chain:
    """The profiler's chain (sizes only, every time 0) at `batch`, on CPU, at the depth profiled."""
    torch.manual_seed(0)
    model = spec.build(3 if spec.depth else None).train()
    found = sequential_stages(model)
    x, y = spec.sample(batch, torch.device("cpu"))
    profile = profile_chain(
        list(found.modules), x, names=list(found.names), loss_tmp=lambda o: spec.loss(o, y), timed=False, offload=True
    )
    return profile.chain


def stage_map(names: list[str], depth: int | None) -> list[int]:
    """For each stage of the full model, the profiled stage that stands for it (3 blocks: first, middle, last)."""
    if depth is None:
        return list(range(len(names)))
    first = next(k for k, n in enumerate(names) if n.startswith("blocks."))
    return [*range(first + 1), *[first + 1] * (depth - 2), *range(first + 2, len(names))]


def extended(low: Chain, high: Chain, steps: int, order: list[int]) -> dict[str, Any]:
    """The chain's size fields `steps` batches above `low`'s, affine from two consecutive batches (`high` one
    above `low`), stages in `order` (see `stage_map`). `bwd_tmp` is kept at or above `-s_k`, its floor."""
    fields: dict[str, Any] = {}
    for name in SIZE_FIELDS:
        a, b = getattr(low, name), getattr(high, name)
        fields[name] = [a[k] + steps * (b[k] - a[k]) for k in order]
    for name in SCALAR_FIELDS:
        a, b = getattr(low, name), getattr(high, name)
        fields[name] = a + steps * (b - a)
    inputs = [fields["input_size"], *fields["out_size"][:-1]]
    fields["bwd_tmp"] = [max(t, -s) for t, s in zip(fields["bwd_tmp"], inputs, strict=True)]
    return fields


def deviations(spec: Spec, low: Chain, high: Chain) -> dict[str, int]:
    """Per size field, the largest error in bytes of the extension at the next batch, profiled to compare."""
    third = measured_sizes(spec, spec.batches[1] + 1)
    order = list(range(low.length))
    predicted = extended(low, high, 2, order)
    actual = {name: getattr(third, name) for name in predicted}
    errors = {}
    for name in (*SIZE_FIELDS, *SCALAR_FIELDS):
        p, a = predicted[name], actual[name]
        errors[name] = max(abs(x - y) for x, y in zip(p, a, strict=True)) if isinstance(p, list) else abs(p - a)
    return errors


class Roofline(TorchDispatchMode):
    """Sums, over the aten ops it sees, max(flops / RATE, bytes moved / HBM): one kernel per op, no fusion."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds = 0.0
        self.flops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        flops = flop_registry[packet](*args, **kwargs, out_val=out) if packet in flop_registry else 0
        moved = 0
        if not func.is_view:
            leaves = tree_flatten((args, kwargs, out))[0]
            moved = sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))
        self.flops += flops
        self.seconds += max(flops / RATE, moved / HBM)
        return out


def stage_times(spec: Spec) -> tuple[list[str], list[float], list[float], int]:
    """Per stage of the full model at the target batch, on meta tensors: forward and backward seconds; FLOPs."""
    with torch.device("meta"):
        model = spec.build(None).train()
    found = sequential_stages(model)
    value, _ = spec.sample(spec.batch, torch.device("meta"))
    fwd, bwd, flops = [], [], 0
    for stage in found.modules:
        given = value.detach().requires_grad_(value.is_floating_point())
        with Roofline() as forward:
            out = stage(given)
        with Roofline() as backward:
            out.backward(torch.ones_like(out))
        fwd.append(forward.seconds)
        bwd.append(backward.seconds)
        flops += forward.flops + backward.flops
        value = out.detach()
    return list(found.names), fwd, bwd, flops


def build_chain(name: str, check: bool) -> tuple[Chain, int]:
    """The chain of `SPECS[name]` (see the module docstring) and its FLOPs per step."""
    spec = SPECS[name]
    start = time.perf_counter()
    low, high = (measured_sizes(spec, b) for b in spec.batches)
    order = stage_map(low.names, spec.depth)
    if check:
        errors = deviations(spec, low, high)
        print(f"{name}: the extension's largest error at batch {spec.batches[1] + 1}, bytes: {errors}", flush=True)
        if any(errors[f] for f in errors if f not in TRANSIENTS):
            raise SystemExit(f"{name}: a held size is not affine in the batch: {errors}")
    names, fwd, bwd, flops = stage_times(spec)
    if len(names) != len(order):
        raise SystemExit(f"{name}: {len(names)} stages at full depth, {len(order)} from the profiled model")
    chain = Chain(names=names, fwd_time=fwd, bwd_time=bwd, **extended(low, high, spec.batch - spec.batches[0], order))
    print(f"{name}: {chain.length} stages in {time.perf_counter() - start:.0f} s", flush=True)
    return chain, flops


def readme(rows: list[str]) -> str:
    return "\n".join(
        [
            "# GPU-like chains",
            "",
            "Written by `python benchmarks/gpu_chains.py` (its docstring says how): sizes measured by the profiler",
            "(fp32, CPU, batches 2 and 3, extended to the batch below); times from a per-op roofline on",
            f"meta tensors for a {DEVICE}: {RATE / 1e12:g} TFLOP/s of matmul/convolution, {HBM / 1e9:g} GB/s of device",
            "memory, each op bound by the slower of the two. `benchmarks/offload_sim.py --gpu` plans on them.",
            "",
            "| chain | stages | batch | one sample | no-recompute peak | step time, no recomputation | TFLOP/step |",
            "|---|---|---|---|---|---|---|",
            *rows,
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(SPECS), choices=list(SPECS))
    parser.add_argument("--check", action="store_true", help="also profile batch 3: the batch extension must hit it")
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.models:
        chain, flops = build_chain(name, args.check)
        chain.save(out / f"{name}.json")
    rows = []
    for name in SPECS:  # the README lists every chain written so far
        path = out / f"{name}.json"
        if path.exists():
            chain, spec = Chain.load(path), SPECS[name]
            rows.append(
                f"| {name} | {chain.length} | {spec.batch} | {spec.shape} | {format_bytes(no_recompute_peak(chain))} "
                f"| {1e3 * chain.no_recompute_time():.0f} ms | {stage_flops(spec) / 1e12:.2f} |"
            )
    (out / "README.md").write_text(readme(rows))
    return 0


def stage_flops(spec: Spec) -> int:
    return stage_times(spec)[3]


if __name__ == "__main__":
    raise SystemExit(main())
