"""Replay a schedule on a chain under the memory model's rules.

The simulator is the referee (docs/memory-model.md): a plan is valid
when it replays here within its budget, and the planner's reported peak and
time must equal what this module computes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from typing_extensions import assert_never

from lightning_rotor.chain import Chain
from lightning_rotor.ops import (
    Op,
    OpKind,
    OpNote,
    annotate,
    check_frozen_prefix,
    no_recompute_ops,
    parse_ops,
    shift_ops,
)

__all__ = ["Simulation", "no_recompute_ops", "no_recompute_peak", "simulate"]


class Simulation(NamedTuple):
    """Peak bytes, total seconds, bytes held after each op, and the peak during each op.

    With offloading (chain version 6): `host_curve` is the host bytes held after each op, `host_peak`
    their largest value, and `wait` the seconds compute waited for a prefetch (part of `time`).
    """

    peak: int
    time: float
    curve: list[int]
    op_peaks: list[int]
    host_curve: Sequence[int] = ()
    host_peak: int = 0
    wait: float = 0.0
    timed_releases: Sequence[Sequence[Op]] = ()  # per op: a wait for each offload its start freed by the times


def simulate(chain: Chain, ops: Iterable[Any]) -> Simulation:
    """Replay `ops` on `chain`; raise `ValueError` naming the first op at fault.

    A chain with a frozen prefix of `F` stages (chain version 4): the plan starts with
    `Fn 0 … Fn F-1`, replayed by the `Fn` rule with `a_0` held, and goes on as a plan
    of `chain.suffix()` (stages `F … L-1`), which starts holding `a_0` and `a_F`.
    """
    ops = parse_ops(ops)
    f = chain.frozen
    if not f:
        replay = _replay(chain, ops)
        return Simulation(
            peak=replay.peak,
            time=math.fsum(replay.times),
            curve=replay.curve,
            op_peaks=replay.op_peaks,
            host_curve=replay.host_curve,
            host_peak=replay.host_peak,
            wait=math.fsum(replay.waits),
            timed_releases=[tuple(released) for released in replay.timed_releases],
        )
    check_frozen_prefix(ops, f)
    s = chain.sizes
    curve, op_peaks, cur = [], [], s[0]
    for k in range(f):  # Fn k: a_k dropped after, never a_0
        op_peaks.append(cur + s[k + 1] + chain.fwd_tmp_nograd[k])
        cur += s[k + 1] - (s[k] if k else 0)
        curve.append(cur)
    rest = _replay(chain.suffix(), shift_ops(ops[f:], -f), first_op=f, first_stage=f)
    return Simulation(
        peak=max(rest.peak, *op_peaks),
        time=math.fsum([*chain.fwd_time[:f], *rest.times]),
        curve=curve + rest.curve,
        op_peaks=op_peaks + rest.op_peaks,
        host_curve=[0] * f + list(rest.host_curve),
        host_peak=rest.host_peak,
        wait=math.fsum(rest.waits),
        timed_releases=[()] * f + [tuple(shift_ops(released, f)) for released in rest.timed_releases],
    )


def _replay(chain: Chain, ops: list[Op], first_op: int = 0, first_stage: int = 0) -> _Memory:
    """Replay an ordinary chain; errors name ops `first_op`, stages `first_stage` on. Returns what it held:
    the peak, op times and waits (`times` holds the waits too), and the curves."""
    memory = _Memory(chain, first_op, first_stage)
    for i, note in enumerate(annotate(ops, chain.length, chain.in_free)):
        memory.step(i, note)
    memory.finish()
    return memory


class _Moves:
    """Copies of one kind of thing on the transfer channel, keyed by k: the values `a_k` (`Offload k`,
    `Prefetch k`) or the saved parts of recorded stages (`OffloadSaved k`, `PrefetchSaved k`).

    docs/memory-model.md, "Chain version 6": an offloaded item leaves device memory at the start of the first
    op at or after its copy ends; a prefetched one occupies it from the prefetch on, and its host copy goes
    when the prefetch ends.
    """

    def __init__(self, sizes: Sequence[int], what: str) -> None:
        self.sizes = sizes  # bytes of item k
        self.what = what  # how messages name item k: "a_{n}" or "the saved part of stage {n}"
        self.leaving: dict[int, float] = {}  # k: end of its offload (its device copy is still held until then)
        self.on_host: set[int] = set()  # offloaded and not yet prefetched
        self.arriving: dict[int, float] = {}  # k: end of its prefetch (compute needing it waits for it)
        self.host_freed: dict[int, float] = {}  # k: when its host copy goes (its prefetch ends)
        self.issued: dict[int, float] = {}  # k: end of the latest copy issued (what a `Wait` waits for)

    def name(self, n: int) -> str:
        return self.what.format(n=n)


class _Memory:
    """What a schedule holds while it is replayed, one method per op kind (docs/memory-model.md, "Operations"
    and Part 2's sections): the values `a_k` (plain or with their graph `ā_k`), the gradients `δ_k`, the byte
    count `cur`, and the transfer timeline (chain version 6).

    Transfers run on one channel beside compute: compute's clock `now` advances by each op's time and by waits
    for prefetched items; the channel serves copies in issue order. Values and saved parts share the channel
    and its rules (`_Moves`); only `B k` reads stage k's saved part. `Wait k` (`WaitSaved k`) idles compute
    until the latest copy of `a_k` (of stage k's saved part) has ended, so what it frees is free from then on.
    """

    def __init__(self, chain: Chain, first_op: int, first_stage: int) -> None:
        self.chain = chain
        self.length = chain.length
        self.first_op, self.first_stage = first_op, first_stage
        s = chain.sizes
        self.sb = [0, *chain.saved_size]  # sb[k] is the bytes of the recorded value ā_k
        self.free = [0, *chain.out_free]  # free[k]: bytes of a_k that ā_k's own graph does not keep
        self.plain = {0}  # values a_k held without graph; a_0 is the caller's and always held
        self.graph: set[int] = set()  # ā_k: value a_k with the graph of F_{k-1}
        self.released: set[int] = set()  # ā_k whose free part (out_free[k-1]) is already let go
        self.grads: set[int] = set()  # δ_k
        # chain version 5: ā_{k+1} recorded by option o >= 1 of stage k (Fs k:o) is held with that option's figures
        self.recorded_by: dict[int, int] = {}  # k+1: the option that recorded ā_{k+1} (absent: option 0, Fe k)
        # chain version 3: after the last forward of stage k before B k (an Fe k, k >= 1), the in_free[k]
        # bytes of a_k that neither graph keeps are let go, from the plain a_k when held, else from ā_k
        self.early_plain: dict[int, int] = {}  # k: bytes of a plain a_k already let go (B k drops the rest)
        self.early_graph: dict[int, int] = {}  # k: bytes of ā_k's free part already let go (B k-1 lets go the rest)
        self.let_go: set[int] = set()  # stages whose input was partly let go: no forward of them may follow
        self.cur = self.peak = s[0]
        self.times: list[float] = []  # op times, and the waits for prefetches among them
        self.waits: list[float] = []
        self.curve: list[int] = []
        self.op_peaks: list[int] = []
        self.loss_done = False
        self.next_backward = self.length - 1
        # the transfer channel (chain version 6)
        self.now = 0.0  # compute's clock
        self.channel = 0.0  # when the channel is free
        self.values = _Moves(s, "a_{n}")
        self.saved = _Moves(chain.offloadable, "the saved part of stage {n}")  # its own key space: stage k
        self.host = self.host_peak = 0
        self.host_curve: list[int] = []
        self.timed_releases: list[list[Op]] = []  # per op: the offloads its start freed by the times
        self.i = 0  # the op being replayed, and its stage (-1: the loss), for messages
        self.op = Op(OpKind.LOSS)
        self.k = -1

    # -- the replay ---------------------------------------------------------------------------------------
    def step(self, i: int, note: OpNote) -> None:
        """Replay op `i`: check what it needs, then charge its peak and what it leaves held."""
        self.i, self.op = i, note.op
        kind = note.kind
        self.k = k = -1 if note.op.stage is None else note.op.stage  # -1: the loss, which has no stage
        if kind is not OpKind.LOSS and not 0 <= k < self.length:
            raise self.fail(f"stage index out of range 0..{self.length + self.first_stage - 1}")
        self.timed_releases.append(self.settle())
        during = self.dispatch(note)
        self.peak = max(self.peak, during)
        self.op_peaks.append(during)
        self.curve.append(self.cur)
        self.host_curve.append(self.host)

    def dispatch(self, note: OpNote) -> int:
        """The op's rule; returns its peak (the bytes held during it)."""
        kind = note.kind
        match kind:
            case OpKind.FN | OpKind.FC:
                return self.forward_nograd()
            case OpKind.FE:
                return self.record(note.last)
            case OpKind.FS:
                return self.record_option(note.op.option)
            case OpKind.LOSS:
                return self.loss()
            case OpKind.B:
                return self.backward()
            case OpKind.OFFLOAD:
                return self.offload()
            case OpKind.PREFETCH:
                return self.prefetch()
            case OpKind.OFFLOAD_SAVED:
                return self.offload_saved()
            case OpKind.PREFETCH_SAVED:
                return self.prefetch_saved()
            case OpKind.WAIT:
                return self.wait(self.values)
            case OpKind.WAIT_SAVED:
                return self.wait(self.saved)
            case _:
                assert_never(kind)

    def fail(self, why: str) -> ValueError:
        op = self.op
        label = op.label if op.stage is None else op.with_stage(op.stage + self.first_stage).label
        return ValueError(f"invalid plan: op {self.i + self.first_op} ({label}): {why}")

    def finish(self) -> None:
        """A plan ends with every offloaded item back and holding `δ_0`."""
        if self.saved.on_host:
            k = min(self.saved.on_host)
            raise ValueError(
                f"invalid plan: the saved part of stage {k + self.first_stage} is offloaded and never prefetched; "
                "a plan ends with every offloaded part back"
            )
        if self.values.on_host:
            k = min(self.values.on_host)
            raise ValueError(
                f"invalid plan: a_{k + self.first_stage} is offloaded and never prefetched; a plan ends with every "
                "offloaded value back"
            )
        if not self.loss_done or self.next_backward != -1:
            expected = "Loss" if not self.loss_done else f"B {self.next_backward + self.first_stage}"
            raise ValueError(
                f"invalid plan: it ends before B {self.first_stage} (next expected: {expected}); "
                f"a plan must end holding δ_{self.first_stage}"
            )

    # -- compute's clock ------------------------------------------------------------------------------------
    def compute(self, seconds: float) -> None:
        self.times.append(seconds)
        self.now += seconds

    def idle_until(self, end: float) -> None:
        """Compute waits for a copy that ends at `end` (nothing when it has ended)."""
        if end > self.now:
            self.times.append(end - self.now)
            self.waits.append(end - self.now)
            self.now = end

    def wait_for(self, moves: _Moves, k: int) -> None:
        """Compute needs item k of `moves`: wait until its prefetch has ended."""
        end = moves.arriving.pop(k, None)
        if end is not None:
            self.idle_until(end)

    # -- forwards (Operations; chain versions 3 and 5) ----------------------------------------------------
    def forward_input(self, kind: OpKind) -> int:
        """Check that the forward of stage k has its input `a_k`, and wait for its prefetch; returns k."""
        k, n = self.k, self.k + self.first_stage
        if kind is OpKind.FN and k not in self.plain:
            raise self.fail(f"needs a_{n} held without graph" + (" (offloaded)" if k in self.values.on_host else ""))
        if k not in self.plain and k not in self.graph:
            raise self.fail(self.not_held(k))
        self.wait_for(self.values, k)
        if k in self.let_go:
            raise self.fail(f"a_{n} was partly let go after the last forward of stage {n} before B {n}")
        return k

    def not_held(self, k: int) -> str:
        n = k + self.first_stage
        return f"needs a_{n}, which is not held" + (
            f" (offloaded: Prefetch {n} first)" if k in self.values.on_host else ""
        )

    def forward_nograd(self) -> int:
        """`Fn k` and `Fc k`: hold `a_{k+1}` plain; `Fn` drops `a_k` (never `a_0`)."""
        kind = self.op.kind
        k = self.forward_input(kind)
        s = self.chain.sizes
        if k + 1 in self.plain:
            raise self.fail(f"a_{k + self.first_stage + 1} is already held")
        during = self.cur + s[k + 1] + self.chain.fwd_tmp_nograd[k]
        self.plain.add(k + 1)
        self.cur += s[k + 1]
        if kind is OpKind.FN and k != 0:
            self.plain.discard(k)
            self.cur -= s[k]
        self.compute(self.chain.fwd_time[k])
        return during

    def record(self, last: bool) -> int:
        """`Fe k`: hold `ā_{k+1}`; the last forward of stage k before `B k` lets `in_free[k]` of `a_k` go."""
        k = self.forward_input(OpKind.FE)
        if k + 1 in self.graph:
            raise self.fail(f"a_{k + self.first_stage + 1} is already held with its graph")
        during = self.cur + self.sb[k + 1] + self.chain.fwd_tmp[k]
        self.graph.add(k + 1)
        self.cur += self.sb[k + 1]
        in_free = self.chain.in_free[k]
        if last and in_free:  # after the op's peak: a_k lives only as far as graphs save it
            (self.early_plain if k in self.plain else self.early_graph)[k] = in_free
            self.let_go.add(k)
            self.cur -= in_free
        self.compute(self.chain.fwd_time[k])
        return during

    def record_option(self, o: int) -> int:
        """`Fs k:o` (chain version 5): hold `ā_{k+1}` with option o's figures; a_k stays (nothing released)."""
        k = self.forward_input(OpKind.FS)
        n = k + self.first_stage
        options = self.chain.options[k]
        if not 1 <= o <= len(options):
            raise self.fail(f"stage {n} has {len(options)} option(s) beside recording all (Fe)")
        if k + 1 in self.graph:
            raise self.fail(f"a_{n + 1} is already held with its graph")
        opt = options[o - 1]
        during = self.cur + opt.saved_size + opt.fwd_tmp
        self.graph.add(k + 1)
        self.recorded_by[k + 1] = o
        self.cur += opt.saved_size  # a_k stays: the option's backward recomputes from it (no release)
        self.compute(opt.fwd_time)
        return during

    def recorded(self, k: int) -> tuple[int, int, int, float]:
        """(sb_{k+1}, free part of a_{k+1}, bwd_tmp, bwd_time) of stage k as ā_{k+1} was recorded."""
        chain = self.chain
        o = self.recorded_by.get(k + 1, 0)
        if not o:
            return self.sb[k + 1], self.free[k + 1], chain.bwd_tmp[k], chain.bwd_time[k]
        opt = chain.options[k][o - 1]
        return opt.saved_size, opt.out_free, opt.bwd_tmp, opt.bwd_time

    # -- the loss and backwards (Operations; "The loss and its gradient"; chain version 2) --------------
    def loss(self) -> int:
        """`Loss`: hold `δ_L` and the loss value; a plain `a_L` leaves the plan, a recorded one keeps its graph."""
        chain, length, s = self.chain, self.length, self.chain.sizes
        if self.loss_done:
            raise self.fail("the loss is computed once per step")
        if length not in self.graph and length not in self.plain:
            raise self.fail(f"needs the chain output a_{length + self.first_stage}, which is not held")
        if length in self.graph:
            o = self.recorded_by.get(length, 0)
            last = chain.options[length - 1][o - 1] if o else None
            tmp = chain.loss_tmp_graph if last is None else chain.option_loss_tmp_graph(last)
            during = self.cur + s[length] + tmp
            self.released.add(length)
            self.cur -= self.recorded(length - 1)[1]
        else:
            during = self.cur + s[length] + chain.loss_tmp
            self.plain.discard(length)
            self.cur -= s[length]
        self.grads.add(length)
        self.cur += s[length] + chain.loss_value  # δ_L, and the loss value from here to the end
        self.loss_done = True
        return during

    def backward(self) -> int:
        """`B k`: hold `δ_k`; drop `ā_{k+1}` (its free part first), `δ_{k+1}` and a plain `a_k` (not `a_0`)."""
        k, n, s = self.k, self.k + self.first_stage, self.chain.sizes
        self.check_backward(k, n)
        self.wait_for(self.values, k)
        self.wait_for(self.saved, k)
        saved_k, free_k, bwd_tmp_k, bwd_time_k = self.recorded(k)
        if k + 1 not in self.released:  # the free part of a_{k+1} is let go before the backward runs
            self.cur -= free_k - self.early_graph.pop(k + 1, 0)
        self.released.discard(k + 1)
        during = self.cur + s[k] + bwd_tmp_k
        self.graph.discard(k + 1)
        self.recorded_by.pop(k + 1, None)
        self.grads.discard(k + 1)
        self.grads.add(k)
        self.cur += s[k] - (saved_k - free_k) - s[k + 1]
        if k in self.plain and k != 0:
            self.plain.discard(k)
            self.cur -= s[k] - self.early_plain.pop(k, 0)
        self.compute(bwd_time_k)
        self.next_backward -= 1
        return during

    def check_backward(self, k: int, n: int) -> None:
        if not self.loss_done:
            raise self.fail("backward before the loss")
        if k != self.next_backward:
            raise self.fail(
                f"backwards run B {self.length + self.first_stage - 1} … B {self.first_stage} in order; "
                f"expected B {self.next_backward + self.first_stage}"
            )
        if k + 1 not in self.graph:
            raise self.fail(f"needs a_{n + 1} with its graph (run Fe {n} first)")
        if k + 1 not in self.grads:
            raise self.fail(f"needs the gradient δ_{n + 1}")
        if k not in self.plain and k not in self.graph:
            raise self.fail(self.not_held(k))
        if k in self.saved.on_host:
            raise self.fail(f"the saved part of stage {n} is on the host (PrefetchSaved {n} first)")

    # -- transfers (chain version 6: "Chain version 6", "Transfers across several operations") -----------
    def settle(self) -> list[Op]:
        """Copies ended by `now` free their source: an offload's device copy, a prefetch's host copy. Returns
        the wait that would make each offload's release independent of the times (`Wait j`, `WaitSaved j`)."""
        released: list[Op] = []
        for moves, kind in ((self.values, OpKind.WAIT), (self.saved, OpKind.WAIT_SAVED)):
            for j, end in list(moves.leaving.items()):
                if end <= self.now:
                    self.cur -= moves.sizes[j]
                    del moves.leaving[j]
                    released.append(Op(kind, j))
            for j, end in list(moves.host_freed.items()):
                if end <= self.now:
                    self.host -= moves.sizes[j]
                    del moves.host_freed[j]
        return released

    def transfer(self, size: int) -> float:
        """Issue a copy of `size` bytes on the channel now; its end."""
        self.channel = max(self.now, self.channel) + size / self.chain.bandwidth
        return self.channel

    def check_channel(self) -> None:
        if self.chain.bandwidth <= 0:
            raise self.fail("the chain has no transfer bandwidth (bandwidth 0: no offloading)")

    def send(self, moves: _Moves, k: int) -> int:
        """Start copying item k of `moves` to host memory; its device copy stays until the copy ends."""
        size = moves.sizes[k]
        moves.leaving[k] = moves.issued[k] = self.transfer(size)
        moves.on_host.add(k)
        self.host += size
        limit = self.chain.host_limit
        if limit is not None and self.host > limit:
            raise self.fail(f"host memory {self.host} bytes exceeds the chain's host_limit {limit}")
        self.host_peak = max(self.host_peak, self.host)
        return self.cur

    def fetch(self, moves: _Moves, k: int) -> int:
        """Start copying item k of `moves` back: it occupies device memory from the prefetch's start."""
        moves.on_host.discard(k)
        self.cur += moves.sizes[k]
        moves.arriving[k] = moves.host_freed[k] = moves.issued[k] = self.transfer(moves.sizes[k])
        self.host_peak = max(self.host_peak, self.host)
        return self.cur

    def offload(self) -> int:
        """`Offload k`: a kept stage input held without graph goes to host memory."""
        k, n = self.check_value_transfer()
        if k not in self.plain:
            why = "is held with its graph" if k in self.graph else "is not held"
            raise self.fail(f"offloads a kept stage input held without graph; a_{n} {why}")
        if k + 1 in self.graph:
            raise self.fail(f"the graph of stage {n} is held and may keep a_{n}: offload before Fe {n}")
        if k in self.values.arriving:
            raise self.fail(f"a_{n} is still being prefetched")
        if k in self.early_plain:
            raise self.fail(f"a_{n} was partly let go after the last forward of stage {n}")
        self.plain.discard(k)
        return self.send(self.values, k)

    def prefetch(self) -> int:
        """`Prefetch k`: `a_k` back, plain."""
        k, n = self.check_value_transfer()
        if k not in self.values.on_host:
            raise self.fail(f"a_{n} is not on the host (no Offload {n} before)")
        during = self.fetch(self.values, k)
        self.plain.add(k)
        return during

    def check_value_transfer(self) -> tuple[int, int]:
        self.check_channel()
        if self.k == 0:
            raise self.fail("a_0 is the caller's: offloading it frees nothing")
        return self.k, self.k + self.first_stage

    def offload_saved(self) -> int:
        """`OffloadSaved k`: the offloadable part of what `Fe k` recorded goes to host memory."""
        self.check_channel()
        k, n = self.k, self.k + self.first_stage
        if k + 1 not in self.graph:
            raise self.fail(f"needs a_{n + 1} recorded by Fe {n} (its graph holds the saved part)")
        if self.recorded_by.get(k + 1, 0):
            raise self.fail(
                f"a_{n + 1} was recorded by Fs {n}:{self.recorded_by[k + 1]}; only Fe {n}'s saved part moves"
            )
        if not self.chain.offloadable[k]:
            raise self.fail(f"stage {n} has nothing offloadable (offloadable[{n}] is 0)")
        if k in self.saved.on_host:
            raise self.fail(f"the saved part of stage {n} is already on the host")
        if k in self.saved.arriving:
            raise self.fail(f"the saved part of stage {n} is still being prefetched")
        return self.send(self.saved, k)

    def prefetch_saved(self) -> int:
        """`PrefetchSaved k`: stage k's saved part back, for `B k`."""
        self.check_channel()
        k, n = self.k, self.k + self.first_stage
        if k not in self.saved.on_host:
            raise self.fail(f"the saved part of stage {n} is not on the host (no OffloadSaved {n} before)")
        return self.fetch(self.saved, k)

    def wait(self, moves: _Moves) -> int:
        """`Wait k` / `WaitSaved k`: compute idles until the latest copy of item k has ended."""
        k = self.k
        if k not in moves.issued:
            raise self.fail(
                f"no copy of {moves.name(k + self.first_stage)} was issued before (Offload/Prefetch it first)"
            )
        during = self.cur  # held while compute idles; what the copy frees goes at its end
        self.idle_until(moves.issued[k])
        self.settle()
        return during


def no_recompute_peak(chain: Chain) -> int:
    """Peak of the no-recomputation schedule: what fractional budgets are fractions of."""
    return simulate(chain, no_recompute_ops(chain.length, chain.frozen)).peak
