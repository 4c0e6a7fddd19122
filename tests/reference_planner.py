"""The tests' oracle for the C++ dynamic program: the same recursion in plain Python.

Slow (memoised recursion, one memory value at a time), but short enough to check by
eye against docs/memory-model.md; docs/planner.md derives the recursion. It plans and
never scores: the tests replay its schedules with `simulate`, the one referee.

Subproblem `(s, t, given, m)`: the caller holds `a_s` (outside the subproblem)
and, when `given`, the gradient `δ_t`; otherwise `t == L` and the loss is still
to be computed. Compute `δ_s` using at most `m` slots above what the caller
holds. Two ways to start:

- **Fe s**: record stage `s`, solve `(s+1, t)` with `sb_{s+1} - in_free_s` fewer slots,
  then `B s`. `Fe s` is the last forward of stage `s` before `B s`, so `in_free_s` bytes of
  `a_s` (kept by neither graph; 0 for `s = 0`) are let go after it (chain version 3),
  whether the caller holds `a_s` plain or recorded: one table serves both.
- **checkpoint s → s2**: `Fc s, Fn s+1 … Fn s2-1` reach `a_{s2}`; solve the right
  part `(s2, t)` with `a_{s2}` held, then the left part `(s, s2, given=True)`.
  When the loss is pending and `s2 == L`, the right part is the loss on plain `a_L`.

Chain version 5: recording stage `s` may also be **Fs s:o**, option `o >= 1` of the stage (a
selection saved, the rest recomputed in its backward): the same as `Fe s` with the option's
figures (`sb^o`, `fwd_tmp^o`, `bwd_net^o`, its loss charge, its costs) and no release of `a_s`.
Choices are tried in the order `Fe s`, `Fs s:1`, `Fs s:2` …, then the checkpoints, and the first
of least cost wins (the C++ planner's order).

`B s` is charged `sb_{s+1} + s_{s+1} + s_s + bwd_net_s - in_free_s` (the free part of
`a_{s+1}` released inside `bwd_net`), the loss on a recorded `a_L`
`sb_L + s_L + loss_tmp_graph - in_free_{L-1}` (docs/memory-model.md, part 2). With the loss
pending, whatever runs after it (`B s`, the left part of a split) also holds the loss value
(`loss_value`, chain version 3).

Offloading (chain version 6, `d.transfer_cost` given; docs/planner.md, "Offloading"): a split
`s -> s2` whose input `a_s` the caller holds plain may also **offload** it during the right part:
`Fc s, Offload s, Fn s+1 … Fn s2-1, <right part but its last op>, Prefetch s, B s2, <left part>`.
The right part gets `a_s`'s slots; the prefetch and `B s2` must fit without them; the copy must
surely end within the sweep; the left part's first op waits for what of the prefetch `B s2` does not
hide. So every subproblem comes in two flavours: "plain" (`a_s` held without graph: offloading
allowed) and "any" (today's choices). Right parts are plain; `Fe s` hands `(s+1, t)` an "any" one;
left parts keep the flavour of their subproblem. Both flavours are infeasible where today's
recursion is (the tables start where today's do). The offload variant comes right after the plain
split of the same `s2` in the order of choices.

Saved parts (chain version 6, `d.saved_transfer_cost` given; docs/planner.md, "Offloading"): in either
flavour, recording `Fe s` may also move the saved part of stage `s` (`d.offloadable[s]` slots) to host
memory while `(s+1, t)` runs: `Fe s, OffloadSaved s, <(s+1, t) but its last op>, PrefetchSaved s,
B s+1, B s`. `(s+1, t)` gets the part's slots; its first op (a forward of stage s+1, during which the copy
surely ends) and its last (`B s+1`, after the prefetch) must fit without them; `B s` waits for what of the
prefetch `B s+1` does not hide. Allowed when `s + 1 < t` and stage `s+1` has no options. The variant comes
right after `Fe s` in the order of choices.
"""

from __future__ import annotations

import sys
from functools import cache

from lightning_rotor.chain import Chain
from lightning_rotor.discretize import DEFAULT_SLOTS, DiscreteChain, discretize

INFEASIBLE = None


def solve(d: DiscreteChain) -> tuple[int, list[tuple]] | None:
    """Least cost and its ops for the whole chain within `d.slots`, or None when nothing fits."""
    length, size, saved = d.length, d.size, d.saved
    ft, ft_ng, bt, lt, ltg = d.fwd_tmp, d.fwd_tmp_nograd, d.bwd_tmp, d.loss_tmp, d.loss_tmp_graph
    inf, lv = d.in_free, d.loss_value
    options = d.options or [[] for _ in range(length)]
    tc, cb = d.transfer_cost, d.count_bits  # tc: [] without offloading
    stc, off = d.saved_transfer_cost, movable(d.offloadable, saved, inf)  # []: no saved part moves

    def saved_offloadable(s: int, t: int) -> bool:
        """Whether Fe s may offload its saved part while (s+1, t) runs: the copy surely ends within Fe/Fc s+1."""
        if not stc or off[s] <= 0 or s + 1 >= t or options[s + 1]:
            return False
        return (stc[s] >> cb) + 1 <= d.fwd_cost[s + 1] >> cb

    def saved_need(s: int, t: int, given: bool) -> int:
        """Least m of (s, t) for the saved-part variant: Fe s, and (s+1, t)'s first and last ops with the part there."""
        held = size[t] if given else 0
        first = held + max(saved[s + 1] + ft[s + 1], size[s + 2] + ft_ng[s + 1])
        before = saved[s + 1] - inf[s + 1] + size[s + 2] + (0 if given else lv)  # at PrefetchSaved s
        last = max(before, before + size[s + 1] + bt[s + 1])  # B s+1
        return max(fe_need(s, t, given), saved[s] - inf[s] + max(first, last))

    def ticks(cost: int) -> int:
        return cost >> cb

    @cache
    def runs(s: int, t: int, given: bool) -> tuple[tuple[int, int, int, int, int, bool], ...]:
        """The debt runs of (s, t): (j, i, need, cost, base_j, wait) per run `Fe s, OffloadSaved s, Fe s+1 … Fe j-1,
        [WaitSaved s], (j, t), B j-1 … B s+1, B s` with `PrefetchSaved s` before `B i` (i = j: before (j, t)'s last op).

        The offload debt is paid by the forwards s+1 … j-1 (the part still on the device while one may run before
        the copy ends) and by the wait; the prefetch debt by the backwards i … s+1, and `B s` waits for the rest.
        `need`: the least m of the run but (j, t) itself, read at `m - base_j + off[s]`; `cost`: the run's ops and
        stalls but (j, t). Runs stop at the first j whose forwards and backwards both hide the copy.
        """
        if not stc or off[s] <= 0:
            return ()
        part, copy = off[s], stc[s]
        held, after = (size[t], 0) if given else (0, lv)

        def before(k: int) -> int:  # held in (k, t)'s frame just before B k: its graph, δ_{k+1}, the loss value
            return saved[k] - inf[k] + size[k + 1] + after

        def bpeak(k: int) -> int:  # B k in (k, t)'s frame
            return before(k) + size[k] + bt[k]

        gone = inf[s + 1] if s + 1 < t and not options[s + 1] else 0  # a_{s+1}'s part Fe s+1 let go before B s
        head = max(held + saved[s] + ft[s], bpeak(s), before(s) - gone)  # Fe s, B s and the prefetch before it
        base = [0] * (t + 1)  # base[k]: (s, t)'s frame to (k, t)'s, the part included
        base[s + 1] = saved[s] - inf[s]
        for k in range(s + 1, t):
            base[k + 1] = base[k] + saved[k] - inf[k]
        found = []
        forwards = sum(d.fwd_cost[k] + d.bwd_cost[k] for k in range(s, s + 1))
        front = head
        for j in range(s + 1, t + 1):
            if j > s + 1:  # Fe j-1, the part still there unless the copy surely ended before it started
                k = j - 1
                gone = done_after(copy, s + 1, k)
                front = max(front, held + base[k] - (part if gone else 0) + saved[k] + ft[k])
                forwards += d.fwd_cost[k] + d.bwd_cost[k]
            wait = not done_after(copy, s + 1, j)
            need_j = front
            if j == t and not given:  # the loss, the part away
                need_j = max(need_j, base[t - 1] + saved[t - 1] + size[t] + ltg - inf[t - 1] - part)
            last = j if (j < t and not options[j]) else j - 1
            for i in range(s, last + 1):
                need = need_j
                for k in range(s + 1, min(i, j - 1) + 1):  # B k with the part back
                    need = max(need, base[k] + bpeak(k))
                for k in range(max(i, s) + 1, j):  # B k before the prefetch
                    need = max(need, base[k] - part + bpeak(k))
                if i == j:
                    need = max(need, base[j] + before(j), base[j] + bpeak(j))
                elif i > s:
                    need = max(need, base[i] + before(i))
                window = sum(d.bwd_cost[s + 1 : i + 1])
                cost = forwards + front_stall(copy, s + 1, j) + max(0, copy - window)
                found.append((j, i, need, cost, base[j] if j < t else 0, wait))
            hidden = sum(d.bwd_cost[s + 1 : j]) >= copy
            if not wait and hidden:
                break
        return tuple(found)

    def offloadable(s: int, t: int, given: bool, s2: int) -> bool:
        """Whether the split s -> s2 may offload a_s (a `Wait s` before the right part pays what the sweep does not)."""
        return bool(tc) and s >= 1 and (given or s2 != length) and s2 < t and not options[s2]

    def done_after(copy: int, start: int, end: int) -> bool:
        """Whether a copy (a cost) issued before the forwards start … end-1 surely ends by their end.

        One tick per forward for their rounding to the nearest tick (the copy is rounded up).
        """
        return ticks(copy) + (end - start) <= sum(ticks(c) for c in d.fwd_cost[start:end])

    def front_stall(copy: int, start: int, end: int) -> int:
        """Idle time (a cost) of a `Wait` after the forwards start … end-1 for a copy issued before them."""
        return max(0, ticks(copy) - sum(ticks(c) for c in d.fwd_cost[start:end])) << cb

    def prefetch_need(s2: int, given: bool) -> int:
        """Least m for the prefetch of a_s and B s2 with a_s back on the device."""
        held = saved[s2] - inf[s2] + size[s2 + 1] + (0 if given else lv)
        return size[s2] + max(held, held + size[s2] + bt[s2])

    def record(s: int, o: int) -> tuple[int, int, int, int, int, int]:
        """(saved, fwd_tmp, bwd_net, released, loss on a recorded a_L, fwd + bwd cost) of recording s with option o."""
        if o == 0:
            return saved[s], ft[s], bt[s], inf[s], ltg, d.fwd_cost[s] + d.bwd_cost[s]
        x = options[s][o - 1]
        return x.saved, x.fwd_tmp, x.bwd_tmp, 0, x.loss_tmp_graph, x.fwd_cost + x.bwd_cost

    def fe_need(s: int, t: int, given: bool, o: int = 0) -> int:
        sb, tmp, net, free, loss, _ = record(s, o)
        held = size[t] if given else 0
        after = 0 if given else lv  # B s runs after the loss: with the loss pending here, its value is held by then
        need = max(held + sb + tmp, sb + size[s + 1] + size[s] + net - free + after)
        if not given and s + 1 == length:
            need = max(need, sb + size[length] + loss - free)
        return need

    def forward_need(s: int, s2: int, given: bool, t: int) -> int:
        held = size[t] if given else 0
        need = size[s + 1] + ft_ng[s]
        for j in range(s + 1, s2):
            need = max(need, size[j] + size[j + 1] + ft_ng[j])
        return held + need

    @cache
    def best(s: int, t: int, given: bool, m: int, flavour: str = "today") -> tuple[int, tuple] | None:
        """(cost, choice) where choice is ('Fe', o) (o >= 1: Fs s:o), ('Fe-saved', 0), ('ck', s2) or ('off', s2).

        `flavour`: "today" (no offloading anywhere), or with offloading "any" or "plain" (a_s held plain).
        """
        if m < 0:
            return None
        inner = "today" if flavour == "today" else "any"  # after Fe s, a_{s+1} is recorded
        rights = "today" if flavour == "today" else "plain"  # a split's a_{s2} is plain
        found: tuple[int, tuple] | None = None
        for o in range(len(options[s]) + 1):
            if m < fe_need(s, t, given, o):
                continue
            sb, _, _, free, _, step = record(s, o)
            sub = None if s + 1 == t else best(s + 1, t, given, m - sb + free, inner)
            if s + 1 == t or sub is not None:
                cost = step + (sub[0] if sub is not None else 0)
                if found is None or cost < found[0]:
                    found = (cost, ("Fe", o))
            if o == 0 and flavour != "today" and saved_offloadable(s, t) and m >= saved_need(s, t, given):
                sub = best(s + 1, t, given, m - sb + free + off[s], inner)  # the saved part is away meanwhile
                if sub is not None:
                    cost = step + max(0, stc[s] - d.bwd_cost[s + 1]) + sub[0]
                    if found is None or cost < found[0]:
                        found = (cost, ("Fe-saved", 0))
        for n, (j, _, need, extra, base_j, _) in enumerate(runs(s, t, given) if flavour != "today" else ()):
            if m < need:
                continue
            sub = (0, ()) if j == t else best(j, t, given, m - base_j + off[s], inner)
            if sub is not None and (found is None or extra + sub[0] < found[0]):
                found = (extra + sub[0], ("run", n))
        last = t if not given else t - 1
        forward = 0
        for s2 in range(s + 1, last + 1):
            forward += d.fwd_cost[s2 - 1]
            if m < forward_need(s, s2, given, t):
                break  # the forward run only needs more memory as s2 grows
            left = best(s, s2, True, m - (0 if given else lv), flavour)  # after the loss: its value is held
            if left is None:
                continue
            right: int | None = None
            if not given and s2 == length:
                right = 0 if m >= 2 * size[length] + lt else None
            else:
                sub = best(s2, t, given, m - size[s2], rights)
                right = None if sub is None else sub[0]
            if right is not None:
                cost = forward + right + left[0]
                if found is None or cost < found[0]:
                    found = (cost, ("ck", s2))
            if flavour == "plain" and offloadable(s, t, given, s2) and m >= prefetch_need(s2, given):
                sub = best(s2, t, given, m - size[s2] + size[s], "plain")  # a_s's slots are free meanwhile
                if sub is not None:
                    stall = front_stall(tc[s], s + 1, s2) + max(0, tc[s] - d.bwd_cost[s2])
                    cost = forward + stall + sub[0] + left[0]
                    if found is None or cost < found[0]:
                        found = (cost, ("off", s2))
        return found

    def ops(s: int, t: int, given: bool, m: int, flavour: str = "today") -> list[tuple]:
        _, choice = best(s, t, given, m, flavour)
        inner = "today" if flavour == "today" else "any"
        rights = "today" if flavour == "today" else "plain"
        if choice[0] == "run":
            j, i, _, _, base_j, wait = runs(s, t, given)[choice[1]]
            middle = [("Fe", k) for k in range(s + 1, j)] + ([("WaitSaved", s)] if wait else [])
            if j < t:
                inside = ops(j, t, given, m - base_j + off[s], inner)
                if i == j:
                    assert inside[-1] == ("B", j)
                    inside = [*inside[:-1], ("PrefetchSaved", s), ("B", j)]
                middle += inside
            elif not given:
                middle.append(("Loss",))
            tail = []
            for k in range(min(j - 1, t - 1), s - 1, -1):
                tail += [("PrefetchSaved", s)] if k == i else []
                tail.append(("B", k))
            return [("Fe", s), ("OffloadSaved", s), *middle, *tail]
        if choice[0] == "Fe-saved":
            inside = ops(s + 1, t, given, m - saved[s] + inf[s] + off[s], inner)
            assert inside[-1] == ("B", s + 1)
            return [("Fe", s), ("OffloadSaved", s), *inside[:-1], ("PrefetchSaved", s), ("B", s + 1), ("B", s)]
        if choice[0] == "Fe":
            o = choice[1]
            sb, _, _, free, _, _ = record(s, o)
            if s + 1 == t:
                middle = [] if given else [("Loss",)]
            else:
                middle = ops(s + 1, t, given, m - sb + free, inner)
            return [("Fe", s) if o == 0 else ("Fs", s, o), *middle, ("B", s)]
        s2 = choice[1]
        sweep = [("Fn", j) for j in range(s + 1, s2)]
        left = ops(s, s2, True, m - (0 if given else lv), flavour)
        if choice[0] == "off":
            right = ops(s2, t, given, m - size[s2] + size[s], "plain")
            assert right[-1] == ("B", s2)
            wait = [] if done_after(tc[s], s + 1, s2) else [("Wait", s)]
            return [("Fc", s), ("Offload", s), *sweep, *wait, *right[:-1], ("Prefetch", s), ("B", s2), *left]
        right = [("Loss",)] if (not given and s2 == length) else ops(s2, t, given, m - size[s2], rights)
        return [("Fc", s), *sweep, *right, *left]

    old_limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old_limit, 10_000))
    try:
        root = d.slots - size[0]
        flavour = "any" if tc else "today"
        top = best(0, length, False, root, flavour)
        if top is None:
            return INFEASIBLE
        return top[0], ops(0, length, False, root, flavour)
    finally:
        sys.setrecursionlimit(old_limit)


def movable(offloadable: list[int], saved: list[int], in_free: list[int]) -> list[int]:
    """Each saved part at most what stays charged for ā_{k+1} beyond the part of a_{k+1} that Fe k+1 lets go: a part
    never holds a_{k+1}'s storage, so a profiled chain passes as it is (the C++ planner clamps the same way)."""
    return [
        max(0, min(o, saved[k] - (in_free[k + 1] if k + 1 < len(in_free) else 0))) for k, o in enumerate(offloadable)
    ]


def reference_plan(chain: Chain, budget: int, slots: int | None = DEFAULT_SLOTS) -> tuple[int, list[tuple]] | None:
    """(cost, ops) at `slots` precision; `slots=None` solves in exact bytes (tiny chains only).

    A frozen prefix (chain version 4) runs first, `Fn 0 … Fn F-1`, within the budget or not at
    all; the rest is `chain.suffix()`'s plan (its cost counts the suffix's ops only).
    """
    f = chain.frozen
    if f and budget < chain.prefix_peak:
        return INFEASIBLE
    suffix = chain.suffix()
    d = discretize(suffix, budget, slots=budget if slots is None else slots)
    found = solve(d)
    if found is None or not f:
        return found
    return found[0], [
        *[("Fn", k) for k in range(f)],
        *[(op[0], op[1] + f, *op[2:]) if len(op) > 1 else op for op in found[1]],
    ]


def reference_min_budget(chain: Chain, offload: bool = False) -> int:
    """Smallest budget in bytes for which some persistent schedule exists (exact, no rounding).

    `offload`: a channel exists, so the offload family's shortest members count too (docs/planner.md, "Debts"):
    a split's plain input moved and waited for during its right part (prefetched before `B s2`), a recorded
    stage's `offloadable` part moved and waited for right after `Fe s` (prefetched before `B s`).
    """
    if chain.frozen:
        return max(chain.prefix_peak, reference_min_budget(chain.suffix(), offload))
    length = chain.length
    size, saved = chain.sizes, chain.saved_size
    ft, ft_ng, bt, lt = chain.fwd_tmp, chain.fwd_tmp_nograd, chain.bwd_net, chain.loss_tmp
    ltg, inf, lv = chain.loss_tmp_graph, chain.in_free, chain.loss_value

    def records(s: int) -> list[tuple[int, int, int, int, int]]:
        """(saved, fwd_tmp, bwd_net, released, loss on a recorded a_L) of each way to record s: Fe s, then Fs s:o."""
        return [(saved[s], ft[s], bt[s], inf[s], ltg)] + [
            (o.saved_size, o.fwd_tmp, o.bwd_net, 0, chain.option_loss_tmp_graph(o)) for o in chain.options[s]
        ]

    off = movable(chain.offloadable, saved, inf) if offload else [0] * length

    @cache
    def need(s: int, t: int, given: bool, plain: bool = False) -> int:
        held = size[t] if given else 0
        after = 0 if given else lv
        fes = []
        for sb, tmp, net, free, loss in records(s):
            fe = max(held + sb + tmp, sb + size[s + 1] + size[s] + net - free + after)
            if not given and s + 1 == length:
                fe = max(fe, sb + size[length] + loss - free)
            if s + 1 < t:
                fe = max(fe, sb - free + need(s + 1, t, given))
            fes.append(fe)
        if off[s] > 0:  # Fe s, OffloadSaved s, WaitSaved s, (s+1, t) without the part, PrefetchSaved s, B s
            before = saved[s] - inf[s] + size[s + 1] + after
            gone = inf[s + 1] if s + 1 < t and not chain.options[s + 1] else 0  # let go by Fe s+1 before B s
            moved = max(held + saved[s] + ft[s], before - gone, before + size[s] + bt[s])
            if s + 1 < t:
                moved = max(moved, saved[s] - inf[s] - off[s] + need(s + 1, t, given))
            if not given and s + 1 == length:
                moved = max(moved, saved[s] + size[length] + ltg - inf[s] - off[s])
            fes.append(moved)
        result = min(fes)
        run = size[s + 1] + ft_ng[s]
        last = t if not given else t - 1
        for s2 in range(s + 1, last + 1):
            if s2 > s + 1:
                run = max(run, size[s2 - 1] + size[s2] + ft_ng[s2 - 1])
            left = need(s, s2, True, plain) + after
            if not given and s2 == length:
                right = 2 * size[length] + lt
            else:
                right = size[s2] + need(s2, t, given, True)
            result = min(result, max(held + run, right, left))
            if offload and plain and s >= 1 and s2 < t and not chain.options[s2]:  # a_s moved during the right part
                before = saved[s2] - inf[s2] + size[s2 + 1] + after
                prefetch = size[s2] + max(before, before + size[s2] + bt[s2])
                result = min(result, max(held + run, size[s2] - size[s] + need(s2, t, given, True), left, prefetch))
        return result

    return size[0] + need(0, length, False)
