"""Parse and explain activation-memory budgets.

Users write budgets the way they think of memory: `6GiB`, `512MB`, a byte
count, or a fraction of what the chain needs without recomputation (`0.5`,
`"50%"`). Fractions need a chain to resolve; everything else does not.

Words: `mem_limit=` is what the user gives (a `MemLimit`; None means automatic);
a *budget* is what it resolves to, in bytes, or the object that resolves and shares
it (`lightning_rotor.shared_budget.Budget`). This module is a leaf (no torch, no
planner): the planner and the `plan` command read budgets with it.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

MemLimit = int | float | str | None  # what users give as `mem_limit=`; None: automatic
BudgetSpec = int | float | str  # a `MemLimit` that is not automatic (the planner's `mem_limit`)

UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
}
ACCEPTED = (
    "accepted: an integer number of bytes (8000000), a size with a unit "
    "('512MiB', '2GB', '1.5GiB'; units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), "
    "or a fraction of the no-recomputation peak in (0, 1] (0.5 or '50%')"
)
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")
_PERCENT = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*%\s*$")


class BudgetError(ValueError):
    """A budget that cannot be parsed."""


MAX_BUDGET = 2**62  # bytes; the planner adds sizes in 64-bit integers


def _whole_bytes(nbytes: int, spec: object) -> int:
    if nbytes < 1:
        raise BudgetError(f"budget {spec!r} is less than one byte; {ACCEPTED}")
    if nbytes > MAX_BUDGET:
        raise BudgetError(f"budget {spec!r} is more than the largest supported budget, 4 EiB (2**62 bytes); {ACCEPTED}")
    return nbytes


def _number(value: Fraction, spec: object) -> int | Fraction:
    """A plain number: a fraction of the peak when in (0, 1], else a whole number of bytes."""
    if value <= 0:
        raise BudgetError(f"budget {spec!r} must be positive; {ACCEPTED}")
    if value <= 1:
        return value
    if value.denominator != 1:
        raise BudgetError(f"budget {spec!r} is neither a fraction in (0, 1] nor a whole number of bytes; {ACCEPTED}")
    return _whole_bytes(int(value), spec)


def parse_budget(spec: BudgetSpec) -> int | Fraction:
    """Return bytes (`int`) or a fraction of the no-recomputation peak (`Fraction`).

    A string means what the same number means: `"0.5"` and `0.5`, `"5e-1"` and `0.5`,
    `"8000000"` and `8000000`; an integer (`1`, `"1"`) is bytes, a decimal (`1.0`, `"1.0"`) in (0, 1]
    is a fraction.
    """
    if isinstance(spec, bool):
        raise BudgetError(f"budget {spec!r} is not a size; {ACCEPTED}")
    if isinstance(spec, int):
        if spec <= 0:
            raise BudgetError(f"budget {spec} bytes must be positive; {ACCEPTED}")
        return _whole_bytes(spec, spec)
    if isinstance(spec, float):
        if not math.isfinite(spec):
            raise BudgetError(f"budget {spec!r} must be positive and finite; {ACCEPTED}")
        return _number(Fraction(repr(spec)), spec)
    if not isinstance(spec, str):
        raise BudgetError(f"budget {spec!r} has type {type(spec).__name__}; {ACCEPTED}")
    if spec.strip().startswith("-"):
        raise BudgetError(f"budget {spec!r} must be positive; {ACCEPTED}")
    percent = _PERCENT.match(spec)
    if percent:
        value = Fraction(percent.group(1)) / 100
        if not 0 < value <= 1:
            raise BudgetError(f"budget {spec!r} must be a percentage in (0%, 100%]; {ACCEPTED}")
        return value
    size = _SIZE.match(spec)
    if not size or size.group(2).lower() not in UNITS:
        raise BudgetError(f"cannot parse budget {spec!r}; {ACCEPTED}")
    text, unit = size.group(1), size.group(2).lower()
    exponent = int(text.lower().partition("e")[2] or 0)
    if len(text) > 40 or abs(exponent) > 40:  # beyond any real budget; keeps Fraction from huge powers of ten
        raise BudgetError(f"budget {spec!r} is out of range; {ACCEPTED}")
    number = Fraction(text)
    if unit == "":
        return _whole_bytes(int(text), spec) if text.isdigit() else _number(number, spec)
    return _whole_bytes(math.floor(number * UNITS[unit]), spec)


def resolve_budget(spec: BudgetSpec | Fraction, reference_peak: int) -> int:
    """Bytes of a budget; fractions are taken of `reference_peak` (the no-recomputation peak)."""
    value = spec if isinstance(spec, Fraction) else parse_budget(spec)
    if isinstance(value, Fraction):
        return max(1, math.floor(value * reference_peak))
    return value


BANDWIDTH_ACCEPTED = (
    "accepted: a positive number of bytes per second (12000000000, '1.5e10') or a rate with a unit "
    "('12GB/s', '12 GB/s', '500MiB/s'; units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB, each followed by '/s')"
)
_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*(?:([a-zA-Z]+)\s*/\s*s)?\s*$")


def parse_bandwidth(value: int | float | str) -> float:
    """Bytes per second of a host<->device link, from a number or a rate such as `"12GB/s"`.

    Offloading is priced by this one number (docs/planner.md), so the same spellings work in
    `Checkpointable(offload=...)`, the strategies, YAML and `lightning-rotor plan --bandwidth`.
    Turning offloading off is the caller's business (False / None), so zero is an error here.
    """
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise BudgetError(f"bandwidth {value!r} is not a rate; {BANDWIDTH_ACCEPTED}")
    if isinstance(value, str):
        rate = _RATE.match(value)
        unit = (rate.group(2) or "").lower() if rate else ""
        if not rate or unit not in UNITS:
            raise BudgetError(f"cannot parse bandwidth {value!r}; {BANDWIDTH_ACCEPTED}")
        number = float(rate.group(1)) * UNITS[unit]
    else:
        number = float(value)
    if not math.isfinite(number) or number <= 0:
        raise BudgetError(f"bandwidth {value!r} must be positive and finite; {BANDWIDTH_ACCEPTED}")
    return number


Offload = bool | int | float | str  # what users give as `offload=`: False, True (measure the link), or a rate


def parse_offload(value: Offload) -> bool | float:
    """`offload=` as False (off), True (the bandwidth is measured at profile time) or bytes per second.

    One parser for the strategies, YAML and `Checkpointable`, so `offload="12GB/s"` fails the same
    way everywhere: in one line, with the accepted forms.
    """
    if isinstance(value, bool):
        return value
    try:
        return parse_bandwidth(value)
    except BudgetError:
        raise BudgetError(
            f"offload={value!r} is neither True/False nor a bandwidth; offload is False (no offloading), True "
            f"(bandwidth measured at profile time) or a rate, {BANDWIDTH_ACCEPTED}"
        ) from None


def parse_host_limit(value: int | str) -> int:
    """Bytes of host memory offloaded values may take at once: bytes or a size (`"2GiB"`), never a fraction.

    A fraction has nothing to be a fraction of: the host is not what the budget's peak measures.
    """
    parsed = parse_budget(value)
    if isinstance(parsed, Fraction):
        raise BudgetError(
            f"host limit {value!r} is a fraction; give bytes or a size with a unit ('2GiB', '512MB', 8000000000)"
        )
    return parsed


def format_bandwidth(rate: float) -> str:
    """Decimal gigabytes per second, the unit links are quoted in: `12 GB/s`, `0.5 GB/s`."""
    return f"{rate / 1e9:.4g} GB/s"


def format_bytes(nbytes: int | float) -> str:
    """Human form with binary units: `1.50 GiB`, `512.0 KiB`, `17 B`."""
    nbytes = float(nbytes)
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{int(nbytes)} B"
