"""Module-level discovery follows a block's output into the torch calls that take it (`modules._Uses`): the
tensors it finds among a call's arguments are pytree's, found without pytree's cost where the arguments are flat."""

import collections

import pytest
import torch
from torch.utils._pytree import tree_flatten

from lightning_rotor.discovery.modules import _argument_leaves

x = torch.randn(2)
Pair = collections.namedtuple("Pair", "a b")

CALLS = [
    ((x, 1, 2.0), {}),
    ((x, (slice(None), slice(0, 1))), {}),  # x[:, :1]
    ((x,), {"dim": -1, "keepdim": True}),
    (([x, x], 0), {}),  # torch.cat
    ((x, [x, [x]]), {}),
    ((Pair(x, 1),), {}),  # a named tuple: pytree's own
    ((x, {"a": x}), {}),
    ((x, torch.float32, torch.device("cpu"), None, Ellipsis), {"out": x}),
    ((torch.Size([2, 3]),), {}),  # flattened by pytree: not an atom
    ((x, [torch.Size([1])]), {}),
    ((torch.nn.Parameter(x), True, "mean", 1j), {}),
    ((), {}),
]


@pytest.mark.parametrize(("args", "kwargs"), CALLS)
def test_argument_leaves_are_pytrees_in_order(args: tuple, kwargs: dict) -> None:
    found, expected = _argument_leaves(args, kwargs), tree_flatten((args, kwargs))[0]
    assert len(found) == len(expected)
    for a, b in zip(found, expected, strict=True):
        assert a is b or (not isinstance(a, torch.Tensor) and type(a) is type(b) and a == b)
