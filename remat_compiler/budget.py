"""Memory budgets: parsing what users pass and printing bytes for people."""
from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass

__all__ = ["Budget", "parse_budget", "human_bytes"]

_UNITS = {
    "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_ACCEPTED = ("a positive int of bytes, a string with a unit such as '2GiB' or '512MB', "
             "a fraction in (0, 1] of the no-recompute step peak such as 0.5, or None for no limit")


@dataclass(frozen=True)
class Budget:
    """A parsed memory budget: exactly one of ``bytes`` or ``fraction`` is set, or neither (no limit)."""

    bytes: int | None = None
    fraction: float | None = None

    def resolve(self, baseline_peak_bytes: int) -> int | None:
        """Return the budget in bytes, given the save-all plan's peak; None means unlimited."""
        if self.bytes is not None:
            return self.bytes
        if self.fraction is not None:
            return int(math.floor(self.fraction * baseline_peak_bytes))
        return None

    def __str__(self) -> str:
        if self.bytes is not None:
            return human_bytes(self.bytes)
        if self.fraction is not None:
            return f"{self.fraction:g} of the no-recompute peak"
        return "unlimited"


def parse_budget(value: object) -> Budget:
    """Parse a ``memory_budget`` argument.

    Parameters
    ----------
    value : int | str | float | None
        Bytes (int), a unit string (``"1.5GiB"``, ``"512MB"``, ``"4096"``), a fraction in (0, 1] of the
        save-all peak, or None (no limit).

    Returns
    -------
    Budget

    Raises
    ------
    ValueError
        For anything else, saying what is accepted.

    Example
    -------
    >>> parse_budget("2KiB").bytes
    2048
    """
    if value is None:
        return Budget()
    if isinstance(value, bool):
        raise ValueError(f"memory_budget={value!r} is not valid; expected {_ACCEPTED}")
    if isinstance(value, numbers.Integral):  # int, numpy integers
        value = int(value)
        if value <= 0:
            raise ValueError(f"memory_budget={value} bytes must be positive; expected {_ACCEPTED}")
        return Budget(bytes=value)
    if isinstance(value, numbers.Real):  # float, numpy floats
        value = float(value)
        if not (0.0 < value <= 1.0) or math.isnan(value):
            raise ValueError(f"memory_budget={value} is a float outside (0, 1]; floats are fractions "
                             f"of the no-recompute peak (pass bytes as an int); expected {_ACCEPTED}")
        return Budget(fraction=value)
    if isinstance(value, str):
        return _parse_text(value)
    raise ValueError(f"memory_budget of type {type(value).__name__} is not valid; expected {_ACCEPTED}")


def _parse_text(value: str) -> Budget:
    """A budget string: a unitless number in (0, 1] is a fraction (as the float would be), a unitless
    whole number is bytes, a number with a unit is bytes (whole bytes when the unit is B)."""
    text = value.strip().replace("_", "")
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)", text)
    unit = m.group(2).lower() if m else None
    if m is None or (unit and unit not in _UNITS):
        raise ValueError(f"memory_budget={value!r} could not be parsed; expected {_ACCEPTED}")
    number = float(m.group(1))
    if not math.isfinite(number) or number * _UNITS.get(unit or "b", 1) > 2.0 ** 80:
        raise ValueError(f"memory_budget={value!r} is too large to be a number of bytes; "
                         f"expected {_ACCEPTED}")
    if not unit:
        if 0 < number <= 1 and not m.group(1).isdigit():  # "0.5", "5e-1"; "1" is one byte
            return Budget(fraction=number)
        if number != int(number):
            raise ValueError(f"memory_budget={value!r} is neither a fraction in (0, 1] nor a whole "
                             f"number of bytes; expected {_ACCEPTED}")
        unit = "b"
    if unit == "b" and number != int(number):
        raise ValueError(f"memory_budget={value!r} is not a whole number of bytes; expected {_ACCEPTED}")
    nbytes = int(number * _UNITS[unit])
    if nbytes <= 0:
        raise ValueError(f"memory_budget={value!r} must be at least one byte; expected {_ACCEPTED}")
    return Budget(bytes=nbytes)


def human_bytes(nbytes: float) -> str:
    """Format a byte count with binary units, e.g. ``human_bytes(3 * 2**20) == '3.00 MiB'``."""
    nbytes = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")
