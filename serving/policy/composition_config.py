"""The knobs of the default split/merge controller (`serving.policy.composition`)."""

from __future__ import annotations

import dataclasses

from serving.policy.checks import require_finite


@dataclasses.dataclass(frozen=True)
class CompositionConfig:
    """Knobs of `CompositionController` (module doc); times in seconds.

    Raises:
      ValueError: naming the field, for a value out of range.
    """

    interval_s: float = 30.0
    window_s: float = 60.0
    max_samples: int = 400
    min_gain: float = 0.25
    min_gain_s: float = 0.005
    cooldown_s: float = 60.0
    reverse_after_s: float = 600.0
    recarve_s: float = 1.0
    lam: float = 1.0
    min_degree: int = 1
    max_degree: int = 8

    def __post_init__(self) -> None:
        require_finite(self, ("interval_s", "window_s", "min_gain", "min_gain_s", "cooldown_s",
                              "reverse_after_s", "recarve_s", "lam"))
        if not (self.interval_s > 0 and self.window_s > 0):
            raise ValueError(f"interval_s and window_s must be > 0 s, got {self.interval_s}, "
                             f"{self.window_s}")
        if self.max_samples < 1:
            raise ValueError(f"max_samples must be >= 1, got {self.max_samples}")
        for name in ("min_gain", "min_gain_s", "cooldown_s", "reverse_after_s", "recarve_s",
                     "lam"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("min_degree", "max_degree"):
            c = getattr(self, name)
            if not isinstance(c, int) or c < 1 or c & (c - 1):
                raise ValueError(f"{name} must be a power of two >= 1, got {c!r}")
        if self.min_degree > self.max_degree:
            raise ValueError(f"need min_degree <= max_degree, got {self.min_degree}, "
                             f"{self.max_degree}")
