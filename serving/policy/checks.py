"""Small argument checks shared by the policy core's configs."""

from __future__ import annotations

import math


def require_finite(obj, names) -> None:
    """Raises ValueError naming the first attribute of `obj` among `names` that is not finite."""
    for name in names:
        value = getattr(obj, name)
        if not math.isfinite(value):
            raise ValueError(f"{name} must be finite, got {value}")
