"""The shared argument checks of the policy core's configs."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from serving.policy.checks import is_power_of_two, require_finite, require_int


def test_is_power_of_two_against_the_powers_listed_by_hand():
    powers = {1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024}
    assert [n for n in range(-3, 1025) if is_power_of_two(n)] == sorted(powers)
    assert is_power_of_two(np.int64(8)) and is_power_of_two(2 ** 62)
    for bad in (True, False, 2.0, "4", None, np.float32(4.0), 0, -8, 6, 2 ** 62 + 2):
        assert not is_power_of_two(bad), bad


@dataclasses.dataclass
class _Config:
    x: object


def test_require_int_and_require_finite_name_the_field_and_the_range():
    require_int(_Config(np.int32(3)), "x", 1, 3)
    for bad, match in ((0, r"x must be an integer in \[1, 3\], got 0"), (True, "got True"),
                       (2.0, "got 2.0")):
        with pytest.raises(ValueError, match=match):
            require_int(_Config(bad), "x", 1, 3)
    with pytest.raises(ValueError, match="x must be an integer >= 1, got -1"):
        require_int(_Config(-1), "x", 1)
    require_finite(_Config(2.5), ("x",))
    for bad in (float("nan"), float("inf"), True, None, "1"):
        with pytest.raises(ValueError, match="x must be a finite number"):
            require_finite(_Config(bad), ("x",))
