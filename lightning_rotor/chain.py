"""The `Chain` record: measured costs of a sequence of stages.

This is the only thing the planner ever sees (docs/memory-model.md):
numbers, never tensors. Validation is strict because a chain file is user
input, and a bad number would otherwise surface as a wrong plan much later.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

SIZE_FIELDS = ("out_size", "saved_size", "fwd_tmp", "bwd_tmp")
SIGNED_FIELDS = ("bwd_tmp",)  # version 2: may be negative (autograd frees as it goes), down to -s_k
# NOTE: [chain versions] each version's new fields, the one table every version check reads: a file may hold
# a field only from the version that added it on (`from_dict`), and a file says the oldest version that
# holds all its fields (`to_dict`). A field's default gives the previous version's meaning.
VERSION_FIELDS: dict[int, tuple[str, ...]] = {
    1: ("fwd_tmp_nograd",),
    2: ("out_free", "loss_tmp_kept"),  # released outputs, the loss on a kept output; bwd_tmp, loss_tmp signed
    3: ("in_free", "loss_value"),  # released stage inputs, the loss value apart from the input
    4: ("frozen",),  # a frozen prefix
    5: ("options",),  # ways to record a stage beside recording all
    6: ("bandwidth", "host_limit", "offloadable"),  # offloading
}
FIELD_VERSION = {name: version for version, names in VERSION_FIELDS.items() for name in names}
OPTIONAL_FIELDS = tuple(FIELD_VERSION)
CHAIN_VERSION = max(VERSION_FIELDS)
READABLE_VERSIONS = tuple(VERSION_FIELDS)
OLDEST_WRITTEN = 4  # files said version 4 before there were later ones; a file written says at least that
OPTION_FIELDS = ("saved_size", "fwd_time", "bwd_time", "fwd_tmp", "bwd_tmp")  # required in each option
TIME_FIELDS = ("fwd_time", "bwd_time")
STAGE_FIELDS = SIZE_FIELDS + TIME_FIELDS


MAX_BYTES = 2**62  # every size, and all of them together: the planner adds them in 64-bit integers
MAX_SECONDS = 1e12  # a bound on the planner's time scale (length x Σ fwd_time + Σ bwd_time)


class ChainError(ValueError):
    """A chain record that breaks the memory model's rules."""


def _check_size(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ChainError(f"{where} must be a non-negative integer number of bytes, got {value!r}")
    if isinstance(value, float) and (not math.isfinite(value) or value != int(value)):
        raise ChainError(f"{where} must be a non-negative integer number of bytes, got {value!r}")
    if value < 0:
        raise ChainError(f"{where} must be a non-negative integer number of bytes, got {value!r}")
    if value > MAX_BYTES:
        raise ChainError(f"{where} is {value!r} bytes, more than the 2**62 bytes (4 EiB) a chain may hold")
    return value if isinstance(value, int) else int(value)  # an int as it is: a traced size keeps its terms


def _check_signed(value: Any, where: str, lowest: int) -> int:
    """A byte count that may be negative, down to `lowest` (a peak is never below the state it starts from)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or (isinstance(value, float) and (not math.isfinite(value) or value != int(value)))
    ):
        raise ChainError(f"{where} must be an integer number of bytes, got {value!r}")
    if abs(value) > MAX_BYTES:
        raise ChainError(f"{where} is {value!r} bytes, beyond the 2**62 bytes (4 EiB) a chain may hold")
    if value < lowest:
        raise ChainError(
            f"{where}={int(value)} is below {lowest}: the peak of an op cannot be below what is held when it starts"
        )
    return value if isinstance(value, int) else int(value)  # an int as it is: a traced size keeps its terms


def _optional_sizes(values: Any, name: str, default: list[int]) -> list[int]:
    """An optional per-stage list of byte counts: `default` when absent, else one valid size per stage."""
    if values is None:
        return default
    if not isinstance(values, (list, tuple)) or len(values) != len(default):
        raise ChainError(f"{name} must be a list with one entry per stage ({len(default)})")
    return [_check_size(v, f"{name}[{k}]") for k, v in enumerate(values)]


def _check_time(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ChainError(f"{where} must be a non-negative number of seconds, got {value!r}")
    seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0:
        raise ChainError(f"{where} must be a finite non-negative number of seconds, got {seconds!r}")
    return seconds


@dataclass(frozen=True)
class StageOption:
    """One further way to record a stage (chain version 5): save a selection, recompute the rest in `B k`.

    Figures as the stage's own columns, for `Fs k:o` (docs/memory-model.md, "Chain version 5"):
    `saved_size` held after it, `fwd_tmp` its transient, `bwd_tmp` (signed) the backward's peak
    above `cur - out_free + s_k`, including the recomputed part, `out_free` the bytes of
    `a_{k+1}` its graph does not keep.
    """

    saved_size: int
    fwd_time: float
    bwd_time: float
    fwd_tmp: int
    bwd_tmp: int
    out_free: int = 0
    name: str = ""

    @property
    def bwd_net(self) -> int:
        """`bwd_tmp - out_free`, as `Chain.bwd_net` for option 0."""
        return self.bwd_tmp - self.out_free

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"name": self.name} if self.name else {}
        data.update({f: getattr(self, f) for f in OPTION_FIELDS})
        if self.out_free:
            data["out_free"] = self.out_free
        return data


@dataclass(frozen=True)
class StageProfile:
    """One stage's figures: its entries of a `Chain`'s per-stage lists, which the `Chain` docstring and
    docs/memory-model.md define. The profiler measures a chain stage by stage; `Chain.from_stages` gathers them."""

    out_size: int
    saved_size: int
    fwd_time: float
    bwd_time: float
    fwd_tmp: int
    bwd_tmp: int
    fwd_tmp_nograd: int | None = None  # None: fwd_tmp
    out_free: int = 0  # version 2
    in_free: int = 0  # version 3
    options: tuple[StageOption, ...] = ()  # version 5
    offloadable: int = 0  # version 6
    name: str | None = None  # None: `stage{k}`


STAGE_COLUMNS = tuple(f.name for f in fields(StageProfile) if f.name != "name")  # a Chain's per-stage lists


def _check_option(value: Any, where: str, s_in: int, s_out: int, in_free_next: int) -> StageOption:
    """A stage option from its JSON object or a `StageOption`, checked like the stage's own figures."""
    if isinstance(value, StageOption):
        value = {**value.to_dict(), "out_free": value.out_free, "name": value.name}
    if not isinstance(value, dict):
        raise ChainError(f"{where} must be an object with fields {', '.join(OPTION_FIELDS)}, got {value!r}")
    known = {*OPTION_FIELDS, "out_free", "name"}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ChainError(f"{where}: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    missing = [f for f in OPTION_FIELDS if f not in value]
    if missing:
        raise ChainError(f"{where} is missing field(s) {', '.join(missing)}")
    name = value.get("name", "")
    if not isinstance(name, str):
        raise ChainError(f"{where}.name must be a string, got {name!r}")
    saved = _check_size(value["saved_size"], f"{where}.saved_size")
    out_free = _check_size(value.get("out_free", 0), f"{where}.out_free")
    if out_free > min(s_out, saved):
        raise ChainError(
            f"{where}.out_free={out_free} is larger than the stage's out_size={s_out} or the option's "
            f"saved_size={saved}; only the stage's own output is released"
        )
    if out_free < in_free_next:
        raise ChainError(
            f"{where}.out_free={out_free} is below in_free={in_free_next} of the next stage: the bytes of the "
            "output that neither graph keeps are among those the option's graph does not keep"
        )
    return StageOption(
        saved_size=saved,
        fwd_time=_check_time(value["fwd_time"], f"{where}.fwd_time"),
        bwd_time=_check_time(value["bwd_time"], f"{where}.bwd_time"),
        fwd_tmp=_check_size(value["fwd_tmp"], f"{where}.fwd_tmp"),
        bwd_tmp=_check_signed(value["bwd_tmp"], f"{where}.bwd_tmp", -s_in),
        out_free=out_free,
        name=name,
    )


def _check_version_holds(data: dict[str, Any], version: int) -> None:
    """A file of `version` holds no field a later version added (NOTE: [chain versions]); version 1's transients
    are non-negative (nothing of a recorded output is released, autograd's early frees are not counted)."""
    for newer in range(CHAIN_VERSION, version, -1):
        added = [name for name in VERSION_FIELDS[newer] if name in data]
        if added:
            raise ChainError(
                f"field(s) {', '.join(added)} need chain version {newer}; this file says version {version}"
            )
    if version == 1:
        for k, v in enumerate(data["bwd_tmp"] if isinstance(data["bwd_tmp"], (list, tuple)) else []):
            _check_size(v, f"bwd_tmp[{k}]")
        _check_size(data.get("loss_tmp", 0), "loss_tmp")


@dataclass
class Chain:
    """Per-stage costs of a chain of `L` stages, in bytes and seconds.

    `out_size[k]` is the size of `a_{k+1}`; `sizes` gives all `s_0 … s_L`.
    `fwd_tmp[k]` is the transient of `F_k` recording its graph (`Fe`), and
    `fwd_tmp_nograd[k]` the transient without grad (`Fn`, `Fc`); it defaults to
    `fwd_tmp`. They differ where a stage saves what is otherwise transient
    (attention scores), and one figure for both would overcharge one of them.

    Version 2 (docs/memory-model.md, part 2): `B k` peaks at
    `cur - out_free[k] + s_k + bwd_tmp[k]`, where `out_free[k]` is the part of
    `a_{k+1}` its own graph does not keep (released before the backward) and
    `bwd_tmp[k]` may be negative (autograd frees saved tensors node by node);
    `Loss` peaks at `cur + s_L + loss_tmp` on a plain `a_L` handed to the loss,
    `cur + s_L + loss_tmp_kept` when part of `a_L` stays alive through it.
    Defaults (`out_free` 0, `loss_tmp_kept = loss_tmp`) give version 1's meaning.

    Version 3: `in_free[k]` is the part of `a_k` that neither the graph of `F_{k-1}`
    nor that of `F_k` keeps; it is released right after the last forward of stage
    `k` before `B k` (always an `Fe k` in a persistent schedule). The caller's `a_0` is never
    dropped: `in_free[0]` is 0 but in the `suffix()` of a frozen prefix, where the input also
    holds `a_F`; the default, all zeros, gives version 2's meaning.
    `loss_value`: bytes the loss holds from the end of `Loss` to the end of the step (its
    value and the gradient `backward()` seeds it with); before version 3 they were counted
    in `input_size`, from the start of the step (default 0: that meaning).

    Version 4: `frozen` is `F`, the length of the frozen prefix: stages `0 … F-1` need no
    backward (the chain input does not require grad and none of their parameters does), so
    they run once as `Fn 0 … Fn F-1` before anything else, recording nothing, and are never
    recomputed nor backwarded; their `saved_size`, `fwd_tmp`, `bwd_tmp`, `bwd_time`,
    `out_free` and `in_free[1..F-1]` are not used; `in_free[F]` is the part of `a_F` that stage
    `F`'s graph does not keep, let go after its last `Fe F`. What follows is the ordinary chain
    `suffix()`. The default, 0, gives version 3's meaning.

    Version 5: `options[k]` lists further ways to record stage `k` (`StageOption`: save a
    selection, recompute the rest in the backward), run as `Fs k:o` for option `o >= 1`;
    option 0 is the stage's own figures (`Fe k`). The default, no options anywhere, gives
    version 4's meaning.

    Version 6: `bandwidth` is the transfer channel's speed between device and host memory, in
    bytes per second, for `Offload k` and `Prefetch k` (docs/memory-model.md, "Offloading");
    0, the default, means no offloading and gives version 5's meaning. `host_limit` bounds the
    host bytes offloaded values may hold at once (None: unbounded). `offloadable[k]` is the part of
    what `Fe k` saves that `OffloadSaved k` may move to host memory: the distinct storages its graph
    saves that are neither parameters nor buffers nor (part of) `a_k` or `a_{k+1}`; at most
    `saved_size[k]`; the default, all zeros, means a recorded stage's saved part stays on the device.
    """

    input_size: int
    out_size: list[int]
    saved_size: list[int]
    fwd_time: list[float]
    bwd_time: list[float]
    fwd_tmp: list[int]
    bwd_tmp: list[int]
    loss_tmp: int = 0
    names: list[str] = field(default_factory=list)
    # None in the constructor means "derive it" (the docstring says from what): __post_init__ fills
    # these in, so on a Chain they are always a list (an int), which is the type they are given.
    fwd_tmp_nograd: list[int] = None  # type: ignore[assignment]
    out_free: list[int] = None  # type: ignore[assignment]
    loss_tmp_kept: int = None  # type: ignore[assignment]
    in_free: list[int] = None  # type: ignore[assignment]
    loss_value: int = 0
    frozen: int = 0
    options: list[list[StageOption]] = None  # type: ignore[assignment]
    bandwidth: float = 0.0
    host_limit: int | None = None
    offloadable: list[int] = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        length = self._check_stage_columns()
        sizes = self._check_sizes(length)
        self._check_out_free(length)
        self.loss_value = _check_size(self.loss_value, "loss_value")
        self._check_frozen(length)
        self._check_in_free(length)
        self._check_options(length, sizes)
        self._check_transfer(length)
        self._check_totals(length)
        self._check_names(length)

    def _check_stage_columns(self) -> int:
        """The number of stages; every required per-stage list has one valid entry per stage (`bwd_tmp` aside,
        checked against the sizes in `_check_sizes`)."""
        length = len(self.out_size) if isinstance(self.out_size, (list, tuple)) else None
        if length is None:
            raise ChainError(f"out_size must be a list, got {type(self.out_size).__name__}")
        if length == 0:
            raise ChainError("a chain needs at least one stage; out_size is empty")
        for name in STAGE_FIELDS:
            values = getattr(self, name)
            if not isinstance(values, (list, tuple)):
                raise ChainError(f"{name} must be a list, got {type(values).__name__}")
            if len(values) != length:
                raise ChainError(
                    f"{name} has {len(values)} entries but out_size has {length}; "
                    "every per-stage list must have one entry per stage"
                )
            if name in SIGNED_FIELDS:
                continue  # checked below, against the sizes
            check = _check_size if name in SIZE_FIELDS else _check_time
            setattr(self, name, [check(v, f"{name}[{k}]") for k, v in enumerate(values)])
        return length

    def _check_sizes(self, length: int) -> list[int]:
        """`s_0 … s_L`, after checking `fwd_tmp_nograd`, `input_size` and the signed transients against them."""
        self.fwd_tmp_nograd = _optional_sizes(self.fwd_tmp_nograd, "fwd_tmp_nograd", list(self.fwd_tmp))
        self.input_size = _check_size(self.input_size, "input_size")
        sizes = self.sizes
        self.bwd_tmp = [_check_signed(v, f"bwd_tmp[{k}]", -sizes[k]) for k, v in enumerate(self.bwd_tmp)]
        self.loss_tmp = _check_signed(self.loss_tmp, "loss_tmp", -sizes[-1])
        if self.loss_tmp_kept is None:
            self.loss_tmp_kept = self.loss_tmp
        else:
            self.loss_tmp_kept = _check_signed(self.loss_tmp_kept, "loss_tmp_kept", -sizes[-1])
        return sizes

    def _check_out_free(self, length: int) -> None:
        self.out_free = _optional_sizes(self.out_free, "out_free", [0] * length)
        for k in range(length):
            if self.out_free[k] > min(self.out_size[k], self.saved_size[k]):
                raise ChainError(
                    f"out_free[{k}]={self.out_free[k]} is larger than out_size[{k}]={self.out_size[k]} "
                    f"or saved_size[{k}]={self.saved_size[k]}; only the stage's own output is released"
                )

    def _check_frozen(self, length: int) -> None:
        if isinstance(self.frozen, bool) or not isinstance(self.frozen, int) or not 0 <= self.frozen < length:
            raise ChainError(
                f"frozen must be an integer from 0 to {length - 1} (the stages before the first one that "
                f"needs a backward; at least the last stage does), got {self.frozen!r}"
            )

    def _check_in_free(self, length: int) -> None:
        """`in_free[k]` within `a_k`, and within what the graph of stage `k-1` does not keep (NOTE: version 3)."""
        self.in_free = _optional_sizes(self.in_free, "in_free", [0] * length)
        if self.in_free[0] > self.input_size:
            raise ChainError(
                f"in_free[0]={self.in_free[0]} is larger than input_size={self.input_size}: only a part of the "
                "chain input the chain owns (a_F after a frozen prefix, in its suffix) is released"
            )
        for k in range(1, length):
            if self.in_free[k] > self.out_size[k - 1]:
                raise ChainError(
                    f"in_free[{k}]={self.in_free[k]} is larger than out_size[{k - 1}]="
                    f"{self.out_size[k - 1]}, the size of a_{k}"
                )
            if k != self.frozen and self.in_free[k] > self.out_free[k - 1]:  # a frozen stage records no graph
                raise ChainError(
                    f"in_free[{k}]={self.in_free[k]} is larger than out_free[{k - 1}]="
                    f"{self.out_free[k - 1]}: bytes of a_{k} neither graph keeps are among those the "
                    f"graph of stage {k - 1} does not keep"
                )

    def _check_options(self, length: int, sizes: list[int]) -> None:
        if self.options is None:
            self.options = [[] for _ in range(length)]
        if not isinstance(self.options, (list, tuple)) or len(self.options) != length:
            raise ChainError(f"options must be a list with one list of options per stage ({length})")
        in_free_next = [*self.in_free[1:], 0]
        checked: list[list[StageOption]] = []
        for k, opts in enumerate(self.options):
            if not isinstance(opts, (list, tuple)):
                raise ChainError(f"options[{k}] must be a list of options (empty: only recording all)")
            checked.append(
                [
                    _check_option(o, f"options[{k}][{i}]", sizes[k], sizes[k + 1], in_free_next[k])
                    for i, o in enumerate(opts)
                ]
            )
        self.options = checked

    def _check_transfer(self, length: int) -> None:
        """The transfer channel and what may move over it (version 6)."""
        bandwidth = self.bandwidth
        if isinstance(bandwidth, bool) or not isinstance(bandwidth, (int, float)) or not 0 <= bandwidth < math.inf:
            raise ChainError(
                f"bandwidth must be a finite number of bytes per second >= 0 (0: no offloading), got {bandwidth!r}"
            )
        self.bandwidth = float(bandwidth)
        if self.host_limit is not None:
            self.host_limit = _check_size(self.host_limit, "host_limit")
        self.offloadable = _optional_sizes(self.offloadable, "offloadable", [0] * length)
        for k in range(length):
            if self.offloadable[k] > self.saved_size[k]:
                raise ChainError(
                    f"offloadable[{k}]={self.offloadable[k]} is larger than saved_size[{k}]={self.saved_size[k]}: "
                    "only bytes the graph of Fe k saves can move to host memory"
                )

    def _check_totals(self, length: int) -> None:
        """All sizes together within what the planner adds exactly, all times within its time scale."""
        total = (
            self.input_size
            + self.loss_value
            + abs(self.loss_tmp)
            + abs(self.loss_tmp_kept)
            + sum(
                sum(abs(v) for v in getattr(self, f)) for f in (*SIZE_FIELDS, "fwd_tmp_nograd", "out_free", "in_free")
            )
            + sum(o.saved_size + o.fwd_tmp + abs(o.bwd_tmp) + o.out_free for opts in self.options for o in opts)
        )
        if int(total) > MAX_BYTES:  # a bound, not a branch of the figures: no guard of a traced profile's
            raise ChainError(
                f"the chain's sizes add up to {total} bytes, more than the 2**62 bytes (4 EiB) the "
                "planner adds up exactly"
            )
        horizon = length * sum(self.slowest_fwd_time) + sum(self.slowest_bwd_time)  # inf when it overflows
        if not horizon <= MAX_SECONDS:
            raise ChainError(
                f"the chain's times are too large: {length} x Σ fwd_time + Σ bwd_time = {horizon:g} s; "
                f"at most {MAX_SECONDS:g} s is accepted"
            )

    def _check_names(self, length: int) -> None:
        if self.names is None or (isinstance(self.names, (list, tuple)) and not self.names):
            self.names = [f"stage{k}" for k in range(length)]
        if not isinstance(self.names, (list, tuple)) or len(self.names) != length:
            raise ChainError(f"names must be a list of {length} strings, one per stage")
        if not all(isinstance(n, str) for n in self.names):
            raise ChainError("names must be strings")
        self.names = list(self.names)

    @classmethod
    def from_stages(
        cls,
        stages: Sequence[StageProfile],
        *,
        input_size: int,
        loss_tmp: int = 0,
        loss_tmp_kept: int | None = None,
        loss_value: int = 0,
        frozen: int = 0,
        bandwidth: float = 0.0,
        host_limit: int | None = None,
    ) -> Chain:
        """The chain of `stages`, in order, with the figures that belong to the whole chain; checked as any chain."""
        columns: dict[str, Any] = {name: [getattr(s, name) for s in stages] for name in STAGE_COLUMNS}
        columns["fwd_tmp_nograd"] = [s.fwd_tmp if s.fwd_tmp_nograd is None else s.fwd_tmp_nograd for s in stages]
        columns["options"] = [list(s.options) for s in stages]
        return cls(
            input_size=input_size,
            loss_tmp=loss_tmp,
            names=[f"stage{k}" if s.name is None else s.name for k, s in enumerate(stages)],
            loss_tmp_kept=loss_tmp if loss_tmp_kept is None else loss_tmp_kept,
            loss_value=loss_value,
            frozen=frozen,
            bandwidth=bandwidth,
            host_limit=host_limit,
            **columns,
        )

    @property
    def stages(self) -> list[StageProfile]:
        """Per stage, its figures as one record (`from_stages` gathers them back into this chain)."""
        columns = {name: getattr(self, name) for name in STAGE_COLUMNS}
        columns["options"] = [tuple(opts) for opts in self.options]
        return [
            StageProfile(name=name, **{column: values[k] for column, values in columns.items()})
            for k, name in enumerate(self.names)
        ]

    @property
    def length(self) -> int:
        """Number of stages `L` (the loss is not counted)."""
        return len(self.out_size)

    def __len__(self) -> int:
        return self.length

    @property
    def sizes(self) -> list[int]:
        """`s_0 … s_L`: bytes of every value of the chain, input first."""
        return [self.input_size, *self.out_size]

    @property
    def has_options(self) -> bool:
        """True when some stage after the frozen prefix has an option beside recording all."""
        return any(self.options[self.frozen :])

    @property
    def slowest_fwd_time(self) -> list[float]:
        """Per stage, the slowest forward over its options (bounds every schedule's time)."""
        return [max([t, *(o.fwd_time for o in opts)]) for t, opts in zip(self.fwd_time, self.options, strict=True)]

    @property
    def slowest_bwd_time(self) -> list[float]:
        """Per stage, the slowest backward over its options."""
        return [max([t, *(o.bwd_time for o in opts)]) for t, opts in zip(self.bwd_time, self.options, strict=True)]

    @property
    def offloads(self) -> bool:
        """True when stage inputs may be offloaded to host memory (a positive `bandwidth`, version 6)."""
        return self.bandwidth > 0

    def with_transfer(self, bandwidth: float | None, host_limit: int | None = None) -> Chain:
        """This chain with another transfer bandwidth (bytes/s; None keeps its own) and host limit."""
        if bandwidth is None and host_limit is None:
            return self
        return replace(
            self,
            bandwidth=self.bandwidth if bandwidth is None else bandwidth,
            host_limit=self.host_limit if host_limit is None else host_limit,
        )

    def option_loss_tmp_graph(self, option: StageOption) -> int:
        """`loss_tmp_graph` when the last stage was recorded by `option`."""
        return self.loss_tmp if option.out_free == self.out_size[-1] else self.loss_tmp_kept

    @property
    def bwd_net(self) -> list[int]:
        """What `B k` adds to the bytes held when it starts, beside `s_k`: `bwd_tmp[k] - out_free[k]` (signed).

        The planners' `B k` charge is `cur + s_k + bwd_net[k]`; the release of the free
        part of `a_{k+1}` is folded in, so version-1 chains (nothing free) keep their figures.
        """
        return [t - f for t, f in zip(self.bwd_tmp, self.out_free, strict=True)]

    @property
    def loss_tmp_graph(self) -> int:
        """`loss_tmp` for a chain output held with its graph: plain when the graph keeps none of `a_L`."""
        return self.loss_tmp if self.out_free[-1] == self.out_size[-1] else self.loss_tmp_kept

    def no_recompute_time(self) -> float:
        """Time of one step with unlimited memory: every stage once forward, every stage after the
        frozen prefix once backward.

        One correctly rounded sum, as `simulate` adds op times, so the two agree exactly.
        """
        return math.fsum([*self.fwd_time, *self.bwd_time[self.frozen :]])

    @property
    def prefix_peak(self) -> int:
        """Peak of the frozen prefix, `Fn 0 … Fn F-1` with `a_0` held (`input_size` when there is none)."""
        s = self.sizes
        peak = s[0]
        for k in range(self.frozen):
            peak = max(peak, s[0] + (s[k] if k else 0) + s[k + 1] + self.fwd_tmp_nograd[k])
        return peak

    def suffix(self) -> Chain:
        """The stages `F … L-1` after the frozen prefix as an ordinary chain (this chain when `F = 0`).

        Its input holds both `a_0` (the caller's) and `a_F`, which stay to the end of the step, and
        `B F` makes no gradient for `a_F`: its `bwd_tmp` is shifted so that the suffix's
        `cur - out_free + s_0' + bwd_tmp'` is the chain's `cur - out_free + s_F + bwd_tmp[F]`
        (docs/memory-model.md, "Chain version 4"). Its `in_free[0]` is `in_free[F]`: the part of `a_F`
        that stage `F`'s graph does not keep goes after the last `Fe F`, as any stage input's; `a_0` stays.
        """
        f = self.frozen
        if f == 0:
            return self
        return Chain(
            input_size=self.input_size + self.out_size[f - 1],
            out_size=self.out_size[f:],
            saved_size=self.saved_size[f:],
            fwd_time=self.fwd_time[f:],
            bwd_time=self.bwd_time[f:],
            fwd_tmp=self.fwd_tmp[f:],
            bwd_tmp=[self.bwd_tmp[f] - self.input_size, *self.bwd_tmp[f + 1 :]],
            loss_tmp=self.loss_tmp,
            names=self.names[f:],
            fwd_tmp_nograd=self.fwd_tmp_nograd[f:],
            out_free=self.out_free[f:],
            loss_tmp_kept=self.loss_tmp_kept,
            in_free=self.in_free[f:],
            loss_value=self.loss_value,
            options=[
                [replace(o, bwd_tmp=o.bwd_tmp - self.input_size) for o in self.options[f]],
                *self.options[f + 1 :],
            ],
            bandwidth=self.bandwidth,
            host_limit=self.host_limit,
            offloadable=self.offloadable[f:],
        )

    @classmethod
    def from_dict(cls, data: Any) -> Chain:
        if not isinstance(data, dict):
            raise ChainError(f"a chain must be a JSON object, got {type(data).__name__}")
        version = data.get("version", 1)  # files before versioning are version 1
        if isinstance(version, bool) or version not in READABLE_VERSIONS:
            raise ChainError(
                f"unknown chain version {version!r}; this release reads versions "
                f"{', '.join(map(str, READABLE_VERSIONS))}"
            )
        missing = [k for k in ("input_size", *STAGE_FIELDS) if k not in data]
        if missing:
            raise ChainError(f"chain is missing field(s) {', '.join(missing)}")
        known = {"version", "names", "input_size", "loss_tmp", *STAGE_FIELDS, *OPTIONAL_FIELDS}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ChainError(f"unknown chain field(s) {', '.join(unknown)}; known fields: {', '.join(sorted(known))}")
        _check_version_holds(data, version)
        return cls(
            input_size=data["input_size"],
            loss_tmp=data.get("loss_tmp", 0),
            names=data.get("names", []),
            **{name: data[name] for name in (*STAGE_FIELDS, *OPTIONAL_FIELDS) if name in data},
        )

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "version": OLDEST_WRITTEN,
            "names": list(self.names),
            "input_size": self.input_size,
            **{name: list(getattr(self, name)) for name in STAGE_FIELDS},
            "loss_tmp": self.loss_tmp,
            **self._optional_dict(),
        }
        # a file says the oldest version that holds it, so older readers still load it (NOTE: [chain versions])
        data["version"] = max(OLDEST_WRITTEN, *(FIELD_VERSION.get(name, 1) for name in data))
        return data

    def _optional_dict(self) -> dict[str, Any]:
        """The optional fields that differ from their defaults (the previous version's meaning), as written."""
        data: dict[str, Any] = {}
        if self.fwd_tmp_nograd != self.fwd_tmp:
            data["fwd_tmp_nograd"] = list(self.fwd_tmp_nograd)
        if any(self.out_free):
            data["out_free"] = list(self.out_free)
        if self.loss_tmp_kept != self.loss_tmp:
            data["loss_tmp_kept"] = self.loss_tmp_kept
        if any(self.in_free):
            data["in_free"] = list(self.in_free)
        if self.loss_value:
            data["loss_value"] = self.loss_value
        if self.frozen:
            data["frozen"] = self.frozen
        if any(self.options):
            data["options"] = [[o.to_dict() for o in opts] for opts in self.options]
        if self.bandwidth:
            data["bandwidth"] = self.bandwidth
        if self.host_limit is not None:
            data["host_limit"] = self.host_limit
        if any(self.offloadable):
            data["offloadable"] = list(self.offloadable)
        return data

    @classmethod
    def load(cls, path: str | Path) -> Chain:
        """Read a chain JSON file; every failure is a one-line `ChainError` naming the file."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ChainError(f"{path}: no such chain file") from None
        except UnicodeDecodeError as err:
            raise ChainError(f"{path}: not UTF-8 text (byte {err.start}); a chain file is JSON in UTF-8") from None
        except OSError as err:
            raise ChainError(f"{path}: cannot read chain file ({err.strerror})") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ChainError(f"{path}: not valid JSON ({err.msg} at line {err.lineno} column {err.colno})") from None
        except RecursionError:
            raise ChainError(f"{path}: JSON nested too deeply; a chain is one object of lists and numbers") from None
        except ValueError:  # an integer literal longer than Python converts
            raise ChainError(f"{path}: a JSON number has too many digits to be a size or a time") from None
        try:
            return cls.from_dict(data)
        except ChainError as err:
            raise ChainError(f"{path}: {err}") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")
