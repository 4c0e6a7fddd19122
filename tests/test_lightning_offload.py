"""`offload=` from the Trainer, Fabric and YAML to the plans, and back in TensorBoard (CPU, tiny models).

Needs the offloading planner and executor of issue 19 (`Checkpointable(offload=, host_limit=)`).
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from fitting import KeepRotorModules, quiet_trainer
from lightning.fabric import Fabric
from lightning.fabric.loggers import TensorBoardLogger as FabricTensorBoardLogger
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_rotor.fabric import RotorFabricStrategy
from lightning_rotor.lightning import RotorCallback, RotorStrategy
from lightning_rotor.lightning.cli import main
from lightning_rotor.simulate import simulate

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
FAST = "1000GB/s"  # a copy of these activations takes well under a microsecond: it always hides behind a forward


def wide_net() -> nn.Sequential:
    """Sixteen equal stages whose checkpoints are as big as what they record: from about 40% to 80% of the plain
    peak, offloading a checkpoint through the right part beats recomputing around it (simulated, any CPU)."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(128, 128), nn.Tanh()) for _ in range(16)], nn.Linear(128, 5))


class Wide(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = wide_net()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(256, 128, generator=g), torch.randint(0, 5, (256,), generator=g)), 64)


def events(log_dir) -> EventAccumulator:
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    return acc


def test_trainer_logs_host_peak_and_host_curve(tmp_path):
    logger = TensorBoardLogger(tmp_path, name="tb")
    keep = KeepRotorModules()
    quiet_trainer(
        tmp_path,
        RotorStrategy(mem_limit="60%", offload=FAST, host_limit="1GiB"),
        logger=logger,
        log_every_n_steps=1,
        max_steps=3,
        callbacks=[keep, RotorCallback(measure_every_n_steps=1)],
    ).fit(Wide(), loader())
    rotor = keep.modules["net"]
    entry = rotor.last_entry
    assert entry.chain.bandwidth == 1e12 and entry.chain.host_limit == 2**30  # one chain: the whole host limit
    sim = simulate(entry.chain, entry.plan.ops)
    assert any(op.kind.is_transfer for op in entry.plan.ops), "the plan at 60% does not offload"
    acc = events(logger.log_dir)
    host_peak = acc.Scalars("rotor/host_peak_bytes")
    assert len(host_peak) == 3 and host_peak[-1].value == entry.plan.host_peak == sim.host_peak > 0
    host_curve = [e.value for e in acc.Scalars("rotor/net/plan0/predicted_host_bytes")]
    curves = [list(simulate(e.chain, e.plan.ops).host_curve) for e in rotor.entries.values()]
    assert host_curve in curves and max(host_curve) > 0  # the simulator's host bytes after each op of a plan
    assert "rotor/net/memory_curve" in acc.Tags()["images"]
    assert 0 < acc.Scalars("rotor/measured_peak_bytes")[-1].value <= acc.Scalars("rotor/budget_bytes")[-1].value


def test_without_offload_there_is_no_host_scalar(tmp_path):
    logger = TensorBoardLogger(tmp_path, name="tb")
    quiet_trainer(tmp_path, RotorStrategy(mem_limit="50%"), logger=logger, log_every_n_steps=1, max_steps=2).fit(
        Wide(), loader()
    )
    scalars = events(logger.log_dir).Tags()["scalars"]
    assert "rotor/budget_bytes" in scalars and "rotor/host_peak_bytes" not in scalars


def test_fabric_passes_offload_through_and_logs_the_host_peak(tmp_path):
    strategy = RotorFabricStrategy(mem_limit="60%", offload=FAST, host_limit=2**20, measure_every_n_steps=0)
    logger = FabricTensorBoardLogger(tmp_path, name="fabric")
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=1, loggers=logger)
    model = wide_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = fabric.setup(model, opt)
    for i, (x, y) in enumerate(loader()):
        opt.zero_grad()
        fabric.backward(F.cross_entropy(model(x), y))
        opt.step()
        fabric.log_dict(strategy.metrics, step=i)
    logger.finalize("success")
    entry = strategy.chains["model"].last_entry
    assert entry.chain.bandwidth == 1e12 and entry.chain.host_limit == 2**20
    values = events(logger.log_dir).Scalars("rotor/host_peak_bytes")
    assert len(values) == 4 and values[-1].value == entry.plan.host_peak <= 2**20


TINY_GPT = [
    "--model.init_args.model_kwargs={vocab_size: 32, block_size: 16, n_layer: 4, n_head: 2, n_embd: 16}",
    "--data.init_args.num_samples=32",
    "--data.init_args.seq_len=16",
    "--data.init_args.vocab_size=32",
    "--data.init_args.batch_size=4",
    "--trainer.accelerator=cpu",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
    "--trainer.num_sanity_val_steps=0",
    "--trainer.log_every_n_steps=1",
    "--trainer.limit_val_batches=0",
]


def _fit(tmp_path, *args: str) -> EventAccumulator:
    code = main(
        [
            "fit",
            *args,
            "--trainer.max_steps=2",
            f"--trainer.default_root_dir={tmp_path}",
            f"--trainer.logger.init_args.save_dir={tmp_path}",
        ]
    )
    assert code == 0
    (run,) = [p for p in tmp_path.glob("*/version_*")]
    return events(run)


def test_offload_yaml_fits_and_logs_the_host_peak(tmp_path):
    acc = _fit(tmp_path, "--config", str(CONFIGS / "offload.yaml"), *TINY_GPT)
    assert "rotor/host_peak_bytes" in acc.Tags()["scalars"]
    assert 0 <= acc.Scalars("rotor/host_peak_bytes")[-1].value <= 2 * 2**30  # within the config's host_limit


def test_offload_on_the_command_line_reaches_the_strategy(tmp_path):
    base = ["--config", str(CONFIGS / "gpt.yaml"), *TINY_GPT]
    plain = _fit(tmp_path / "plain", *base)
    assert "rotor/host_peak_bytes" not in plain.Tags()["scalars"]
    offloading = _fit(tmp_path / "offload", *base, "--trainer.strategy.offload=12GB/s")
    assert "rotor/host_peak_bytes" in offloading.Tags()["scalars"]  # logged only for chains that may offload
