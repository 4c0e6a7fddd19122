"""Variable image sizes on a diffusion U-Net (diffusers' `UNet2DModel` from a tiny config): a last partial
batch and other resolutions train bitwise like plain training, every step within its budget; what is derived
(a new side, a partial batch, both: sizes monomials of the batch and the side) and what is measured
(benchmarks/shapes_images.py times it; tests/test_symbolic_sizes.py pins a ConvNeXt)."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from fitting import KeepRotorModules, quiet_trainer
from torch import nn
from torch.utils.data import DataLoader, Dataset
from training import assert_same_state

from lightning_rotor import Checkpointable
from lightning_rotor.discovery import GuardFailed, discover_chain
from lightning_rotor.lightning import RotorCallback, RotorStrategy
from lightning_rotor.profile import profile_chain

diffusers = pytest.importorskip("diffusers")


def unet() -> nn.Module:
    torch.manual_seed(0)
    return diffusers.UNet2DModel(
        sample_size=16,
        in_channels=3,
        out_channels=3,
        block_out_channels=(8, 16),
        layers_per_block=1,
        norm_num_groups=4,
        attention_head_dim=8,
        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"),
    )


def noisy(images: int, side: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(images, 3, side, side, generator=g)
    return x, torch.randint(0, 1000, (images,), generator=g), torch.randn(x.shape, generator=g)


LOSS = ("loss_tmp", "loss_tmp_kept", "loss_value")  # raised on a plan's first step to the real loss's (loss_watch.py)


def sizes(chain):
    return {k: v for k, v in chain.to_dict().items() if k not in ("fwd_time", "bwd_time", *LOSS)}


def same_sizes_loss_raised(derived, measured) -> None:
    """A derived chain has a profile's sizes; its loss figures, the stand-in's a profile measures, raised by its
    first step's window to MSE's (which keeps `a_L`, its value a buffer of `a_L`'s size), never lowered."""
    assert sizes(derived) == sizes(measured)
    assert all(getattr(derived, f) >= getattr(measured, f) for f in LOSS)


def train_shapes(shapes: list[tuple[int, int]]) -> tuple[Checkpointable, list[str]]:
    """Plain and rotor (the defaults, "60%") over `shapes` (images, side): every step bitwise equal to plain
    training and measured within its plan's budget; each derived chain equal to a profile's. The rotor model
    and the warnings it gave."""
    plain, rotor = unet(), Checkpointable(unet(), "60%", repeats=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, (images, side) in enumerate(shapes):
            x, t, noise = noisy(images, side, step)
            plain.zero_grad()
            torch.manual_seed(step)
            F.mse_loss(plain(x, t).sample, noise).backward()
            rotor.zero_grad()
            if step:  # the first step finds the chain and profiles it (a profiling step is not held to the budget)
                rotor.prepare_for((x, t))
            torch.manual_seed(step)
            with rotor.measure_step() as m:
                F.mse_loss(rotor(x, t).sample, noise).backward()
            assert_same_state(plain, rotor)
            entry = rotor.last_entry
            assert m.peak <= entry.plan.budget or not step
            key = next((k for k, e in rotor.entries.items() if e is entry), None)
            if key in rotor.fitted:
                measured = profile_chain(list(rotor.stages), (x, t), names=rotor.stage_names, repeats=1, timed=False)
                same_sizes_loss_raised(entry.chain, measured.chain)
    return rotor, [str(w.message) for w in caught if "rotor" in str(w.message)]


def derived(rotor: Checkpointable) -> set[str]:
    return {rotor.chain_state._shapes[k] for k in rotor.fitted}


@pytest.mark.slow  # 6-8 s here: U-Net profiles
def test_a_unet_s_last_partial_batch_trains_bitwise_within_its_budget_and_batch_sizes_are_derived():
    """`UNet2DModel` broadcasts the timesteps with `torch.ones(sample.shape[0])`: the traced graph computes with
    each call's own batch size (torch's argument parser asks the size for its integer, and the op is recorded
    with the size itself: no guard), so a last batch of 3 after batches of 5, 2 and 4 runs the same graph. After
    two measured batch sizes, the ones between them are derived: the batch size is one axis (the images' and the
    timesteps' first dimension), every dimension a monomial of it."""
    rotor, _ = train_shapes([(5, 16), (2, 16), (4, 16), (3, 16)])
    assert derived(rotor) == {"(4, 3, 16, 16), (4,)", "(3, 3, 16, 16), (3,)"} and len(rotor.entries) == 4


@pytest.mark.slow  # about 8 s here
def test_a_unet_at_new_sides_partial_batches_and_both_gets_measured_sizes_from_three_shapes():
    """3 sides x {a full batch, a last partial one}: (4, 16), (4, 24), (3, 16) and (4, 32) (beyond the first two
    sides: a third confirms their law) measured, the partial batches at 24 and 32 derived (two axes new), each
    chain equal to a profile's to the byte, each step bitwise plain training's and within its budget. The
    attention blocks flatten the feature map (`B, H*W/4, C`): a dimension quadratic in the side (exponent 2),
    which no affine law fits."""
    rotor, said = train_shapes([(4, 16), (4, 24), (3, 16), (4, 32), (3, 24), (3, 32)])
    assert len(rotor.entries) == 6 and not said
    assert derived(rotor) == {"(3, 3, 24, 24), (3,)", "(3, 3, 32, 32), (3,)"}


@pytest.mark.slow  # about 6 s here
def test_a_unet_side_off_the_measured_multiples_is_measured():
    """Measured sides 16 and 24 are multiples of 8: at 20 what the downsampling's floor or a padding does went
    unseen by both, so it is measured, never derived; it confirms their law, and 32 is derived."""
    rotor, _ = train_shapes([(2, 16), (2, 24), (2, 20), (2, 32)])
    assert derived(rotor) == {"(2, 3, 32, 32), (2,)"}


class Epoch(Dataset):
    """Ready batches (images, side): two resolutions, each ending on a partial batch, then shapes seen before."""

    SHAPES = ((4, 16), (3, 16), (4, 24), (3, 24), (4, 16), (3, 24))

    def __len__(self):
        return len(self.SHAPES)

    def __getitem__(self, i):
        return noisy(*self.SHAPES[i], seed=i)


class Denoiser(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.unet = unet()

    def training_step(self, batch, batch_idx):
        x, t, noise = batch
        return F.mse_loss(self.unet(x, t).sample, noise)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


@pytest.mark.slow  # about 6 s here
def test_the_trainer_trains_a_unet_over_resolutions_and_partial_batches_bitwise_within_budget(tmp_path):
    """Through a real Trainer and `RotorStrategy` (the defaults, "60%"): every step sampled, none above its
    budget (a sample above warns), the weights after the epoch bitwise plain training's."""
    loader = DataLoader(Epoch(), batch_size=None)
    plain, rotor, keep = Denoiser(), Denoiser(), KeepRotorModules()
    torch.manual_seed(7)
    quiet_trainer(tmp_path / "plain", max_steps=len(Epoch())).fit(plain, loader)
    measure = RotorCallback(measure_every_n_steps=1, log_curves=False, print_summary=False)
    torch.manual_seed(7)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = quiet_trainer(tmp_path / "rotor", RotorStrategy(mem_limit="60%"), max_steps=len(Epoch()))
        trainer.callbacks.extend([keep, measure])
        trainer.fit(rotor, loader)
    assert not [str(w.message) for w in caught if "is above the budget" in str(w.message)]
    wrapped = keep.modules["unet"]
    assert len(wrapped.entries) == 4 and wrapped.last_measurement.peak <= wrapped.last_entry.plan.budget
    assert len(wrapped.fitted) == 1  # (3, 24): from (4, 16), (3, 16) and (4, 24), no profile
    for (key, a), b in zip(rotor.state_dict().items(), plain.state_dict().values(), strict=True):
        assert torch.equal(a, b), key


class LoopOverBatch(nn.Module):
    """A Python loop as long as the batch: the trace unrolls it, so another batch size needs another graph."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        n = x.shape[0]
        h = self.a(x)
        for _ in range(n):
            h = h * torch.ones(n)[:, None]
        return self.b(h)


def test_a_size_that_shaped_the_trace_keeps_its_guard_though_an_op_then_takes_it():
    """Only the argument parser's own question loses its guard: `range(n)` (a loop unrolled `n` times) asked
    first, and an op taking `n` next does not make that answer any less fixed into the graph."""
    found = discover_chain(LoopOverBatch(), torch.randn(2, 4))
    stages = found.stages
    x = torch.randn(3, 4)
    with pytest.raises(GuardFailed, match="input gives 3 .* where the sample gave 2"):
        for stage in stages:
            x = stage(x)
