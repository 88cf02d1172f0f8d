"""`StayingRegret`, the ski-rental credit of the composition controller's steps toward its
target, by hand."""

from __future__ import annotations

import pytest

from serving.policy.composition_steps import StayingRegret


def test_the_regret_accrues_the_gain_for_each_new_arrival():
    r = StayingRegret()
    for _ in range(10):
        r.arrive()
    assert r.accrue(0.5) == pytest.approx(5.0)  # 10 arrivals x 0.5 s
    for _ in range(4):
        r.arrive()
    assert r.accrue(0.25) == pytest.approx(6.0)  # + 4 x 0.25 s: each arrival counted once
    assert r.accrue(3.0) == pytest.approx(6.0)  # no arrival since: nothing more


def test_a_reset_clears_the_regret_and_the_arrivals_before_it():
    r = StayingRegret()
    for _ in range(7):
        r.arrive()
    r.accrue(1.0)
    for _ in range(3):
        r.arrive()
    r.reset()  # the target stopped paying (or a change was made): the 3 arrivals are not rent
    assert r.total == 0.0
    for _ in range(2):
        r.arrive()
    assert r.accrue(0.5) == pytest.approx(1.0)


def test_a_step_is_covered_up_to_the_break_even_point():
    r = StayingRegret()
    assert r.covers(-0.1, 100) and r.covers(0.0, 100)  # no worse than staying: always
    assert not r.covers(0.01, 100)
    for _ in range(20):
        r.arrive()
    r.accrue(0.1)  # 2.0 TTFT-s paid
    assert r.covers(0.02, 100)  # 2.0 <= 2.0: break-even, the step is bought
    assert not r.covers(0.0201, 100)
