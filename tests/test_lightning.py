"""RotorStrategy and RotorCallback in real Trainer runs (CPU, tiny models, a few steps)."""

from __future__ import annotations

import re
import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from fitting import KeepRotorModules, SaveAtEnd, classes_loader, quiet_trainer
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

from lightning_rotor.budget import BudgetError, resolve_budget
from lightning_rotor.checkpointable import Checkpointable
from lightning_rotor.lightning import RotorCallback, RotorDDPStrategy, RotorStrategy
from lightning_rotor.lightning.state import rotor_modules
from lightning_rotor.lightning.wrap import find_chains, offload_settings, unwrap, wrap
from lightning_rotor.planner import min_feasible_budget
from lightning_rotor.shared_budget import InfeasibleTotal, split_by_need
from lightning_rotor.simulate import no_recompute_peak

BUDGET = 0.7  # of the no-recomputation peak: forces recomputation in the nets below


def make_net() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(12, 48),
        nn.BatchNorm1d(48),
        nn.ReLU(),
        nn.Sequential(nn.Linear(48, 48), nn.Tanh(), nn.Dropout(0.2)),
        nn.Linear(48, 48),
        nn.GELU(),
        nn.Linear(48, 48),
        nn.Sigmoid(),
        nn.Linear(48, 5),
    )


class Net(pl.LightningModule):
    """A chain plus a loss; records losses and the gradients each optimizer step sees."""

    def __init__(self, lr: float = 0.1):
        super().__init__()
        torch.manual_seed(1)
        self.net = make_net()
        self.lr = lr
        self.losses: list[float] = []
        self.grads: list[list[torch.Tensor]] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x).float(), y)
        self.losses.append(loss.item())
        return loss

    def on_before_optimizer_step(self, optimizer):
        self.grads.append([p.grad.detach().clone() for p in self.parameters()])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class ManualNet(Net):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.losses.append(loss.item())
        opt.zero_grad()
        self.manual_backward(loss)
        self.grads.append([p.grad.detach().clone() for p in self.parameters()])
        opt.step()


class TwoChains(Net):
    """Two chains one after the other, with a plain layer between them."""

    def __init__(self):
        super().__init__()
        self.mid = nn.Linear(5, 12)
        self.tail = make_net()

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.tail(torch.relu(self.mid(self.net(x)))), y)
        self.losses.append(loss.item())
        return loss


class Flat(pl.LightningModule):
    """Nothing for rotor: no nn.Sequential."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(12, 16), nn.Linear(16, 5)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.b(torch.relu(self.a(x))), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Keep(pl.Callback):
    """Remembers the rotor modules while they are in the model (the strategy unwraps at teardown)."""

    def __init__(self):
        self.modules: dict[str, Checkpointable] = {}
        self.entries_at_start: dict[str, list[int]] = {}

    def on_train_start(self, trainer, pl_module):
        self.modules = rotor_modules(pl_module)
        self.entries_at_start = {n: [id(e) for e in m.entries.values()] for n, m in self.modules.items()}


def events(log_dir) -> EventAccumulator:
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    return acc


# -- the policy ---------------------------------------------------------------------------------------
def test_find_chains_takes_outermost_plain_sequentials():
    model = nn.Module()
    model.body = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    model.one = nn.Sequential(nn.Linear(2, 2))  # a single stage: nothing to plan
    model.head = nn.Linear(2, 2)
    assert [n for n, _ in find_chains(model)[0]] == ["body"]
    assert [n for n, _ in find_chains(model, include=["body.1"])[0]] == ["body.1"]
    chains, why = find_chains(model, exclude=["body"])
    assert chains == [] and "none is a plain Sequential" in why
    assert "no nn.Sequential" in find_chains(nn.Linear(2, 2))[1]
    with pytest.raises(TypeError, match="plain nn.Sequential"):
        find_chains(model, include=["head"])


def test_one_budget_is_split_by_need_and_an_infeasible_total_names_chains_and_the_smallest_total():
    needs = {"features": (300, 1000), "head": (50, 100)}  # (smallest feasible, no-recompute peak)
    shares = split_by_need(700, needs)
    assert shares == {"features": 300 + 350 * 700 // 750, "head": 50 + 350 * 50 // 750}
    assert sum(shares.values()) <= 700
    assert split_by_need(2000, needs)["head"] >= 100  # enough for both: no chain recomputes
    with pytest.raises(
        InfeasibleTotal,
        match=r"smallest feasible budget .*\(350 bytes\) \(the total\) for chains "
        r"'features' \(>= 300 B\), 'head' \(>= 50 B\); use mem_limit >= 350",
    ):
        split_by_need(349, needs)


def test_wrap_keeps_parameters_and_keys_and_unwrap_restores():
    model = Net()
    before_keys = list(model.state_dict())
    params = list(model.parameters())
    original = model.net
    wrapped, _ = wrap(model, 0.5)
    assert isinstance(model.net, Checkpointable) and wrapped[0].original is original
    assert list(model.state_dict()) == before_keys
    assert all(a is b for a, b in zip(model.parameters(), params, strict=True))
    unwrap(model, wrapped)
    assert model.net is original and list(model.state_dict()) == before_keys


def test_registry_names_and_device_from_accelerator(tmp_path):
    t = quiet_trainer(tmp_path, "rotor")
    assert isinstance(t.strategy, RotorStrategy) and t.strategy.root_device == torch.device("cpu")
    spawn = pl.Trainer(strategy="rotor_ddp_spawn", accelerator="cpu", devices=2, logger=False)
    assert isinstance(spawn.strategy, RotorDDPStrategy) and spawn.strategy._start_method == "spawn"
    assert isinstance(pl.Trainer(strategy="rotor_ddp", accelerator="cpu", devices=2).strategy, RotorDDPStrategy)
    with pytest.raises(ValueError, match="rotor_ddp"):
        pl.Trainer(strategy=RotorStrategy(), accelerator="cpu", devices=2)


def test_bad_budget_is_one_line_error():
    with pytest.raises(BudgetError, match="cannot parse budget 'lots'") as err:
        RotorStrategy(mem_limit="lots")
    assert "\n" not in str(err.value)
    with pytest.raises(BudgetError):
        RotorStrategy(mem_limit={"net": -3})


@pytest.mark.parametrize("strategy", [RotorStrategy, RotorDDPStrategy])
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"offload": "fast"}, "offload='fast' is neither True/False nor a bandwidth"),
        ({"offload": "12GB"}, "accepted: a positive number of bytes per second"),
        ({"offload": 0}, "offload=0 is neither"),
        ({"host_limit": "2GiB"}, "host_limit='2GiB' bounds offloaded copies; give offload= too"),
        ({"offload": True, "host_limit": "50%"}, "host limit '50%' is a fraction"),
        ({"offload": "12GB/s", "host_limit": "lots"}, "cannot parse budget 'lots'"),
    ],
)
def test_bad_offload_arguments_fail_at_construction_in_one_line(strategy, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        strategy(mem_limit="50%", **kwargs)
    assert "\n" not in str(err.value)


def test_offload_arguments_are_kept_and_the_host_limit_is_the_whole_models():
    strategy = RotorStrategy(mem_limit="50%", offload="12 GB/s", host_limit="1GiB")
    assert (strategy.offload, strategy.host_limit) == ("12 GB/s", "1GiB")
    assert RotorDDPStrategy(offload=True).offload is True
    assert offload_settings(False, None, 3) == {}  # Checkpointable's own defaults: no offloading
    assert offload_settings("12GB/s", None, 2) == {"offload": "12GB/s", "host_limit": None}  # parsed again there
    assert offload_settings(True, "1GiB", 2) == {"offload": True, "host_limit": 2**29}  # two chains share it
    assert offload_settings(1.5e10, 3, 2) == {"offload": 1.5e10, "host_limit": 1}


# -- training equals plain training -------------------------------------------------------------------
@pytest.mark.parametrize(("precision", "accumulate"), [("32-true", 1), ("bf16-mixed", 1), ("32-true", 2)])
def test_same_losses_grads_and_buffers_as_plain_training(tmp_path, precision, accumulate):
    runs = {}
    for name, strategy in (("plain", "auto"), ("rotor", RotorStrategy(mem_limit=BUDGET))):
        model, keep = Net(), Keep()
        torch.manual_seed(7)
        quiet_trainer(
            tmp_path / name,
            strategy,
            precision=precision,
            accumulate_grad_batches=accumulate,
            max_steps=3,
            callbacks=[keep],
        ).fit(model, classes_loader())
        runs[name] = (model, keep)
    (plain, _), (rotor, keep) = runs["plain"], runs["rotor"]
    assert sum(r > 1 for r in keep.modules["net"].last_entry.runs) > 0  # the budget really forces recomputation
    assert isinstance(rotor.net, nn.Sequential) and not isinstance(rotor.net, Checkpointable)  # unwrapped
    assert len(rotor.losses) == 3 * accumulate
    torch.testing.assert_close(rotor.losses, plain.losses, rtol=0, atol=0)
    for step_a, step_b in zip(rotor.grads, plain.grads, strict=True):
        for a, b in zip(step_a, step_b, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    for (name, a), b in zip(rotor.state_dict().items(), plain.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)  # weights and BatchNorm statistics


def test_manual_optimization(tmp_path):
    runs = {}
    for name, strategy in (("plain", "auto"), ("rotor", RotorStrategy(mem_limit=BUDGET))):
        model = ManualNet()
        torch.manual_seed(7)
        quiet_trainer(tmp_path / name, strategy, max_steps=3).fit(model, classes_loader())
        runs[name] = model
    torch.testing.assert_close(runs["rotor"].losses, runs["plain"].losses, rtol=0, atol=0)
    for a, b in zip(runs["rotor"].parameters(), runs["plain"].parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_two_chains_share_a_fractional_budget(tmp_path):
    runs = {}
    keep = Keep()
    for name, strategy in (("plain", "auto"), ("rotor", RotorStrategy(mem_limit=BUDGET))):
        model = TwoChains()
        torch.manual_seed(7)
        quiet_trainer(tmp_path / name, strategy, max_steps=3, callbacks=[keep]).fit(model, classes_loader())
        runs[name] = model
    assert sorted(keep.modules) == ["net", "tail"]
    # one budget, the fraction of the chains' summed no-recomputation peaks, split by need
    total = resolve_budget(BUDGET, sum(no_recompute_peak(r.chain) for r in keep.modules.values()))
    assert sum(r.plan.budget for r in keep.modules.values()) <= total
    assert sum(r.plan.budget for r in keep.modules.values()) >= total - len(keep.modules)
    assert all(r.plan.budget >= min_feasible_budget(r.chain) for r in keep.modules.values())
    torch.testing.assert_close(runs["rotor"].losses, runs["plain"].losses, rtol=0, atol=0)
    for a, b in zip(runs["rotor"].parameters(), runs["plain"].parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# -- logging ------------------------------------------------------------------------------------------
def test_tensorboard_gets_rotor_scalars_curve_and_stage_table(tmp_path):
    logger = TensorBoardLogger(tmp_path, name="tb")
    keep = Keep()
    quiet_trainer(
        tmp_path,
        RotorStrategy(mem_limit=BUDGET),
        logger=logger,
        log_every_n_steps=1,
        max_steps=4,
        callbacks=[keep, RotorCallback(measure_every_n_steps=2)],
    ).fit(Net(), classes_loader())
    acc = events(logger.log_dir)
    scalars = acc.Tags()["scalars"]
    for tag in (
        "budget_bytes",
        "predicted_peak_bytes",
        "measured_peak_bytes",
        "recomputed_stages",
        "step_seconds",
        "step_overhead",
        "predicted_overhead",
        "no_recompute_seconds",
    ):
        assert f"rotor/{tag}" in scalars, tag
    assert len(acc.Scalars("rotor/budget_bytes")) == 4  # every step
    rotor = keep.modules["net"]
    limit = acc.Scalars("rotor/budget_bytes")[-1].value
    assert limit == rotor.plan.budget
    measured = acc.Scalars("rotor/measured_peak_bytes")[-1].value
    assert 0 < measured <= limit  # the budget held in the real step (exact tensor accounting)
    assert acc.Scalars("rotor/recomputed_stages")[-1].value == sum(r > 1 for r in rotor.last_entry.runs) > 0
    # the memory curve of one step: predicted after every op, measured where the executor marked it
    predicted = acc.Scalars("rotor/net/plan0/predicted_bytes")
    assert [e.step for e in predicted] == list(range(len(rotor.plan.ops)))
    assert max(e.value for e in predicted) <= limit
    assert len(acc.Scalars("rotor/net/plan0/measured_bytes")) >= len(rotor.plan.ops) - 1
    assert "rotor/net/memory_curve" in acc.Tags()["images"]
    table = acc.Tensors("rotor/net/stages/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "recompute" in table and "| stage |" in table


def test_callback_summary_printed(tmp_path, capsys):
    quiet_trainer(tmp_path, RotorStrategy(mem_limit=BUDGET), max_steps=2).fit(Net(), classes_loader())
    out = capsys.readouterr().out
    assert "rotor plan" in out and "predicted peak" in out


def test_automatic_budget_on_cpu_says_its_bytes_and_that_nothing_is_recomputed(tmp_path, capsys):
    keep = KeepRotorModules()
    quiet_trainer(tmp_path, "rotor", max_steps=2, callbacks=[keep]).fit(Net(), classes_loader())
    out = capsys.readouterr().out
    rotor = keep.modules["net"]
    chosen = rotor.plan.budget
    assert chosen == no_recompute_peak(rotor.chain) and rotor.plan.recomputed_stages == 0
    line = next(line for line in out.splitlines() if line.startswith("net: automatic budget"))
    assert f"({chosen} bytes)" in line and "no device memory limit on cpu" in line
    assert line.endswith("nothing is recomputed")


def test_nothing_to_wrap_warns_once_and_trains(tmp_path):
    model = Flat()
    before = [p.detach().clone() for p in model.parameters()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_trainer(tmp_path, RotorStrategy(mem_limit="1MiB"), max_steps=2).fit(model, classes_loader())
    messages = [str(w.message) for w in caught if "nothing to checkpoint" in str(w.message)]
    assert len(messages) == 1 and "no nn.Sequential" in messages[0]
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_chain_never_run_in_training_warns(tmp_path):
    class Unused(Flat):
        def __init__(self):
            super().__init__()
            self.spare = nn.Sequential(nn.Linear(2, 2), nn.ReLU())  # wrappable, but training_step never calls it

    with pytest.warns(UserWarning, match="did not run in the training forward"):
        quiet_trainer(tmp_path, RotorStrategy(mem_limit="1MiB"), max_steps=2).fit(Unused(), classes_loader())


# -- checkpoints --------------------------------------------------------------------------------------
def test_checkpoint_carries_chains_resume_skips_profiling_and_cross_loads(tmp_path):
    quiet_trainer(
        tmp_path / "b", RotorStrategy(mem_limit=BUDGET), max_steps=2, callbacks=[SaveAtEnd(tmp_path / "mid.ckpt")]
    ).fit(Net(), classes_loader())
    ckpt = torch.load(tmp_path / "mid.ckpt", weights_only=True)
    saved = ckpt["rotor"]["modules"]["net"]
    assert saved["entries"] and saved["entries"][0]["plan"]["ops"]
    plain_keys = set(Net().state_dict())
    assert set(ckpt["state_dict"]) == plain_keys  # same keys as a model without rotor

    # resume with rotor: the chain comes from the checkpoint, nothing is profiled
    keep = Keep()
    resumed = Net()
    quiet_trainer(tmp_path / "c", RotorStrategy(mem_limit=BUDGET), max_steps=4, callbacks=[keep]).fit(
        resumed, classes_loader(), ckpt_path=tmp_path / "mid.ckpt"
    )
    rotor = keep.modules["net"]
    assert len(keep.entries_at_start["net"]) == 1  # restored before the first batch
    assert [id(e) for e in rotor.entries.values()] == keep.entries_at_start["net"]  # and never profiled again
    assert len(resumed.losses) == 2  # steps 3 and 4 only

    # into a Trainer without rotor
    plain = Net()
    quiet_trainer(tmp_path / "d", max_steps=4).fit(plain, classes_loader(), ckpt_path=tmp_path / "mid.ckpt")
    assert len(plain.losses) == 2
    torch.testing.assert_close(plain.losses, resumed.losses, rtol=0, atol=0)

    # a checkpoint made without rotor resumes under rotor
    quiet_trainer(tmp_path / "e", max_steps=2, callbacks=[SaveAtEnd(tmp_path / "plain.ckpt")]).fit(
        Net(), classes_loader()
    )
    assert "rotor" not in torch.load(tmp_path / "plain.ckpt", weights_only=True)
    again = Net()
    quiet_trainer(tmp_path / "f", RotorStrategy(mem_limit=BUDGET), max_steps=4).fit(
        again, classes_loader(), ckpt_path=tmp_path / "plain.ckpt"
    )
    torch.testing.assert_close(again.losses, resumed.losses, rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_accelerator_puts_rotor_on_cuda(tmp_path):
    keep = Keep()
    # 100%: on an H200 this tiny net's smallest feasible budget was its whole no-recompute peak (32 MiB: likely
    # the first matmul's cuBLAS workspace, measured inside a stage), so 70% was refused (docs/benchmarks.md)
    strategy = RotorStrategy(mem_limit="100%")
    runs = {}
    for name, chosen in (("plain", "auto"), ("rotor", strategy)):
        model = Net()
        torch.manual_seed(7)
        quiet_trainer(tmp_path, chosen, accelerator="gpu", callbacks=[keep]).fit(model, classes_loader())
        runs[name] = model
    assert strategy.root_device.type == "cuda"
    assert next(iter(keep.modules["net"].entries.values())).runner.token_device.type == "cuda"
    torch.testing.assert_close(runs["rotor"].losses, runs["plain"].losses)


class Slow(nn.Module):
    """A stage slow enough that profiling the first batch takes over a second."""

    def forward(self, x):
        import time

        time.sleep(0.35)
        return x * 1.0


class SlowNet(Net):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, 16), Slow(), nn.Tanh(), nn.Linear(16, 5))


def test_slow_profiling_shows_progress(tmp_path, caplog):
    import logging

    with caplog.at_level(logging.INFO):
        quiet_trainer(tmp_path, RotorStrategy(mem_limit=1.0), max_steps=1).fit(SlowNet(), classes_loader())
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("rotor: profiling net:")]
    assert lines, [r.getMessage() for r in caplog.records]
    assert lines[-1].startswith("rotor: profiling net: 4/4 stages, ") and lines[-1].endswith(" s")
    assert float(lines[-1].split(", ")[1][:-2]) >= 1.0


def test_fast_profiling_prints_no_progress(caplog):
    """A profile under a second prints nothing; past it one line a second and always the last (the times given, not
    taken: a loaded machine makes any real profile slow, as `test_slow_profiling_shows_progress` makes one)."""
    import logging

    from lightning_rotor.lightning.strategy import ProfileProgress

    progress = ProfileProgress("net")
    with caplog.at_level(logging.INFO):
        for done, seconds in [(1, 0.1), (6, 0.5), (11, 0.9)]:
            progress(done, 11, seconds)
        assert not [r for r in caplog.records if "rotor: profiling net:" in r.getMessage()]
        for done, seconds in [(1, 0.2), (4, 1.1), (5, 1.5), (8, 2.2), (11, 2.4)]:
            progress(done, 11, seconds)
    lines = [r.getMessage() for r in caplog.records if "rotor: profiling net:" in r.getMessage()]
    assert lines == [
        "rotor: profiling net: 4/11 stages, 1.1 s",
        "rotor: profiling net: 8/11 stages, 2.2 s",
        "rotor: profiling net: 11/11 stages, 2.4 s",
    ]


@pytest.mark.parametrize(
    "state",
    [
        None,
        5,
        {"version": 1, "modules": 5},
        {"version": 1, "modules": {"net": "garbage"}},
        {"version": 1, "modules": {"net": {"stages": 7}}},
        {"version": 1, "modules": {"net": {"stages": ["0", "1"], "entries": 5}}},
        {"version": 1, "modules": {"net": {"stages": ["0", "1"], "entries": [{"chain": 3}]}}},
        {
            "version": 1,
            "modules": {
                "net": {"stages": ["0", "1"], "stage_names": ["0", "1"], "fingerprints": [1, 2], "entries": [5]}
            },
        },
    ],
)
def test_malformed_plan_states_are_reported_not_raised(state):
    from lightning_rotor.lightning.state import import_state

    model = nn.Module()
    model.net = Checkpointable(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), 0.5)
    restored, problems = import_state(model, state)
    assert restored == [] and len(problems) == 1 and "\n" not in problems[0]
    assert model.net.entries == {}
