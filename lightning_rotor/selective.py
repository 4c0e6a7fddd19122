"""Stage option 1, "sac": record only the outputs of expensive ops, recompute the rest in the backward.

torch's selective activation checkpointing does the work (`torch.utils.checkpoint` with
`create_selective_checkpoint_contexts`): under it a stage's forward saves the outputs of the ops
the policy names, and its backward reruns the stage from its input, taking those outputs from the
cache instead of computing them again. Recomputed values are the forward's, bitwise, as long as
the stage draws no random numbers: a random op is refused for now (see `save_expensive`).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

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


class RandomInSelective(RuntimeError):
    """A stage recorded by the "sac" option drew random numbers, which its recomputation would not replay."""


def save_expensive(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Save matmul, convolution and attention outputs; recompute the rest. Refuse random ops (see below)."""
    if torch.Tag.nondeterministic_seeded in getattr(op, "tags", ()):
        # the recomputation would draw again: exact only with the executor's replay of the first run's
        # generator states inside the recompute context, which is not built yet (dropout's bernoulli_ fills
        # a tensor in place, so its output cannot simply be saved)
        raise RandomInSelective(
            f"a stage recorded with option 'sac' runs the random op {op}; the 'sac' option does not replay random "
            "numbers yet: use it on stages without dropout (or with dropout off)"
        )
    return CheckpointPolicy.MUST_SAVE if op in EXPENSIVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def run_selective(stage: nn.Module, value: Any) -> Any:
    """`stage(value)` recording option "sac": the graph keeps `value` and the expensive ops' outputs."""
    return checkpoint(
        stage,
        value,
        use_reentrant=False,
        context_fn=partial(create_selective_checkpoint_contexts, save_expensive),
        preserve_rng_state=False,  # nothing random runs under the option (save_expensive refuses it)
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
