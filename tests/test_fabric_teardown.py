"""`RotorFabricStrategy.teardown()` gives the user's model back as it was, as the Trainer's strategies do at the end
of a fit: the submodules rotor swapped out put back (with the weights they trained), and no hook of rotor's left
on the model, so that its later forwards (evaluation, another loop, saving) run the user's code alone."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn

from lightning_rotor.checkpointable import Checkpointable
from lightning_rotor.fabric import RotorFabricStrategy


def stack(act: type[nn.Module]) -> nn.Sequential:
    return nn.Sequential(*(nn.Sequential(nn.Linear(32, 32), act()) for _ in range(4)))


class EncoderDecoder(nn.Module):
    """Two chains under one budget (`include=`), with code of the model's own around them."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.encoder, self.decoder, self.head = stack(nn.Tanh), stack(nn.GELU), nn.Linear(32, 8)

    def forward(self, x):
        return self.head(self.decoder(self.encoder(x) * 2))


def test_teardown_puts_the_users_submodules_back_with_their_trained_weights_and_no_hook():
    model = EncoderDecoder()
    parts, plain = (model.encoder, model.decoder), copy.deepcopy(model)
    strategy = RotorFabricStrategy(mem_limit="80%", include=["encoder", "decoder"], print_summary=False)
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=1)
    wrapped, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 8, (16,), generator=g)
        opt.zero_grad()
        fabric.backward(F.cross_entropy(wrapped(x), y))
        opt.step()
    assert isinstance(model.encoder, Checkpointable) and isinstance(model.decoder, Checkpointable)
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    strategy.teardown()
    assert (model.encoder, model.decoder) == parts  # the user's own modules, as set up
    assert not any(isinstance(m, Checkpointable) for m in model.modules())
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    for (key, a), b in zip(model.state_dict().items(), trained.values(), strict=True):
        assert torch.equal(a, b), key  # the weights the loop trained
    plain.load_state_dict(trained)
    x = torch.randn(4, 32)
    assert torch.equal(model(x), plain(x))
    strategy.teardown()  # a second call changes nothing
    assert (model.encoder, model.decoder) == parts
