"""Turn a chain and a budget into the integer problem the planners solve.

Both the C++ planner and the Python reference read a `DiscreteChain`, so they
solve the very same problem and their optima can be compared exactly.

- Memory: `unit = budget // slots` bytes; every size is rounded *up* to whole
  units, so a schedule that fits in units also fits in bytes (the budget is a
  hard promise). With the default 500 slots this is rotor's discretisation.
  Signed figures (version-2 `bwd_tmp`, `loss_tmp`) are rounded up too: a sum of
  ceilings is at least the ceiling of the sum. Releases (version-3 `in_free`, bytes of
  `a_k` let go after its last forward and subtracted from what is held) are rounded
  *down*: a held size rounded up less a release rounded down is at least the exact
  remainder in units, so discrete plans still fit in exact bytes.
- Time: every stage time becomes an integer number of ticks, fine enough that
  no schedule's time loses more than ~1e-10 of its value. A cost is
  `ticks << count_bits | forward_ops`, so among schedules of equal time the one
  with fewer forward operations wins: zero-cost stages are never recomputed
  needlessly. Costs stay below 2**53, so they are exact in a C double too.
- Options (chain version 5): each option of a stage is discretized like the stage's own
  figures (`DiscreteOption`); the time scale bounds schedules by each stage's slowest option.
- Transfers (chain version 6, `bandwidth > 0`): `transfer_cost[k]` is the time to copy `a_k`
  between device and host, in ticks rounded *up* (so the planner's "the offload ends within
  the forward sweep" is never optimistic) and shifted like a backward's cost (no forward op).
  Every stall (a `Wait`, or an op waiting for a prefetch) lasts at most one copy, capped at
  `copy_cap`, and a schedule has a bounded number of them: the time scale's bound counts them,
  and costs stay below 2**53. Without bandwidth nothing here changes.
- Saved parts (chain version 6, `offloadable`): `offloadable[k]` leaves the device while the part is
  on the host, so it is a release and rounded *down*; `saved_transfer_cost[k]` is its copy time as
  `transfer_cost`. Each record's stall is at most the forward it follows (stage k+1's), so all of them
  together at most the chain's forwards once: the time scale's bound is tripled instead. Without
  bandwidth, or with every `offloadable` 0, both lists are empty and nothing changes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

from lightning_rotor.chain import Chain

DEFAULT_SLOTS = 500  # rotor's discretisation; the floor of the automatic precision
MAX_AUTO_SLOTS = 20_000
AUTO_TABLE_CELLS = 150 * 150 * DEFAULT_SLOTS  # L^2 x slots: about a 150-stage chain at 500 slots


def auto_slots(length: int) -> int:
    """The planner's precision when none is given: finer for shorter chains, at about constant cost.

    Tables grow as L^2 x slots and the fill as L^3 x slots; at 500 slots a 39-stage chain plans
    in about a millisecond, and its plan at a budget equal to a uniform scheme's peak could be
    5% slower than at 2000 slots (a large stage's rounding decides what fits). So short chains
    get up to 20,000 slots, keeping L^2 x slots about what 150 stages take at 500.
    """
    return max(DEFAULT_SLOTS, min(MAX_AUTO_SLOTS, AUTO_TABLE_CELLS // max(1, length * length)))


def resolve_slots(slots: object, length: int) -> int:
    """`slots` checked, or the automatic precision for `length` stages when None."""
    checked = check_slots(slots)
    return auto_slots(length) if checked is None else checked


class DiscreteOption(NamedTuple):
    """Option `o >= 1` of a stage in slots and ticks (`Fs k:o`, chain version 5)."""

    saved: int  # sb^o_{k+1}
    fwd_tmp: int
    bwd_tmp: int  # StageOption.bwd_net, rounded up
    loss_tmp_graph: int  # the loss on a_L recorded by this option (read for the last stage only)
    fwd_cost: int
    bwd_cost: int


@dataclass(frozen=True)
class DiscreteChain:
    length: int
    unit: int  # bytes per slot
    slots: int  # budget in slots, a_0 included
    size: list[int]  # s_0 … s_L in slots
    saved: list[int]  # sb_1 … sb_L in slots, at index k = sb_{k+1}
    fwd_tmp: list[int]  # recording the graph (Fe)
    fwd_tmp_nograd: list[int]  # without grad (Fn, Fc)
    bwd_tmp: list[int]  # Chain.bwd_net: B k peaks at cur + s_k + bwd_tmp[k] (signed)
    loss_tmp: int  # Loss on a plain a_L (signed)
    loss_tmp_graph: int  # Loss on a_L held with its graph (Chain.loss_tmp_graph)
    in_free: list[int]  # bytes of a_k let go after Fe k (its last forward before B k), rounded down
    loss_value: int  # held from the end of Loss to the end of the step
    fwd_cost: list[int]  # ticks << count_bits | 1
    bwd_cost: list[int]  # ticks << count_bits
    count_bits: int
    tick: float  # seconds per tick
    options: list[list[DiscreteOption]] = field(default_factory=list)  # per stage, options 1, 2, …; [] for none
    transfer_cost: list[int] = field(default_factory=list)  # a_0 … a_L: ticks << count_bits; [] without bandwidth
    offloadable: list[int] = field(default_factory=list)  # per stage, in slots rounded down; [] as below
    saved_transfer_cost: list[int] = field(default_factory=list)  # per stage; [] without bandwidth or saved parts

    def cost_to_time(self, cost: int) -> float:
        return (cost >> self.count_bits) * self.tick

    def cost_to_forward_ops(self, cost: int) -> int:
        return cost & ((1 << self.count_bits) - 1)


def time_scale(chain: Chain) -> tuple[int, float]:
    """(count_bits, seconds per tick) so that every schedule's cost fits in 53 bits."""
    length = chain.length
    most_forward_ops = length * (length + 1) // 2 + length
    count_bits = most_forward_ops.bit_length()
    time_bits = 51 - count_bits
    bound = length * math.fsum(chain.slowest_fwd_time) + math.fsum(chain.slowest_bwd_time)
    if chain.offloads:  # every stall is at most one copy, capped at copy_cap (docs/planner.md, "Debts")
        stalls = 2 * most_forward_ops + 3 * length  # two per value offloaded (one per Fc at most), three per record
        bound += stalls * copy_cap(chain)
    tick = bound / 2**time_bits if bound > 0 else 1.0
    return count_bits, tick


def transfer_costs(chain: Chain, count_bits: int, tick: float) -> list[int]:
    """Per value `a_0 … a_L`, its copy time in ticks rounded up, shifted by `count_bits`; [] without bandwidth.

    The time scale counts every possible stall at `copy_cap`, so costs stay below 2**53.
    """
    if not chain.offloads:
        return []
    return _copy_costs(chain, chain.sizes, count_bits, tick)


def saved_transfer_costs(chain: Chain, count_bits: int, tick: float) -> list[int]:
    """Per stage, the copy time of its saved part (`offloadable[k]`) as `transfer_costs`; [] when none moves."""
    if not chain.offloads or not any(chain.offloadable):
        return []
    return _copy_costs(chain, chain.offloadable, count_bits, tick)


def copy_cap(chain: Chain) -> float:
    """Seconds no copy exceeds: the largest value or saved part over the bandwidth. Each stall (a wait, an op waiting
    for a prefetch) lasts at most one copy; copies are never capped, so "the copy surely ended" is never optimistic
    (a copy thousands of times a stage's time coarsens the ticks instead)."""
    largest = max([*chain.sizes, *chain.offloadable], default=0)
    return largest / chain.bandwidth if chain.offloads else 0.0


def _copy_costs(chain: Chain, sizes: list[int], count_bits: int, tick: float) -> list[int]:
    return [math.ceil(s / chain.bandwidth / tick) << count_bits for s in sizes]


def check_slots(slots: object) -> int | None:
    """Validate the planner's memory precision (one place, for every entry point); None means automatic."""
    if slots is None:
        return slots
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise ValueError(f"slots must be a positive integer or None (automatic), got {slots!r}")
    return slots


def discretize(chain: Chain, budget: int, slots: int = DEFAULT_SLOTS) -> DiscreteChain:
    check_slots(slots)
    unit = max(1, budget // slots)
    count_bits, tick = time_scale(chain)

    def up(x: int) -> int:
        return -(-x // unit)

    saved_costs = saved_transfer_costs(chain, count_bits, tick)
    options = [
        [
            DiscreteOption(
                saved=up(o.saved_size),
                fwd_tmp=up(o.fwd_tmp),
                bwd_tmp=up(o.bwd_net),
                loss_tmp_graph=up(chain.option_loss_tmp_graph(o)),
                fwd_cost=(round(o.fwd_time / tick) << count_bits) | 1,
                bwd_cost=round(o.bwd_time / tick) << count_bits,
            )
            for o in opts
        ]
        for opts in chain.options
    ]

    return DiscreteChain(
        length=chain.length,
        unit=unit,
        slots=budget // unit,
        size=[up(x) for x in chain.sizes],
        saved=[up(x) for x in chain.saved_size],
        fwd_tmp=[up(x) for x in chain.fwd_tmp],
        fwd_tmp_nograd=[up(x) for x in chain.fwd_tmp_nograd],
        bwd_tmp=[up(x) for x in chain.bwd_net],  # ceil of signed figures: sums of ceilings stay safe
        loss_tmp=up(chain.loss_tmp),
        loss_tmp_graph=up(chain.loss_tmp_graph),
        in_free=[x // unit for x in chain.in_free],  # a release: rounded down (floor), see above
        loss_value=up(chain.loss_value),
        fwd_cost=[(round(t / tick) << count_bits) | 1 for t in chain.fwd_time],
        bwd_cost=[round(t / tick) << count_bits for t in chain.bwd_time],
        count_bits=count_bits,
        tick=tick,
        options=options if any(options) else [],
        transfer_cost=transfer_costs(chain, count_bits, tick),
        offloadable=[x // unit for x in chain.offloadable] if saved_costs else [],  # a release: rounded down
        saved_transfer_cost=saved_costs,
    )
