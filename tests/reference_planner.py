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

Debt runs and wide runs (issue 28; docs/planner.md, "Debts" and "Wide runs"): `Fe s`, the parts of stages s … e
moved while `Fe s+1 … Fe j-1` run (copies queued), `(j, t)`, the backwards with each part prefetched d backwards
ahead of its own (`runs`). They come after the records and before the splits in the order of choices.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import cache
from typing import Literal

from lightning_rotor.chain import Chain
from lightning_rotor.discretize import DEFAULT_SLOTS, DiscreteChain, discretize

INFEASIBLE = None

# "today": no offloading anywhere; with offloading, "any" (today's choices and the moves) or "plain" (`a_s` held
# plain, so a split may offload it too).
Flavour = Literal["today", "any", "plain"]
Choice = tuple[
    int, tuple
]  # (cost, choice): ('Fe', o) (o >= 1: Fs s:o), ('Fe-saved', 0), ('run', n), ('ck' | 'off', s2)
Run = tuple[int, int, int, int, int, int, bool]  # (j, e, d, need, cost, shift, wait): see `runs`

# The code reads like cpp/planner.cpp's `Solver`: `best` is its `fill` (one function per family of choices:
# `best_record`, `best_saved`, `best_run`, `best_split` with `best_checkpoint` and `best_offload`), `emit` its
# `emit`, and the helpers keep the C++ names (`fe_need`, `saved_need`, `runs`, `prefetch_need`, ...).


class Problem:
    """What the recursion's functions share: the discretized chain under short names, and the memos."""

    def __init__(self, d: DiscreteChain) -> None:
        self.length, self.size, self.saved = d.length, d.size, d.saved
        self.ft, self.ft_ng, self.bt = d.fwd_tmp, d.fwd_tmp_nograd, d.bwd_tmp
        self.lt, self.ltg, self.inf, self.lv = d.loss_tmp, d.loss_tmp_graph, d.in_free, d.loss_value
        self.fwd, self.bwd = d.fwd_cost, d.bwd_cost
        self.options = d.options or [[] for _ in range(d.length)]
        self.tc, self.cb = d.transfer_cost, d.count_bits  # tc: [] without offloading
        self.stc = d.saved_transfer_cost  # []: no saved part moves
        self.off = movable(d.offloadable, d.saved, d.in_free)
        self.best_memo: dict[tuple[int, int, bool, int, Flavour], Choice | None] = {}
        self.runs_memo: dict[tuple[int, int, bool], tuple[Run, ...]] = {}


def solve(d: DiscreteChain) -> tuple[int, list[tuple]] | None:
    """Least cost and its ops for the whole chain within `d.slots`, or None when nothing fits."""
    p = Problem(d)
    old_limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old_limit, 10_000))
    try:
        root = d.slots - p.size[0]
        flavour: Flavour = "any" if p.tc else "today"
        top = best(p, 0, p.length, False, root, flavour)
        if top is None:
            return INFEASIBLE
        return top[0], emit(p, 0, p.length, False, root, flavour)
    finally:
        sys.setrecursionlimit(old_limit)


def inner_flavour(flavour: Flavour) -> Flavour:
    """The flavour of `(s+1, t)` after `Fe s`: `a_{s+1}` is recorded."""
    return "today" if flavour == "today" else "any"


def right_flavour(flavour: Flavour) -> Flavour:
    """The flavour of a split's right part: its `a_{s2}` is plain."""
    return "today" if flavour == "today" else "plain"


def first_least(found: Choice | None, candidate: Choice | None) -> Choice | None:
    """The choice so far unless the later candidate costs strictly less: the first of least cost wins."""
    if candidate is not None and (found is None or candidate[0] < found[0]):
        return candidate
    return found


# Memory and time of single choices (cpp/planner.cpp's free functions and Solver helpers of the same names).


def ticks(p: Problem, cost: int) -> int:
    return cost >> p.cb


def done_after(p: Problem, copy: int, start: int, end: int) -> bool:
    """Whether a copy (a cost) issued before the forwards start … end-1 surely ends by their end.

    One tick per forward for their rounding to the nearest tick (the copy is rounded up).
    """
    return ticks(p, copy) + (end - start) <= sum(ticks(p, c) for c in p.fwd[start:end])


def front_stall(p: Problem, copy: int, start: int, end: int) -> int:
    """Idle time (a cost) of a `Wait` after the forwards start … end-1 for a copy issued before them."""
    return max(0, ticks(p, copy) - sum(ticks(p, c) for c in p.fwd[start:end])) << p.cb


def record(p: Problem, s: int, o: int) -> tuple[int, int, int, int, int, int]:
    """(saved, fwd_tmp, bwd_net, released, loss on a recorded a_L, fwd + bwd cost) of recording s with option o."""
    if o == 0:
        return p.saved[s], p.ft[s], p.bt[s], p.inf[s], p.ltg, p.fwd[s] + p.bwd[s]
    x = p.options[s][o - 1]
    return x.saved, x.fwd_tmp, x.bwd_tmp, 0, x.loss_tmp_graph, x.fwd_cost + x.bwd_cost


def fe_need(p: Problem, s: int, t: int, given: bool, o: int = 0) -> int:
    """Least m of (s, t) for recording s with option o itself: the recording, the backward (and the loss)."""
    size = p.size
    sb, tmp, net, free, loss, _ = record(p, s, o)
    held = size[t] if given else 0
    after = 0 if given else p.lv  # B s runs after the loss: with the loss pending here, its value is held by then
    need = max(held + sb + tmp, sb + size[s + 1] + size[s] + net - free + after)
    if not given and s + 1 == p.length:
        need = max(need, sb + size[p.length] + loss - free)
    return need


def forward_need(p: Problem, s: int, s2: int, given: bool, t: int) -> int:
    """Least m of (s, t) for the forward run `Fc s, Fn s+1 … Fn s2-1` of a split s -> s2."""
    size = p.size
    held = size[t] if given else 0
    need = size[s + 1] + p.ft_ng[s]
    for j in range(s + 1, s2):
        need = max(need, size[j] + size[j + 1] + p.ft_ng[j])
    return held + need


def prefetch_need(p: Problem, s2: int, given: bool) -> int:
    """Least m for the prefetch of a_s and B s2 with a_s back on the device."""
    held = before_b(p, s2, given)
    return p.size[s2] + max(held, held + p.size[s2] + p.bt[s2])


def offloadable(p: Problem, s: int, t: int, given: bool, s2: int) -> bool:
    """Whether the split s -> s2 may offload a_s (a `Wait s` before the right part pays what the sweep does not)."""
    return bool(p.tc) and s >= 1 and (given or s2 != p.length) and s2 < t and not p.options[s2]


def saved_offloadable(p: Problem, s: int, t: int) -> bool:
    """Whether Fe s may offload its saved part while (s+1, t) runs: the copy surely ends within Fe/Fc s+1."""
    if not p.stc or p.off[s] <= 0 or s + 1 >= t or p.options[s + 1]:
        return False
    return (p.stc[s] >> p.cb) + 1 <= p.fwd[s + 1] >> p.cb


def saved_need(p: Problem, s: int, t: int, given: bool) -> int:
    """Least m of (s, t) for the saved-part variant: Fe s, and (s+1, t)'s first and last ops with the part there."""
    size, saved = p.size, p.saved
    held = size[t] if given else 0
    first = held + max(saved[s + 1] + p.ft[s + 1], size[s + 2] + p.ft_ng[s + 1])
    before = saved[s + 1] - p.inf[s + 1] + size[s + 2] + (0 if given else p.lv)  # at PrefetchSaved s
    last = max(before, before + size[s + 1] + p.bt[s + 1])  # B s+1
    return max(fe_need(p, s, t, given), saved[s] - p.inf[s] + max(first, last))


# Debt runs (docs/planner.md, "Debts"; cpp/planner.cpp's `runs` and the free functions it reads).

WIDE_RUN = 12  # the longest run (j - s) whose stages after s move their parts too (cpp/planner.cpp's kWideRun)


def before_b(p: Problem, k: int, given: bool) -> int:
    """Held in (k, t)'s frame just before B k: its graph, δ_{k+1}, the loss value after the loss."""
    return p.saved[k] - p.inf[k] + p.size[k + 1] + (0 if given else p.lv)


def b_peak(p: Problem, k: int, given: bool) -> int:
    """Peak of B k in (k, t)'s frame (fe_need's backward term)."""
    return before_b(p, k, given) + p.size[k] + p.bt[k]


def run_head(p: Problem, s: int, t: int, given: bool) -> int:
    """What every run of (s, t) needs besides the rest: Fe s with its part, and B s."""
    held = p.size[t] if given else 0
    return max(held + p.saved[s] + p.ft[s], b_peak(p, s, given))


def prefetch_at_b(p: Problem, s: int, t: int, given: bool) -> int:
    """The state just before B s with stage s's part back (`PrefetchSaved s` there): the whole graph of s, its
    free part of a_{s+1} not yet let go (B s lets it go first), δ_{s+1}, the loss value. A run prefetching the part
    earlier never holds it at an op: after `B s+1` and before `B s`, so it is no op's peak."""
    gone = p.inf[s + 1] if s + 1 < t and not p.options[s + 1] else 0  # a_{s+1}'s part Fe s+1 let go before B s
    return before_b(p, s, given) - gone


def run_frames(p: Problem, s: int, t: int) -> list[int]:
    """base[k]: (s, t)'s frame to (k, t)'s, the parts included (recording s … k-1)."""
    base = [0] * (t + 1)
    base[s + 1] = p.saved[s] - p.inf[s]
    for k in range(s + 1, t):
        base[k + 1] = base[k] + p.saved[k] - p.inf[k]
    return base


def runs(p: Problem, s: int, t: int, given: bool) -> tuple[Run, ...]:
    """The debt runs of (s, t): (j, e, d, need, cost, shift, wait) per run `Fe s, OffloadSaved s, Fe s+1,
    [OffloadSaved s+1], …, Fe j-1, [WaitSaved e], (j, t), B j-1 … B s`: the parts of stages s … e move (queued on
    the channel in that order), `PrefetchSaved k` of each right before `B min(k + d, top)` (top: j when (j, t)'s
    last op is a plain `B j`, else j-1; several at one place in descending k).

    The offload debts are paid by the forwards s+1 … j-1 (a part held during one that may start before its copy
    ends) and by the wait; the prefetch debts by the backwards, each `B k` waiting for the rest of its part.
    `need`: the least m of the run but (j, t) itself, read at `m - shift`; `cost`: the run's ops and stalls but
    (j, t). Runs moving stage s's part only (e = s) stop at the first j whose forwards and backwards both hide the
    copy; wider ones (e > s) are at most `WIDE_RUN` stages long. Per j: e ascending, then d ascending.
    """
    key = (s, t, given)
    if key not in p.runs_memo:
        p.runs_memo[key] = () if not p.stc or p.off[s] <= 0 else tuple(find_runs(p, s, t, given))
    return p.runs_memo[key]


def find_runs(p: Problem, s: int, t: int, given: bool) -> list[Run]:
    """The runs of `runs`, stage s's part movable: for each j ascending, each e, each d ascending."""
    base = run_frames(p, s, t)
    found: list[Run] = []
    narrow = True  # runs moving stage s's part only still go on
    for j in range(s + 1, t + 1):
        last_e = s if j - s > WIDE_RUN else j - 1
        if not narrow and last_e == s:
            break
        for e in range(s if narrow else s + 1, last_e + 1):
            if any(p.off[k] <= 0 for k in range(s, e + 1)):
                break
            found += runs_of(p, s, t, given, j, e, base)
        if narrow and run_hidden(p, s, j):
            narrow = False
    return found


def run_hidden(p: Problem, s: int, j: int) -> bool:
    """Whether the forwards s+1 … j-1 surely hide stage s's copy and the backwards j-1 … s+1 hide its prefetch."""
    return done_after(p, p.stc[s], s + 1, j) and sum(p.bwd[s + 1 : j]) >= p.stc[s]


def run_front(p: Problem, s: int, t: int, given: bool, j: int, e: int, base: list[int]) -> tuple[int, int, bool]:
    """(need, stall ticks, wait) of the forwards `Fe s … Fe j-1` moving the parts s … e, queued on the channel.

    `left[k]`: ticks until part k's copy surely ends (rounded up, forwards counted one tick short each); `lag`: the
    nominal ticks until the channel is free. A part leaves the device at the first forward starting after its end.
    """
    held = p.size[t] if given else 0
    need = run_head(p, s, t, given)
    if e > s:  # a wide run is charged the state before B s whatever d (the floor models narrow runs only)
        need = max(need, prefetch_at_b(p, s, t, given))
    left: list[int] = [ticks(p, p.stc[s])]
    lag = ticks(p, p.stc[s])
    for k in range(s + 1, j):
        gone = sum(p.off[s + n] for n, x in enumerate(left) if x <= 0)
        need = max(need, held + base[k] - gone + p.saved[k] + p.ft[k])
        f = ticks(p, p.fwd[k])
        left = [x - (f - 1) for x in left]
        lag = max(0, lag - f)
        if k <= e:
            left.append(max(0, left[-1]) + ticks(p, p.stc[k]))
            lag += ticks(p, p.stc[k])
    moved = sum(p.off[s : e + 1])
    if j == t and not given:  # the loss, the parts away
        need = max(need, base[t] + p.size[t] + p.ltg - moved)
    return need, lag, left[-1] > 0


def run_top(p: Problem, t: int, j: int) -> int:
    """Where the run's prefetches go at the latest: before (j, t)'s last op `B j`, or before `B j-1`."""
    return j if j < t and not p.options[j] else j - 1


def run_back(
    p: Problem, s: int, t: int, given: bool, j: int, e: int, d: int, top: int, base: list[int]
) -> tuple[int, int]:
    """(need, stall ticks) of the backwards `B top … B s` with the parts s … e prefetched before `B min(k + d, top)`.

    Part k is away during the backwards after `B min(k + d, top)`'s start only if not yet issued; each `B k`
    (k <= e) waits for its part; the channel is free at `B top`'s start (the run's copies were waited for).
    """
    need, now, channel, stall = 0, 0, 0, 0
    arrive: dict[int, int] = {}
    for i in range(top, s - 1, -1):
        issued = [k for k in range(e, s - 1, -1) if min(k + d, top) == i]
        for k in issued:
            channel = max(channel, now) + ticks(p, p.stc[k])
            arrive[k] = channel
        away = sum(p.off[s : max(s, min(e, i - d - 1) + 1)])
        if i > s:
            need = max(need, base[i] - away + b_peak(p, i, given))
            if issued:
                need = max(need, base[i] - away + before_b(p, i, given))
        elif issued:  # d = 0: stage s's part comes back just before B s
            need = max(need, prefetch_at_b(p, s, t, given))
        if i < j:
            if i in arrive:
                stall += max(0, arrive[i] - now)
                now = max(now, arrive[i])
            now += ticks(p, p.bwd[i])
        else:
            now += ticks(p, p.bwd[i])
    return need, stall


def runs_of(p: Problem, s: int, t: int, given: bool, j: int, e: int, base: list[int]) -> list[Run]:
    """The runs (j, e, d) for d ascending, less those an earlier one of the same (j, e) matches or beats in both
    need and cost (they can never be the first of least cost)."""
    front, lag, wait = run_front(p, s, t, given, j, e, base)
    top = run_top(p, t, j)
    moved = sum(p.off[s : e + 1])
    ops = sum(p.fwd[s:j]) + sum(p.bwd[s:j])
    shift = base[j] - moved if j < t else 0
    kept: list[Run] = []
    for d in range(top - s + 1):
        back, stall = run_back(p, s, t, given, j, e, d, top, base)
        need, cost = max(front, back), ops + ((lag + stall) << p.cb)
        if any(r[3] <= need and r[4] <= cost for r in kept):
            continue
        kept.append((j, e, d, need, cost, shift, wait))
    return kept


# The recursion: the best choice of (s, t, given, m) in each flavour (cpp/planner.cpp's `fill`).


def best(p: Problem, s: int, t: int, given: bool, m: int, flavour: Flavour = "today") -> Choice | None:
    """(cost, choice) of least cost for (s, t, given) within m slots, or None; the first of least cost wins,
    in the order `Fe s` (with its saved-part variant right after), `Fs s:1` …, the runs, then the splits."""
    key = (s, t, given, m, flavour)
    if key not in p.best_memo:
        p.best_memo[key] = choose(p, s, t, given, m, flavour)
    return p.best_memo[key]


def choose(p: Problem, s: int, t: int, given: bool, m: int, flavour: Flavour) -> Choice | None:
    """`best` without the memo: each family's first choice of least cost, in the order of choices."""
    if m < 0:
        return None
    found = best_record(p, s, t, given, m, flavour)
    if flavour != "today":
        found = first_least(found, best_run(p, s, t, given, m))
    return first_least(found, best_split(p, s, t, given, m, flavour))


def best_record(p: Problem, s: int, t: int, given: bool, m: int, flavour: Flavour) -> Choice | None:
    """Record stage s (`Fe s`, then `Fs s:o`), solve (s+1, t) with a_{s+1} recorded, `B s`."""
    found: Choice | None = None
    for o in range(len(p.options[s]) + 1):
        if m < fe_need(p, s, t, given, o):
            continue
        sb, _, _, free, _, step = record(p, s, o)
        if s + 1 == t:
            found = first_least(found, (step, ("Fe", o)))
        else:
            sub = best(p, s + 1, t, given, m - sb + free, inner_flavour(flavour))
            found = first_least(found, None if sub is None else (step + sub[0], ("Fe", o)))
        if o == 0 and flavour != "today":
            found = first_least(found, best_saved(p, s, t, given, m))
    return found


def best_saved(p: Problem, s: int, t: int, given: bool, m: int) -> Choice | None:
    """`Fe s` with its saved part away while (s+1, t) runs (which gets the part's slots), back before `B s+1`."""
    if not saved_offloadable(p, s, t) or m < saved_need(p, s, t, given):
        return None
    sub = best(p, s + 1, t, given, m - p.saved[s] + p.inf[s] + p.off[s], "any")
    if sub is None:
        return None
    return record(p, s, 0)[5] + max(0, p.stc[s] - p.bwd[s + 1]) + sub[0], ("Fe-saved", 0)


def best_run(p: Problem, s: int, t: int, given: bool, m: int) -> Choice | None:
    """The debt runs of (s, t) (`runs`), each with its (j, t) solved in what the run leaves."""
    found: Choice | None = None
    for n, (j, _, _, need, extra, shift, _) in enumerate(runs(p, s, t, given)):
        if m < need:
            continue
        sub = (0, ()) if j == t else best(p, j, t, given, m - shift, "any")
        found = first_least(found, None if sub is None else (extra + sub[0], ("run", n)))
    return found


def best_split(p: Problem, s: int, t: int, given: bool, m: int, flavour: Flavour) -> Choice | None:
    """Checkpoint s -> s2 for s2 ascending: `Fc s, Fn s+1 … Fn s2-1`, the right part, the left part (s, s2);
    in the "plain" flavour each followed by its variant offloading a_s."""
    found: Choice | None = None
    last = t if not given else t - 1
    forward = 0
    for s2 in range(s + 1, last + 1):
        forward += p.fwd[s2 - 1]
        if m < forward_need(p, s, s2, given, t):
            break  # the forward run only needs more memory as s2 grows
        left = best(p, s, s2, True, m - (0 if given else p.lv), flavour)  # after the loss: its value is held
        if left is None:
            continue
        found = first_least(found, best_checkpoint(p, s, t, given, m, s2, forward, left[0], flavour))
        if flavour == "plain":
            found = first_least(found, best_offload(p, s, t, given, m, s2, forward, left[0]))
    return found


def best_checkpoint(
    p: Problem, s: int, t: int, given: bool, m: int, s2: int, forward: int, left: int, flavour: Flavour
) -> Choice | None:
    """The split s -> s2 with a_{s2} held during the right part (the loss on plain a_L when s2 == L, loss pending)."""
    if not given and s2 == p.length:
        if m < 2 * p.size[p.length] + p.lt:
            return None
        right = 0
    else:
        sub = best(p, s2, t, given, m - p.size[s2], right_flavour(flavour))
        if sub is None:
            return None
        right = sub[0]
    return forward + right + left, ("ck", s2)


def best_offload(p: Problem, s: int, t: int, given: bool, m: int, s2: int, forward: int, left: int) -> Choice | None:
    """The split s -> s2 offloading a_s during the right part (which gets a_s's slots), prefetched before `B s2`."""
    if not offloadable(p, s, t, given, s2) or m < prefetch_need(p, s2, given):
        return None
    sub = best(p, s2, t, given, m - p.size[s2] + p.size[s], "plain")  # a_s's slots are free meanwhile
    if sub is None:
        return None
    stall = front_stall(p, p.tc[s], s + 1, s2) + max(0, p.tc[s] - p.bwd[s2])
    return forward + stall + sub[0] + left, ("off", s2)


# The ops of the best choices (cpp/planner.cpp's `emit`, which re-evaluates where this reads `best`'s choice).


def emit(p: Problem, s: int, t: int, given: bool, m: int, flavour: Flavour = "today") -> list[tuple]:
    """The ops of (s, t, given) within m slots: those of its best choice, recursively."""
    found = best(p, s, t, given, m, flavour)
    assert found is not None
    kind, arg = found[1]
    if kind == "run":
        return emit_run(p, s, t, given, m, arg)
    if kind == "Fe-saved":
        return emit_saved(p, s, t, given, m)
    if kind == "Fe":
        return emit_record(p, s, t, given, m, arg, flavour)
    return emit_split(p, s, t, given, m, kind == "off", arg, flavour)


def emit_record(p: Problem, s: int, t: int, given: bool, m: int, o: int, flavour: Flavour) -> list[tuple]:
    """`Fe s` or `Fs s:o`, the ops of (s+1, t) (the loss when s+1 == L, pending), `B s`."""
    sb, _, _, free, _, _ = record(p, s, o)
    if s + 1 == t:
        middle = [] if given else [("Loss",)]
    else:
        middle = emit(p, s + 1, t, given, m - sb + free, inner_flavour(flavour))
    return [("Fe", s) if o == 0 else ("Fs", s, o), *middle, ("B", s)]


def emit_saved(p: Problem, s: int, t: int, given: bool, m: int) -> list[tuple]:
    """`Fe s, OffloadSaved s`, (s+1, t) with `PrefetchSaved s` before its last op `B s+1`, `B s`."""
    inside = emit(p, s + 1, t, given, m - p.saved[s] + p.inf[s] + p.off[s], "any")
    assert inside[-1] == ("B", s + 1)
    return [("Fe", s), ("OffloadSaved", s), *inside[:-1], ("PrefetchSaved", s), ("B", s + 1), ("B", s)]


def emit_run(p: Problem, s: int, t: int, given: bool, m: int, n: int) -> list[tuple]:
    """The ops of the n-th debt run of (s, t) (`runs`), its (j, t) in what the run leaves."""
    j, e, d, _, _, shift, wait = runs(p, s, t, given)[n]
    top = run_top(p, t, j)

    def prefetches(i: int) -> list[tuple]:
        return [("PrefetchSaved", k) for k in range(e, s - 1, -1) if min(k + d, top) == i]

    ops: list[tuple] = [("Fe", s), ("OffloadSaved", s)]
    for k in range(s + 1, j):
        ops += [("Fe", k)] + ([("OffloadSaved", k)] if k <= e else [])
    ops += [("WaitSaved", e)] if wait else []
    if j < t:
        inside = emit(p, j, t, given, m - shift, "any")
        if top == j:
            assert inside[-1] == ("B", j)
            inside = [*inside[:-1], *prefetches(j), ("B", j)]
        ops += inside
    elif not given:
        ops.append(("Loss",))
    for k in range(j - 1, s - 1, -1):
        ops += [*prefetches(k), ("B", k)]
    return ops


def emit_split(
    p: Problem, s: int, t: int, given: bool, m: int, offload: bool, s2: int, flavour: Flavour
) -> list[tuple]:
    """`Fc s`, the sweep to a_{s2}, the right part (s2, t), the left part (s, s2); offloading a_s meanwhile."""
    sweep = [("Fn", j) for j in range(s + 1, s2)]
    left = emit(p, s, s2, True, m - (0 if given else p.lv), flavour)
    if offload:
        right = emit(p, s2, t, given, m - p.size[s2] + p.size[s], "plain")
        assert right[-1] == ("B", s2)
        wait = [] if done_after(p, p.tc[s], s + 1, s2) else [("Wait", s)]
        return [("Fc", s), ("Offload", s), *sweep, *wait, *right[:-1], ("Prefetch", s), ("B", s2), *left]
    if not given and s2 == p.length:
        right = [("Loss",)]
    else:
        right = emit(p, s2, t, given, m - p.size[s2], right_flavour(flavour))
    return [("Fc", s), *sweep, *right, *left]


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


def moved_part_need(
    chain: Chain, off: list[int], need: Callable[[int, int, bool], int], s: int, t: int, given: bool
) -> int:
    """Least need of (s, t) recording s with its part moved and waited for at once (`reference_min_budget`'s `need`
    for the subproblems): back before `B s`, else before `B i` for some i in s+1 … t-1 (`part_back_early`)."""
    size, saved, inf = chain.sizes, chain.saved_size, chain.in_free
    held, after = (size[t], 0) if given else (0, chain.loss_value)
    before = saved[s] - inf[s] + size[s + 1] + after
    gone = inf[s + 1] if s + 1 < t and not chain.options[s + 1] else 0  # let go by Fe s+1 before B s
    head = max(held + saved[s] + chain.fwd_tmp[s], before + size[s] + chain.bwd_net[s])
    moved = max(head, before - gone)  # Fe s, OffloadSaved s, WaitSaved s, (s+1, t), PrefetchSaved s, B s
    if s + 1 < t:
        moved = max(moved, saved[s] - inf[s] - off[s] + need(s + 1, t, given))
    if not given and s + 1 == chain.length:
        moved = max(moved, saved[s] + size[s + 1] + chain.loss_tmp_graph - inf[s] - off[s])
    return min(moved, part_back_early(chain, off, need, s, t, given, head))


def part_back_early(
    chain: Chain, off: list[int], need: Callable[[int, int, bool], int], s: int, t: int, given: bool, head: int
) -> int:
    """Least need of stage s's part moved and back before `B i` for some i in s+1 … t-1: `Fe s+1 … Fe i-1` recorded
    with the part still charged (a copy they do not hide, waited for before `(i, t)`), `(i, t)` without it but its
    last op, `PrefetchSaved s`, `B i … B s+1` with it, `B s` (`head`); where stage i has options, `Fe i` inside the
    run too and `(i+1, t)` after the wait (the debt run `(j = i+1, d = i - s)`). The state just before `B s` is
    then held at no op's peak (it is when the part comes back there: `moved_part_need`)."""
    size, saved, inf, ft, bt = chain.sizes, chain.saved_size, chain.in_free, chain.fwd_tmp, chain.bwd_net
    held, after = (size[t], 0) if given else (0, chain.loss_value)
    least, base, charged = sys.maxsize, saved[s] - inf[s], head
    for i in range(s + 1, t):
        if i > s + 1:  # stage i-1 recorded inside the run: Fe i-1 and B i-1 with the part
            k = i - 1
            b_k = base + saved[k] - inf[k] + size[i] + after + size[k] + bt[k]
            charged = max(charged, held + base + saved[k] + ft[k], b_k)
            base += saved[k] - inf[k]
        before = saved[i] - inf[i] + size[i + 1] + after  # held just before B i
        back = base + before + max(0, size[i] + bt[i])
        if not chain.options[i]:  # (i, t) any schedule, its last op B i
            rest = base - off[s] + need(i, t, given)
        else:  # Fe i inside the run too (with the part), then (i+1, t) or the loss without it
            inside = base + saved[i] - inf[i] - off[s]
            after_i = need(i + 1, t, given) if i + 1 < t else 0 if given else size[t] + chain.loss_tmp_graph
            rest = max(held + base + saved[i] + ft[i], inside + after_i)
        least = min(least, max(charged, rest, back))
    return least


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
        if off[s] > 0:
            fes.append(moved_part_need(chain, off, need, s, t, given))
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
