"""Stage option 1, "sac": record only the outputs of expensive ops, recompute the rest in the backward.

torch's selective activation checkpointing does the work (`torch.utils.checkpoint` with
`create_selective_checkpoint_contexts`): under it a stage's forward saves the outputs of the ops
the policy names, and its backward reruns the stage from its input, taking those outputs from the
cache instead of computing them again. Random ops (dropout) are recomputed too, drawing from the
generator states of the forward (lightning_rotor/rng.py's record and replay modes, inside the
contexts), so recomputed values are the forward's, bitwise.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lightning_rotor.rng import RecordRandom, ReplayRandom

aten = torch.ops.aten
EXPENSIVE_OPS = frozenset(
    op
    for op in (
        getattr(aten.mm, "default", None),
        getattr(aten.addmm, "default", None),
        getattr(aten.bmm, "default", None),
        getattr(aten.baddbmm, "default", None),
        getattr(aten.convolution, "default", None),
        getattr(getattr(aten, "_scaled_dot_product_flash_attention", None), "default", None),
        getattr(getattr(aten, "_scaled_dot_product_efficient_attention", None), "default", None),
        getattr(getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None), "default", None),
        getattr(getattr(aten, "_scaled_dot_product_cudnn_attention", None), "default", None),
    )
    if op is not None
)


def save_expensive(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Save matmul, convolution and attention outputs; recompute the rest (random ops replayed, see `run_selective`)."""
    return CheckpointPolicy.MUST_SAVE if op in EXPENSIVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


class _Nested:
    """Context managers entered in order (the last one innermost), as one: what `context_fn` must return."""

    def __init__(self, *managers: AbstractContextManager[Any]) -> None:
        self.managers = managers
        self.stack = ExitStack()

    def __enter__(self) -> _Nested:
        for manager in self.managers:
            self.stack.enter_context(manager)
        return self

    def __exit__(self, *exc: Any) -> bool | None:
        return self.stack.__exit__(*exc)


def _contexts(replay: AbstractContextManager[Any] | None, name: str) -> tuple[Any, Any]:
    """(forward, recompute) contexts: torch's selective caching, plus the replay of the forward's random draws.

    `replay`: how the executor replays this stage's draws (it recorded them on the stage's first run); None:
    record them here, in the forward (innermost, so each random op's generator state is seen before it draws).
    """
    forward, recompute = create_selective_checkpoint_contexts(save_expensive)
    if replay is not None:
        return forward, _Nested(recompute, replay)
    record = RecordRandom()
    return _Nested(forward, record), _Nested(recompute, ReplayRandom(record.states, name))


def run_selective(
    stage: nn.Module, value: Any, replay: AbstractContextManager[Any] | None = None, name: str = "stage"
) -> Any:
    """`stage(value)` recording option "sac": the graph keeps `value` and the expensive ops' outputs.

    Its backward reruns the stage under the contexts; random ops draw from the forward's generator
    states (`replay`, or recorded here), so the rerun is bitwise the forward, whatever drew since.
    """
    return checkpoint(
        stage,
        value,
        use_reentrant=False,
        context_fn=partial(_contexts, replay, name),
        preserve_rng_state=False,  # the replay above restores each random op's state, not the generator's
        determinism_check="default",
    )


def measure_sac_memory(stage: nn.Module, value: torch.Tensor, input_size: int) -> tuple[int, int, int]:
    """(saved_size, fwd_tmp, bwd_tmp) of option "sac" on `stage` at input `value` (one tensor), measured exactly.

    As docs/memory-model.md defines them for an option with `out_free` 0: bytes alive after the forward
    (the output included, the input not), the forward's peak above that, and the backward's peak above
    `saved + δ_{k+1} + s_k` with the output kept alive (`input_size` is `s_k`).
    """
    from lightning_rotor.memory import MemoryProbe  # memory imports torch dispatch machinery: only when measuring

    x = value.detach().requires_grad_()  # made before the probe: a_k is not counted
    with MemoryProbe(exclude=stage) as probe:
        out = run_selective(stage, x)
        saved = probe.current
        fwd_tmp = probe.peak - saved
        grad = torch.ones_like(out)
        probe.reset_peak()
        start = probe.current
        out.backward(grad)
        bwd_tmp = probe.peak - start - input_size
        del out, grad
    stage.zero_grad(set_to_none=True)
    return saved, max(0, fwd_tmp), max(-input_size, bwd_tmp)
