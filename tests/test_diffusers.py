"""Diffusion U-Nets (diffusers' `UNet2DModel` and `UNet2DConditionModel`, issue 25) train under rotor.

Graph discovery finds the U-Net's chain: the down blocks, mid block and up blocks in order, the skips
(diffusers' `down_block_res_samples`) crossing as one tuple, and the time embedding (and the
cross-attention context) carried to every stage that still needs it. Tiny configs, noise-prediction
MSE on random data with random timesteps, compared bitwise with plain training on the same seed.
"""

import copy

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from fitting import KeepRotorModules, quiet_trainer
from torch.utils.data import DataLoader, TensorDataset
from training import assert_same_state, check_measured_peak

from lightning_rotor import Checkpointable, MemoryProbe
from lightning_rotor.discovery import discover_chain
from lightning_rotor.lightning import RotorCallback, RotorStrategy
from lightning_rotor.loss_watch import LossOverBudget
from lightning_rotor.planner import InfeasibleBudget

diffusers = pytest.importorskip("diffusers")

BATCH = 4


def unet(layers: int = 1) -> torch.nn.Module:
    torch.manual_seed(0)
    return diffusers.UNet2DModel(
        sample_size=16,
        in_channels=3,
        out_channels=3,
        block_out_channels=(16, 32),
        layers_per_block=layers,
        norm_num_groups=4,
        attention_head_dim=8,
        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"),
    )


def unet_condition(layers: int = 1) -> torch.nn.Module:
    torch.manual_seed(0)
    return diffusers.UNet2DConditionModel(
        sample_size=16,
        in_channels=4,
        out_channels=4,
        block_out_channels=(16, 32),
        layers_per_block=layers,
        norm_num_groups=4,
        cross_attention_dim=16,
        attention_head_dim=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    )


MODELS = {"unet": unet, "unet_condition": unet_condition}
BOTH = ["unet", pytest.param("unet_condition", marks=pytest.mark.slow)]  # the conditioned U-Net takes 4-7 s here


def batches(name: str, n: int = BATCH) -> list[torch.Tensor]:
    """Noisy samples, random timesteps, the noise to predict (and a text context for the conditioned U-Net)."""
    g = torch.Generator().manual_seed(1)
    c = 3 if name == "unet" else 4
    data = [torch.randn(n, c, 16, 16, generator=g), torch.randint(0, 1000, (n,), generator=g)]
    data.append(torch.randn(n, c, 16, 16, generator=g))
    if name == "unet_condition":
        data.append(torch.randn(n, 7, 16, generator=g))
    return data


def noise_loss(model, batch):
    sample, t, noise, *context = batch
    kwargs = {"encoder_hidden_states": context[0]} if context else {}
    return F.mse_loss(model(sample, t, **kwargs).sample, noise)


def train(model, batch, steps=3):
    torch.manual_seed(2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        loss = noise_loss(model, batch)
        loss.backward()
        if step < steps - 1:
            opt.step()
        losses.append(loss.detach())
    return torch.stack(losses)


def smallest_budget(rotor: Checkpointable, batch) -> int:
    with pytest.raises(InfeasibleBudget) as err:  # a 1-byte budget: discovered and profiled, then refused
        noise_loss(rotor, batch).backward()
    return err.value.min_feasible


def at_smallest_budget(model, batch) -> Checkpointable:
    """`model` wrapped for its smallest feasible budget with its MSE loss (discovered and profiled by a first call
    at 1 byte; the smallest budget with the cross-entropy stand-in then refused at the first backward, which
    measures the real loss, naming the smallest with it: lightning_rotor/loss_watch.py)."""
    rotor = Checkpointable(model, 1, repeats=1, warmup=0)
    rotor.replan(smallest_budget(rotor, batch))
    with pytest.raises(LossOverBudget) as err:  # the MSE's value holds a buffer of the output's size
        noise_loss(rotor, batch).backward()
    assert all(p.grad is None for p in rotor.parameters())
    rotor.replan(err.value.min_feasible)
    return rotor


@pytest.mark.parametrize("name", list(MODELS))
def test_the_chain_carries_the_time_embedding_and_the_skips(name):
    model, batch = MODELS[name](), batches(name)
    kwargs = {"encoder_hidden_states": batch[3]} if name == "unet_condition" else {}
    found = discover_chain(model, batch[:2], sample_kwargs=kwargs)
    assert found.kind == "graph"  # torch.fx traced it: `torch.is_tensor(timesteps)` answered from the sample
    names = found.stages.names
    for block in ("down_blocks.0", "mid_block", "up_blocks.0", "up_blocks.1"):
        assert any(n.startswith(block) for n in names), block
    crossing = [c for c in found.notes if c.startswith("after mid_block")]
    assert crossing and all("time_embedding_linear_2[4, 64]" in c for c in crossing)  # temb goes to every block
    assert all("conv_in[4, 16, 16, 16]" in c for c in crossing)  # the first skip waits for the last up block
    if name == "unet_condition":
        assert all("encoder_hidden_states[4, 7, 16]" in c for c in crossing)


@pytest.mark.parametrize("name", BOTH)
@pytest.mark.parametrize("at", ["smallest", "unlimited"])
def test_checkpointable_trains_bitwise_like_plain_within_budget(name, at):
    plain, batch = MODELS[name](), batches(name)
    model = copy.deepcopy(plain)
    rotor = at_smallest_budget(model, batch) if at == "smallest" else Checkpointable(model, None, repeats=1, warmup=0)
    assert torch.equal(train(plain, batch), train(rotor, batch))
    assert_same_state(plain, rotor)
    assert type(rotor(*batch[:2], **({"encoder_hidden_states": batch[3]} if batch[3:] else {}))).__name__.endswith(
        "Output"
    )  # `model(x, t).sample` works: the output class is rebuilt
    assert (rotor.plan.recomputed_stages > 0) == (at == "smallest")
    rotor.zero_grad()
    with rotor.measure_step() as measured:
        noise_loss(rotor, batch).backward()
    # the simulator charges these U-Nets 9-11% above what a step holds (found with the MSE's own bytes charged;
    # not explained yet, noted in docs/memory-model.md section 2): the budget itself holds
    check_measured_peak(rotor, measured.peak, within=0.12)


def own_checkpointing_peak(model, batch) -> int:
    """The activation peak of a training step with diffusers' `enable_gradient_checkpointing()` (per block)."""
    model.enable_gradient_checkpointing()
    with MemoryProbe(exclude=model) as probe:
        for t in batch:
            probe.track(t)
        noise_loss(model, batch).backward()
    model.disable_gradient_checkpointing()
    model.zero_grad(set_to_none=True)
    return probe.peak


@pytest.mark.parametrize("name", BOTH)
def test_smallest_budget_is_well_below_the_models_own_checkpointing(name):
    """Two ResNets per level: the up path's transformer blocks hold the time embedding, the text context, the
    skips of their level and their own residual at once; with 6 carried values (before: 8) whole spans stayed one
    stage and the smallest budget was 0.69x and 0.62x the own checkpointing's peak."""
    model, batch = MODELS[name](layers=2), batches(name)
    own = own_checkpointing_peak(model, batch)
    smallest = smallest_budget(Checkpointable(copy.deepcopy(model), 1, repeats=1, warmup=0), batch)
    assert smallest <= 0.5 * own  # 0.42x (UNet2DModel) and 0.49x (UNet2DConditionModel) on CPU


@pytest.mark.slow
def test_a_text_context_that_requires_grad_gets_its_gradient_bitwise():
    """The context is read by every cross-attention stage: its gradient is summed over all of them (a text
    encoder trained with the U-Net)."""
    plain, batch = unet_condition(), batches("unet_condition")
    rotor = Checkpointable(copy.deepcopy(plain), "40%", repeats=1, warmup=0)
    grads = []
    for model in (plain, rotor):
        context = batch[3].clone().requires_grad_()
        for _ in range(2):  # the first rotor call discovers and profiles, the second runs the plan
            model.zero_grad()
            context.grad = None
            noise_loss(model, [*batch[:3], context]).backward()
        grads.append(context.grad)
    assert rotor.plan.recomputed_stages > 0
    assert torch.equal(grads[0], grads[1])
    assert_same_state(plain, rotor)


def test_checkpoint_modules_keep_each_resnet_block_whole():
    from diffusers.models.resnet import ResnetBlock2D

    plain, batch = unet(), batches("unet")
    rotor = Checkpointable(copy.deepcopy(plain), "50%", checkpoint_modules=[ResnetBlock2D], repeats=1, warmup=0)
    assert torch.equal(train(plain, batch, steps=2), train(rotor, batch, steps=2))
    assert_same_state(plain, rotor)
    names = rotor.stages.names
    resnets = [n for n, m in plain.named_modules() if isinstance(m, ResnetBlock2D)]
    assert all(r in names for r in resnets), (resnets, names)  # each a stage of its own, none cut inside


def test_module_level_discovery_never_runs_into_the_shared_activation():
    """`ResnetBlock2D.nonlinearity` is one module called three times per block: no run may hold it."""
    plain, batch = unet(), batches("unet")
    rotor = Checkpointable(copy.deepcopy(plain), None, discover="modules", repeats=1, warmup=0)
    assert torch.equal(train(plain, batch, steps=2), train(rotor, batch, steps=2))  # was ChainDiverged
    assert_same_state(plain, rotor)
    assert not any("nonlinearity" in n for n in rotor.stages.names)


class Denoiser(pl.LightningModule):
    def __init__(self, name: str):
        super().__init__()
        self.unet = MODELS[name]()

    def training_step(self, batch, batch_idx):
        return noise_loss(self.unet, batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


@pytest.mark.parametrize("name", BOTH)
def test_trainer_with_rotor_strategy_trains_bitwise_like_plain(tmp_path, name):
    data = DataLoader(TensorDataset(*batches(name, 3 * BATCH)), batch_size=BATCH)
    plain, rotor, keep = Denoiser(name), Denoiser(name), KeepRotorModules()
    torch.manual_seed(7)
    quiet_trainer(tmp_path / "plain").fit(plain, data)
    measure = RotorCallback(measure_every_n_steps=1, log_curves=False, print_summary=False)
    torch.manual_seed(7)
    quiet_trainer(tmp_path / "rotor", RotorStrategy(mem_limit="40%"), callbacks=[keep, measure]).fit(rotor, data)
    wrapped = keep.modules["unet"]
    assert wrapped.discovery.kind == "graph"
    assert wrapped.plan.recomputed_stages > 0
    for (key, a), b in zip(rotor.state_dict().items(), plain.state_dict().values(), strict=True):
        assert torch.equal(a, b), key
    assert wrapped.last_measurement.peak <= wrapped.plan.budget
    # skips held by a checkpoint and by the current value are counted twice (docs/discovery.md, Limits): 0.85 here
    assert wrapped.last_measurement.peak >= 0.8 * wrapped.plan.peak


@pytest.mark.slow
def test_the_unets_own_gradient_checkpointing_is_turned_off_and_rotor_plans_the_chain():
    """`enable_gradient_checkpointing()` on: one warning, diffusers' flags off while rotor holds the U-Net (no block
    is checkpointed inside rotor's plan), each ResNet run as often as the plan says, bitwise like plain training
    without checkpointing, within budget; the flags back on once restored."""
    plain, batch = unet(), batches("unet")
    model = copy.deepcopy(plain)
    model.enable_gradient_checkpointing()
    rotor = Checkpointable(model, "50%", repeats=1, warmup=0)
    with pytest.warns(UserWarning, match="rotor plans the whole chain itself") as record:
        noise_loss(rotor, batch).backward()
    assert sum("rotor plans the whole chain itself" in str(w.message) for w in record) == 1
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    rotor.zero_grad(set_to_none=True)
    resnets = [m for m in model.modules() if type(m).__name__ == "ResnetBlock2D"]
    calls = [0] * len(resnets)
    hooks = [
        r.conv1.register_forward_pre_hook(lambda *_, k=k: calls.__setitem__(k, calls[k] + 1))
        for k, r in enumerate(resnets)
    ]
    with rotor.measure_step() as measured:
        noise_loss(rotor, batch).backward()
    for hook in hooks:
        hook.remove()
    assert rotor.plan.recomputed_stages > 0
    assert max(calls) <= max(rotor.last_entry.runs) and max(calls) > 1  # recomputed by rotor, not nested again
    assert measured.peak <= rotor.budget and measured.peak <= rotor.plan.peak
    # skips held by a checkpoint and by the current value are counted twice (docs/discovery.md, Limits): 0.84 here
    assert measured.peak >= 0.8 * rotor.plan.peak
    rotor.zero_grad(set_to_none=True)
    assert torch.equal(train(plain, batch), train(rotor, batch))
    assert_same_state(plain, rotor)
    rotor.restore_own_checkpointing()
    assert model.is_gradient_checkpointing
