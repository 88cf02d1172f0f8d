"""Small argument checks shared by the policy core's configs."""

from __future__ import annotations

import math
import numbers


def require_finite(obj, names) -> None:
    """Raises ValueError naming the first attribute of `obj` among `names` that is not a
    finite real number (a bool, a string or None included)."""
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, numbers.Real) \
                or not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value!r}")


def require_int(obj, name: str, low: int, high: int | None = None) -> None:
    """Raises ValueError unless attribute `name` of `obj` is an integer (not a bool; numpy
    integers too) in `[low, high]` (`high` None: no upper bound); the message names the field
    and the range."""
    value = getattr(obj, name)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low or (
            high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be an integer {bound}, got {value!r}")


def is_power_of_two(value) -> bool:
    """Whether `value` is an integer (not a bool; numpy integers too) >= 1 and a power of two
    (a CP degree, a block size)."""
    return (not isinstance(value, bool) and isinstance(value, numbers.Integral) and value >= 1
            and not value & (value - 1))
