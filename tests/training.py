"""Plain-PyTorch helpers shared by the test files: a few optimizer steps the same for a plain model and its
rotor-wrapped copy, losses, and the comparisons of their results (Lightning helpers: fitting.py).

Plain functions, not fixtures: they take the model and data they work on as arguments.
"""

import dataclasses

import torch
import torch.nn.functional as F


def train(model, x, y, loss_fn, steps=3, lr=0.1):
    """Losses of `steps` SGD steps; after the last one the gradients are left in `.grad`."""
    torch.manual_seed(2)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        if step < steps - 1:
            opt.step()
        losses.append(loss.detach())
    return torch.stack(losses)


def grads(model):
    """Every parameter's gradient, cloned: the next step overwrites `.grad`."""
    return [p.grad.clone() for p in model.parameters()]


def tokens_loss(out, y):
    """Cross-entropy of token logits against flat targets; `out` is a tensor or a Hugging Face output (`.logits`)."""
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y)


def assert_same_state(plain, wrapped):
    """Every parameter gradient and every buffer bitwise equal, under the same names."""
    for (n, a), (m, b) in zip(plain.named_parameters(), wrapped.named_parameters(), strict=True):
        assert n == m and torch.equal(a.grad, b.grad), n
    for (n, a), (m, b) in zip(plain.named_buffers(), wrapped.named_buffers(), strict=True):
        assert n == m and torch.equal(a, b), n


def measured_step(model, x, y, loss_fn):
    """One training step of a rotor-wrapped model measured on real tensors (`Checkpointable.measure_step`)."""
    model.zero_grad()
    with model.measure_step() as m:
        loss_fn(model(x), y).backward()
    return m


def check_measured_peak(ckpt, measured, within=0.1):
    """Measured peak within the budget, at most the prediction, and within `within` (10%) of it."""
    chosen = ckpt.plan
    assert measured <= chosen.budget
    assert (1 - within) * chosen.peak <= measured <= chosen.peak, (measured, chosen.peak)


DROPOUT_GPT = dict(vocab_size=64, block_size=16, n_layer=6, n_head=2, n_embd=16, dropout=0.1)  # RNG replayed


def uniform_times(chain):
    """The chain with every forward 1 s and every backward 2 s: measured times vary, plans under test must not."""
    n = chain.length
    return dataclasses.replace(chain, fwd_time=[1.0] * n, bwd_time=[2.0] * n)
