"""The `Chain` record: measured costs of a sequence of stages.

This is the only thing the planner ever sees (docs/memory-model.md):
numbers, never tensors. Validation is strict because a chain file is user
input, and a bad number would otherwise surface as a wrong plan much later.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CHAIN_VERSION = 1
SIZE_FIELDS = ("out_size", "saved_size", "fwd_tmp", "bwd_tmp")
OPTIONAL_FIELDS = ("fwd_tmp_nograd",)
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
    return int(value)


def _check_time(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ChainError(f"{where} must be a non-negative number of seconds, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise ChainError(f"{where} must be a finite non-negative number of seconds, got {value!r}")
    return value


@dataclass
class Chain:
    """Per-stage costs of a chain of `L` stages, in bytes and seconds.

    `out_size[k]` is the size of `a_{k+1}`; `sizes` gives all `s_0 … s_L`.
    `fwd_tmp[k]` is the transient of `F_k` recording its graph (`Fe`), and
    `fwd_tmp_nograd[k]` the transient without grad (`Fn`, `Fc`); it defaults to
    `fwd_tmp`. They differ where a stage saves what is otherwise transient
    (attention scores), and one figure for both would overcharge one of them.
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
    fwd_tmp_nograd: list[int] | None = None

    def __post_init__(self) -> None:
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
            check = _check_size if name in SIZE_FIELDS else _check_time
            setattr(self, name, [check(v, f"{name}[{k}]") for k, v in enumerate(values)])
        if self.fwd_tmp_nograd is None:
            self.fwd_tmp_nograd = list(self.fwd_tmp)
        elif not isinstance(self.fwd_tmp_nograd, (list, tuple)) or len(self.fwd_tmp_nograd) != length:
            raise ChainError(f"fwd_tmp_nograd must be a list with one entry per stage ({length})")
        else:
            self.fwd_tmp_nograd = [_check_size(v, f"fwd_tmp_nograd[{k}]") for k, v in enumerate(self.fwd_tmp_nograd)]
        self.input_size = _check_size(self.input_size, "input_size")
        self.loss_tmp = _check_size(self.loss_tmp, "loss_tmp")
        total = self.input_size + self.loss_tmp + sum(sum(getattr(self, f)) for f in (*SIZE_FIELDS, "fwd_tmp_nograd"))
        if total > MAX_BYTES:
            raise ChainError(f"the chain's sizes add up to {total} bytes, more than the 2**62 bytes (4 EiB) the "
                             "planner adds up exactly")
        horizon = length * sum(self.fwd_time) + sum(self.bwd_time)  # inf, not an error, when it overflows
        if not horizon <= MAX_SECONDS:
            raise ChainError(f"the chain's times are too large: {length} x Σ fwd_time + Σ bwd_time = {horizon:g} s; "
                             f"at most {MAX_SECONDS:g} s is accepted")
        if self.names is None or (isinstance(self.names, (list, tuple)) and not self.names):
            self.names = [f"stage{k}" for k in range(length)]
        if not isinstance(self.names, (list, tuple)) or len(self.names) != length:
            raise ChainError(f"names must be a list of {length} strings, one per stage")
        if not all(isinstance(n, str) for n in self.names):
            raise ChainError("names must be strings")
        self.names = list(self.names)

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

    def no_recompute_time(self) -> float:
        """Time of one step with unlimited memory: every stage once forward, once backward.

        One correctly rounded sum, as `simulate` adds op times, so the two agree exactly.
        """
        return math.fsum([*self.fwd_time, *self.bwd_time])

    @classmethod
    def from_dict(cls, data: Any) -> Chain:
        if not isinstance(data, dict):
            raise ChainError(f"a chain must be a JSON object, got {type(data).__name__}")
        version = data.get("version", CHAIN_VERSION)
        if isinstance(version, bool) or version != CHAIN_VERSION:
            raise ChainError(f"unknown chain version {version!r}; this release reads version {CHAIN_VERSION}")
        missing = [k for k in ("input_size", *STAGE_FIELDS) if k not in data]
        if missing:
            raise ChainError(f"chain is missing field(s) {', '.join(missing)}")
        known = {"version", "names", "input_size", "loss_tmp", *STAGE_FIELDS, *OPTIONAL_FIELDS}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ChainError(f"unknown chain field(s) {', '.join(unknown)}; known fields: {', '.join(sorted(known))}")
        return cls(
            input_size=data["input_size"],
            loss_tmp=data.get("loss_tmp", 0),
            names=data.get("names"),
            fwd_tmp_nograd=data.get("fwd_tmp_nograd"),
            **{name: data[name] for name in STAGE_FIELDS},
        )

    def to_dict(self) -> dict[str, Any]:
        data = {
            "version": CHAIN_VERSION,
            "names": list(self.names),
            "input_size": self.input_size,
            **{name: list(getattr(self, name)) for name in STAGE_FIELDS},
            "loss_tmp": self.loss_tmp,
        }
        if self.fwd_tmp_nograd != self.fwd_tmp:
            data["fwd_tmp_nograd"] = list(self.fwd_tmp_nograd)
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
