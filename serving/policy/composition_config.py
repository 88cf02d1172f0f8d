"""The knobs of the default split/merge controller (`serving.policy.composition`)."""

from __future__ import annotations

import dataclasses

from serving.policy.checks import is_power_of_two, require_finite, require_int

MAX_SAMPLES = 1_000_000  # window samples replayed at most (the horizon keeps 4x as many)
MAX_DEGREE = 64  # the largest CP degree the controller makes (`CompositionController._degrees`)


@dataclasses.dataclass(frozen=True)
class CompositionConfig:
    """Knobs of `CompositionController` (module doc); times in seconds.

    Ranges: the times finite and >= 0 (`interval_s`, `window_s` > 0); `min_gain` in [0, 1) (a
    relative gain of 1 or more would forbid every window-picked change); `max_samples` an
    integer in [1, MAX_SAMPLES]; `min_degree <= max_degree` powers of two in [1, MAX_DEGREE].
    A `reverse_after_s` no longer than `window_s` leaves the horizon rule nothing beyond the
    window to weigh (module doc of `serving.policy.composition`). `deep_splits` (a bool): an
    overload's planned halvings of one worker are made as one split into their parts, one
    re-carve (`composition_changes.further_splits`); False plans halves only, for a backend
    whose `recarve` makes two workers of a split.

    Raises:
      ValueError: naming the field and its range, for a value outside it (a bool, a string or
        None included).
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
    deep_splits: bool = True

    def __post_init__(self) -> None:
        require_finite(self, ("interval_s", "window_s", "min_gain", "min_gain_s", "cooldown_s",
                              "reverse_after_s", "recarve_s", "lam"))
        if not (self.interval_s > 0 and self.window_s > 0):
            raise ValueError(f"interval_s and window_s must be > 0 s, got {self.interval_s}, "
                             f"{self.window_s}")
        require_int(self, "max_samples", 1, MAX_SAMPLES)
        if not self.min_gain < 1:
            raise ValueError(f"min_gain must be in [0, 1), got {self.min_gain}")
        for name in ("min_gain", "min_gain_s", "cooldown_s", "reverse_after_s", "recarve_s",
                     "lam"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("min_degree", "max_degree"):
            require_int(self, name, 1, MAX_DEGREE)
            c = getattr(self, name)
            if not is_power_of_two(c):
                raise ValueError(f"{name} must be a power of two in [1, {MAX_DEGREE}], got {c!r}")
        if not isinstance(self.deep_splits, bool):
            raise ValueError(f"deep_splits must be True or False, got {self.deep_splits!r}")
        for name in ("max_samples", "min_degree", "max_degree"):  # (numpy integers as int)
            object.__setattr__(self, name, int(getattr(self, name)))
        if self.min_degree > self.max_degree:
            raise ValueError(f"need min_degree <= max_degree, got {self.min_degree}, "
                             f"{self.max_degree}")
