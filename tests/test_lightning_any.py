"""RotorStrategy on models as users write them, through a real Trainer (CPU)."""

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from fitting import KeepRotorModules, SaveAtEnd, quiet_trainer
from models_any import GPT, BasicBlock, Block
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_rotor.lightning import RotorStrategy
from lightning_rotor.lightning.wrap import find_chains, resolve_block_types
from lightning_rotor.shared_budget import InfeasibleTotal


class GPTTask(pl.LightningModule):
    """A nanoGPT-style model (ModuleList blocks, tied head, dropout) trained on int64 tokens."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = GPT(n_layer=4, n_embd=32, block_size=32)
        self.losses: list[torch.Tensor] = []
        self.grads: list[list[torch.Tensor]] = []

    def training_step(self, batch, batch_idx):
        idx, targets = batch
        logits = self.model(idx)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        self.losses.append(loss.detach())
        return loss

    def on_before_optimizer_step(self, optimizer):
        self.grads.append([p.grad.detach().clone() for p in self.parameters()])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class CNNTask(pl.LightningModule):
    """Features and a three-stage classifier head, both plain Sequentials of the LightningModule."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(inplace=True),
            nn.Conv2d(8, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(inplace=True),
            nn.Conv2d(8, 16, 3, padding=1, stride=2),
            nn.ReLU(),
        )
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 5))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.head(self.features(x)), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def tokens(n=32, t=32):
    g = torch.Generator().manual_seed(0)
    data = torch.randint(64, (n, t + 1), generator=g)
    return DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=8)


def images(n=32):
    g = torch.Generator().manual_seed(0)
    return DataLoader(
        TensorDataset(torch.randn(n, 3, 16, 16, generator=g), torch.randint(5, (n,), generator=g)), batch_size=8
    )


def fit(tmp_path, model, data, strategy="auto", **kw):
    trainer = quiet_trainer(tmp_path, strategy, **kw)
    torch.manual_seed(7)
    trainer.fit(model, data)
    return trainer


def test_gpt_with_modulelist_trains_bitwise_like_plain_under_half_the_memory(tmp_path, capsys):
    plain, rotor, keep = GPTTask(), GPTTask(), KeepRotorModules()
    fit(tmp_path / "plain", plain, tokens())
    fit(tmp_path / "rotor", rotor, tokens(), RotorStrategy(mem_limit="50%", discover="auto"), callbacks=[keep])
    ((name, wrapped),) = keep.modules.items()
    assert name == "model"  # the whole GPT, not its inner mlp Sequentials
    assert wrapped.discovery.kind == "graph" and len(wrapped.stages) >= 6
    assert sum(r > 1 for r in wrapped.last_entry.runs) > 0  # the budget forces recomputation
    assert isinstance(rotor.model, GPT)  # put back at teardown
    torch.testing.assert_close(rotor.losses, plain.losses, rtol=0, atol=0)
    for step_a, step_b in zip(rotor.grads, plain.grads, strict=True):
        for a, b in zip(step_a, step_b, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    for (key, a), b in zip(rotor.state_dict().items(), plain.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=key)
    printed = capsys.readouterr().out
    assert "model: graph chain of" in printed and "after transformer.h" in printed  # stages and cut points


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_tied_gpt_with_gradient_accumulation_and_clipping_stays_bitwise(tmp_path, precision):
    """issue 15: accumulate_grad_batches=4 with a tied embedding and LM head drifted 0.0102 in 4 steps."""
    plain, rotor, keep = GPTTask(), GPTTask(), KeepRotorModules()
    kw = dict(accumulate_grad_batches=4, gradient_clip_val=1.0, precision=precision)
    fit(tmp_path / "plain", plain, tokens(64), **kw)
    fit(tmp_path / "rotor", rotor, tokens(64), RotorStrategy(mem_limit="50%"), callbacks=[keep], **kw)
    assert sum(r > 1 for r in keep.modules["model"].last_entry.runs) > 0  # the budget forces recomputation
    torch.testing.assert_close(rotor.losses, plain.losses, rtol=0, atol=0)
    for (key, a), b in zip(rotor.state_dict().items(), plain.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=key)


def test_checkpoint_modules_by_name_keep_blocks_whole(tmp_path):
    keep = KeepRotorModules()
    fit(tmp_path, GPTTask(), tokens(), RotorStrategy(mem_limit="50%", checkpoint_modules=["Block"]), callbacks=[keep])
    stages = keep.modules["model"].stage_names
    assert [s for s in stages if s.startswith("transformer.h")] == [f"transformer.h.{i}" for i in range(4)]
    with pytest.raises(
        ValueError,
        match="checkpoint_modules names 'Blok', which is no class of a submodule of "
        "GPTTask; give a class, a class path, or one of: .*Block",
    ):
        fit(tmp_path, GPTTask(), tokens(), RotorStrategy(checkpoint_modules=["Blok"]))
    assert find_chains(GPTTask(), discover="auto")[0][0][0] == "model"
    assert Block in {type(m) for m in GPTTask().modules()}


def test_auto_does_not_wrap_a_small_head_on_its_own(tmp_path):
    found, _ = find_chains(CNNTask(), discover="auto")
    assert [n for n, _ in found] == ["features"]
    assert [n for n, _ in find_chains(CNNTask(), discover="sequential")[0]] == ["features", "head"]
    keep = KeepRotorModules()
    fit(tmp_path, CNNTask(), images(), RotorStrategy(mem_limit="90%"), callbacks=[keep])
    assert list(keep.modules) == ["features"]


def test_infeasible_total_names_every_chain_and_the_smallest_total(tmp_path):
    model = CNNTask()
    strategy = RotorStrategy(mem_limit=1000, discover="sequential")  # wraps features and head
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(
        InfeasibleTotal,
        match=r"\(the total\) for chains 'features' \(>= .*\), 'head' \(>= .*\); "
        r"use mem_limit >= \d+",
    ) as err:
        fit(tmp_path, model, images(), strategy)
    smallest = err.value.min_feasible
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))  # no step was taken
    keep = KeepRotorModules()
    fit(tmp_path, CNNTask(), images(), RotorStrategy(mem_limit=smallest, discover="sequential"), callbacks=[keep])
    assert sum(r.plan.budget for r in keep.modules.values()) <= smallest  # the stated total works


def test_bad_discover_and_checkpoint_modules_are_one_line_errors():
    with pytest.raises(ValueError, match="discover='all' is not a discovery method; use one of auto, sequential"):
        RotorStrategy(discover="all")
    with pytest.raises(TypeError, match="checkpoint_modules must be a list of classes, class paths or class names"):
        RotorStrategy(checkpoint_modules="Block")


def test_discover_and_checkpoint_modules_from_yaml(tmp_path, capsys):
    import yaml

    from lightning_rotor.lightning.cli import main

    config = tmp_path / "rotor.yaml"
    config.write_text(
        "trainer:\n"
        "  strategy:\n"
        "    class_path: rotor\n"
        "    init_args:\n"
        "      mem_limit: 50%\n"
        "      discover: graph\n"
        "      checkpoint_modules: [Block, lightning_rotor.bench.any_models.BasicBlock]\n"
    )
    quickstart = str(Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml")
    assert main(["fit", "--config", quickstart, "--config", str(config), "--print_config"]) == 0
    strategy = yaml.safe_load(capsys.readouterr().out)["trainer"]["strategy"]
    assert strategy["class_path"] == "lightning_rotor.lightning.RotorStrategy"
    assert strategy["init_args"]["discover"] == "graph"
    assert strategy["init_args"]["checkpoint_modules"] == ["Block", "lightning_rotor.bench.any_models.BasicBlock"]
    made = RotorStrategy(**{k: v for k, v in strategy["init_args"].items() if k in ("discover", "checkpoint_modules")})
    assert resolve_block_types(GPTTask(), made.checkpoint_modules) == (Block, BasicBlock)


def test_resume_with_two_chains_keeps_the_split_of_one_byte_budget(tmp_path):
    first = KeepRotorModules()
    fit(
        tmp_path / "a",
        CNNTask(),
        images(),
        RotorStrategy(mem_limit=600_000, discover="sequential"),
        callbacks=[SaveAtEnd(tmp_path / "mid.ckpt"), first],
    )
    before = {name: r.plan.budget for name, r in first.modules.items()}
    assert sorted(before) == ["features", "head"] and sum(before.values()) <= 600_000
    resumed = KeepRotorModules()
    trainer = quiet_trainer(
        tmp_path / "b", RotorStrategy(mem_limit=600_000, discover="sequential"), max_steps=4, callbacks=[resumed]
    )
    trainer.fit(CNNTask(), images(), ckpt_path=tmp_path / "mid.ckpt")
    after = {name: r.plan.budget for name, r in resumed.modules.items()}
    assert after == before  # each chain its share again, never the whole total each


def test_resume_restores_a_discovered_chains_plans_once_it_is_found_again(tmp_path):
    first = KeepRotorModules()
    fit(
        tmp_path / "a",
        GPTTask(),
        tokens(),
        RotorStrategy(mem_limit="50%"),
        callbacks=[SaveAtEnd(tmp_path / "mid.ckpt"), first],
    )
    saved = torch.load(tmp_path / "mid.ckpt", weights_only=True)["rotor"]["modules"]["model"]
    assert saved["stages"] == first.modules["model"].stage_names and saved["entries"]
    resumed, model = KeepRotorModules(), GPTTask()
    trainer = quiet_trainer(tmp_path / "b", RotorStrategy(mem_limit="50%"), max_steps=5, callbacks=[resumed])
    trainer.fit(model, tokens(), ckpt_path=tmp_path / "mid.ckpt")
    rotor = resumed.modules["model"]
    assert len(model.losses) == 2 and rotor.discovery.kind == "graph"
    assert rotor.profile_seconds == first.modules["model"].profile_seconds  # the saved profile, not a new one
    assert rotor.plan.ops == first.modules["model"].plan.ops


class GPT2Task(GPTTask):
    """A transformers GPT-2 from a small config: tracing fails, module-level discovery takes its blocks."""

    def __init__(self):
        pl.LightningModule.__init__(self)
        from lightning_rotor.bench.any_models import gpt2

        torch.manual_seed(0)
        self.model = gpt2(n_layer=4, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
        self.losses, self.grads = [], []

    def training_step(self, batch, batch_idx):
        idx, targets = batch
        logits = self.model(idx).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        self.losses.append(loss.detach())
        return loss


def test_transformers_gpt2_through_a_trainer_equals_plain_training(tmp_path):
    pytest.importorskip("transformers")
    plain, rotor, keep = GPT2Task(), GPT2Task(), KeepRotorModules()
    fit(tmp_path / "plain", plain, tokens())
    fit(tmp_path / "rotor", rotor, tokens(), RotorStrategy(mem_limit="50%"), callbacks=[keep])
    wrapped = keep.modules["model"]
    assert wrapped.discovery.kind == "modules" and wrapped.stage_names == [f"transformer.h.{i}" for i in range(4)]
    assert sum(r > 1 for r in wrapped.last_entry.runs) > 0
    torch.testing.assert_close(rotor.losses, plain.losses, rtol=0, atol=0)
    for step_a, step_b in zip(rotor.grads, plain.grads, strict=True):
        for a, b in zip(step_a, step_b, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
