"""On CUDA, what the caching allocator holds above tensor accounting, carried from measured shapes to derived ones.

NOTE: [sizes on CUDA] a CUDA profile keeps the caching allocator's figure where it is larger than tensor
accounting's (kernel workspaces; a request given a whole cached block). That excess follows the allocator's
state, not the shape (docs/gpu_check_h200.md, "Changing shapes on CUDA"): no law derives it. So a traced CUDA
profile measures tensor accounting alone, whose sizes are sums of storages as on CPU and give the law
(lightning_rotor/symbolic_sizes.py), and a second, sizes-only profile with the allocator's figures gives the
chain the shape is planned on. Their difference, per field and stage (`AllocatorExcess`), is charged to a shape
whose sizes the law derives: the nearest measured shape's, a positive excess scaled up where the figure is larger
there. The budget's promise is tensor accounting's and holds exactly; the allocator's peak within the budget is a
target, as on every CUDA shape (`Checkpointable.measure_step` reads it).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from lightning_rotor.chain import Chain, StageOption
from lightning_rotor.engine import value_device

FIELDS = ("saved_size", "fwd_tmp", "fwd_tmp_nograd", "bwd_tmp")  # the figures a CUDA profile reads from both
OPTION_FIELDS = ("saved_size", "fwd_tmp", "bwd_tmp")


def reads_allocator(value: Any) -> bool:
    """Whether a profile on `value` reads the caching allocator's figures too: on CUDA."""
    return value_device(value).type == "cuda"


@dataclass(frozen=True)
class AllocatorExcess:
    """The allocator's figures above tensor accounting's in one measured shape's chain."""

    tensors: Chain  # the shape's chain by tensor accounting alone
    excess: dict[str, list[int]]  # per field, per stage: the allocator's figure less tensor accounting's, >= 0
    options: list[dict[str, int]]  # per stage, the same for its options' figures (the largest of its options)

    @classmethod
    def between(cls, allocator: Chain, tensors: Chain) -> AllocatorExcess:
        """The excess of `allocator` (a profile with the allocator's figures) over `tensors` (one without), the same
        stages at the same shape; a figure the allocator's profile has lower counts 0. An option's is the larger of
        its stage's and its own (the two profiles may keep different options)."""
        excess = {f: _above(getattr(allocator, f), getattr(tensors, f)) for f in FIELDS}
        options = []
        for k, (mine, theirs) in enumerate(zip(allocator.options, tensors.options, strict=True)):
            pairs = list(zip(mine, theirs, strict=False))
            options.append(
                {f: max([excess[f][k], *(getattr(a, f) - getattr(t, f) for a, t in pairs)]) for f in OPTION_FIELDS}
            )
        return cls(tensors, excess, options)

    def distance(self, chain: Chain) -> float:
        """How far `chain`'s shape is from this one's: the log ratio of their stages' output bytes."""
        mine, theirs = sum(self.tensors.out_size), sum(chain.out_size)
        return abs(math.log(max(theirs, 1) / max(mine, 1)))

    def charged(self, chain: Chain) -> Chain:
        """`chain`, tensor accounting's figures at another shape of the same stages, charged this excess: each
        stage's field plus its excess here, scaled by how much larger the field is there (never scaled down)."""
        options = [[_option_plus(o, e) for o in mine] for mine, e in zip(chain.options, self.options, strict=True)]
        return dataclasses.replace(
            chain,
            saved_size=self._field(chain, "saved_size"),
            fwd_tmp=self._field(chain, "fwd_tmp"),
            fwd_tmp_nograd=self._field(chain, "fwd_tmp_nograd"),
            bwd_tmp=self._field(chain, "bwd_tmp"),
            options=options,
        )

    def _field(self, chain: Chain, name: str) -> list[int]:
        """`chain`'s field `name`, each stage's charged its excess here (`_plus`)."""
        here, there = getattr(self.tensors, name), getattr(chain, name)
        return [_plus(v, e, t) for v, e, t in zip(there, self.excess[name], here, strict=True)]


def _above(allocator: list[int], tensors: list[int]) -> list[int]:
    """Per stage, how far the allocator's figure is above tensor accounting's (0 where not)."""
    return [max(0, a - t) for a, t in zip(allocator, tensors, strict=True)]


def _plus(value: int, excess: int, measured: int) -> int:
    """`value` plus `excess`, scaled by `value / measured` where that is above 1."""
    if excess == 0:
        return value
    scale = value / measured if measured > 0 and value > measured else 1.0
    return value + math.ceil(excess * scale)


def _option_plus(option: StageOption, excess: dict[str, int]) -> StageOption:
    """An option charged its stage's option excess, unscaled (its figures at the measured shape may be another
    option's)."""
    return dataclasses.replace(option, **{f: getattr(option, f) + excess[f] for f in OPTION_FIELDS})
