"""Tests for the floor of serving.policy.cost_model.PrefillCostModel (module doc, "Floor")."""

from __future__ import annotations

import json

import numpy as np
import pytest

from serving.policy.cost_model import PrefillCostModel
from serving.policy.profiles import generate_profile

COEF = (0.004, 3.0e-5, 2.0e-9, 4.0e-7)  # a, b, g, d of one CP-2 worker
FLOOR, MIN_NEW = 0.021, 128  # seconds, new tokens


def _form(L, h, coef=COEF):
    a, b, g, d = coef
    return a + b * (L - h) + g * (L * L - h * h) + d * L


def _hinge_table(seed=0, rows=80):
    """Rows of a known hinge: max(FLOOR, form) for prefills of >= MIN_NEW new tokens, the form
    alone below (the shortest full prefill is MIN_NEW tokens)."""
    rng = np.random.default_rng(seed)
    L = np.exp(rng.uniform(np.log(MIN_NEW), np.log(60_000), rows)).astype(np.int64)
    L[:3] = (MIN_NEW, 150, 200)
    h = (rng.uniform(0, 0.999, rows) * L).astype(np.int64)
    h[:3] = 0
    Lf, hf = L.astype(float), h.astype(float)
    y = np.where(L - h >= MIN_NEW, np.maximum(FLOOR, _form(Lf, hf)), _form(Lf, hf))
    return {"cp": np.full(rows, 2), "input_len": L, "cached_len": h, "seconds": y}


def test_fit_recovers_a_known_hinge():
    table = _hinge_table()
    y = table["seconds"]
    assert (y == FLOOR).sum() >= 3  # the floor binds on several rows, the form on the rest
    model = PrefillCostModel.fit(table)
    assert model.floors() == {2: (FLOOR, MIN_NEW)}
    got = model.coefficients(2)
    np.testing.assert_allclose([got[k] for k in "abgd"], COEF, rtol=1e-6)
    pred = model.predict_many(2, table["input_len"], table["cached_len"])
    np.testing.assert_allclose(pred, y, rtol=1e-6)
    assert model.fit_error()[2][1] < 1e-6
    # The form alone cannot: it bends through the floor's rows.
    plain = PrefillCostModel.fit(table, floor=False)
    assert plain.floors() == {2: (0.0, 0)}
    assert plain.fit_error()[2][0] > 10 * model.fit_error()[2][0]


def test_predict_applies_the_floor_from_its_new_tokens_on():
    model = PrefillCostModel({2: COEF}, floors={2: (FLOOR, MIN_NEW)})
    # 200 new tokens: the form is 4 ms + 6 ms + 0.08 ms + 0.08 ms = 10.16 ms < 21 ms
    assert _form(200.0, 0.0) == pytest.approx(0.01016)
    assert model.predict(2, 200, 0) == FLOOR
    # 100 new tokens (below MIN_NEW): the form, 4 ms + 3 ms + ~0.3 ms + ~2.4 ms
    assert model.predict(2, 6000, 5900) == pytest.approx(_form(6000.0, 5900.0), rel=1e-12)
    assert model.predict(2, 6000, 5900) < FLOOR
    # 128 new tokens, form above the floor: the form
    assert model.predict(2, 40_000, 39_872) == pytest.approx(_form(40_000.0, 39_872.0))
    L, h = np.array([200, 6000, 40_000, 128]), np.array([0, 5900, 39_872, 0])
    np.testing.assert_allclose(model.predict_many(2, L, h),
                               [model.predict(2, int(a), int(b)) for a, b in zip(L, h)],
                               rtol=1e-12)


def test_floor_json_round_trip_and_old_json():
    model = PrefillCostModel.fit(_hinge_table(seed=1))
    back = PrefillCostModel.from_json(json.loads(json.dumps(model.to_json())))
    assert back.floors() == model.floors()
    for L, h in ((200, 0), (9000, 100), (6000, 5990)):
        assert back.predict(2, L, h) == model.predict(2, L, h)
    old = model.to_json()
    del old["floors"]  # written before floors existed: the form alone
    assert PrefillCostModel.from_json(old).predict(2, 200, 0) == pytest.approx(
        _form(200.0, 0.0, tuple(model.coefficients(2)[k] for k in "abgd")))


def test_noisy_rows_keep_the_floor_from_the_shortest_full_prefill():
    # Measured rows are noisy: the quickest full prefill need not be the shortest. The floor is
    # the least full-prefill time and applies from the shortest full prefill's new tokens on.
    table = _hinge_table(seed=2)
    y = table["seconds"].copy()
    y[0] *= 1.03  # the 128-token row, 3 % slow: the 150-token row (FLOOR) is now the quickest
    model = PrefillCostModel.fit(dict(table, seconds=y))
    assert model.floors() == {2: (FLOOR, MIN_NEW)}
    assert model.predict(2, 130, 0) == FLOOR


def test_the_form_alone_is_kept_where_it_fits_better():
    # A compute-bound degree with noisy rows: a cached row measured below the quickest full
    # prefill would be pushed up by a floor; the fit keeps whichever fits the rows better.
    rng = np.random.default_rng(5)
    L = np.exp(rng.uniform(np.log(1000), np.log(60_000), 60)).astype(np.int64)
    h = np.where(np.arange(60) < 20, 0, (rng.uniform(0.5, 0.999, 60) * L).astype(np.int64))
    y = _form(L.astype(float), h.astype(float), (0.0, 3e-5, 2e-9, 4e-7))
    y *= np.exp(rng.normal(0, 0.2, 60))
    table = {"cp": np.full(60, 2), "input_len": L, "cached_len": h, "seconds": y}
    model, plain = PrefillCostModel.fit(table), PrefillCostModel.fit(table, floor=False)

    def sse(m):
        return float(np.sum((m.predict_many(2, L, h) / y - 1) ** 2))

    assert sse(model) <= sse(plain) * (1 + 1e-9)


@pytest.mark.parametrize("floors, match", [
    ({4: (0.01, 1)}, "without coefficients"),
    ({2.5: (0.01, 1)}, "without coefficients"),
    ({None: (0.01, 1)}, "without coefficients"),
    ([(2, (0.01, 1))], "mapping"),
    ({2: (np.complex128(0.01), 1)}, "finite and >= 0"),
    ({2: 0.01}, "pair"),
    ({2: (-0.01, 1)}, "finite and >= 0"),
    ({2: (float("nan"), 1)}, "finite and >= 0"),
    ({2: (True, 1)}, "finite and >= 0"),
    ({2: (0.01, -1)}, "int >= 0"),
    ({2: (0.01, 1.5)}, "int >= 0"),
])
def test_floor_errors_name_the_field(floors, match):
    with pytest.raises(ValueError, match=match):
        PrefillCostModel({2: COEF}, floors=floors)
    coefficients = {"2": dict(zip("abgd", COEF))}
    with pytest.raises(ValueError, match="min_new_tokens"):
        PrefillCostModel.from_json({"coefficients": coefficients,
                                    "floors": {"2": {"seconds": 0.01}}})
    for bad, what in ((None, "'floors' must be an object"), ([1], "'floors' must be an object"),
                      ({"x": {"seconds": 0.01, "min_new_tokens": 1}}, "floors key 'x'")):
        with pytest.raises(ValueError, match=what):
            PrefillCostModel.from_json({"coefficients": coefficients, "floors": bad})
    assert PrefillCostModel({2: COEF}, floors={2: (-0.0, 0)}).to_json()["floors"]["2"] == {
        "seconds": 0.0, "min_new_tokens": 0}


def test_floor_on_the_moe_profile():
    # Qwen3-30B-A3B on H20: a short prefill reads every expert's weights (the roofline's memory
    # side), 21.1 ms whatever its length up to 512 tokens at CP-4. With the floor the fit
    # predicts those rows to within 1 % (the form alone: 34 % low at 128 tokens), and its mean
    # relative error over the profile falls; the dense Qwen3-32B is compute-bound throughout
    # and its floor never binds (identical predictions).
    table = generate_profile("h20", "qwen3-30b-a3b", (2, 4))
    model, plain = PrefillCostModel.fit(table), PrefillCostModel.fit(table, floor=False)
    for c in (2, 4):
        s = table.select(c)
        short = (s.cached_len == 0) & (s.input_len <= 256)
        pred = model.predict_many(c, s.input_len, s.cached_len)
        assert np.all(np.abs(pred[short] / s.seconds[short] - 1) < 0.01)
        assert model.fit_error()[c][0] < plain.fit_error()[c][0]
    s = table.select(4)
    assert plain.predict(4, 128, 0) < 0.7 * s.seconds[(s.input_len == 128) & (s.cached_len == 0)][0]
    dense = generate_profile("h20", "qwen3-32b", (4, 8))
    m, p = PrefillCostModel.fit(dense), PrefillCostModel.fit(dense, floor=False)
    for c in (4, 8):
        for L, h in ((128, 0), (1000, 0), (20_000, 19_000), (60_000, 0)):
            assert m.predict(c, L, h) == pytest.approx(p.predict(c, L, h), rel=1e-9)
