"""Tests for eval.sim.ground_truth.GroundTruthProfile."""

from __future__ import annotations

import numpy as np
import pytest

from eval.sim.ground_truth import GroundTruthProfile
from serving.policy.profiles import ProfileTable, generate_profile

# Hand-made degree-2 table: rows L=1000 (r = 0, 0.5) and L=2000 (r = 0, 0.25, 0.5).
HAND = ProfileTable(
    cp=[2, 2, 2, 2, 2, 1, 1, 1, 1],
    input_len=[1000, 1000, 2000, 2000, 2000, 1000, 1000, 4000, 4000],
    cached_len=[0, 500, 0, 500, 1000, 0, 0, 0, 3000],
    seconds=[1.0, 0.6, 3.0, 2.0, 1.8, 0.9, 1.1, 8.0, 2.0],
)


def test_exact_at_grid_points():
    table = generate_profile("h20", "qwen3-30b-a3b", (1, 2, 8), (128, 1000, 8192, 65536))
    gt = GroundTruthProfile(table)
    for c, L, h, s in zip(table.cp, table.input_len, table.cached_len, table.seconds):
        assert gt.seconds(int(c), int(L), int(h)) == pytest.approx(float(s), rel=1e-12)
    assert gt.degrees == (1, 2, 8)
    assert gt.max_input_len(8) == 65536


def test_linear_within_a_row_and_between_rows():
    gt = GroundTruthProfile(HAND)
    # Within row L=2000: r=0.125 halfway between r=0 (3.0) and r=0.25 (2.0).
    assert gt.seconds(2, 2000, 250) == pytest.approx(2.5)
    # Between rows at r=0.25: row 1000 -> 1.0 + (0.6-1.0)*0.5 = 0.8; row 2000 -> 2.0;
    # L=1500 is halfway: 1.4. At L=1200 a fifth of the way: 0.8 + 0.2*1.2 = 1.04.
    assert gt.seconds(2, 1500, 375) == pytest.approx(1.4)
    assert gt.seconds(2, 1200, 300) == pytest.approx(1.04)
    # Beyond the row's largest r the value is held: row 2000 at r=0.9 -> 1.8, row 1000 -> 0.6.
    assert gt.seconds(2, 2000, 1999) == pytest.approx(1.8)
    assert gt.seconds(2, 1500, 1500) == pytest.approx(0.5 * (0.6 + 1.8))


def test_below_smallest_row_scales_linearly_and_duplicates_average():
    gt = GroundTruthProfile(HAND)
    assert gt.seconds(2, 250, 0) == pytest.approx(1.0 * 250 / 1000)
    assert gt.seconds(2, 500, 125) == pytest.approx(0.8 * 500 / 1000)
    assert gt.seconds(1, 1000, 0) == pytest.approx(1.0)  # (0.9 + 1.1) / 2
    assert gt.seconds(1, 4000, 1500) == pytest.approx(5.0)  # a single-r row is linear in r
    assert gt.seconds(1, 2500, 0) == pytest.approx(1.0 + 7.0 * 0.5)


def test_beyond_max_and_bad_arguments_raise():
    gt = GroundTruthProfile(HAND)
    assert gt.max_input_len(2) == 2000
    with pytest.raises(ValueError, match=r"input_len=2001 exceeds .* maximum 2000"):
        gt.seconds(2, 2001, 0)
    with pytest.raises(ValueError, match=r"cp_degree=4 not in the profile.*\(1, 2\)"):
        gt.seconds(4, 100, 0)
    with pytest.raises(ValueError, match=r"cp_degree=8"):
        gt.max_input_len(8)
    with pytest.raises(ValueError, match="cached_len"):
        gt.seconds(2, 100, 101)
    with pytest.raises(ValueError, match="input_len"):
        gt.seconds(2, 0, 0)
    with pytest.raises(ValueError, match="noise_sigma"):
        GroundTruthProfile(HAND, noise_sigma=-0.1)


def test_noise_is_seeded_deterministic_with_mean_one():
    sigma = 0.2
    a = GroundTruthProfile(HAND, noise_sigma=sigma, seed=7)
    b = GroundTruthProfile(HAND, noise_sigma=sigma, seed=7)
    c = GroundTruthProfile(HAND, noise_sigma=sigma, seed=8)
    xa = np.array([a.seconds(2, 1500, 375) for _ in range(20_000)]) / 1.4
    xb = np.array([b.seconds(2, 1500, 375) for _ in range(20_000)]) / 1.4
    xc = np.array([c.seconds(2, 1500, 375) for _ in range(100)]) / 1.4
    np.testing.assert_array_equal(xa, xb)
    assert not np.allclose(xa[:100], xc)
    assert xa.mean() == pytest.approx(1.0, abs=0.01)  # standard error ~0.0014
    assert np.log(xa).std() == pytest.approx(sigma, rel=0.03)
    assert a.exact_seconds(2, 1500, 375) == pytest.approx(1.4)


def test_mostly_cached_prompts_are_charged_near_the_analytic_time():
    """The issue's case: 103,424 tokens with 102,400 cached on CP-2 (99 %) was charged 5.02 s
    when the grid stopped at 0.9; now within a few per cent of the analytic 0.58 s, and the
    time keeps falling as h -> L (never held at a smaller fraction's time)."""
    from serving.policy.profiles import analytic_prefill_seconds
    truth = GroundTruthProfile(generate_profile("h20", "qwen3-30b-a3b", (2, 4)))
    for c, L, h in ((2, 103_424, 102_400), (4, 94_000, 90_240), (2, 20_000, 19_900),
                    (2, 50_000, 49_999)):
        want = analytic_prefill_seconds("h20", "qwen3-30b-a3b", c, L, h)
        assert truth.exact_seconds(c, L, h) == pytest.approx(want, rel=0.04), (c, L, h)
    ts = [truth.exact_seconds(2, 103_424, int(f * 103_424)) for f in (0.9, 0.95, 0.98, 0.99, 0.999)]
    assert all(a > b for a, b in zip(ts, ts[1:])), ts


def test_with_noise_is_the_constructed_profile_without_parsing_again():
    # the same rows and the same seeded noise stream as a profile built from the table
    table = generate_profile("h20", "qwen3-30b-a3b", (1, 2, 8), (128, 1000, 8192, 65536))
    base = GroundTruthProfile(table)
    calls = [(c, n, h) for c, n, h in zip([1, 2, 8, 2, 1] * 40, range(300, 40_300, 200),
                                          range(0, 20_000, 100))]
    for sigma, seed in ((0.0, 0), (0.3, 7), (0.3, 8)):
        built, shared = GroundTruthProfile(table, sigma, seed), base.with_noise(sigma, seed)
        assert [shared.seconds(*a) for a in calls] == [built.seconds(*a) for a in calls]
    assert base.with_noise(0.3, 7)._degrees is base._degrees
    with pytest.raises(ValueError, match="noise_sigma"):
        base.with_noise(-0.1)
