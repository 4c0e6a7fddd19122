"""Replay a schedule on a chain under the memory model's rules.

The simulator is the referee (docs/memory-model.md): a plan is valid
when it replays here within its budget, and the planner's reported peak and
time must equal what this module computes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from lightning_rotor.chain import Chain
from lightning_rotor.ops import (
    Op,
    OpKind,
    check_frozen_prefix,
    last_forwards,
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
    )


class _Replay(NamedTuple):
    peak: int
    times: list[float]  # op times, and the waits for prefetches among them
    curve: list[int]
    op_peaks: list[int]
    host_curve: list[int]
    host_peak: int
    waits: list[float]


def _replay(chain: Chain, ops: list[Op], first_op: int = 0, first_stage: int = 0) -> _Replay:
    """Replay an ordinary chain; errors name ops `first_op`, stages `first_stage` on.

    Transfers (chain version 6) run on one channel beside compute: compute's clock `now` advances by
    each op's time and by waits for prefetched values; the channel serves transfers in issue order.
    An offloaded `a_k` leaves device memory at the start of the first op at or after its copy ends; a
    prefetched one occupies it from the prefetch on (docs/memory-model.md, "Offloading"). The saved part
    of a recorded stage k (`offloadable[k]` bytes of the graph `Fe k` recorded) moves the same way, by
    `OffloadSaved k` and `PrefetchSaved k`; only `B k` reads it. `Wait k` (`WaitSaved k`) idles compute
    until the latest copy of `a_k` (of stage k's saved part) has ended, so what it frees is free from then on.
    """
    length = chain.length
    s = chain.sizes
    sb = [0, *chain.saved_size]  # sb[k] is the bytes of the recorded value ā_k
    plain = {0}  # values a_k held without graph; a_0 is the caller's and always held
    graph: set[int] = set()  # ā_k: value a_k with the graph of F_{k-1}
    released: set[int] = set()  # ā_k whose free part (out_free[k-1]) is already let go
    free = [0, *chain.out_free]  # free[k]: bytes of a_k that ā_k's own graph does not keep
    grads: set[int] = set()  # δ_k
    # chain version 5: ā_{k+1} recorded by option o >= 1 of stage k (Fs k:o) is held with that option's figures
    recorded_by: dict[int, int] = {}  # k+1: the option that recorded ā_{k+1} (absent: option 0, Fe k)

    def recorded(k: int) -> tuple[int, int, int, float]:
        """(sb_{k+1}, free part of a_{k+1}, bwd_tmp, bwd_time) of stage k as ā_{k+1} was recorded."""
        o = recorded_by.get(k + 1, 0)
        if not o:
            return sb[k + 1], free[k + 1], chain.bwd_tmp[k], chain.bwd_time[k]
        opt = chain.options[k][o - 1]
        return opt.saved_size, opt.out_free, opt.bwd_tmp, opt.bwd_time

    # chain version 3: after the last forward of stage k before B k (an Fe k, k >= 1), the in_free[k]
    # bytes of a_k that neither graph keeps are let go, from the plain a_k when held, else from ā_k
    in_free = chain.in_free
    last_forward = last_forwards(ops, length) if any(in_free) else set()
    early_plain: dict[int, int] = {}  # k: bytes of a plain a_k already let go (B k drops the rest)
    early_graph: dict[int, int] = {}  # k: bytes of ā_k's free part already let go (B k-1 lets go the rest)
    let_go: set[int] = set()  # stages whose input was partly let go: no forward of them may follow
    cur = s[0]
    peak = cur
    times: list[float] = []
    curve: list[int] = []
    op_peaks: list[int] = []
    loss_done = False
    next_backward = length - 1
    # the transfer channel (chain version 6)
    bandwidth = chain.bandwidth
    now = 0.0  # compute's clock
    channel = 0.0  # when the channel is free
    leaving: dict[int, float] = {}  # k: end of a_k's offload (its device copy is still held until then)
    on_host: set[int] = set()  # a_k offloaded and not yet prefetched
    arriving: dict[int, float] = {}  # k: end of a_k's prefetch (compute needing a_k waits for it)
    host_freed: dict[int, float] = {}  # k: when a_k's host copy goes (its prefetch ends)
    # the saved part of stage k's graph: same timeline, its own key space (stage k, not value a_k)
    offloadable = chain.offloadable
    saved_leaving: dict[int, float] = {}
    saved_on_host: set[int] = set()
    saved_arriving: dict[int, float] = {}
    saved_host_freed: dict[int, float] = {}
    host = host_peak = 0
    host_curve: list[int] = []
    waits: list[float] = []

    def fail(i: int, op: Op, why: str) -> ValueError:
        label = op.label if op.stage is None else op.with_stage(op.stage + first_stage).label
        return ValueError(f"invalid plan: op {i + first_op} ({label}): {why}")

    def transfer(size: int) -> float:
        """Issue a copy of `size` bytes on the channel now; its end."""
        nonlocal channel
        channel = max(now, channel) + size / bandwidth
        return channel

    def wait_for(k: int, arrivals: dict[int, float] | None = None) -> None:
        """Compute needs a_k (or, from `saved_arriving`, stage k's saved part): wait until its prefetch has ended."""
        nonlocal now
        end = (arriving if arrivals is None else arrivals).pop(k, None)
        if end is not None and end > now:
            times.append(end - now)
            waits.append(end - now)
            now = end

    issued: dict[int, float] = {}  # k: end of the latest copy of a_k issued (what `Wait k` waits for)
    saved_issued: dict[int, float] = {}  # k: the same for stage k's saved part (`WaitSaved k`)

    def settle() -> None:
        """Copies ended by `now` free their source: an offload's device copy, a prefetch's host copy."""
        nonlocal cur, host
        for j, end in list(leaving.items()):  # offloads done by now free their device copy
            if end <= now:
                cur -= s[j]
                del leaving[j]
        for j, end in list(host_freed.items()):  # prefetches done by now free their host copy
            if end <= now:
                host -= s[j]
                del host_freed[j]
        for j, end in list(saved_leaving.items()):
            if end <= now:
                cur -= offloadable[j]
                del saved_leaving[j]
        for j, end in list(saved_host_freed.items()):
            if end <= now:
                host -= offloadable[j]
                del saved_host_freed[j]

    def not_held(k: int, n: int) -> str:
        return f"needs a_{n}, which is not held" + (f" (offloaded: Prefetch {n} first)" if k in on_host else "")

    for i, op in enumerate(ops):
        kind = op.kind
        k = -1 if op.stage is None else op.stage  # -1: the loss, which has no stage
        n = k + first_stage  # the stage's index in messages
        if kind is not OpKind.LOSS and not 0 <= k < length:
            raise fail(i, op, f"stage index out of range 0..{length + first_stage - 1}")
        settle()
        if kind is OpKind.WAIT or kind is OpKind.WAIT_SAVED:
            saved = kind is OpKind.WAIT_SAVED
            if k not in (saved_issued if saved else issued):
                what = f"the saved part of stage {n}" if saved else f"a_{n}"
                raise fail(i, op, f"no copy of {what} was issued before (Offload/Prefetch it first)")
            end = (saved_issued if saved else issued)[k]
            during = cur  # held while compute idles; what the copy frees goes at its end
            if end > now:
                times.append(end - now)
                waits.append(end - now)
                now = end
            settle()
            peak = max(peak, during)
            op_peaks.append(during)
            curve.append(cur)
            host_curve.append(host)
            continue
        if kind is OpKind.OFFLOAD_SAVED or kind is OpKind.PREFETCH_SAVED:
            if bandwidth <= 0:
                raise fail(i, op, "the chain has no transfer bandwidth (bandwidth 0: no offloading)")
            if kind is OpKind.OFFLOAD_SAVED:
                if k + 1 not in graph:
                    raise fail(i, op, f"needs a_{n + 1} recorded by Fe {n} (its graph holds the saved part)")
                if recorded_by.get(k + 1, 0):
                    raise fail(
                        i, op, f"a_{n + 1} was recorded by Fs {n}:{recorded_by[k + 1]}; only Fe {n}'s saved part moves"
                    )
                if not offloadable[k]:
                    raise fail(i, op, f"stage {n} has nothing offloadable (offloadable[{n}] is 0)")
                if k in saved_on_host:
                    raise fail(i, op, f"the saved part of stage {n} is already on the host")
                if k in saved_arriving:
                    raise fail(i, op, f"the saved part of stage {n} is still being prefetched")
                saved_leaving[k] = saved_issued[k] = transfer(offloadable[k])
                saved_on_host.add(k)
                host += offloadable[k]
                if chain.host_limit is not None and host > chain.host_limit:
                    raise fail(i, op, f"host memory {host} bytes exceeds the chain's host_limit {chain.host_limit}")
            else:
                if k not in saved_on_host:
                    raise fail(i, op, f"the saved part of stage {n} is not on the host (no OffloadSaved {n} before)")
                saved_on_host.discard(k)
                cur += offloadable[k]  # on the device again from the prefetch's start
                saved_arriving[k] = saved_host_freed[k] = saved_issued[k] = transfer(offloadable[k])
            host_peak = max(host_peak, host)
            peak = max(peak, cur)
            op_peaks.append(cur)
            curve.append(cur)
            host_curve.append(host)
            continue
        if kind is OpKind.OFFLOAD or kind is OpKind.PREFETCH:
            if bandwidth <= 0:
                raise fail(i, op, "the chain has no transfer bandwidth (bandwidth 0: no offloading)")
            if k == 0:
                raise fail(i, op, "a_0 is the caller's: offloading it frees nothing")
            if kind is OpKind.OFFLOAD:
                if k not in plain:
                    why = "is held with its graph" if k in graph else "is not held"
                    raise fail(i, op, f"offloads a kept stage input held without graph; a_{n} {why}")
                if k + 1 in graph:
                    raise fail(i, op, f"the graph of stage {n} is held and may keep a_{n}: offload before Fe {n}")
                if k in arriving:
                    raise fail(i, op, f"a_{n} is still being prefetched")
                if k in early_plain:
                    raise fail(i, op, f"a_{n} was partly let go after the last forward of stage {n}")
                plain.discard(k)
                leaving[k] = issued[k] = transfer(s[k])
                on_host.add(k)
                host += s[k]
                if chain.host_limit is not None and host > chain.host_limit:
                    raise fail(i, op, f"host memory {host} bytes exceeds the chain's host_limit {chain.host_limit}")
                during = cur
            else:
                if k not in on_host:
                    raise fail(i, op, f"a_{n} is not on the host (no Offload {n} before)")
                on_host.discard(k)
                cur += s[k]  # the prefetched copy occupies device memory from the prefetch's start
                arriving[k] = host_freed[k] = issued[k] = transfer(s[k])
                plain.add(k)
                during = cur
            host_peak = max(host_peak, host)
            peak = max(peak, during)
            op_peaks.append(during)
            curve.append(cur)
            host_curve.append(host)
            continue
        if kind is OpKind.FN or kind is OpKind.FC or kind is OpKind.FE or kind is OpKind.FS:
            if kind is OpKind.FN and k not in plain:
                raise fail(i, op, f"needs a_{n} held without graph" + (" (offloaded)" if k in on_host else ""))
            if k not in plain and k not in graph:
                raise fail(i, op, not_held(k, n))
            wait_for(k)
            if k in let_go:
                raise fail(i, op, f"a_{n} was partly let go after the last forward of stage {n} before B {n}")
            fwd_time = chain.fwd_time[k]
            if kind is OpKind.FS:
                o = op.option
                if not 1 <= o <= len(chain.options[k]):
                    raise fail(i, op, f"stage {n} has {len(chain.options[k])} option(s) beside recording all (Fe)")
                if k + 1 in graph:
                    raise fail(i, op, f"a_{n + 1} is already held with its graph")
                opt = chain.options[k][o - 1]
                during = cur + opt.saved_size + opt.fwd_tmp
                graph.add(k + 1)
                recorded_by[k + 1] = o
                cur += opt.saved_size  # a_k stays: the option's backward recomputes from it (no release)
                fwd_time = opt.fwd_time
            elif kind is OpKind.FE:
                if k + 1 in graph:
                    raise fail(i, op, f"a_{n + 1} is already held with its graph")
                during = cur + sb[k + 1] + chain.fwd_tmp[k]
                graph.add(k + 1)
                cur += sb[k + 1]
                if i in last_forward and in_free[k]:  # after the op's peak: a_k lives only as far as graphs save it
                    (early_plain if k in plain else early_graph)[k] = in_free[k]
                    let_go.add(k)
                    cur -= in_free[k]
            else:
                if k + 1 in plain:
                    raise fail(i, op, f"a_{n + 1} is already held")
                during = cur + s[k + 1] + chain.fwd_tmp_nograd[k]
                plain.add(k + 1)
                cur += s[k + 1]
                if kind is OpKind.FN and k != 0:
                    plain.discard(k)
                    cur -= s[k]
            times.append(fwd_time)
            now += fwd_time
        elif kind is OpKind.LOSS:
            if loss_done:
                raise fail(i, op, "the loss is computed once per step")
            if length not in graph and length not in plain:
                raise fail(i, op, f"needs the chain output a_{length + first_stage}, which is not held")
            # a_L is handed to the loss: plain, it leaves the plan; with its graph, the plan keeps only the graph
            if length in graph:
                o = recorded_by.get(length, 0)
                last = chain.options[length - 1][o - 1] if o else None
                during = cur + s[length] + (chain.loss_tmp_graph if last is None else chain.option_loss_tmp_graph(last))
                released.add(length)
                cur -= recorded(length - 1)[1]
            else:
                during = cur + s[length] + chain.loss_tmp
                plain.discard(length)
                cur -= s[length]
            grads.add(length)
            cur += s[length] + chain.loss_value  # δ_L, and the loss value from here to the end
            loss_done = True
        elif kind is OpKind.B:
            if not loss_done:
                raise fail(i, op, "backward before the loss")
            if k != next_backward:
                raise fail(
                    i,
                    op,
                    f"backwards run B {length + first_stage - 1} … B {first_stage} in order; "
                    f"expected B {next_backward + first_stage}",
                )
            if k + 1 not in graph:
                raise fail(i, op, f"needs a_{n + 1} with its graph (run Fe {n} first)")
            if k + 1 not in grads:
                raise fail(i, op, f"needs the gradient δ_{n + 1}")
            if k not in plain and k not in graph:
                raise fail(i, op, not_held(k, n))
            if k in saved_on_host:
                raise fail(i, op, f"the saved part of stage {n} is on the host (PrefetchSaved {n} first)")
            wait_for(k)
            wait_for(k, saved_arriving)
            saved_k, free_k, bwd_tmp_k, bwd_time_k = recorded(k)
            if k + 1 not in released:  # the free part of a_{k+1} is let go before the backward runs
                cur -= free_k - early_graph.pop(k + 1, 0)
            released.discard(k + 1)
            during = cur + s[k] + bwd_tmp_k
            graph.discard(k + 1)
            recorded_by.pop(k + 1, None)
            grads.discard(k + 1)
            grads.add(k)
            cur += s[k] - (saved_k - free_k) - s[k + 1]
            if k in plain and k != 0:
                plain.discard(k)
                cur -= s[k] - early_plain.pop(k, 0)
            times.append(bwd_time_k)
            now += bwd_time_k
            next_backward -= 1
        else:
            raise fail(i, op, f"the simulator has no rule for {kind.value} ops")
        peak = max(peak, during)
        op_peaks.append(during)
        curve.append(cur)
        host_curve.append(host)
    if saved_on_host:
        k = min(saved_on_host)
        raise ValueError(
            f"invalid plan: the saved part of stage {k + first_stage} is offloaded and never prefetched; a plan "
            "ends with every offloaded part back"
        )
    if on_host:
        k = min(on_host)
        raise ValueError(
            f"invalid plan: a_{k + first_stage} is offloaded and never prefetched; a plan ends with every "
            "offloaded value back"
        )
    if not loss_done or next_backward != -1:
        expected = "Loss" if not loss_done else f"B {next_backward + first_stage}"
        raise ValueError(
            f"invalid plan: it ends before B {first_stage} (next expected: {expected}); "
            f"a plan must end holding δ_{first_stage}"
        )
    return _Replay(peak, times, curve, op_peaks, host_curve, host_peak, waits)


def no_recompute_peak(chain: Chain) -> int:
    """Peak of the no-recomputation schedule: what fractional budgets are fractions of."""
    return simulate(chain, no_recompute_ops(chain.length, chain.frozen)).peak
