"""torch.compile with rotor (lightning_rotor/compile.py): compiled stages, a graph break, the strategy.

Backends "eager" and "aot_eager" keep these tests fast (inductor compiles C++ on the CPU).
NOTE: [compiled stages and equality] in lightning_rotor/compile.py says what is compared with what.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
import yaml
from torch import nn
from torch._dynamo.eval_frame import OptimizedModule
from torch._dynamo.testing import CompileCounterWithBackend
from torch.utils.data import DataLoader, TensorDataset
from training import train

from lightning_rotor.checkpointable import Checkpointable
from lightning_rotor.compile import CompiledStage, compile_stages
from lightning_rotor.lightning import RotorStrategy
from lightning_rotor.lightning.state import rotor_modules
from lightning_rotor.models.gpt import gpt, lm_loss
from lightning_rotor.stages import sequential_stages

AOT = {"backend": "aot_eager"}


def make_net() -> nn.Sequential:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Dropout(0.3)) for _ in range(4)]
    return nn.Sequential(*blocks, nn.Linear(16, 4))


class InTurn(nn.Module):
    """The same compiled stages run one after the other: plain training of a compiled-stage setup."""

    def __init__(self, net: nn.Sequential, options: dict = AOT):
        super().__init__()
        self.net = net
        self.stages = compile_stages(sequential_stages(net), lambda m: torch.compile(m, **options))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.stages:
            x = stage(x)
        return x


def sample() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(6, 16, generator=g), torch.randint(4, (6,), generator=g)


def assert_same_grads(a: nn.Module, b: nn.Module) -> None:
    """Bitwise equal gradients under the same names (a compiled module's `_orig_mod.` left out)."""
    for (n, p), (m, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert n.replace("_orig_mod.", "") == m.replace("_orig_mod.", "") and torch.equal(p.grad, q.grad), n


@pytest.mark.parametrize("form", ["torch.compile(m)", "compile=dict"])
def test_compiled_stages_recompute_dropout_exactly(form):
    """Rotor outside, compile inside: stages compiled, a plan that recomputes dropout stages, gradients and
    losses bitwise those of the same compiled stages run without recomputation, peak within the budget."""
    x, y = sample()
    net = make_net()
    rotor = (
        Checkpointable(torch.compile(net, **AOT), 0.7)
        if form == "torch.compile(m)"
        else Checkpointable(net, 0.7, compile=AOT)
    )
    losses = train(rotor, x, y, F.cross_entropy)
    assert all(isinstance(stage, CompiledStage) for stage in rotor.stages)
    recomputed = [name for name, runs in zip(rotor.stage_names, rotor.entry.runs, strict=True) if runs > 1]
    assert any(isinstance(rotor.module.get_submodule(n), nn.Dropout) for n in recomputed), recomputed
    plain = make_net()
    assert torch.equal(losses, train(InTurn(plain), x, y, F.cross_entropy))
    assert_same_grads(net, plain)
    rotor.zero_grad()
    with rotor.measure_step() as m:
        F.cross_entropy(rotor(x), y).backward()
    assert 0 < m.peak <= rotor.plan.budget


def test_compiled_model_is_discovered_on_the_original_module():
    """A GPT (graph discovery) compiled by the user: discovery runs on `_orig_mod`, stages compiled; bitwise
    equal to the same compiled stages with no recomputation (mem_limit=None on the CPU)."""

    def model():
        torch.manual_seed(0)
        return nn.Sequential(gpt(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=8, dropout=0.2))

    g = torch.Generator().manual_seed(0)
    idx, targets = torch.randint(32, (2, 8), generator=g), torch.randint(32, (2, 8), generator=g)
    a, b = model(), model()
    rotor = Checkpointable(torch.compile(a[0], **AOT), 0.5, discover="graph")
    whole = Checkpointable(torch.compile(b[0], **AOT), None, discover="graph")
    assert torch.equal(train(rotor, idx, targets, lm_loss), train(whole, idx, targets, lm_loss))
    assert rotor.discovery.kind == "graph" and all(isinstance(s, CompiledStage) for s in rotor.stages)
    assert max(rotor.entry.runs) > 1 and max(whole.entry.runs) == 1
    assert_same_grads(a, b)


class Outer(nn.Module):
    """Layers around a chain; `wrap` is what stands for the chain (rotor, or a graph break without rotor)."""

    def __init__(self, wrap):
        super().__init__()
        torch.manual_seed(0)
        self.pre = nn.Linear(16, 16)
        self.body = wrap(make_net()[:4])
        self.post = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(self.body(torch.relu(self.pre(x))))


def test_compiled_model_around_rotor_breaks_the_graph_at_rotor():
    """torch.compile(model holding a Checkpointable): rotor's step runs eagerly, the layers around it are
    compiled; bitwise equal to the same compiled model whose chain is a graph break without rotor."""
    x, y = sample()
    counter = CompileCounterWithBackend("aot_eager")
    rotor = Outer(lambda body: Checkpointable(body, 0.6))
    losses = train(torch.compile(rotor, backend=counter), x, y, F.cross_entropy)
    assert counter.frame_count >= 2  # the layers before and after rotor are compiled graphs
    assert max(rotor.body.entry.runs) > 1
    plain = Outer(torch.compiler.disable)
    assert torch.equal(losses, train(torch.compile(plain, **AOT), x, y, F.cross_entropy))
    assert_same_grads(rotor, plain)
    counter.clear()
    with torch.no_grad():  # evaluation is compiled whole
        assert torch.equal(torch.compile(rotor.eval(), backend=counter)(x), plain.eval()(x))
    assert counter.frame_count == 1


def test_compiled_checkpointable_trains_like_the_plain_module():
    x, y = sample()
    net, plain = make_net(), make_net()
    rotor = torch.compile(Checkpointable(net, 0.7), backend="eager")
    assert torch.equal(train(rotor, x, y, F.cross_entropy), train(plain, x, y, F.cross_entropy))
    assert_same_grads(net, plain)


def test_bad_compile_argument_is_one_line():
    with pytest.raises(ValueError, match="torch.compile does not take.*backend"):
        Checkpointable(make_net(), compile={"backnd": "eager"})
    with pytest.raises(TypeError, match="compile= takes True, False or a dict"):
        Checkpointable(make_net(), compile="yes")
    with pytest.raises(ValueError, match="compiled already"):
        Checkpointable(torch.compile(make_net()), compile=True)
    with pytest.raises(ValueError, match="torch.compile does not take"):
        RotorStrategy(compile={"mod": "max-autotune"})


# -- Lightning -----------------------------------------------------------------------------------------
class Net(pl.LightningModule):
    def __init__(self, compiled: bool):
        super().__init__()
        net = make_net()
        self.net = torch.compile(net, **AOT) if compiled else net
        self.grads: list[list[torch.Tensor]] = []
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.losses.append(loss.detach())
        return loss

    def on_before_optimizer_step(self, optimizer):
        self.grads.append([p.grad.detach().clone() for p in self.parameters()])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class Keep(pl.Callback):
    def on_train_start(self, trainer, pl_module):
        self.modules = rotor_modules(pl_module)


def fit(tmp_path, model: pl.LightningModule, strategy) -> Keep:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(24, 16, generator=g), torch.randint(0, 4, (24,), generator=g))
    keep = Keep()
    torch.manual_seed(7)
    pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=1,
        default_root_dir=tmp_path,
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[keep],
    ).fit(model, DataLoader(data, batch_size=6))
    return keep


@pytest.mark.parametrize("form", ["torch.compile(submodule)", "compile=dict"])
def test_strategy_trains_compiled_stages(tmp_path, form):
    """In a real Trainer: the chain behind `torch.compile(submodule)` is wrapped with its compile kept, or
    `RotorStrategy(compile=...)` compiles the stages; bitwise equal to the same compiled stages without
    recomputation (mem_limit=None on the CPU)."""
    compiled = form == "torch.compile(submodule)"
    extra = {} if compiled else {"compile": AOT}
    rotor, plain = Net(compiled), Net(compiled)
    keep = fit(tmp_path / "rotor", rotor, RotorStrategy(0.7, **extra))
    chain = keep.modules["net"]
    assert all(isinstance(stage, CompiledStage) for stage in chain.stages)
    assert max(chain.last_entry.runs) > 1  # the budget forces recomputation
    assert isinstance(rotor.net, OptimizedModule) == compiled  # the user's module is put back at teardown
    reference = fit(tmp_path / "plain", plain, RotorStrategy(None, **extra)).modules["net"]
    assert max(reference.last_entry.runs) == 1
    assert len(rotor.losses) == 3 and torch.equal(torch.stack(rotor.losses), torch.stack(plain.losses))
    for step_a, step_b in zip(rotor.grads, plain.grads, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(step_a, step_b, strict=True))


def test_yaml_compile_option_reaches_the_strategy(capsys):
    """`compile:` in the strategy's init_args of a LightningCLI config (here on the command line); training
    with it is `test_strategy_trains_compiled_stages` (a full CLI fit compiles a ResNet: minutes on a busy CPU)."""
    from test_cli import QUICKSTART

    from lightning_rotor.lightning.cli import main

    assert (
        main(["fit", "--config", QUICKSTART, "--trainer.strategy.compile={backend: aot_eager}", "--print_config"]) == 0
    )
    assert yaml.safe_load(capsys.readouterr().out)["trainer"]["strategy"]["init_args"]["compile"] == AOT


def test_recomputed_compiled_stages_run_compiled_while_other_threads_live():
    """With a non-daemon thread alive (inductor leaves one: its compile pool), rng.py would record and replay
    random ops under dispatch modes, under which dynamo runs a stage eagerly; compiled stages rewind the
    generators instead (NOTE: [compiled stages rewind]): every stage call runs a compiled graph, and dropout
    replays exactly."""
    import threading

    calls = []

    def counting(gm, example_inputs):
        def run(*args):
            calls.append(1)
            return gm(*args)

        return run

    x, y = sample()
    net = make_net()
    rotor = Checkpointable(net, 0.7, compile={"backend": counting})
    train(rotor, x, y, F.cross_entropy, steps=1)  # profile and plan
    release = threading.Event()
    other = threading.Thread(target=release.wait)  # not a daemon: rng.py's "not alone"
    other.start()
    try:
        calls.clear()
        losses = train(rotor, x, y, F.cross_entropy, steps=2)
    finally:
        release.set()
        other.join()
    runs = sum(rotor.entry.runs)
    assert max(rotor.entry.runs) > 1 and len(calls) == 2 * runs  # each stage run, recomputations too, compiled
    plain = make_net()
    plain_model = InTurn(plain)
    train(plain_model, x, y, F.cross_entropy, steps=1)
    assert torch.equal(losses, train(plain_model, x, y, F.cross_entropy, steps=2))


def test_compiled_lightning_module_trains_with_rotor_as_a_graph_break(tmp_path):
    """`trainer.fit(torch.compile(module))`: Lightning compiles training_step; the chain rotor wraps in it is a
    graph break (rotor eager, the rest compiled), bitwise equal to the same compiled module without rotor."""
    rotor, plain = Net(False), Net(False)
    chain = fit(tmp_path / "rotor", torch.compile(rotor, **AOT), RotorStrategy(0.7)).modules["net"]
    assert max(chain.last_entry.runs) > 1
    fit(tmp_path / "plain", torch.compile(plain, **AOT), "auto")
    assert len(rotor.losses) == 3 and torch.equal(torch.stack(rotor.losses), torch.stack(plain.losses))
    for step_a, step_b in zip(rotor.grads, plain.grads, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(step_a, step_b, strict=True))


def test_inductor_recomputations_are_bitwise_those_of_the_recorded_forward():
    """Inductor: no-grad forwards (`Fn`, `Fc`) run each stage's training graph (NOTE: [no-grad forwards through
    the training graph]), so a plan that recomputes dropout blocks gives the losses and gradients of the same
    inductor-compiled stages run in turn, bitwise; the measured peak stays within the budget."""

    def model() -> nn.Sequential:
        torch.manual_seed(0)
        return gpt(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=8, dropout=0.2)

    g = torch.Generator().manual_seed(0)
    idx, targets = torch.randint(16, (2, 8), generator=g), torch.randint(16, (2, 8), generator=g)
    net, plain = model(), model()
    rotor = Checkpointable(net, 0.7, compile={"backend": "inductor"})
    losses = train(rotor, idx, targets, lm_loss)
    assert all(isinstance(s, CompiledStage) and s.same_forward for s in rotor.stages)
    recomputed = [n for n, runs in zip(rotor.stage_names, rotor.entry.runs, strict=True) if runs > 1]
    assert any(n.startswith("blocks.") for n in recomputed), recomputed
    chain = rotor.entry.chain  # Fn/Fc charged what the training graph saves, alive until the stage returns
    blocks = [k for k, n in enumerate(rotor.stage_names) if n.startswith("blocks.")]
    assert all(chain.fwd_tmp_nograd[k] + chain.out_size[k] >= chain.saved_size[k] for k in blocks), chain
    in_turn = InTurn(plain, {"backend": "inductor"})
    assert torch.equal(losses, train(in_turn, idx, targets, lm_loss))
    assert_same_grads(net, plain)
    rotor.zero_grad()
    with rotor.measure_step() as m:
        lm_loss(rotor(idx), targets).backward()
    assert 0 < m.peak <= rotor.plan.budget


def test_no_grad_forwards_of_an_inductor_stage_run_its_training_graph():
    """`same_forward` (on for inductor): a no-grad call reuses the graph compiled for the recorded call, with the
    inputs requiring grad as then, and returns detached outputs equal to the recorded ones; other backends
    compile an inference graph of their own."""
    from lightning_rotor.compile import wants_same_forward

    assert wants_same_forward(lambda m: torch.compile(m), nn.Identity())
    assert wants_same_forward(lambda m: torch.compile(m, backend="inductor", mode="max-autotune"), nn.Identity())
    assert not wants_same_forward(lambda m: torch.compile(m, **AOT), nn.Identity())
    x = torch.randn(3, 16)
    for same in (True, False):
        graphs: list[int] = []

        def counting(gm, example_inputs, graphs=graphs):
            graphs.append(len(example_inputs))
            return gm

        torch._dynamo.reset()
        stage = CompiledStage(torch.compile(nn.Sequential(nn.Linear(16, 16), nn.Tanh()), backend=counting), same)
        recorded = stage(x.requires_grad_())
        x = x.detach()
        with torch.no_grad():
            out = stage(x)
        assert torch.equal(out, recorded) and not out.requires_grad and out.grad_fn is None
        assert len(graphs) == (1 if same else 2), graphs
    assert stage.recorded_as is None  # only the same-forward stage learns how its inputs were recorded
