"""Unusual but legal PyTorch use around a rotor module (copies, threads, autograd variants, resumes), by the
promise each test checks: bad input refused in one clear line; gradients bitwise equal to plain training; the
module standing in for the Sequential it wraps."""

from __future__ import annotations

import copy
import gc
import io
import pickle
import sys
import threading
import time

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from fitting import SaveAtEnd, quiet_trainer
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, TensorDataset
from training import grads

from lightning_rotor.checkpointable import Checkpointable
from lightning_rotor.lightning import RotorStrategy


# -- models, data and one plain step, shared by the sections below -------------------------------------------
def dropout_net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        *[m for _ in range(5) for m in (nn.Linear(24, 24), nn.Tanh(), nn.Dropout(0.2))], nn.Linear(24, 4)
    )


def tanh_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(5) for m in (nn.Linear(24, 24), nn.Tanh())], nn.Linear(24, 4))


def wide_net(width: int) -> nn.Sequential:
    torch.manual_seed(0)
    hidden = [m for _ in range(4) for m in (nn.Linear(width, width), nn.Tanh())]
    return nn.Sequential(nn.Linear(24, width), nn.Tanh(), *hidden, nn.Linear(width, 4))


def data(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(16, 24, generator=g), torch.randint(0, 4, (16,), generator=g)


def step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    return loss.detach()


class LitNet(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = dropout_net()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class WideLit(LitNet):
    def __init__(self, width: int):
        super().__init__()
        self.net = wide_net(width)


def lit_loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(
        TensorDataset(torch.randn(48, 24, generator=g), torch.randint(0, 4, (48,), generator=g)), batch_size=16
    )


# == promise: bad input is refused in one clear line, before anything is half done ===========================
# -- autograd calls rotor cannot serve while its plan recomputes ---------------------------------------------
AUTOGRAD_CALLS = {
    "grad of params": lambda loss, model, x: torch.autograd.grad(loss, list(model.parameters())),
    "grad of params, allow_unused": lambda loss, model, x: torch.autograd.grad(
        loss, list(model.parameters()), allow_unused=True
    ),
    "grad of input": lambda loss, model, x: torch.autograd.grad(loss, x),
    "backward(inputs=)": lambda loss, model, x: loss.backward(inputs=[model[0].weight]),
    "create_graph": lambda loss, model, x: torch.autograd.grad(loss, x, create_graph=True)[0].sum().backward(),
    "retain_graph twice": lambda loss, model, x: (loss.backward(retain_graph=True), loss.backward()),
}


@pytest.mark.parametrize("name", list(AUTOGRAD_CALLS))
def test_autograd_variants_are_refused_with_one_clear_error_when_the_plan_recomputes(name):
    rotor = Checkpointable(tanh_net(), 0.75)
    x, y = data()
    step(rotor, x, y)
    assert rotor.plan.recomputed_stages > 0
    rotor.zero_grad(set_to_none=True)
    xr = x.clone().requires_grad_(True)
    loss = F.cross_entropy(rotor(xr), y)
    match = "once per forward" if name == "retain_graph twice" else "not supported while the plan recomputes"
    with pytest.raises(RuntimeError, match=match) as err:
        AUTOGRAD_CALLS[name](loss, rotor, xr)
    assert "\n" not in str(err.value)
    if name != "retain_graph twice":  # refused before any gradient was written
        assert all(p.grad is None for p in rotor.parameters()) and xr.grad is None


# -- nothing to run the chain on -----------------------------------------------------------------------------
def test_no_input_is_one_clear_error():
    with pytest.raises(TypeError, match="needs the chain input"):
        Checkpointable(tanh_net(), 0.75)()


# -- saved plans: only this chain's plan is loaded; another one is refused, or profiled again with a warning
def test_plan_of_another_model_with_the_same_stage_names_is_refused():
    x, y = data()
    small = Checkpointable(wide_net(16), 0.75)
    step(small, x, y)
    state = small.plan_state()
    big = Checkpointable(wide_net(256), 0.9)
    assert big.stage_names == small.stage_names
    with pytest.raises(ValueError, match="differ in module types or parameter/buffer shapes") as err:
        big.load_plan_state(state)
    assert "\n" not in str(err.value)
    assert big.entries == {} and big.budget is None  # nothing forced in: the next forward profiles
    with big.measure_step() as m:
        step(big, x, y)
    assert m.peak <= big.plan.budget
    twin = Checkpointable(wide_net(16), 0.75)  # the same chain loads
    twin.load_plan_state(state)
    assert twin.entries.keys() == small.entries.keys() and twin.budget == small.budget


def test_plan_state_without_fingerprints_is_not_loaded():
    x, y = data()
    rotor = Checkpointable(wide_net(16), 0.75)
    step(rotor, x, y)
    state = rotor.plan_state()
    del state["fingerprints"]
    fresh = Checkpointable(wide_net(16), 0.75)
    with pytest.raises(ValueError, match="no stage fingerprints"):
        fresh.load_plan_state(state)
    assert fresh.entries == {}


def test_checkpoint_of_another_model_is_profiled_again_with_a_warning(tmp_path):
    quiet_trainer(
        tmp_path / "a", strategy=RotorStrategy(mem_limit=0.75), callbacks=[SaveAtEnd(tmp_path / "small.ckpt")]
    ).fit(WideLit(16), lit_loader())
    big = WideLit(256)
    ckpt = torch.load(tmp_path / "small.ckpt", weights_only=True)
    ckpt["state_dict"] = big.state_dict()  # the weights fit; only the rotor state is the small model's
    torch.save(ckpt, tmp_path / "mixed.ckpt")
    with pytest.warns(UserWarning, match="saved plan state not used .*differ.*profiled again"):
        quiet_trainer(tmp_path / "b", strategy=RotorStrategy(mem_limit=0.9), max_steps=4).fit(
            big, lit_loader(), ckpt_path=tmp_path / "mixed.ckpt"
        )


# -- budgets: a resume refuses an infeasible budget as a fresh run does --------------------------------------
def test_resume_with_an_infeasible_budget_fails_as_a_fresh_run_does(tmp_path):
    from lightning_rotor.planner import InfeasibleBudget

    quiet_trainer(
        tmp_path / "a",
        strategy=RotorStrategy(mem_limit=0.75),
        max_steps=2,
        callbacks=[SaveAtEnd(tmp_path / "mid.ckpt")],
    ).fit(LitNet(), lit_loader())
    with pytest.raises(InfeasibleBudget) as fresh:
        quiet_trainer(tmp_path / "b", strategy=RotorStrategy(mem_limit="1KiB"), max_steps=4).fit(LitNet(), lit_loader())
    resumed_model = LitNet()
    with pytest.raises(InfeasibleBudget) as resumed:
        quiet_trainer(tmp_path / "c", strategy=RotorStrategy(mem_limit="1KiB"), max_steps=4).fit(
            resumed_model, lit_loader(), ckpt_path=tmp_path / "mid.ckpt"
        )
    assert resumed.value.min_feasible == fresh.value.min_feasible
    assert resumed.value.budget == fresh.value.budget == 1024


# == promise: gradients bitwise equal to plain training ======================================================
# -- through copies of a measured module (deepcopy, pickle, torch.save; mid-step; from a callback) -----------
def raw_handles(root: object) -> list[str]:
    """Storage weak references or dispatch modes reachable from `root` (the object graph, not tensors' data)."""
    found, seen, todo = [], set(), [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (torch.Tensor, type)):
            continue
        seen.add(id(obj))
        if isinstance(obj, (StorageWeakRef, TorchDispatchMode)):
            found.append(type(obj).__name__)
        todo.extend(gc.get_referents(obj))
    return found


def measured_rotor() -> tuple[Checkpointable, torch.Tensor, torch.Tensor]:
    rotor = Checkpointable(dropout_net(), 0.5)
    x, y = data()
    with rotor.measure_step() as m:
        step(rotor, x, y)
    assert m.peak > 0 and rotor.plan.recomputed_stages > 0
    return rotor, x, y


def test_measured_module_holds_no_storage_handles():
    rotor, _, _ = measured_rotor()
    assert raw_handles(rotor) == []
    assert rotor.last_measurement.peak > 0 and rotor.last_measurement.curve  # the figures stay


def _save_load(module: nn.Module) -> nn.Module:
    buf = io.BytesIO()
    torch.save(module, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_copy_after_a_measured_step_trains_bitwise_like_the_original(how):
    rotor, x, y = measured_rotor()
    copier = {"deepcopy": copy.deepcopy, "pickle": lambda m: pickle.loads(pickle.dumps(m)), "torch.save": _save_load}[
        how
    ]
    twin = copier(rotor)
    assert twin.entries.keys() == rotor.entries.keys()  # the plan travels with the copy
    for _ in range(2):
        torch.manual_seed(5)
        loss_a = step(rotor, x, y)
        torch.manual_seed(5)
        loss_b = step(twin, x, y)
        assert torch.equal(loss_a, loss_b)
        for a, b in zip(grads(rotor), grads(twin), strict=True):
            assert torch.equal(a, b)
    # the copy trains its own parameters, not the original's
    assert all(p.grad is not None for p in twin.parameters())
    assert not any(a is b for a, b in zip(rotor.parameters(), twin.parameters(), strict=True))
    del twin
    gc.collect()


def test_copy_while_a_step_is_measured():
    rotor = Checkpointable(dropout_net(), 0.5)
    x, y = data()
    step(rotor, x, y)  # plans
    with rotor.measure_step():
        loss = F.cross_entropy(rotor(x), y)
        twin = copy.deepcopy(rotor)
        loss.backward()
    assert twin._measurement is None and raw_handles(twin) == []
    step(twin, x, y)
    assert all(p.grad is not None for p in twin.parameters())


class DeepCopies(pl.Callback):
    """EMA/teacher style: deep-copies the LightningModule at several points of every step."""

    def __init__(self):
        self.copies = 0

    def _copy(self, pl_module):
        twin = copy.deepcopy(pl_module)
        twin.net(torch.randn(4, 24)).sum().backward()
        self.copies += 1

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._copy(pl_module)

    def on_before_backward(self, trainer, pl_module, loss):
        self._copy(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._copy(pl_module)


def test_callback_deep_copying_the_module_during_fit(tmp_path):
    copies = DeepCopies()
    quiet_trainer(tmp_path, strategy=RotorStrategy(mem_limit=0.75), callbacks=[copies]).fit(LitNet(), lit_loader())
    assert copies.copies == 9


# -- through autograd calls other than loss.backward(), when nothing is recomputed ---------------------------
def _autograd_result(model: nn.Module, x: torch.Tensor, y: torch.Tensor, call) -> list:
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    out = call(F.cross_entropy(model(x), y), model, x)
    returned = [t for t in (out if isinstance(out, tuple) else ()) if isinstance(t, torch.Tensor) or t is None]
    return returned + [p.grad for p in model.parameters()] + [x.grad]


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        (u is None and v is None) or (u is not None and v is not None and torch.equal(u, v))
        for u, v in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("name", list(AUTOGRAD_CALLS))
def test_autograd_variants_behave_as_plain_when_nothing_is_recomputed(name):
    plain, rotor = tanh_net(), Checkpointable(tanh_net(), 1.0)
    x, y = data()
    step(rotor, x, y)
    assert rotor.plan.recomputed_stages == 0
    assert _same(
        _autograd_result(plain, x, y, AUTOGRAD_CALLS[name]), _autograd_result(rotor, x, y, AUTOGRAD_CALLS[name])
    )


def test_backward_of_a_loss_not_through_the_chain_is_untouched():
    """backward(inputs=...) of parameters outside the chain never reaches rotor: plain behaviour."""
    rotor, head = Checkpointable(tanh_net(), 0.75), nn.Linear(4, 4)
    x, y = data()
    step(rotor, x, y)
    rotor.zero_grad(set_to_none=True)
    loss = F.cross_entropy(head(rotor(x)), y)
    loss.backward(inputs=[head.weight])
    assert head.weight.grad is not None and head.bias.grad is None
    assert all(p.grad is None for p in rotor.parameters())


def test_post_accumulate_grad_hooks_run_once_per_backward_as_in_plain_training():
    rotor = Checkpointable(tanh_net(), 0.75)
    x, y = data()
    step(rotor, x, y)
    assert rotor.plan.recomputed_stages > 0
    seen: list[tuple[int, bool]] = []
    for i, p in enumerate(rotor.parameters()):
        p.register_post_accumulate_grad_hook(lambda q, i=i: seen.append((i, q.grad is not None)))
    step(rotor, x, y)
    n = len(list(rotor.parameters()))
    assert sorted(seen) == [(i, True) for i in range(n)]


# -- with several inputs, at every budget --------------------------------------------------------------------
class Pair(nn.Module):
    """A first stage taking two tensors, as one tuple (an nn.Sequential passes one value along)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(24, 24), nn.Linear(24, 24)

    def forward(self, pair):
        a, b = pair
        return torch.tanh(self.a(a) + self.b(b))


def pair_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Pair(), *[m for _ in range(5) for m in (nn.Linear(24, 24), nn.Tanh())], nn.Linear(24, 4))


@pytest.mark.parametrize("budget", [None, 1.0, 0.75])
def test_several_inputs_reach_the_first_stage_as_one_tuple_at_every_budget(budget):
    plain = pair_net()
    rotor = Checkpointable(pair_net(), budget)
    g = torch.Generator().manual_seed(3)
    a, b, y = torch.randn(16, 24, generator=g), torch.randn(16, 24, generator=g), torch.randint(0, 4, (16,))
    losses = []
    for model in (plain, rotor):
        model.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model((a, b)) if model is plain else model(a, b), y)
        loss.backward()
        losses.append(loss.detach())
    assert (rotor.plan.recomputed_stages > 0) == (budget == 0.75)
    assert torch.equal(*losses)
    for p, q in zip(plain.parameters(), rotor.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    rotor.eval()
    with torch.no_grad():
        assert torch.equal(rotor(a, b), plain((a, b)))


# -- with random numbers: replays draw their first run's numbers, across threads; the generator is never rewound
class FixedDropout(nn.Module):
    """Dropout with given masks, computed as nn.Dropout computes it on CPU (input * mask / (1 - p))."""

    def __init__(self, p: float, masks: list[torch.Tensor]):
        super().__init__()
        self.p, self.masks = p, iter(masks)

    def forward(self, x):
        return x * next(self.masks).to(x.dtype).div_(1 - self.p)


def dropout_calls(model: nn.Module) -> dict[nn.Module, list[torch.Tensor]]:
    """Every output of every nn.Dropout of `model`, in call order (first run, then recomputations)."""
    calls: dict[nn.Module, list[torch.Tensor]] = {}
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            calls[m] = []
            m.register_forward_hook(lambda mod, inp, out: calls[mod].append(out.detach().clone()))
    return calls


def train_recording(seed: int, steps: int, results: dict, start: threading.Barrier) -> None:
    """Rotor training at a recomputing budget; per step the weights before it, the first-run masks, the grads."""
    rotor = Checkpointable(dropout_net(seed), 0.4)
    x, y = data(seed)
    step(rotor, x, y)  # profiles and plans
    assert rotor.plan.recomputed_stages > 0
    opt = torch.optim.SGD(rotor.parameters(), lr=0.1)
    calls = dropout_calls(rotor)
    record = []
    start.wait()
    for _ in range(steps):
        weights = copy.deepcopy(rotor.module.state_dict())
        for c in calls.values():
            c.clear()
        step(rotor, x, y)
        replays_equal = all(torch.equal(c[0], later) for c in calls.values() for later in c[1:])
        recomputed = sum(len(c) > 1 for c in calls.values())
        masks = [c[0] != 0 for c in calls.values()]
        record.append((weights, masks, grads(rotor), replays_equal, recomputed))
        opt.step()
    results[seed] = record


def expected_grads(seed: int, weights: dict, masks: list[torch.Tensor]) -> list[torch.Tensor]:
    """The plain model's gradients with the given dropout masks."""
    model = dropout_net(seed)
    model.load_state_dict(weights)
    it = iter(masks)
    for i, m in enumerate(model):
        if isinstance(m, nn.Dropout):
            model[i] = FixedDropout(m.p, [next(it)])
    step(model, *data(seed))
    return grads(model)


@pytest.fixture
def often_switching_threads():
    """Switch threads every 10 µs instead of 5 ms, so that the steps of two threads interleave finely."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(before)


def test_two_threads_training_concurrently_replay_their_own_random_numbers(often_switching_threads):
    results: dict = {}
    start = threading.Barrier(2)
    threads = [threading.Thread(target=train_recording, args=(seed, 20, results, start)) for seed in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [0, 1]  # both threads finished without an error
    for seed, record in results.items():
        for weights, masks, got, replays_equal, recomputed in record:
            assert recomputed > 0 and replays_equal
            for a, b in zip(expected_grads(seed, weights, masks), got, strict=True):
                assert torch.equal(a, b)


def test_a_thread_drawing_random_numbers_during_training_sees_no_repeats():
    drawn: list[torch.Tensor] = []
    done = threading.Event()

    start = threading.Barrier(2)  # drawing starts after the first step: profiling forks the generator (documented)

    def draw():
        start.wait()
        while not done.is_set():
            drawn.append(torch.rand(64, dtype=torch.float64))
            time.sleep(1e-4)

    results: dict = {}
    drawer = threading.Thread(target=draw)
    trainer = threading.Thread(target=train_recording, args=(0, 12, results, start))
    drawer.start()
    trainer.start()
    trainer.join()
    done.set()
    drawer.join()
    assert 0 in results and len(drawn) > 10
    values = torch.cat(drawn)
    assert values.unique().numel() == values.numel()  # 53-bit doubles: a repeat means a rewound generator
    # and the busy thread did not shift the dropout masks (bernoulli_ fills a tensor: exact whatever others draw)
    for weights, masks, got, replays_equal, recomputed in results[0]:
        assert recomputed > 0 and replays_equal
        for a, b in zip(expected_grads(0, weights, masks), got, strict=True):
            assert torch.equal(a, b)


class SometimesDropout(nn.Module):
    """Draws random numbers only when `active` (control flow that changes between steps)."""

    active = False

    def forward(self, x):
        return F.dropout(x, 0.5, True) if SometimesDropout.active else x


def test_a_stage_that_starts_drawing_later_is_still_replayed_exactly():
    """Quiet stages (no random number in their recorded first run) run with no mode; when they start drawing,
    that step replays them from the generator states before their first run, and they are recorded again."""
    torch.manual_seed(0)
    layers = [m for _ in range(5) for m in (nn.Linear(24, 24), nn.Tanh(), SometimesDropout())]
    plain = nn.Sequential(*layers, nn.Linear(24, 4))
    rotor = Checkpointable(copy.deepcopy(plain), 0.75)
    x, y = data()
    quiet = []
    try:
        for active in (False, False, True, True, False, False):
            SometimesDropout.active = active
            for model in (plain, rotor):
                torch.manual_seed(11)
                step(model, x, y)
            for a, b in zip(grads(plain), grads(rotor), strict=True):
                assert torch.equal(a, b)
            quiet.append(len(rotor.last_entry.runner.quiet))
    finally:
        SometimesDropout.active = False
    recomputed = len(rotor.last_entry.runner.recomputed)
    assert recomputed > 0
    # all quiet after an inactive step; the stages holding dropout are recorded again once they drew
    assert quiet[0] == quiet[1] == quiet[4] == quiet[5] == recomputed
    assert quiet[2] < recomputed and quiet[3] < recomputed


# == promise: the module stands in for the Sequential it wraps ===============================================
def test_wrapped_sequential_iterates_indexes_and_has_a_length():
    seq = tanh_net()
    rotor = Checkpointable(seq, 0.75)
    assert len(rotor) == len(seq) == 11
    assert list(rotor) == list(seq)
    assert rotor[0] is seq[0] and rotor[-1] is seq[-1]
    part = rotor[2:5]
    assert isinstance(part, nn.Sequential) and list(part) == list(seq)[2:5]
    with pytest.raises(IndexError):
        rotor[11]
