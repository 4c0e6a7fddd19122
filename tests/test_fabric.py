"""RotorFabricStrategy in real Lightning Fabric loops (CPU, a small nanoGPT-style model, a few steps)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.fabric.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

from lightning_rotor.bench.any_models import GPT
from lightning_rotor.budget import BudgetError
from lightning_rotor.checkpointable import Checkpointable
from lightning_rotor.fabric import RotorFabricStrategy
from lightning_rotor.lightning import RotorStrategy
from lightning_rotor.memory import MemoryProbe
from lightning_rotor.planner import min_feasible_budget

torch.set_num_threads(1)


def batches(steps: int = 3, n: int = 8, t: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    data = torch.randint(64, (steps, n, t + 1), generator=g)
    return [(d[:, :-1], d[:, 1:]) for d in data]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def run(strategy, steps: int = 3, **fabric_kw):
    """A plain Fabric loop (setup, forward, fabric.backward, step): the model and each step's gradients."""
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=1, **fabric_kw)
    fabric.seed_everything(0, verbose=False)
    model = GPT(n_layer=4, n_embd=32, block_size=16)  # dropout 0.1: recomputed stages must replay it
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = fabric.setup(model, opt)
    grads = []
    for i, (x, y) in enumerate(batches(steps)):
        x, y = fabric.to_device((x, y))
        opt.zero_grad()
        fabric.backward(lm_loss(model(x), y))
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        if isinstance(fabric.strategy, RotorFabricStrategy):
            fabric.log_dict(fabric.strategy.metrics, step=i)
    return fabric, model, grads


def test_rotor_name_and_instance_give_the_strategy_on_one_device():
    assert isinstance(Fabric(strategy="rotor", accelerator="cpu", devices=1).strategy, RotorFabricStrategy)
    strategy = Fabric(strategy=RotorFabricStrategy(mem_limit="50%"), accelerator="cpu", devices=1).strategy
    assert strategy.mem_limit == "50%" and strategy.root_device == torch.device("cpu")


def test_the_name_registered_on_import_builds_the_strategy():
    """`import lightning_rotor` registers a factory (tests/test_imports.py: in any import order); it builds ours."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    from lightning_rotor import _autoregister

    saved = STRATEGY_REGISTRY.pop("rotor")
    try:
        _autoregister._register_fabric()
        assert STRATEGY_REGISTRY["rotor"]["strategy"] is _autoregister._fabric_rotor
        assert isinstance(Fabric(strategy="rotor", accelerator="cpu", devices=1).strategy, RotorFabricStrategy)
    finally:
        STRATEGY_REGISTRY["rotor"] = saved


def test_bad_input_is_one_line():
    with pytest.raises(BudgetError, match="cannot parse budget 'lots'") as err:
        RotorFabricStrategy(mem_limit="lots")
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="discover='x' is not a discovery method"):
        RotorFabricStrategy(discover="x")
    with pytest.raises(ValueError, match="runs on one device but Fabric asks for 2; use devices=1") as err:
        Fabric(strategy="rotor", accelerator="cpu", devices=2)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_fabric_loop_equals_plain_fabric_within_budget(tmp_path, capsys, precision):
    logger = TensorBoardLogger(tmp_path, name="tb")
    _, _, plain = run("auto", precision=precision)
    strategy = RotorFabricStrategy(mem_limit="50%", measure_every_n_steps=0)
    fabric, model, got = run(strategy, loggers=logger, precision=precision)
    rotor = strategy.chains["model"]
    assert isinstance(model.module, GPT) and model._forward_module is rotor  # the whole model is the chain
    assert rotor.discovery.kind == "graph" and sum(r > 1 for r in rotor.last_entry.runs) > 0  # recomputes
    for step_a, step_b in zip(got, plain, strict=True):  # every step's gradients, bitwise
        assert len(step_a) == len(step_b) and all(torch.equal(a, b) for a, b in zip(step_a, step_b, strict=True))

    # the step's activation peak: sampled by the strategy at step 2, and measured here at step 4
    limit = rotor.plan.budget
    assert strategy.metrics["rotor/budget_bytes"] == limit
    assert 0 < strategy.metrics["rotor/measured_peak_bytes"] <= limit
    x, y = batches(4)[-1]
    with MemoryProbe([model]) as probe:
        fabric.backward(lm_loss(model(x), y))
    assert 0 < probe.peak <= limit

    assert "rotor plan" in capsys.readouterr().out  # the plan table, once
    logger.finalize("success")
    acc = EventAccumulator(str(logger.log_dir))
    acc.Reload()
    for tag in (
        "budget_bytes",
        "predicted_peak_bytes",
        "measured_peak_bytes",
        "recomputed_stages",
        "no_recompute_seconds",
        "predicted_overhead",
        "step_seconds",
        "step_overhead",
    ):
        assert f"rotor/{tag}" in acc.Tags()["scalars"], tag
    assert [e.value for e in acc.Scalars("rotor/budget_bytes")] == [limit] * 3


class TwoParts(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.body(x))


def test_include_names_submodules_of_the_set_up_module():
    fabric = Fabric(strategy=RotorFabricStrategy(mem_limit="90%", include=["body"]), accelerator="cpu", devices=1)
    model = fabric.setup(TwoParts())
    assert isinstance(model.body, Checkpointable) and list(fabric.strategy.chains) == ["body"]
    fabric.backward(model(torch.randn(8, 16)).sum())
    assert fabric.strategy.metrics["rotor/budget_bytes"] == model.body.plan.budget


def test_two_modules_set_up_apart_are_two_chains():
    fabric = Fabric(strategy=RotorFabricStrategy(mem_limit="80%"), accelerator="cpu", devices=1)
    torch.manual_seed(0)
    g = fabric.setup(nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4))))
    d = fabric.setup(nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(4))))
    assert list(fabric.strategy.chains) == ["model", "model_2"]
    fabric.backward(d(g(torch.randn(8, 16))).sum())
    limits = [r.plan.budget for r in fabric.strategy.chains.values()]
    assert fabric.strategy.metrics["rotor/budget_bytes"] == sum(limits)


def test_a_kept_output_above_the_budget_is_warned_about_once():
    fabric = Fabric(strategy=RotorFabricStrategy(measure_every_n_steps=1), accelerator="cpu", devices=1)
    torch.manual_seed(0)
    model = fabric.setup(GPT(n_layer=4, n_embd=32, block_size=16))
    with pytest.warns(UserWarning, match="keeps the model's output alive") as record:
        for i, (x, y) in enumerate(batches(4)):
            logits = model(x)  # kept through the backward: the plan does not expect it
            fabric.backward(lm_loss(logits, y))
            if i == 0:  # the smallest budget leaves no room for the logits
                rotor = fabric.strategy.chains["model"]
                rotor.replan(min_feasible_budget(rotor.chain))
    assert sum("is above the budget" in str(w.message) for w in record) == 1  # once per plan
    assert fabric.strategy.metrics["rotor/measured_peak_bytes"] > rotor.plan.budget


def test_compile_and_shape_buckets_reach_the_chain_as_with_the_trainer():
    """`compile=` compiles each stage and `shape_buckets=` serves two lengths from one plan, as on
    `RotorStrategy`; bad values fail at construction, in one line."""
    from lightning_rotor.compile import CompiledStage

    with pytest.raises(TypeError, match="compile= takes True, False or a dict"):
        RotorFabricStrategy(compile="yes")
    strategy = RotorFabricStrategy(
        mem_limit="60%", compile={"backend": "aot_eager"}, shape_buckets={1: [16]}, measure_every_n_steps=0
    )
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=1)
    fabric.seed_everything(0, verbose=False)
    model, opt = fabric.setup(*_model_and_optimizer())
    for x, y in batches(1, t=16) + batches(1, t=12):  # the longest first, then a shorter batch
        opt.zero_grad()
        fabric.backward(lm_loss(model(x), y))
        opt.step()
    rotor = strategy.chains["model"]
    assert rotor.shape_buckets == {1: (16,)} and all(isinstance(s, CompiledStage) for s in rotor.stages)
    assert len(rotor.entries) == 1  # the shorter batch ran under the bucket's plan
    assert RotorFabricStrategy(options=True).options is True  # per-stage options reach wrap() as on RotorStrategy
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def _model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = GPT(n_layer=2, n_embd=32, block_size=16)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def test_the_probe_samples_each_schedule_once_not_each_shape():
    """Lengths that share a schedule share one sampled step (as RotorCallback does): changing shapes
    do not each run under the probe. At 100% of each shape's own peak every length plans the same
    schedule whatever the profiled times, so which steps are sampled does not depend on timing."""
    from lightning_rotor.lightning.callback import schedule_key

    strategy = RotorFabricStrategy(mem_limit="100%", measure_every_n_steps=0)
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=1)
    fabric.seed_everything(0, verbose=False)
    model, opt = fabric.setup(*_model_and_optimizer())
    for t in (16, 12, 14, 10, 16, 12, 14, 10):
        ((x, y),) = batches(1, t=t)
        opt.zero_grad()
        fabric.backward(lm_loss(model(x), y))
        opt.step()
    rotor = strategy.chains["model"]
    schedules = {schedule_key(e) for e in rotor.entries.values()}
    assert len(rotor.entries) == 4 and len(schedules) == 1  # four shapes, one schedule
    assert strategy.sampler.measured_once == schedules
    # step 2 is probed but profiles a new shape (no clean sample); as RotorCallback, the next try waits for a
    # step of known shapes (step 6, after step 5 ran one), not one after each new shape: steps 7 and 8 ran without
    assert strategy.sampler.since == dict.fromkeys(schedules, 2)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"offload": "fast"}, "offload='fast' is neither True/False nor a bandwidth"),
        ({"host_limit": "2GiB"}, "host_limit='2GiB' bounds offloaded copies; give offload= too"),
        ({"offload": "12GB/s", "host_limit": 0.5}, "host limit 0.5 is a fraction"),
    ],
)
def test_bad_offload_arguments_fail_as_on_the_trainer(kwargs, message):
    """One check for both strategies and Checkpointable: the same one-line errors as RotorStrategy's."""
    with pytest.raises(ValueError, match=re.escape(message)) as fabric_err:
        RotorFabricStrategy(mem_limit="50%", **kwargs)
    with pytest.raises(ValueError) as trainer_err:
        RotorStrategy(mem_limit="50%", **kwargs)
    assert str(fabric_err.value) == str(trainer_err.value) and "\n" not in str(fabric_err.value)
    kept = RotorFabricStrategy(offload="500MiB/s", host_limit="1GiB")
    assert (kept.offload, kept.host_limit) == ("500MiB/s", "1GiB")


@pytest.mark.parametrize("bad", [-1, True, "5", 2.0])
def test_a_bad_measure_every_n_steps_is_refused_in_one_line_by_the_callback_and_the_fabric_strategy(bad):
    from lightning_rotor.fabric import RotorFabricStrategy
    from lightning_rotor.lightning.callback import RotorCallback

    for make in (RotorCallback, RotorFabricStrategy):
        with pytest.raises(ValueError, match=r"^measure_every_n_steps must be an integer >= 0, got "):
            make(measure_every_n_steps=bad)
