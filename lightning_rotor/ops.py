"""The operations of a schedule: one `Op` type for the simulator, planner, executor and reports.

docs/memory-model.md defines the kinds: `Fn`, `Fc`, `Fe`, `Fs` (forwards), `Loss` and `B`
(backward). An `Op` is a tuple, `("Fe", 2)`, `("Fs", 2, 1)` or `("Loss",)`, so it compares equal
to the JSON form of a plan and to what the C++ planner returns; `kind` is an
`OpKind`, `stage` the stage index (None for `Loss`; for `Offload k` and `Prefetch k` the index of
the value `a_k` they move; for `OffloadSaved k` and `PrefetchSaved k` the stage whose recorded graph's
offloadable part they move) and `option` the stage option an `Fs` records (chain version 5; 0 for
every other op). Code that acts on ops
dispatches on every kind explicitly (see `OpKind`; the interpreters with `match` and `assert_never`,
so mypy names a kind without a rule), so a new kind cannot fall through as another.
What an op's place in a plan says about it (the last forward of its stage, a record an
`OffloadSaved` moves, an early stop, a joined backward) is computed once, by `annotate`, as an
`OpNote` the simulator and the executor both read.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, cast


class OpKind(str, Enum):
    """What an op does (docs/memory-model.md, "Operations")."""

    FN = "Fn"  # forward without grad, forget the input
    FC = "Fc"  # forward without grad, keep the input (checkpoint)
    FE = "Fe"  # forward recording the graph
    FS = "Fs"  # forward recording option o >= 1 of the stage: a selection, the rest recomputed in B (version 5)
    LOSS = "Loss"
    B = "B"  # backward of one stage
    OFFLOAD = "Offload"  # start copying a kept stage input a_k to host memory (chain version 6)
    PREFETCH = "Prefetch"  # start copying a_k back to the device (chain version 6)
    OFFLOAD_SAVED = "OffloadSaved"  # start copying what `Fe k` saved (offloadable[k] bytes) to host memory
    PREFETCH_SAVED = "PrefetchSaved"  # start copying stage k's saved part back, for B k
    WAIT = "Wait"  # compute idles until the copy of a_k issued last (offload or prefetch) has ended
    WAIT_SAVED = "WaitSaved"  # compute idles until the copy of stage k's saved part issued last has ended

    def __str__(self) -> str:
        return self.value

    def __hash__(self) -> int:  # equal to its string, so hash like it too
        return str.__hash__(self)

    @property
    def is_forward(self) -> bool:
        return self in FORWARD_KINDS

    @property
    def is_transfer(self) -> bool:
        """`Offload`, `Prefetch`, `OffloadSaved`, `PrefetchSaved`: runs on the transfer channel, beside
        compute, and takes no compute time."""
        return self in TRANSFER_KINDS


FORWARD_KINDS = frozenset({OpKind.FN, OpKind.FC, OpKind.FE, OpKind.FS})
TRANSFER_KINDS = frozenset({OpKind.OFFLOAD, OpKind.PREFETCH, OpKind.OFFLOAD_SAVED, OpKind.PREFETCH_SAVED})


class Op(tuple[Any, ...]):
    """One schedule operation: `Op("Fe", 2)`, `Op("Fs", 2, 1)`, `Op("Loss")`; a tuple in JSON shape."""

    __slots__ = ()

    def __new__(cls, kind: OpKind | str, stage: int | None = None, option: int | None = None) -> Op:
        kind = OpKind(kind)
        if kind is OpKind.LOSS:
            if stage is not None or option is not None:
                raise ValueError("Loss takes no stage index")
            return tuple.__new__(cls, (kind,))
        if isinstance(stage, bool) or not isinstance(stage, int):
            raise ValueError(f"{kind.value} needs one integer stage index, got {stage!r}")
        if kind is OpKind.FS:
            if isinstance(option, bool) or not isinstance(option, int) or option < 1:
                raise ValueError(f"Fs needs a stage index and an option number >= 1 (option 0 is Fe), got {option!r}")
            return tuple.__new__(cls, (kind, stage, option))
        if option is not None:
            raise ValueError(f"{kind.value} takes no option number (only Fs records an option)")
        return tuple.__new__(cls, (kind, stage))

    @property
    def kind(self) -> OpKind:
        return cast(OpKind, self[0])

    @property
    def stage(self) -> int | None:
        return self[1] if len(self) >= 2 else None

    @property
    def option(self) -> int:
        """The stage option an `Fs` records; 0 (record all, or nothing) for every other op."""
        return self[2] if len(self) == 3 else 0

    @property
    def label(self) -> str:
        """`"Fe 2"`, `"Fs 2:1"`, `"Loss"`: how logs, plots and errors name the op."""
        if self.stage is None:
            return self.kind.value
        return f"{self.kind.value} {self.stage}" + (f":{self.option}" if self.option else "")

    def to_json(self) -> list[Any]:
        return [self.kind.value, *self[1:]]

    def with_stage(self, stage: int) -> Op:
        """The same op on another stage index (same option)."""
        return Op(self.kind, stage, self.option or None)

    def __repr__(self) -> str:
        return f"Op({self.label})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Op, (self.kind.value, *self[1:]))


def parse_ops(items: Iterable[Any]) -> list[Op]:
    """Ops from JSON-shaped items (`["Fe", 2]`, `["Fs", 2, 1]`, `["Loss"]`, `"Loss"`, `Op`).

    A `ValueError` names the bad one.
    """
    out: list[Op] = []
    kinds = ", ".join(k.value for k in OpKind)
    for i, item in enumerate(items):
        if isinstance(item, str):
            item = (item,)
        if not isinstance(item, (list, tuple)) or not item or not isinstance(item[0], str):
            raise ValueError(f"op {i} {item!r}: unknown op; ops are {kinds}")
        try:
            kind = OpKind(item[0])
        except ValueError:
            raise ValueError(f"op {i} {list(item)!r}: unknown op; ops are {kinds}") from None
        if kind is OpKind.LOSS and len(item) != 1:
            raise ValueError(f"op {i} {list(item)!r}: Loss takes no stage index")
        if kind is OpKind.FS:
            if len(item) != 3 or any(isinstance(v, bool) or not isinstance(v, int) for v in item[1:]) or item[2] < 1:
                raise ValueError(
                    f"op {i} {list(item)!r}: Fs needs an integer stage index and an option number >= 1 (option 0 is Fe)"
                )
            out.append(Op(kind, item[1], item[2]))
            continue
        if kind is not OpKind.LOSS and (len(item) != 2 or isinstance(item[1], bool) or not isinstance(item[1], int)):
            raise ValueError(f"op {i} {list(item)!r}: {kind.value} needs one integer stage index")
        out.append(Op(kind, None if kind is OpKind.LOSS else item[1]))
    return out


def forward_counts(ops: Iterable[Op], length: int) -> list[int]:
    """How many times each of `length` stages runs forward in `ops` (more than 1: recomputed)."""
    runs = [0] * length
    for op in ops:
        if op.kind.is_forward and op.stage is not None:  # a forward always has a stage
            runs[op.stage] += 1
    return runs


def recomputed_stage_set(ops: Iterable[Op]) -> set[int]:
    """The stages that run forward more than once."""
    counts: dict[int, int] = {}
    for op in ops:
        if op.kind.is_forward and op.stage is not None:  # a forward always has a stage
            counts[op.stage] = counts.get(op.stage, 0) + 1
    return {k for k, n in counts.items() if n > 1}


def recomputed_stages(ops: Iterable[Op]) -> int:
    """How many stages run forward more than once."""
    return len(recomputed_stage_set(ops))


def last_forwards(ops: Sequence[Op], length: int) -> set[int]:
    """Indices of the `Fe k` ops that are the last forward of stage k before `B k`.

    After such an op the executor no longer references `a_k` (chain version 3), and the
    simulator lets `in_free[k]` go; a forward of stage k of another kind, or none at all,
    between the last `Fe k` and `B k` means no release. For `k = 0` only a chain's own part of its
    input goes (`in_free[0]`: `a_F` in the suffix of a frozen prefix); the caller's `a_0` stays.
    """
    found: set[int] = set()
    awaiting: set[int] = set()  # stages whose B k comes later and whose last forward is not yet seen (scanning back)
    for i in range(len(ops) - 1, -1, -1):
        op = ops[i]
        k = op.stage
        if k is None:  # the loss
            continue
        if op.kind is OpKind.B:
            awaiting.add(k)
        elif op.kind.is_forward and k in awaiting:
            awaiting.discard(k)
            if op.kind is OpKind.FE and 0 <= k < length:
                found.add(i)
    return found


@dataclass(frozen=True)
class OpNote:
    """One op of a plan with what its place in the plan says about it (`annotate`): both interpreters,
    the simulator and the executor, read these flags rather than scanning the plan themselves."""

    op: Op
    last: bool = False  # an `Fe k` that is stage k's last forward before `B k` (`last_forwards`): a_k may go after it
    pack: bool = False  # an `Fe k` whose saved part an `OffloadSaved k` moves (recorded behind handles)
    moves: bool = False  # an `OffloadSaved k` whose stage's latest forward is an `Fe k` (the record it moves)
    early: bool = (
        False  # an `Fc k`, or the `Fe k` right before `B k` it makes unneeded: early stop allowed (`early_pairs`)
    )
    joins: bool = False  # a `B k` followed by `B k-1`: a recorded a_k may feed stage k as it is, joining the graphs

    @property
    def kind(self) -> OpKind:
        return self.op.kind


def annotate(ops: Sequence[Op], length: int, in_free: Sequence[int] | None = None) -> list[OpNote]:
    """Each op of `ops` (a plan of a chain of `length` stages) with its flags (`OpNote`).

    `in_free`: the chain's `in_free` figures; without them no op is marked `early` (whether the plan keeps
    a_k whole is then unknown). Raises nothing: what a flag's absence means is each interpreter's rule.
    """
    last = last_forwards(ops, length)
    packed, moving = _packed_records(ops)
    early = early_pairs(ops, in_free, packed)
    joins = {i for i, (op, nxt) in enumerate(zip(ops, ops[1:], strict=False)) if _joins(op, nxt)}
    return [
        OpNote(op, last=i in last, pack=i in packed, moves=i in moving, early=i in early, joins=i in joins)
        for i, op in enumerate(ops)
    ]


def _joins(op: Op, nxt: Op) -> bool:
    return op.kind is OpKind.B and op.stage is not None and nxt == Op(OpKind.B, op.stage - 1)


def _packed_records(ops: Sequence[Op]) -> tuple[set[int], set[int]]:
    """(positions of the `Fe k` ops whose saved part an `OffloadSaved k` moves: each one's latest forward of
    stage k before it; positions of the `OffloadSaved k` ops whose stage's latest forward is such an `Fe k`)."""
    packed: set[int] = set()
    moving: set[int] = set()
    recent: dict[int, int] = {}  # stage: position of its latest forward
    for i, op in enumerate(ops):
        k = op.stage
        if op.kind.is_forward and k is not None:
            recent[k] = i
        elif op.kind is OpKind.OFFLOAD_SAVED and k is not None:
            at = recent.get(k)
            if at is not None and ops[at].kind is OpKind.FE:
                packed.add(at)
                moving.add(i)
    return packed, moving


def early_pairs(ops: Sequence[Op], in_free: Sequence[int] | None, packed: set[int]) -> set[int]:
    """Positions of the `Fc k` ops the plan allows to run with early-stopping recomputation, and of the `Fe k`
    ops they replace (docs/memory-model.md, "Early-stopping recomputation"; the executor also asks the stage).

    A pair qualifies when its `Fe k` comes right before `B k` and is not packed, the forward of stage k before
    that `Fe k` is an `Fc k`, and the plan holds `a_k` whole from that `Fc k` to the end of `B k`: no forward
    of stage k-1 (which would make `a_k` again) or transfer of `a_k` in between, and nothing of `a_k` let go at
    `Fe k` (`in_free[k] == 0`: stage k's graph keeps all of it; unknown without a chain, so none qualifies).
    A frozen stage runs only `Fn` (`check_frozen_prefix`), so never qualifies.
    """
    if in_free is None:
        return set()
    found: set[int] = set()
    recent: dict[int, int] = {}  # stage: position of its latest forward
    for j, op in enumerate(ops):
        k = op.stage
        if k is None or not op.kind.is_forward:
            continue
        i = recent.get(k)
        recent[k] = j
        if op.kind is not OpKind.FE or j + 1 >= len(ops) or ops[j + 1] != Op(OpKind.B, k) or j in packed:
            continue
        if i is None or ops[i].kind is not OpKind.FC or in_free[k] != 0:
            continue
        between = ops[i + 1 : j]
        if any((o.kind.is_forward and o.stage == k - 1) or (o.kind.is_transfer and o.stage == k) for o in between):
            continue
        found |= {i, j}
    return found


def frozen_prefix_ops(frozen: int) -> list[Op]:
    """`Fn 0 … Fn F-1`: how every plan of a chain with a frozen prefix of `F` stages starts (chain version 4)."""
    return [Op(OpKind.FN, k) for k in range(frozen)]


def check_frozen_prefix(ops: Sequence[Op], frozen: int) -> None:
    """Raise `ValueError` naming the first op that breaks the frozen prefix's rule (chain version 4): a plan
    starts with `Fn 0 … Fn F-1` and never runs those stages again."""
    prefix = frozen_prefix_ops(frozen)
    for i, op in enumerate(ops):
        if i < frozen and op != prefix[i]:
            raise ValueError(
                f"invalid plan: op {i} ({op.label}): stages 0..{frozen - 1} are frozen (no backward); a "
                f"plan starts with {', '.join(o.label for o in prefix)}, expected {prefix[i].label}"
            )
        if i >= frozen and op.stage is not None and op.stage < frozen:
            raise ValueError(
                f"invalid plan: op {i} ({op.label}): stage {op.stage} is frozen (no backward): it runs "
                "once, as the plan's first ops, and never again"
            )
    if len(ops) < frozen:
        raise ValueError(f"invalid plan: it ends before the frozen prefix {', '.join(o.label for o in prefix)} is run")


def shift_ops(ops: Iterable[Op], by: int) -> list[Op]:
    """`ops` with every stage index moved by `by` (a suffix's plan in the whole chain's indices, and back)."""
    return [op if op.stage is None else op.with_stage(op.stage + by) for op in ops]


def no_recompute_ops(length: int, frozen: int = 0) -> list[Op]:
    """`Fn 0 … Fn F-1, Fe F … Fe L-1, Loss, B L-1 … B F`: the fastest schedule, at unlimited memory."""
    return (
        frozen_prefix_ops(frozen)
        + [Op(OpKind.FE, k) for k in range(frozen, length)]
        + [Op(OpKind.LOSS)]
        + [Op(OpKind.B, k) for k in reversed(range(frozen, length))]
    )


def is_no_recompute(ops: Iterable[Op]) -> bool:
    """True when every forward records its graph once (after a frozen prefix): the schedule plain autograd runs."""
    ops = list(ops)
    length = 1 + max((op.stage for op in ops if op.stage is not None), default=-1)
    frozen = length - sum(1 for op in ops if op.kind is OpKind.B)
    return 0 <= frozen <= length and ops == no_recompute_ops(length, frozen)
