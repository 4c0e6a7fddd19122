"""Side outputs: what a model records from inside its blocks besides their output (router logits, attention weights).

Hugging Face transformers 5 collects per-layer outputs with forward hooks it registers
(`transformers.utils.output_capturing`): while a model's forward runs with `output_router_logits=True`
(or `output_attentions=True`, ...), a context variable holds a dict of lists, one per recorded name,
and each hook on a recorded module appends that module's output to its list. A Mixture-of-Experts
model then adds a load-balancing loss over every layer's router logits to `loss`: they are outputs
of the blocks that the loss differentiates.

Inside a module-level chain the blocks run as rotor's plan says: without grad, again in the
backward, several times while profiling. So a stage runs with a collector of its own
(`recording`): what its blocks record becomes part of the stage's output and is carried to the end
of the chain (lightning_rotor/discovery/modules.py, `ModuleRun.side`), where it is put into the
model's collector in the order the blocks recorded it. The loss gets the values of the forward it
differentiates, their gradients flow back through the chain into the stage that made them, and a
recomputation records nothing twice (docs/discovery.md, "Side outputs").

Everything transformers-specific sits here; without transformers imported nothing is ever recorded.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

from lightning_rotor._torch_compat import forward_hooks

_CAPTURING = "transformers.utils.output_capturing"  # where transformers 5 keeps its output-recording hooks
_HOOK = "output_capturing_hook"  # the name of the hook function it registers on each recorded module
SELECTION = "_hidden_states_layers"  # a collector entry that is no recorded name (the hidden states selected)


def _collector_var() -> Any:
    """transformers' context variable of the active collector, or None when transformers is not imported."""
    capturing = sys.modules.get(_CAPTURING)
    return None if capturing is None else getattr(capturing, "_active_collector", None)


def active_collector() -> dict[str, Any] | None:
    """The dict of lists the running forward records into (`{}` or None: it records nothing)."""
    var = _collector_var()
    return None if var is None else var.get()


def recorded_names() -> tuple[str, ...]:
    """The names the running forward records (`"router_logits"`, `"attentions"`, ...), in the collector's order."""
    collector = active_collector()
    return tuple(k for k in collector or () if k != SELECTION)


def recorder_name(hook: Any) -> str | None:
    """The name a transformers output-recording hook records under, or None for any other hook.

    The hook is a closure over `key` (transformers 5.24, `install_output_capuring_hook`).
    """
    code = getattr(hook, "__code__", None)
    if code is None or code.co_name != _HOOK or not getattr(hook, "__module__", "").startswith("transformers."):
        return None
    cells = dict(zip(code.co_freevars, hook.__closure__ or (), strict=False))
    cell = cells.get("key")
    return cell.cell_contents if cell is not None and isinstance(cell.cell_contents, str) else None


def recorders(module: nn.Module) -> list[str | None]:
    """The names `module`'s forward hooks record under (None for a hook that is not a transformers recorder)."""
    return [recorder_name(h) for h in forward_hooks(module)]


def names_recorded_inside(blocks: list[nn.Module], names: tuple[str, ...]) -> tuple[str, ...]:
    """Which of `names` a hook on a module inside one of `blocks` (not on a block itself) records."""
    if not names:  # the common case, every training step: no module walk
        return ()
    inside: set[str] = set()
    for block in blocks:
        for sub in block.modules():
            if sub is not block:
                inside.update(n for n in recorders(sub) if n in names)
    return tuple(n for n in names if n in inside)


@contextmanager
def recording(names: tuple[str, ...]) -> Iterator[dict[str, list[Any]]]:
    """Run the body with a collector of rotor's own that records `names` (an empty one when `names` is empty:
    nothing is recorded, as in a recomputation no caller asked for). Yields the dict the hooks append to."""
    var = _collector_var()
    own: dict[str, list[Any]] = {n: [] for n in names}
    if var is None:
        yield own
        return
    token = var.set(own)
    try:
        yield own
    finally:
        var.reset(token)
