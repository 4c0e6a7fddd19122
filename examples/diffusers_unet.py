"""Rotor on diffusers' U-Nets (CPU, exact tensor accounting): the figures of docs/discovery.md, "Diffusion U-Nets".

    python examples/diffusers_unet.py [--model unet|condition] [--levels 16,32,32,32] [--layers 2]
                                      [--size 32] [--batch 4] [--max-carry 6]

Prints the activation peak of a plain training step, of diffusers' own `enable_gradient_checkpointing()`
(every ResNet and attention block checkpointed), rotor's smallest feasible budget, and rotor planned
for exactly the own checkpointing's measured peak (its measured peak and the stages it recomputes).
Noise-prediction MSE on random data with random timesteps. Needs diffusers (`pip install diffusers`).
"""

import argparse
import time

import torch
import torch.nn.functional as F
from diffusers import UNet2DConditionModel, UNet2DModel

from lightning_rotor import Checkpointable, InfeasibleBudget, MemoryProbe, discover


def build(args: argparse.Namespace) -> tuple[torch.nn.Module, list[torch.Tensor], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    levels = tuple(int(c) for c in args.levels.split(","))
    n = len(levels)
    common = dict(sample_size=args.size, block_out_channels=levels, layers_per_block=args.layers, norm_num_groups=4)
    g = torch.Generator().manual_seed(1)
    t = torch.randint(0, 1000, (args.batch,), generator=g)
    if args.model == "unet":
        down, up = ("DownBlock2D",) * (n - 1) + ("AttnDownBlock2D",), ("AttnUpBlock2D",) + ("UpBlock2D",) * (n - 1)
        model = UNet2DModel(
            in_channels=3, out_channels=3, down_block_types=down, up_block_types=up, attention_head_dim=8, **common
        )
        x = torch.randn(args.batch, 3, args.size, args.size, generator=g)
        return model, [x, t, torch.randn_like(x)], {}
    down = ("CrossAttnDownBlock2D",) * (n - 1) + ("DownBlock2D",)
    up = ("UpBlock2D",) + ("CrossAttnUpBlock2D",) * (n - 1)
    model = UNet2DConditionModel(
        in_channels=4,
        out_channels=4,
        down_block_types=down,
        up_block_types=up,
        cross_attention_dim=16,
        attention_head_dim=4,
        **common,
    )
    x = torch.randn(args.batch, 4, args.size, args.size, generator=g)
    context = torch.randn(args.batch, 7, 16, generator=g)
    return model, [x, t, torch.randn_like(x)], {"encoder_hidden_states": context}


def plain_peak(model, batch, kwargs) -> int:
    """The activation peak of one training step of the model as it is (its own checkpointing on or off)."""
    model.zero_grad(set_to_none=True)
    with MemoryProbe(exclude=model) as probe:
        for t in [*batch, *kwargs.values()]:
            probe.track(t)
        x, t, noise = batch
        F.mse_loss(model(x, t, **kwargs).sample, noise).backward()
    model.zero_grad(set_to_none=True)
    return probe.peak


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=["unet", "condition"], default="unet")
    parser.add_argument("--levels", default="16,32,32,32")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--max-carry", type=int, default=None, help="graph discovery's max_carry (default: its own)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, batch, kwargs = build(args)
    plain = plain_peak(model, batch, kwargs)
    model.enable_gradient_checkpointing()
    own = plain_peak(model, batch, kwargs)
    model.disable_gradient_checkpointing()
    print(f"plain peak {plain} B; diffusers' own checkpointing {own} B ({own / plain:.3f} of plain)")

    start = time.perf_counter()
    carry = {} if args.max_carry is None else {"max_carry": args.max_carry}
    stages = discover(model, batch[:2], sample_kwargs=kwargs, **carry)  # as Checkpointable does
    rotor = Checkpointable(model, 1, stages=stages, repeats=1, warmup=0)
    chain_input = (*batch[:2], *kwargs.values())  # the forward's tensor arguments, in its signature's order
    try:
        F.mse_loss(rotor(*chain_input).sample, batch[2]).backward()
        raise SystemExit("a 1-byte budget was accepted")
    except InfeasibleBudget as err:
        smallest = err.min_feasible
    first = time.perf_counter() - start
    print(
        f"rotor: {len(rotor.stages)} stages (discovery and profile {first:.1f} s); smallest feasible budget "
        f"{smallest} B = {smallest / plain:.3f} of plain, {smallest / own:.3f}x the own checkpointing's peak"
    )
    rotor.replan(own)
    F.mse_loss(rotor(*chain_input).sample, batch[2]).backward()  # profiles and plans again (none was kept)
    rotor.zero_grad()
    with rotor.measure_step() as measured:
        F.mse_loss(rotor(*chain_input).sample, batch[2]).backward()
    print(
        f"rotor at the own checkpointing's peak ({own} B): measured {measured.peak} B "
        f"({measured.peak / own:.3f}x own), predicted {rotor.plan.peak} B, "
        f"{rotor.plan.recomputed_stages} of {len(rotor.stages)} stages recomputed"
    )


if __name__ == "__main__":
    main()
