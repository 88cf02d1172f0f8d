"""`eval.profile_check`: a measured profile against the analytic one, on hand-built tables."""

import json

import numpy as np
import pytest

from eval import profile_check
from serving.policy.profiles import ProfileTable, analytic_prefill_seconds, write_profile_csv


def _table(scale_by_fraction):
    """A CP-1 qwen3-8b/h200 grid whose 'measured' seconds are the analytic ones times a known
    factor per cached fraction (so every ratio is known in advance)."""
    cp, lens, cached, secs = [], [], [], []
    for L in (1024, 4096, 16384):
        for frac, scale in scale_by_fraction.items():
            h = int(L * frac)
            cp.append(1), lens.append(L), cached.append(h)
            secs.append(scale * analytic_prefill_seconds("h200", "qwen3-8b", 1, L, h))
    return ProfileTable(np.array(cp), np.array(lens), np.array(cached), np.array(secs))


def test_ratios_and_buckets_are_the_known_factors():
    # Measured = analytic x 1.25 cold, x 2 at 50 %, x 4 at 99 %: ratios 0.8, 0.5, 0.25.
    result = profile_check.compare(_table({0.0: 1.25, 0.5: 2.0, 0.99: 4.0}), "h200", "qwen3-8b")
    by_fraction = {}
    for r in result["rows"]:
        by_fraction.setdefault(round(r["cached_len"] / r["input_len"], 2), []).append(r["ratio"])
    assert by_fraction.keys() == {0.0, 0.5, 0.99}
    np.testing.assert_allclose(by_fraction[0.0], [0.8] * 3, rtol=1e-12)
    np.testing.assert_allclose(by_fraction[0.5], [0.5] * 3, rtol=1e-12)
    np.testing.assert_allclose(by_fraction[0.99], [0.25] * 3, rtol=1e-12)
    buckets = {b["from_fraction"]: b for b in result["buckets"]}
    assert sorted(buckets) == [0.0, 0.25, 0.95]  # no row in [75 %, 95 %)
    assert buckets[0.25]["rows"] == 3
    assert buckets[0.95]["ratio_median"] == pytest.approx(0.25)
    # The analytic table over the same grid is what the fit sees on the analytic side: a
    # uniform scale changes no relative error, so both fits agree when the factor is uniform.
    uniform = profile_check.compare(_table({0.0: 3.0, 0.5: 3.0, 0.99: 3.0}), "h200", "qwen3-8b")
    assert uniform["fit"]["measured"][1] == pytest.approx(uniform["fit"]["analytic"][1], rel=1e-6)
    # A hit-dependent error (the shape the H200 run showed) fits worse than the analytic table.
    assert result["fit"]["measured"][1][1] > result["fit"]["analytic"][1][1]


def test_main_writes_json(tmp_path):
    csv = tmp_path / "profile.csv"
    write_profile_csv(_table({0.0: 1.0, 0.9: 2.0}), csv)
    out = tmp_path / "check.json"
    profile_check.run(str(csv), "h200", "qwen3-8b", str(out))
    data = json.loads(out.read_text())
    assert len(data["rows"]) == 6 and data["model"] == "qwen3-8b"
    assert sorted(round(r["ratio"], 6) for r in data["rows"]) == [0.5] * 3 + [1.0] * 3


def test_a_table_too_small_to_fit_still_gets_its_rows_compared(tmp_path):
    # Three CP-1 rows (the closed form needs 4 distinct ones): rows and buckets as usual, the
    # fit's reason instead of its errors, on both sides.
    table = _table({0.0: 2.0})
    result = profile_check.compare(table, "h200", "qwen3-8b")
    assert [round(r["ratio"], 9) for r in result["rows"]] == [0.5] * 3
    assert "at least 4" in result["fit"]["measured"]["error"]
    assert "at least 4" in result["fit"]["analytic"]["error"]
    with pytest.raises(ValueError):
        profile_check.compare(table, "h200", "no-such-model")
