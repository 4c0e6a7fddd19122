"""Twin stages: stages of one structure, so that a measured one's figures may stand for another's.

Transformers, ResNets and ConvNeXts repeat one block many times. A profile measures each stage with
several runs under the memory probe; where a later stage has the structure of one measured before
(`structure`: the same module types, parameters' and buffers' shapes, hooks, and for a discovered
stage the same graph) and gets an input of the same structure (`value_structure`), its first
recorded run is compared with that stage's, figure by figure, and where they agree it takes that
stage's other figures instead of running for them (NOTE: [twin stages], lightning_rotor/profile.py).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch
from torch import fx, nn

from lightning_rotor._torch_compat import is_python_backward, own_hooks, tree_flatten

__all__ = ["python_backward", "stage_key", "structure", "value_structure"]

_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def tensor_meta(t: torch.Tensor) -> Hashable:
    """What of a tensor shapes what a run on it holds: its type, shape, layout in memory, dtype, device, grad."""
    strided = t.layout == torch.strided
    return (
        type(t),
        tuple(t.shape),
        tuple(t.stride()) if strided else None,
        t.storage_offset() if strided else None,
        t.dtype,
        t.device,
        t.requires_grad,
    )


def _hooks(m: nn.Module) -> Hashable:
    """The module's own hooks, by identity: a hook on one block only (one that keeps an output) breaks twinship."""
    return tuple(id(hook) for hook in own_hooks(m))


def _module_structure(module: nn.Module, named: bool = True) -> tuple[Hashable, ...]:
    """Every submodule's type, mode and hooks, with its own parameters' and buffers' metadata; `named`: its
    name too (a discovered stage's modules keep the user's names, `h.0.attn`: their order stands for them)."""
    return tuple(
        (
            name if named else None,
            type(m),
            m.training,
            _hooks(m),
            tuple((n, tensor_meta(p)) for n, p in m.named_parameters(recurse=False)),
            tuple((n, tensor_meta(b)) for n, b in m.named_buffers(recurse=False)),
        )
        for name, m in module.named_modules(remove_duplicate=False)
        if not isinstance(m, fx.GraphModule)
    )


def _argument(value: Any, index: dict[fx.Node, int]) -> Hashable:
    """A node's argument with nodes as their positions and constants as they are (tensors by metadata)."""
    if isinstance(value, fx.Node):
        return ("node", index[value])
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(_argument(v, index) for v in value))
    if isinstance(value, dict):
        return (dict, tuple((k, _argument(v, index)) for k, v in value.items()))
    if isinstance(value, slice):
        return (slice, _argument((value.start, value.stop, value.step), index))
    if isinstance(value, torch.Tensor):
        return ("tensor", tensor_meta(value))
    if isinstance(value, _PLAIN) or value is Ellipsis:
        return (type(value), value)
    return ("object", id(value))  # anything else: the very object (a function, a class, a shared config)


def _graph_structure(gm: fx.GraphModule) -> Hashable:
    """A discovered stage's graph with its modules and attributes by position of first use, not by name."""
    index: dict[fx.Node, int] = {}
    targets: dict[str, int] = {}
    nodes = []
    for i, node in enumerate(gm.graph.nodes):
        index[node] = i
        target: Hashable = node.target if isinstance(node.target, str) else ("object", id(node.target))
        if node.op in ("call_module", "get_attr"):
            owned = _module_structure(gm.get_submodule(node.target)) if node.op == "call_module" else None
            target = (targets.setdefault(str(node.target), len(targets)), owned or _attribute(gm, node.target))
        nodes.append((node.op, target, _argument(node.args, index), _argument(node.kwargs, index)))
    return tuple(nodes)


def _attribute(gm: fx.GraphModule, target: str) -> Hashable:
    """A `get_attr` target by what it is: a tensor's metadata, a module's structure, else the object."""
    owner, _, name = target.rpartition(".")
    value = getattr(gm.get_submodule(owner) if owner else gm, name)
    if isinstance(value, torch.Tensor):
        return ("tensor", tensor_meta(value))
    if isinstance(value, nn.Module):
        return ("module", _module_structure(value))
    return ("object", id(value))


def structure(stage: nn.Module) -> Hashable:
    """What two stages must share to be twins: their modules (types, modes, hooks, parameters' and buffers'
    metadata, by relative name) and, for a stage discovered as a graph, its graph up to names."""
    if isinstance(stage, fx.GraphModule):  # each GraphModule is of a class of its own
        return (fx.GraphModule, _hooks(stage), _graph_structure(stage), _module_structure(stage, named=False))
    return (type(stage), _hooks(stage), None, _module_structure(stage))


def value_structure(value: Any) -> Hashable:
    """A stage input's structure: its nesting, and its tensors' metadata (other leaves as they are)."""
    leaves, spec = tree_flatten(value)
    return (str(spec), tuple(_argument(t, {}) for t in leaves))


def stage_key(stage: nn.Module, value: Any) -> Hashable:
    """The structure of a stage and of its input: what a twin shares, what a FLOP count stands for."""
    return (structure(stage), value_structure(value))


def python_backward(outputs: Sequence[torch.Tensor]) -> bool:
    """Whether the graph that made `outputs` holds a custom autograd Function's node: its backward is Python code,
    which may hold what its forward does not show (a branch on an attribute of the stage)."""
    seen: set[Any] = set()
    todo = [t.grad_fn for t in outputs if t.grad_fn is not None]
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if is_python_backward(node):
            return True
        todo.extend(n for n, _ in node.next_functions if n is not None)
    return False
