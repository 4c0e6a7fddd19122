"""Replay a schedule on a chain under the memory model's rules.

The simulator is the referee (docs/memory-model.md): a plan is valid
when it replays here within its budget, and the planner's reported peak and
time must equal what this module computes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from lightning_rotor.chain import Chain

FORWARD_OPS = ("Fn", "Fc", "Fe")
OP_NAMES = (*FORWARD_OPS, "Loss", "B")


class Simulation(NamedTuple):
    """Peak bytes, total seconds, and bytes held after each op."""

    peak: int
    time: float
    curve: list[int]


def normalize_ops(ops: Iterable[Sequence]) -> list[tuple]:
    """Turn JSON-shaped ops (`["Fe", 2]`, `["Loss"]`) into tuples, checking their form."""
    out: list[tuple] = []
    for i, op in enumerate(ops):
        if isinstance(op, str):
            op = (op,)
        if not isinstance(op, (list, tuple)) or not op or op[0] not in OP_NAMES:
            raise ValueError(f"op {i} {op!r}: unknown op; ops are {', '.join(OP_NAMES)}")
        if op[0] == "Loss":
            if len(op) != 1:
                raise ValueError(f"op {i} {list(op)!r}: Loss takes no stage index")
            out.append(("Loss",))
            continue
        if len(op) != 2 or isinstance(op[1], bool) or not isinstance(op[1], int):
            raise ValueError(f"op {i} {list(op)!r}: {op[0]} needs one integer stage index")
        out.append((op[0], op[1]))
    return out


def simulate(chain: Chain, ops: Iterable[Sequence]) -> Simulation:
    """Replay `ops` on `chain`; raise `ValueError` naming the first op at fault."""
    ops = normalize_ops(ops)
    length = chain.length
    s = chain.sizes
    sb = [0, *chain.saved_size]  # sb[k] is the bytes of the recorded value ā_k
    plain = {0}  # values a_k held without graph; a_0 is the caller's and always held
    graph: set[int] = set()  # ā_k: value a_k with the graph of F_{k-1}
    grads: set[int] = set()  # δ_k
    cur = s[0]
    peak = cur
    times: list[float] = []
    curve: list[int] = []
    loss_done = False
    next_backward = length - 1

    def fail(i: int, op: tuple, why: str) -> ValueError:
        name = op[0] if len(op) == 1 else f"{op[0]} {op[1]}"
        return ValueError(f"invalid plan: op {i} ({name}): {why}")

    for i, op in enumerate(ops):
        kind = op[0]
        if kind != "Loss":
            k = op[1]
            if not 0 <= k < length:
                raise fail(i, op, f"stage index out of range 0..{length - 1}")
        if kind in FORWARD_OPS:
            if kind == "Fn" and k not in plain:
                raise fail(i, op, f"needs a_{k} held without graph")
            if k not in plain and k not in graph:
                raise fail(i, op, f"needs a_{k}, which is not held")
            if kind == "Fe":
                if k + 1 in graph:
                    raise fail(i, op, f"a_{k + 1} is already held with its graph")
                peak = max(peak, cur + sb[k + 1] + chain.fwd_tmp[k])
                graph.add(k + 1)
                cur += sb[k + 1]
            else:
                if k + 1 in plain:
                    raise fail(i, op, f"a_{k + 1} is already held")
                peak = max(peak, cur + s[k + 1] + chain.fwd_tmp_nograd[k])
                plain.add(k + 1)
                cur += s[k + 1]
                if kind == "Fn" and k != 0:
                    plain.discard(k)
                    cur -= s[k]
            times.append(chain.fwd_time[k])
        elif kind == "Loss":
            if loss_done:
                raise fail(i, op, "the loss is computed once per step")
            if length not in graph and length not in plain:
                raise fail(i, op, f"needs the chain output a_{length}, which is not held")
            peak = max(peak, cur + s[length] + chain.loss_tmp)
            grads.add(length)
            cur += s[length]
            if length not in graph:
                plain.discard(length)
                cur -= s[length]
            loss_done = True
        else:  # B
            if not loss_done:
                raise fail(i, op, "backward before the loss")
            if k != next_backward:
                raise fail(i, op, f"backwards run B {length - 1} … B 0 in order; expected B {next_backward}")
            if k + 1 not in graph:
                raise fail(i, op, f"needs a_{k + 1} with its graph (run Fe {k} first)")
            if k + 1 not in grads:
                raise fail(i, op, f"needs the gradient δ_{k + 1}")
            if k not in plain and k not in graph:
                raise fail(i, op, f"needs a_{k}, which is not held")
            peak = max(peak, cur + s[k] + chain.bwd_tmp[k])
            graph.discard(k + 1)
            grads.discard(k + 1)
            grads.add(k)
            cur += s[k] - sb[k + 1] - s[k + 1]
            if k in plain and k != 0:
                plain.discard(k)
                cur -= s[k]
            times.append(chain.bwd_time[k])
            next_backward -= 1
        curve.append(cur)
    if not loss_done or next_backward != -1:
        raise ValueError(
            f"invalid plan: it ends before B 0 (next expected: {'Loss' if not loss_done else f'B {next_backward}'}); "
            "a plan must end holding δ_0"
        )
    return Simulation(peak=peak, time=math.fsum(times), curve=curve)


def no_recompute_ops(length: int) -> list[tuple]:
    """`Fe 0 … Fe L-1, Loss, B L-1 … B 0`: the fastest schedule, at unlimited memory."""
    return [("Fe", k) for k in range(length)] + [("Loss",)] + [("B", k) for k in reversed(range(length))]


def no_recompute_peak(chain: Chain) -> int:
    """Peak of the no-recomputation schedule: what fractional budgets are fractions of."""
    return simulate(chain, no_recompute_ops(chain.length)).peak
