"""The router's prefill cost model: a per-degree closed form fitted to a profile table.

Form (issue 2; the Vertumnus paper's cost model), for a worker of CP degree C, L input tokens of
which h are a prefix hit and n = L - h are new:

    T_C(L, h) = a_C + b_C * n + g_C * (L^2 - h^2) + d_C * L * [C > 1]      (seconds)

a_C: fixed cost per prefill; b_C: per new token (projections, MLP); g_C: causal attention of the
new queries over all earlier keys (sum over new positions p of p ~ (L^2 - h^2) / 2); d_C: the CP
all-gather of K/V, which moves the whole L-token context (new tokens and striped cached prefix).

Fitting: per degree, *weighted* least squares minimising the sum of squared *relative* errors,
sum_i ((T(x_i) - y_i) / y_i)^2, i.e. each row of the design matrix and the target divided by y_i,
so a 0.1 s prefill counts as much as a 60 s one. Coefficients are constrained non-negative with
`scipy.optimize.nnls` on that weighted system (columns scaled to unit norm first, for
conditioning); `nonnegative=False` uses unconstrained `numpy.linalg.lstsq` instead. For C = 1 the
d column is absent and d_1 = 0.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from scipy.optimize import nnls

FORM = "a_C + b_C*n + g_C*(L^2 - h^2) + d_C*L*[C>1]"
_NAMES = ("a", "b", "g", "d")
_MIN_DISTINCT_ROWS = 4


def _column(table, name: str) -> np.ndarray:
    v = table[name] if isinstance(table, Mapping) else getattr(table, name)
    return np.asarray(v)


class PrefillCostModel:
    """Predicts prefill seconds per CP degree from fitted coefficients (module doc gives form and
    fit).

    Args:
      coefficients: {cp_degree: (a, b, g, d)} in seconds, s/token, s/token^2, s/token; finite.
      fit_error: optional {cp_degree: (mean_rel_err, max_rel_err)} of the fit.

    Raises:
      ValueError: on a degree that is not a power of two >= 1, a coefficient tuple not of length
        4 or not finite, or d != 0 for degree 1.
    """

    def __init__(self, coefficients: Mapping[int, tuple[float, float, float, float]],
                 fit_error: Mapping[int, tuple[float, float]] | None = None):
        coef = {}
        for c, v in coefficients.items():
            c = int(c)
            if c < 1 or c & (c - 1):
                raise ValueError(f"cp_degree={c} must be a power of two >= 1")
            v = tuple(float(x) for x in v)
            if len(v) != 4 or not all(np.isfinite(v)):
                raise ValueError(f"coefficients[{c}]={v} must be 4 finite floats (a, b, g, d)")
            if c == 1 and v[3] != 0.0:
                raise ValueError(f"coefficients[1] d={v[3]} must be 0 (no all-gather at C=1)")
            coef[c] = v
        if not coef:
            raise ValueError("coefficients must name at least one cp_degree")
        self._coef = dict(sorted(coef.items()))
        self._fit_error = {int(c): (float(e[0]), float(e[1]))
                           for c, e in (fit_error or {}).items()}

    @classmethod
    def fit(cls, table, nonnegative: bool = True) -> PrefillCostModel:
        """Fits every degree of `table` (a `ProfileTable`, or any object or mapping with columns
        cp, input_len, cached_len, seconds as 1-D arrays).

        Raises:
          ValueError: when a degree has fewer than 4 distinct (input_len, cached_len) rows, or
            on a row outside 0 <= cached_len <= input_len or with seconds <= 0; or, naming the
            degree, when its fit comes out all zero or not finite (seconds so small or large,
            e.g. 1e-300, that the relative-error system over- or underflows float64).
        """
        cp, L, h, y = (_column(table, k) for k in ("cp", "input_len", "cached_len", "seconds"))
        L, h, y = L.astype(np.float64), h.astype(np.float64), y.astype(np.float64)
        if not (len(cp) == len(L) == len(h) == len(y)):
            raise ValueError("table columns cp, input_len, cached_len, seconds differ in length")
        if np.any((h < 0) | (h > L)):
            raise ValueError("table rows must have 0 <= cached_len <= input_len")
        if np.any(~np.isfinite(y) | (y <= 0)):
            raise ValueError("table seconds must be finite and > 0")
        coef, err = {}, {}
        for c in sorted(int(x) for x in np.unique(cp)):
            m = cp == c
            Lc, hc, yc = L[m], h[m], y[m]
            distinct = len(set(zip(Lc.tolist(), hc.tolist())))
            if distinct < _MIN_DISTINCT_ROWS:
                raise ValueError(f"cp_degree={c} has {distinct} distinct (input_len, cached_len) "
                                 f"rows; the fit needs at least {_MIN_DISTINCT_ROWS}")
            cols = [np.ones_like(Lc), Lc - hc, Lc * Lc - hc * hc] + ([Lc] if c > 1 else [])
            with np.errstate(over="ignore"):  # absurd seconds: caught by the check below
                A = np.stack(cols, axis=1) / yc[:, None]
                scale = np.linalg.norm(A, axis=0)
            scale[scale == 0] = 1.0
            if nonnegative:
                x, _ = nnls(A / scale, np.ones_like(yc), maxiter=50 * A.shape[1])
            else:
                x = np.linalg.lstsq(A / scale, np.ones_like(yc), rcond=None)[0]
            x = x / scale
            if not np.all(np.isfinite(x)) or not np.any(x):
                raise ValueError(
                    f"cp_degree={c}: the fit gave coefficients {x.tolist()} (all zero or not "
                    f"finite), which predict no time; its seconds span [{yc.min():g}, "
                    f"{yc.max():g}], outside what the relative-error fit handles in float64")
            coef[c] = tuple(float(v) for v in x) + ((0.0,) if c == 1 else ())
            rel = np.abs(A @ x - 1.0)  # |pred - y| / y
            err[c] = (float(rel.mean()), float(rel.max()))
        return cls(coef, err)

    @property
    def degrees(self) -> tuple[int, ...]:
        """Fitted CP degrees, ascending."""
        return tuple(self._coef)

    def _unknown(self, cp_degree) -> ValueError:
        return ValueError(f"cp_degree={cp_degree} has no fitted coefficients; "
                          f"fitted degrees: {self.degrees}")

    def predict(self, cp_degree: int, input_len: int, cached_len: int) -> float:
        """Predicted prefill seconds (plain Python float arithmetic; hot path of the router).

        Raises:
          ValueError: unknown cp_degree (naming the fitted degrees), or unless
            0 <= cached_len <= input_len and input_len >= 1 token.
        """
        coef = self._coef.get(cp_degree)
        if coef is None or not (0 <= cached_len <= input_len and input_len >= 1):
            if coef is None:
                raise self._unknown(cp_degree)
            raise ValueError(f"need input_len >= 1 and 0 <= cached_len <= input_len, got "
                             f"cached_len={cached_len}, input_len={input_len}")
        a, b, g, d = coef
        return a + b * (input_len - cached_len) + g * (input_len * input_len
                                                       - cached_len * cached_len) + d * input_len

    def predict_many(self, cp_degree: int, input_len, cached_len) -> np.ndarray:
        """Vectorised `predict`: int arrays of one shape [N] -> float64 seconds [N].

        Raises:
          ValueError: as `predict`, or on shapes that differ.
        """
        if cp_degree not in self._coef:
            raise self._unknown(cp_degree)
        L = np.asarray(input_len, dtype=np.float64)
        h = np.asarray(cached_len, dtype=np.float64)
        if L.shape != h.shape:
            raise ValueError(f"input_len shape {L.shape} != cached_len shape {h.shape}")
        if np.any((h < 0) | (h > L) | (L < 1)):
            raise ValueError("need input_len >= 1 and 0 <= cached_len <= input_len for every "
                             "element")
        a, b, g, d = self._coef[cp_degree]
        return a + b * (L - h) + g * (L * L - h * h) + d * L

    def coefficients(self, cp_degree: int) -> dict[str, float]:
        """{'a', 'b', 'g', 'd'} of one degree (units in the class doc)."""
        if cp_degree not in self._coef:
            raise self._unknown(cp_degree)
        return dict(zip(_NAMES, self._coef[cp_degree]))

    def fit_error(self) -> dict[int, tuple[float, float]]:
        """{cp_degree: (mean relative error, max relative error)} over the fitted rows; empty
        when the model was built from coefficients alone."""
        return dict(self._fit_error)

    def to_json(self) -> dict:
        """A JSON-serialisable dict (keys are strings) that `from_json` reads back exactly."""
        return {
            "form": FORM,
            "fit": "nnls, relative-error weighting (rows / seconds)",
            "coefficients": {str(c): dict(zip(_NAMES, v)) for c, v in self._coef.items()},
            "fit_error": {str(c): {"mean_rel_err": e[0], "max_rel_err": e[1]}
                          for c, e in self._fit_error.items()},
        }

    @classmethod
    def from_json(cls, data: Mapping) -> PrefillCostModel:
        """Inverse of `to_json`.

        Raises:
          ValueError: when 'coefficients' is missing or an entry lacks one of a, b, g, d.
        """
        if "coefficients" not in data:
            raise ValueError("cost-model JSON lacks the 'coefficients' field")
        coef = {}
        for c, v in data["coefficients"].items():
            missing = [k for k in _NAMES if k not in v]
            if missing:
                raise ValueError(f"coefficients[{c}] lacks {missing}")
            coef[int(c)] = tuple(v[k] for k in _NAMES)
        err = {int(c): (e["mean_rel_err"], e["max_rel_err"])
               for c, e in data.get("fit_error", {}).items()}
        return cls(coef, err)
