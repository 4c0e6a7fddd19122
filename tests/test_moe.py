"""Mixture-of-Experts models with `output_router_logits=True` train under rotor bitwise as without it.

transformers 5 records each layer's router logits with forward hooks on the routers, inside the blocks of
rotor's chain, and adds a load-balancing loss over them to `loss`. They are side outputs of the stages,
carried to the end of the chain (lightning_rotor/side_outputs.py, NOTE: [side outputs] in
lightning_rotor/discovery/modules.py): their gradients reach the stage that made them, their bytes are
charged as part of the chain's values, and a recomputation records nothing twice.
"""

from __future__ import annotations

import copy
import warnings

import lightning.pytorch as pl
import pytest
import torch
from fitting import quiet_trainer
from hf_models import TINY_DECODER
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from training import check_measured_peak

from lightning_rotor.checkpointable import Checkpointable
from lightning_rotor.discovery import ChainDiverged
from lightning_rotor.lightning import RotorStrategy
from lightning_rotor.lightning.state import rotor_modules

transformers = pytest.importorskip("transformers")

torch.set_num_threads(1)

LAYERS = [f"model.layers.{i}" for i in range(4)]
COMMON = dict(
    **TINY_DECODER,
    num_experts_per_tok=2,
    output_router_logits=True,
    router_aux_loss_coef=1.0,  # the load-balancing loss weighs as much as the tokens' loss
)
FAMILIES = {
    "mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(num_local_experts=4, **COMMON)),
    "qwen2_moe": lambda: transformers.Qwen2MoeForCausalLM(
        transformers.Qwen2MoeConfig(
            num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=32, **COMMON
        )
    ),
    "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(
        transformers.Qwen3MoeConfig(num_experts=4, moe_intermediate_size=32, **COMMON)
    ),
    "olmoe": lambda: transformers.OlmoeForCausalLM(transformers.OlmoeConfig(num_experts=4, **COMMON)),
}


def moe(family: str, **config: object) -> nn.Module:
    """A four-layer MoE causal LM from a small config (two of four experts per token); nothing downloaded."""
    torch.manual_seed(0)
    model = FAMILIES[family]()
    for name, value in config.items():
        setattr(model.config, name, value)
    return model


def tokens(n: int = 4, t: int = 16) -> torch.Tensor:
    return torch.randint(64, (n, t), generator=torch.Generator().manual_seed(0))


def lm_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=x, labels=x)
    assert out.aux_loss is not None and len(out.router_logits) == 4  # the load-balancing loss is in `loss`
    return out.loss


def train(model: nn.Module, x: torch.Tensor, loss=lm_loss, steps: int = 3) -> list[list[torch.Tensor]]:
    """AdamW steps; the gradients of every step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    grads = []
    for _ in range(steps):
        opt.zero_grad()
        loss(model, x).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return grads


def assert_bitwise(got: list[list[torch.Tensor]], want: list[list[torch.Tensor]]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_router_logits_train_bitwise_within_budget(family):
    model = moe(family, use_cache=False)
    plain = copy.deepcopy(model)
    x = tokens()
    rotor = Checkpointable(model, "50%", discover="modules", repeats=1)
    got = train(rotor, x)
    assert rotor.stage_names == LAYERS
    assert sum(r > 1 for r in rotor.last_entry.runs) > 0  # the budget really recomputes
    assert_bitwise(got, train(plain, x))
    rotor.zero_grad()
    with rotor.measure_step() as m:
        lm_loss(rotor, x).backward()
    check_measured_peak(rotor, m.peak)


def attention_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The tokens' and load-balancing loss, plus a loss on every layer's attention weights."""
    out = model(input_ids=x, labels=x, output_attentions=True)
    assert len(out.attentions) == 4
    return out.loss + sum(a.square().mean() for a in out.attentions)


def test_attention_weights_and_router_logits_train_bitwise():
    model = moe("mixtral", use_cache=False)
    model.config._attn_implementation = "eager"  # the attention weights exist (sdpa makes none)
    plain = copy.deepcopy(model)
    x = tokens()
    rotor = Checkpointable(model, "50%", discover="modules", repeats=1)
    got = train(rotor, x, attention_loss, steps=2)
    assert sum(r > 1 for r in rotor.last_entry.runs) > 0
    assert_bitwise(got, train(plain, x, attention_loss, steps=2))


def test_hidden_states_and_changed_recording_are_refused_in_one_line():
    model = moe("mixtral", use_cache=False)
    rotor = Checkpointable(model, "50%", discover="modules", repeats=1)
    x = tokens()
    with pytest.raises(ChainDiverged, match=r"^output_hidden_states=True records the output of every block") as err:
        rotor(input_ids=x, labels=x, output_hidden_states=True)
    assert "\n" not in str(err.value) and "output_hidden_states=False" in str(err.value)
    assert all(p.grad is None for p in model.parameters())
    lm_loss(rotor, x).backward()  # the chain is profiled with router logits as side outputs
    with pytest.raises(ChainDiverged, match=r"keep output_\* \(e\.g\. output_router_logits\) the same"):
        rotor(input_ids=x, labels=x, output_router_logits=False)


def test_recording_hooks_of_an_earlier_call_do_not_refuse_training():
    """transformers installs its recording hooks on the blocks at the first call that records anything and keeps
    them; a later training call that records nothing is not refused for them."""
    model = moe("mixtral", use_cache=False, output_router_logits=False)
    plain = copy.deepcopy(model)
    x = tokens()
    with torch.no_grad():
        assert len(model.eval()(input_ids=x, output_hidden_states=True).hidden_states) == 5
    model.train()
    rotor = Checkpointable(model, "50%", discover="modules", repeats=1)

    def loss(m, x):
        return m(input_ids=x, labels=x).loss

    got = train(rotor, x, loss, steps=1)
    assert sum(r > 1 for r in rotor.last_entry.runs) > 0
    assert_bitwise(got, train(plain, x, loss, steps=1))


def test_plans_saved_without_router_logits_are_profiled_again_with_them():
    """The stages' values carry the router logits only when they are recorded: a plan saved by a run that did not
    record them (a resumed run with another config) would under-charge, so it is not reused."""
    x = tokens()
    first = Checkpointable(moe("mixtral", use_cache=False, output_router_logits=False), "50%", discover="modules")
    first(input_ids=x, labels=x).loss.backward()
    rotor = Checkpointable(moe("mixtral", use_cache=False), "50%", discover="modules", repeats=1)
    rotor.discover_on(input_ids=x, labels=x)
    rotor.load_plan_state(first.plan_state())
    lm_loss(rotor, x).backward()
    assert len(rotor.entries) == 2  # the saved plan, and one profiled with the router logits
    rotor.zero_grad()
    with rotor.measure_step() as m:
        lm_loss(rotor, x).backward()
    check_measured_peak(rotor, m.peak)


class MoeLM(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = moe("qwen3_moe")  # its default config: use_cache=True, turned off in training by rotor
        self.keep: dict[str, Checkpointable] = {}

    def training_step(self, batch, batch_idx):
        self.keep = self.keep or rotor_modules(self)
        (x,) = batch
        return lm_loss(self.model, x)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def test_router_logits_train_through_a_trainer_like_plain(tmp_path):
    loader = DataLoader(TensorDataset(tokens(8)), batch_size=4)
    runs = {}
    for name, strategy in (("plain", "auto"), ("rotor", RotorStrategy("50%", discover="modules"))):
        module = MoeLM()
        if name == "plain":
            module.model.config.use_cache = False
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            quiet_trainer(tmp_path / name, strategy).fit(module, loader)
        runs[name] = module
    wrapped = runs["rotor"].keep["model"]
    assert wrapped.stage_names == LAYERS and sum(r > 1 for r in wrapped.last_entry.runs) > 0
    for (n, a), (_, b) in zip(runs["rotor"].named_parameters(), runs["plain"].named_parameters(), strict=True):
        assert torch.equal(a, b), n
