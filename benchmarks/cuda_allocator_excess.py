"""On CUDA, how far the caching allocator's figures exceed tensor accounting, per chain field, stage and shape.

    PYTHONPATH=. python benchmarks/cuda_allocator_excess.py                 # a CUDA machine
    PYTHONPATH=. python benchmarks/cuda_allocator_excess.py --device cpu    # the same code; every excess is 0

A CUDA profile keeps the allocator's figure where it is larger than the tensor-accounted one (kernel workspaces,
its rounding), so its sizes are no sums of storage sizes (NOTE: [sizes on CUDA], lightning_rotor/allocator.py).
This measures what a law for those excesses would have to give: each model is profiled, sizes only, at several
shapes with the allocator's figures (as now) and without them (tensor accounting alone), and every field that
differs is printed with both figures. Models: the project's GPT (four blocks, 256 wide) at four lengths and
ConvNeXt-Atto at three sides, one warm profile first (cuBLAS's and cuDNN's workspaces made once).
"""

from __future__ import annotations

import argparse

import torch

from lightning_rotor.models.convnext import convnext_atto
from lightning_rotor.models.gpt import gpt
from lightning_rotor.profile import profile_chain


def chains(stages: list[torch.nn.Module], x: torch.Tensor) -> tuple[dict, dict]:
    """(the chain as profiled with the allocator's figures, the chain by tensor accounting alone), as dicts."""
    now = profile_chain(stages, x, repeats=1, timed=False).chain.to_dict()
    alone = profile_chain(stages, x, repeats=1, timed=False, allocator=False).chain.to_dict()
    return now, alone


def report(name: str, stages: list[torch.nn.Module], inputs: list[torch.Tensor]) -> None:
    profile_chain(stages, inputs[0], repeats=1, timed=False)  # warm: workspaces made once
    print(f"\n## {name}\n\n| input | field | stage | allocator | tensors | excess |\n|---|---|---|---|---|---|")
    for x in inputs:
        now, alone = chains(stages, x)
        differ = 0
        for field, values in now.items():
            if not isinstance(values, list) or field in ("fwd_time", "bwd_time"):
                continue
            for k, (a, b) in enumerate(zip(values, alone[field], strict=True)):
                if a != b:
                    differ += 1
                    print(f"| {tuple(x.shape)} | {field} | {k} | {a:,} | {b:,} | {a - b:+,} |")
        if not differ:
            print(f"| {tuple(x.shape)} | - | - | - | - | none |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    embed, blocks, norm, head = gpt(vocab_size=8192, block_size=1024, n_layer=4, n_head=4, n_embd=256, dropout=0.1)
    gpt_stages = [s.to(device) for s in (embed, *blocks, norm, head)]
    tokens = [torch.randint(0, 8192, (8, n), device=device) for n in (64, 200, 333, 512)]
    report("GPT, 4 blocks x 256, batch 8", gpt_stages, tokens)
    model = convnext_atto(num_classes=10).to(device)
    conv_stages = [model.stem, *(m for stage in model.stages for m in (stage.downsample, *stage.blocks)), model.head]
    images = [torch.randn(8, 3, side, side, device=device) for side in (64, 96, 160)]
    report("ConvNeXt-Atto, batch 8", conv_stages, images)


if __name__ == "__main__":
    main()
