"""Default discovery on models from other libraries, and a graph trace that fails falls back, saying why.

litgpt's `GPT` (a tiny Llama config) crashed graph discovery: its forward calls a module it makes on
the spot (`clamp_head = nn.Identity()`), which torch.fx refuses ("module is not installed as a
submodule"); that error was not among the ones `discover="auto"` fell back on.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from training import assert_same_state, measured_step, tokens_loss, train

from lightning_rotor.checkpointable import Checkpointable
from lightning_rotor.discovery import discover_chain


class MadeInForward(nn.Module):
    """Calls a module made inside its forward, as litgpt's GPT does with `nn.Identity()`."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        clamp = nn.Identity()
        return clamp(self.head(x))


def test_a_module_made_in_the_forward_is_traced_inline():
    model, x = MadeInForward(), torch.randn(8, 16)
    found = discover_chain(model, (x,), "auto")
    assert found.kind == "graph" and found.stages.names[-1] == "head", found.stages.names


class HashedShape(nn.Module):
    """A forward torch.fx cannot trace (a dict keyed by a size: a KeyError under the trace), which runs as written."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.scales = {8: 0.5}

    def forward(self, x):
        x = x * self.scales[x.shape[0]]
        for block in self.blocks:
            x = block(x)
        return x


def test_any_failure_of_the_graph_trace_falls_back_and_says_why():
    torch.manual_seed(0)
    plain, x, y = HashedShape(), torch.randn(8, 16), torch.randn(8, 16)
    found = discover_chain(plain, (x,), "auto")
    assert found.kind == "modules"
    assert found.notes[0].startswith("graph discovery failed: KeyError"), found.notes
    assert found.notes[0].endswith("module-level discovery used instead")
    rotor = Checkpointable(copy.deepcopy(plain), repeats=1, warmup=0)
    assert torch.equal(train(rotor, x, y, F.mse_loss), train(plain, x, y, F.mse_loss))
    assert_same_state(plain, rotor)
    assert "graph discovery failed: KeyError" in rotor.discovery.notes[0]


def litgpt_case():
    pytest.importorskip("litgpt")
    from litgpt.config import Config
    from litgpt.model import GPT

    config = Config(
        n_layer=6,
        n_embd=64,
        n_head=4,
        n_query_groups=2,
        vocab_size=256,
        padded_vocab_size=256,
        block_size=64,
        bias=False,
        norm_class_name="RMSNorm",
        mlp_class_name="LLaMAMLP",
        intermediate_size=172,
        parallel_residual=False,
        rotary_percentage=1.0,
    )
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(256, (2, 64), generator=g)
    return GPT(config), x, torch.randint(256, (x.numel(),), generator=g)


@pytest.mark.parametrize("how", ["auto", "modules"])
@pytest.mark.parametrize("label", ["50%", "unlimited"])
def test_litgpt_trains_like_plain_within_budget(how, label):
    plain, x, y = litgpt_case()
    rotor = Checkpointable(
        copy.deepcopy(plain), 10**12 if label == "unlimited" else label, discover=how, repeats=1, warmup=0
    )
    assert torch.equal(train(rotor, x, y, tokens_loss), train(plain, x, y, tokens_loss))
    assert_same_state(plain, rotor)
    assert rotor.discovery.kind == ("graph" if how == "auto" else "modules")
    if how == "auto":  # the whole forward is the chain: embedding, the six blocks, the norm, the head
        assert rotor.stage_names == [
            "transformer.wte",
            *(f"transformer.h.{i}" for i in range(6)),
            "transformer.ln_f",
            "lm_head",
        ]
    recomputed = sum(r > 1 for r in rotor.last_entry.runs)
    assert recomputed > 0 if label == "50%" else recomputed == 0
    m = measured_step(rotor, x, y, tokens_loss)
    assert m.peak <= rotor.plan.budget


def test_litgpt_through_a_trainer_with_half_the_memory(tmp_path):
    import lightning.pytorch as pl
    from fitting import quiet_trainer
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_rotor.lightning import RotorCallback, RotorStrategy
    from lightning_rotor.lightning.state import rotor_modules

    class Task(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = litgpt_case()[0]
            self.grads = []

        def training_step(self, batch, batch_idx):
            idx, targets = batch
            return tokens_loss(self.model(idx), targets.reshape(-1))

        def on_before_optimizer_step(self, optimizer):
            self.grads.append([p.grad.detach().clone() for p in self.parameters()])

        def on_train_end(self):
            self.chains = rotor_modules(self)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    g = torch.Generator().manual_seed(0)
    data = torch.randint(256, (8, 65), generator=g)
    loader = DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=2)
    measure = RotorCallback(measure_every_n_steps=1, log_curves=False, print_summary=False)
    tasks = []
    for strategy, callbacks in (("auto", []), (RotorStrategy(mem_limit="50%"), [measure])):
        task = Task()
        quiet_trainer(tmp_path, strategy, callbacks=callbacks).fit(task, loader)
        tasks.append(task)
    plain, rotor = tasks
    (wrapped,) = rotor.chains.values()
    assert wrapped.discovery.kind == "graph" and sum(r > 1 for r in wrapped.last_entry.runs) > 0
    assert measure._measured_peak is not None and measure._measured_peak <= wrapped.plan.budget
    for step_a, step_b in zip(rotor.grads, plain.grads, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(step_a, step_b, strict=True))
