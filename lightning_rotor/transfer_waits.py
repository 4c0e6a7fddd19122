"""The waits that make a plan's device memory independent of its times (offloading, chain version 6).

An offload frees its device bytes when its copy ends (docs/memory-model.md, "Transfers across several
operations"), and the simulator finds that end from the chain's times: compute ops long enough that a copy has
ended before a later op starts, whose peak then counts it as freed. Run faster than profiled (a rank under FSDP2
planning on every rank's slowest times, or a step quicker than its profile) or on a slower link, the copy has
not ended there and the op runs with the bytes still held: above the plan's peak, and above the budget. On
GPU-like chains a plan replayed at 0.8x its compute times peaked up to 10% above its budget.

`with_release_waits` puts a `Wait k` (`WaitSaved k`) before each op whose start the times alone freed an offload
at: at the plan's own times that copy has ended there, so the wait costs nothing and the simulated peak and time
are the plan's; at any other times compute idles until the copy ends, so no op holds more than planned.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_rotor.chain import Chain
from lightning_rotor.ops import Op
from lightning_rotor.simulate import simulate

__all__ = ["with_release_waits"]


def with_release_waits(chain: Chain, ops: Sequence[Op]) -> list[Op]:
    """`ops` with an explicit wait before each op that counts an offload freed because its copy had ended by then
    (the chain's times said so), so that it is freed there at any times; `ops` as they are without offloading."""
    if not chain.offloads:
        return list(ops)
    released = simulate(chain, ops).timed_releases
    waited: list[Op] = []
    for op, waits in zip(ops, released, strict=True):
        waited += waits
        waited.append(op)
    return waited
