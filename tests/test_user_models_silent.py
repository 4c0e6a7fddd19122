"""Models users bring, where rotor once gave a silent wrong result (issue 25): names the wrapped module shares
with rotor's own attributes, submodules the user put in eval mode, and the model's own checkpointing.

Each runs through `Checkpointable` and through a real Trainer with `RotorStrategy`, against plain training
of the same model on the same seed: parameters bitwise equal.
"""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from fitting import KeepRotorModules, quiet_trainer
from hf_models import tiny_llama
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_rotor import Checkpointable
from lightning_rotor.lightning import RotorStrategy

torch.set_num_threads(1)


def regression_loader(n: int = 32, width: int = 8) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(n, width, generator=g), torch.randn(n, width, generator=g))
    return DataLoader(data, batch_size=8)


def sgd_steps(model: nn.Module, steps: int = 3, width: int = 8) -> None:
    """`steps` SGD steps on a regression loss, the same batches for every model."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(2)
    for (x, y), _ in zip(regression_loader(width=width), range(steps), strict=False):
        opt.zero_grad()
        F.mse_loss(model(x.requires_grad_()), y).backward()
        opt.step()


def assert_same_model(plain: nn.Module, rotor: nn.Module) -> None:
    """The same state_dict keys, in order, and every tensor bitwise equal."""
    a, b = plain.state_dict(), rotor.state_dict()
    assert list(a) == list(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


class Fit(pl.LightningModule):
    """`net` trained on a regression loss by SGD; the per-module `training` flags seen at each step."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net
        self.modes: list[list[bool]] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.modes.append([m.training for m in self.net.modules()])
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(net: nn.Module, root, strategy="auto", callbacks=()) -> tuple[Fit, KeepRotorModules]:
    keep = KeepRotorModules()
    model = Fit(net)
    torch.manual_seed(2)
    quiet_trainer(root, strategy, callbacks=[keep, *callbacks]).fit(model, regression_loader())
    return model, keep


class GradientsSeen(pl.Callback):
    """The names of the parameters that got a gradient in some training step (a dropped one never does)."""

    def __init__(self):
        self.names: set[str] = set()

    def on_after_backward(self, trainer, pl_module):
        self.names |= {n for n, p in pl_module.named_parameters() if p.grad is not None}


# -- 1. names the wrapped module shares with rotor's own attributes ----------------------------------------------
def rotor_names() -> list[str]:
    """Every name a `Checkpointable` uses for itself (its state after a step, its methods and properties, the
    attribute holding its state) that a user's module may use too (nn.Module's own names it may not)."""
    ck = Checkpointable(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)), repeats=1)
    ck(torch.randn(2, 4, requires_grad=True)).sum().backward()
    classes = [c for c in Checkpointable.__mro__ if issubclass(c, nn.Module) and c is not nn.Module]  # and its bases'
    own = set(vars(ck._rotor)) | {n for c in classes for n in vars(c) if not n.startswith("__")} | {"_rotor"}
    return sorted(own - set(dir(nn.Module())))


NAMES = rotor_names()


class Named(nn.Module):
    """Every one of rotor's names used as a child (a linear layer), a parameter (a scale) or a buffer (a shift),
    then a run of blocks (where the memory is)."""

    def __init__(self, kind: str):
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        for name in NAMES:
            if kind == "module":
                self.add_module(name, nn.Linear(8, 8))
            elif kind == "parameter":
                self.register_parameter(name, nn.Parameter(1 + 0.01 * torch.randn(())))
            else:
                self.register_buffer(name, 0.01 * torch.randn(()))
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 8)) for _ in range(6))

    def forward(self, x):
        values = [getattr(self, name) for name in NAMES]
        if self.kind == "module":
            for layer in values:
                x = x + torch.tanh(layer(x))
        elif self.kind == "parameter":
            x = x * torch.stack(values).prod(0)
        else:
            x = x + torch.stack(values).sum(0)
        for block in self.blocks:
            x = torch.relu(block(x))
        return x


def test_rotor_names_are_many():
    assert {"shared", "budget", "discovery", "loss_fn", "calls", "outside", "options", "plan", "_rotor"} <= set(NAMES)


@pytest.mark.parametrize("kind", [pytest.param("module", marks=pytest.mark.slow), "parameter", "buffer"])
def test_names_shared_with_rotor_stay_the_users_through_checkpointable(kind):
    net = Named(kind)
    plain = copy.deepcopy(net)
    rotor = Checkpointable(net, "50%", repeats=1)
    assert list(rotor.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in rotor.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert [n for n, _ in rotor.named_buffers()] == [n for n, _ in plain.named_buffers()]
    sgd_steps(plain)
    sgd_steps(rotor)
    assert sum(r > 1 for r in rotor.last_entry.runs) > 0  # the budget really recomputes
    assert rotor.shared is None and isinstance(rotor.budget, int)  # rotor's own, apart from the user's
    assert_same_model(plain, rotor)
    assert_same_model(plain, net)


@pytest.mark.parametrize("kind", [pytest.param("module", marks=pytest.mark.slow), "parameter", "buffer"])
def test_names_shared_with_rotor_stay_the_users_through_a_trainer(tmp_path, kind):
    plain, _ = fit(Named(kind), tmp_path / "plain")
    seen = GradientsSeen()
    rotor, keep = fit(Named(kind), tmp_path / "rotor", RotorStrategy("50%"), [seen])
    wrapped = keep.modules["net"]
    assert sum(r > 1 for r in wrapped.last_entry.runs) > 0
    assert_same_model(plain, rotor)
    # every parameter trained: each got a gradient (a scale's update can round away next to 1.0, so values can't say)
    assert seen.names == {n for n, _ in plain.named_parameters()}


# -- 2. submodules the user put in eval mode ---------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.norm = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        return x + F.dropout(self.drop(torch.relu(self.norm(self.lin(x)))), 0.1, self.training)


class Frozen(nn.Module):
    """Blocks with BatchNorm and dropout; some frozen with `.eval()` as fine-tuning recipes do."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(Block() for _ in range(5))
        self.head = nn.Linear(16, 8)
        self.freeze()

    def freeze(self) -> None:
        self.blocks[0].eval()  # frozen BatchNorm statistics, no dropout
        self.blocks[2].norm.eval()  # frozen statistics only
        self.blocks[3].drop.eval()  # one dropout off

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def modes(net: nn.Module) -> list[bool]:
    return [m.training for m in net.modules()]


@pytest.mark.parametrize("discover", ["graph", "modules"])
def test_eval_submodules_stay_in_eval_through_checkpointable(discover):
    net = Frozen()
    plain = copy.deepcopy(net)
    before = modes(net)
    assert not all(before)
    rotor = Checkpointable(net, "50%", discover=discover, repeats=1)
    sgd_steps(plain)
    sgd_steps(rotor)
    assert rotor.discovery.kind == discover and sum(r > 1 for r in rotor.last_entry.runs) > 0
    assert modes(net) == before == modes(plain)
    assert_same_model(plain, rotor)  # frozen statistics unchanged in both, dropout off where it was
    assert torch.equal(net.blocks[0].norm.running_mean, Frozen().blocks[0].norm.running_mean)
    rotor.eval()
    assert not any(modes(net))  # eval and train switch the wrapped module itself too
    rotor.train()
    assert all(modes(net))


def test_eval_submodules_stay_in_eval_through_a_trainer(tmp_path):
    plain, _ = fit(Frozen(), tmp_path / "plain")
    rotor, keep = fit(Frozen(), tmp_path / "rotor", RotorStrategy("50%"))
    assert sum(r > 1 for r in keep.modules["net"].last_entry.runs) > 0
    assert not all(plain.modes[0]) and rotor.modes == plain.modes
    assert_same_model(plain, rotor)


def test_a_child_named_shared_keeps_its_parameters():
    class Net(nn.Module):  # T5 and others name their embedding `shared`
        def __init__(self):
            super().__init__()
            self.shared = nn.Linear(8, 8)
            self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(6))

        def forward(self, x):
            x = self.shared(x)
            for b in self.blocks:
                x = torch.relu(b(x))
            return x

    net = Net()
    rotor = Checkpointable(net, "80%", repeats=1)
    assert len(list(rotor.parameters())) == len(list(net.parameters())) == 14
    rotor(torch.randn(4, 8, requires_grad=True)).sum().backward()
    assert rotor.module.shared.weight.grad is not None and rotor.shared is None


# -- 3. the model's own checkpointing ----------------------------------------------------------------------------
def own_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "rotor plans the whole chain itself" in str(w.message)]


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=4, n_embd=32, n_head=2, vocab_size=64, n_positions=32, use_cache=False)
    return GPT2LMHeadModel(config)


def llama() -> nn.Module:
    return tiny_llama(use_cache=False)


def tokens(n: int = 8, t: int = 16) -> torch.Tensor:
    return torch.randint(64, (n, t), generator=torch.Generator().manual_seed(0))


def lm_steps(model: nn.Module, steps: int = 3, first: int = 0) -> None:
    """SGD steps on next-token loss; step `i` draws its dropout from seed `first + i`."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = tokens()
    for i in range(steps):
        torch.manual_seed(first + i)
        opt.zero_grad()
        model(input_ids=x, labels=x).loss.backward()
        opt.step()


def layers(model: nn.Module) -> list[nn.Module]:
    return list(model.transformer.h) if hasattr(model, "transformer") else list(model.model.layers)


@pytest.mark.parametrize("make", [gpt2, llama])
def test_hugging_face_gradient_checkpointing_is_rotors_through_checkpointable(make):
    pytest.importorskip("transformers")
    model = make()
    plain = copy.deepcopy(model)
    model.gradient_checkpointing_enable()
    rotor = Checkpointable(model, "50%", discover="modules", repeats=1)
    with pytest.warns(UserWarning) as record:
        lm_steps(rotor, 1)
    assert len(own_warnings(record)) == 1 and "gradient checkpointing on" in own_warnings(record)[0]
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    runs = [0] * len(layers(model))  # each block's inner calls in one step: what the plan says, no more
    hooks = [
        block.mlp.register_forward_pre_hook(lambda *_, k=k: runs.__setitem__(k, runs[k] + 1))
        for k, block in enumerate(layers(model))
    ]
    with rotor.measure_step() as measured:
        lm_steps(rotor, 1, first=1)
    for hook in hooks:
        hook.remove()
    assert rotor.stage_names == [f"{n}" for n, _ in rotor.module.named_modules() if n in rotor.stage_names]
    assert runs == list(rotor.last_entry.runs) and max(runs) > 1
    assert measured.chain_peak <= rotor.budget
    lm_steps(rotor, 1, first=2)
    lm_steps(plain, 3)
    assert_same_model(plain, rotor)
    rotor.restore_own_checkpointing()
    assert model.is_activation_checkpointing


def lm_step_peak(model: nn.Module, x: torch.Tensor) -> int:
    """One training step's activation peak, measured as its own (parameters excluded)."""
    from lightning_rotor.memory import MemoryProbe

    with MemoryProbe(model) as probe:
        model(input_ids=x, labels=x).loss.backward()
    return probe.peak


def test_the_warning_gives_what_the_users_own_checkpointing_measured():
    """Issue 25: the budget is compared with the peak the user's own checkpointing measured (here below rotor's
    per-stage estimate), and the step that measured it leaves the training bitwise plain's, the RNG stream too."""
    pytest.importorskip("transformers")
    model, x = gpt2(), tokens()
    plain = copy.deepcopy(model)
    model.gradient_checkpointing_enable()
    users = lm_step_peak(copy.deepcopy(model), x)  # the user's own checkpointing, measured apart
    rotor = Checkpointable(model, "90%", discover="modules", repeats=1)
    torch.manual_seed(3)
    with pytest.warns(UserWarning) as record:
        rotor(input_ids=x, labels=x).loss.backward()
    after_rotor = torch.random.get_rng_state()
    (said,) = own_warnings(record)
    assert f"your own checkpointing measured {users} B a step; rotor's budget {rotor.budget} B" in said
    assert rotor.budget > users and f"give mem_limit={users} or less to hold no more" in said
    torch.manual_seed(3)
    plain(input_ids=x, labels=x).loss.backward()
    assert torch.equal(torch.random.get_rng_state(), after_rotor)
    for (name, p), q in zip(plain.named_parameters(), model.parameters(), strict=True):
        assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad), name


def test_hugging_face_gradient_checkpointing_is_rotors_through_a_trainer(tmp_path):
    pytest.importorskip("transformers")

    class LM(pl.LightningModule):
        def __init__(self, checkpointing: bool):
            super().__init__()
            self.model = gpt2()
            if checkpointing:
                self.model.gradient_checkpointing_enable()

        def training_step(self, batch, batch_idx):
            (x,) = batch
            return self.model(input_ids=x, labels=x).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = DataLoader(TensorDataset(tokens(24)), batch_size=8)
    plain = LM(False)
    torch.manual_seed(1)
    quiet_trainer(tmp_path / "plain").fit(plain, data)
    rotor, keep = LM(True), KeepRotorModules()
    torch.manual_seed(1)
    with pytest.warns(UserWarning) as record:
        quiet_trainer(tmp_path / "rotor", RotorStrategy("50%", discover="modules"), callbacks=[keep]).fit(rotor, data)
    assert len(own_warnings(record)) == 1
    assert sum(r > 1 for r in keep.modules["model"].last_entry.runs) > 0
    assert_same_model(plain, rotor)
    assert rotor.model.is_activation_checkpointing  # the user's setting, back after the fit


class MLPBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 128)
        self.b = nn.Linear(128, 32)

    def forward(self, x):
        return x + self.b(torch.relu(self.a(x)))


class OwnCheckpoints(nn.Module):
    """Blocks each run under `torch.utils.checkpoint.checkpoint` in the forward (`own`), or under torch's
    `checkpoint_wrapper` (`wrapper`), or plainly."""

    def __init__(self, how: str):
        super().__init__()
        torch.manual_seed(0)
        self.how = how
        self.blocks = nn.ModuleList(MLPBlock() for _ in range(8))
        if how == "wrapper":
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

            self.blocks = nn.ModuleList(checkpoint_wrapper(b) for b in self.blocks)

    def forward(self, x):
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) if self.how == "own" else block(x)
        return x


def step_peak(model: nn.Module, x: torch.Tensor) -> int:
    from lightning_rotor.memory import MemoryProbe

    with MemoryProbe(model) as probe:
        model(x).sum().backward()
    return probe.peak


@pytest.mark.parametrize("how", ["own", "wrapper"])
def test_checkpoint_in_the_forward_is_replaced_and_a_larger_budget_said(how):
    x = next(iter(regression_loader(width=32)))[0].requires_grad_()  # the batches the models train on
    users = step_peak(OwnCheckpoints(how), x)  # what the user's own checkpointing holds
    assert users < 0.6 * step_peak(OwnCheckpoints("plain"), x)
    plain = OwnCheckpoints(how)
    rotor = Checkpointable(OwnCheckpoints(how), "80%", discover="graph", repeats=1)
    with pytest.warns(UserWarning) as record:
        sgd_steps(rotor, 1, width=32)
    (said,) = own_warnings(record)
    if how == "own":
        assert "calls torch.utils.checkpoint" in said and "rotor's plan replaces them" in said
    else:  # checkpoint_wrapper: turned off as Hugging Face's flags are (its block not recomputed by it on top)
        assert "had its own gradient checkpointing on (8 modules: blocks.0" in said and "rotor turned it off" in said
    with rotor.measure_step() as measured:
        rotor(x).sum().backward()
    assert measured.chain_peak <= rotor.budget
    assert measured.chain_peak > users  # more than the user's own checkpointing held, and the warning says so:
    assert "may hold more than before; give mem_limit=" in said
    rotor.zero_grad()
    sgd_steps(plain, 1, width=32)
    plain(x).sum().backward()
    plain.zero_grad()
    assert_same_model(plain, rotor)
    sgd_steps(rotor, 2, width=32)
    sgd_steps(plain, 2, width=32)
    assert_same_model(plain, rotor)


def test_own_checkpointing_stays_on_where_no_chain_is_found():
    class Branchy(nn.Module):  # a value-dependent branch, no sibling blocks: no chain
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.gradient_checkpointing = True

        def forward(self, x):
            return self.lin(x) if x.sum() > 0 else -self.lin(x)

    net = Branchy()
    rotor = Checkpointable(net, "50%", fallback_plain=True, repeats=1)
    with pytest.warns(UserWarning, match="runs without checkpointing"):
        rotor(torch.ones(2, 8, requires_grad=True)).sum().backward()
    assert net.gradient_checkpointing and rotor.own_checkpointing == []


class Head(nn.Module):  # used once: graph discovery traces into it, and reads its flag while tracing
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 8)

    def forward(self, x):
        return self.lin(F.dropout(x, 0.5, self.training))


class Unfrozen(Frozen):
    def __init__(self):
        super().__init__()
        self.head = Head()
        self.head.eval()


def test_a_block_unfrozen_after_discovery_is_found_and_profiled_again():
    net = Unfrozen()
    plain = copy.deepcopy(net)
    rotor = Checkpointable(net, "50%", discover="graph", repeats=1)
    sgd_steps(plain, 1)
    sgd_steps(rotor, 1)
    first = rotor.discovery
    for model in (plain, net):
        model.head.train()  # dropout on from now on
        model.blocks[0].train()
    sgd_steps(plain, 2)
    sgd_steps(rotor, 2)
    assert_same_model(plain, rotor)  # the head's dropout runs in rotor's stages too
    assert rotor.discovery is not first and sum(r > 1 for r in rotor.last_entry.runs) > 0
    x = next(iter(regression_loader()))[0].requires_grad_()
    with rotor.measure_step() as measured:
        rotor(x).sum().backward()
    assert measured.chain_peak <= rotor.budget
