"""What a module-level chain's loss is charged: what the user's step really runs (issue 17).

The rest of the forward after the run of blocks and the caller's loss are measured by
`pipeline.measure_outside`. A Hugging Face output that carries `.loss` (labels passed) has its
loss in the forward already: it used to be charged a second cross-entropy over `.logits` (the
stand-in over every differentiable output) and the logits held through the backward, so rotor
could not reach the memory of Hugging Face's own checkpointing. `loss_fn=` is a function of the
module's output, measured there (it used to be applied to the run's output, a hidden state).
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from training import assert_same_state

from lightning_rotor import Checkpointable, MemoryProbe
from lightning_rotor.checkpointable import InfeasibleBudget
from lightning_rotor.profile import caller_loss, output_loss, proxy_loss

transformers = pytest.importorskip("transformers")


def qwen() -> torch.nn.Module:
    """A small Qwen2 built from a config (nothing downloaded); its logits outweigh a block's activations."""
    config = transformers.Qwen2Config(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        use_cache=False,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(config).train()


def tokens() -> torch.Tensor:
    return torch.randint(1024, (4, 64), generator=torch.Generator().manual_seed(0))


def labels_step(model, x):
    """The step Hugging Face's examples run: the loss computed in the forward from `labels`."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    model(input_ids=x, labels=x).loss.backward()


def peak_of(model, step, x) -> int:
    """Activation bytes at the step's peak (the token ids are the caller's data, as in Lightning)."""
    with MemoryProbe(model) as probe:
        step(model, x)
    return probe.peak


def min_feasible(model, x, **settings) -> int:
    with pytest.raises(InfeasibleBudget) as err:
        labels_step(Checkpointable(model, 1, discover="modules", repeats=1, **settings), x)
    return err.value.min_feasible


def test_caller_loss_is_the_users_then_the_outputs_then_a_stand_in():
    logits = torch.randn(2, 3, 5, requires_grad=True)
    carried = (logits.sum() * 2).requires_grad_()
    output = transformers.modeling_outputs.CausalLMOutput(loss=carried, logits=logits)
    assert output_loss(output) is carried and caller_loss(output) is carried  # charged once, not with the logits
    assert output_loss({"loss": carried, "logits": logits}) is carried
    assert output_loss(transformers.modeling_outputs.CausalLMOutput(logits=logits)) is None  # no labels
    assert torch.equal(caller_loss(logits), proxy_loss(logits))
    mine = caller_loss(output, lambda out: out.logits.pow(2).mean())
    assert torch.equal(mine, logits.pow(2).mean())


def test_output_loss_is_charged_once_so_rotor_reaches_hugging_faces_checkpointing():
    """Old pricing: a second cross-entropy over the logits and the logits held through the backward put
    rotor's smallest budget above the peak of Hugging Face's own checkpointing (infeasible there)."""
    model, x = qwen(), tokens()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    hf_peak = peak_of(model, labels_step, x)
    model.gradient_checkpointing_disable()
    assert min_feasible(copy.deepcopy(model), x) < hf_peak
    rotor = Checkpointable(copy.deepcopy(model), hf_peak, discover="modules", repeats=1)
    labels_step(rotor, x)  # profiles and plans
    measured = peak_of(rotor, labels_step, x)
    assert measured <= hf_peak
    assert 0.99 * rotor.plan.peak <= measured <= rotor.plan.peak, (measured, rotor.plan.peak)


def test_labels_at_the_smallest_budget_bitwise_and_within_it():
    model, x = qwen(), tokens()
    smallest = min_feasible(copy.deepcopy(model), x)
    rotor = Checkpointable(copy.deepcopy(model), smallest, discover="modules", repeats=1)
    labels_step(rotor, x)
    assert sum(r > 1 for r in rotor.last_entry.runs) == len(rotor.stages)  # every block recomputed
    measured = peak_of(rotor, labels_step, x)
    assert measured <= smallest and measured >= 0.99 * rotor.plan.peak
    labels_step(model, x)
    assert_same_state(model, rotor)


def test_loss_fn_is_measured_on_the_models_output():
    """`loss_fn` takes what the module returns (a Hugging Face output here), not the run's hidden state."""
    model, x = qwen(), tokens()
    target = x.roll(-1, dims=1)

    def loss_fn(out):
        return F.cross_entropy(out.logits.flatten(0, 1), target.flatten())

    def step(m, x):
        m.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        loss_fn(m(input_ids=x)).backward()

    with pytest.raises(InfeasibleBudget) as err:
        step(Checkpointable(copy.deepcopy(model), 1, discover="modules", repeats=1, loss_fn=loss_fn), x)
    smallest = err.value.min_feasible
    rotor = Checkpointable(copy.deepcopy(model), smallest, discover="modules", repeats=1, loss_fn=loss_fn)
    step(rotor, x)
    measured = peak_of(rotor, step, x)
    assert 0.99 * rotor.plan.peak <= measured <= smallest
    step(model, x)
    assert_same_state(model, rotor)
