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

Floor (`floor=True`, the default): a prefill of at least `n_C` new tokens takes at least `f_C`
seconds, `f_C` the least time of the degree's full (uncached) profile rows and `n_C` the
shortest of them (a bound the profile shows: prefill time grows with new and total tokens),
and the model predicts max(f_C, T_C(L, h)) there, T_C(L, h) below `n_C` new tokens (fewer
tokens touch fewer MoE experts: the profile's one-new-token rows take half the floor, so
short prompts below the profile's shortest row keep the form's underestimate). A short prefill is
bound by reading the weights, not by its tokens (the roofline: Williams, Waterman and
Patterson, "Roofline", CACM 2009; `serving.policy.profiles.analytic_prefill_seconds` takes
each layer's max(compute, memory)), which the closed form cannot express: fitted through the
floor's rows it predicted 13.9 ms for a 128-token prefill at C = 4 where the profile has
21.1 ms, and 4-9 % too much at 1-4K tokens, so it favoured large degrees on short prompts
(eval/RESULTS.md, item 15). The form is then fitted to the rows it predicts at or above the
floor, until that set is stable (an active-set fit of the hinge max(f, T); the fit of least
squared relative error over all rows, the floor's included, is kept, and the form alone with
no floor where that fits better, as it can on a noisy profile of a compute-bound model).
`floor=False`, or coefficients without floors, is the paper's form alone.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from scipy.optimize import nnls

from serving.policy.checks import is_power_of_two

FORM = "a_C + b_C*n + g_C*(L^2 - h^2) + d_C*L*[C>1]"
_NAMES = ("a", "b", "g", "d")
_MIN_DISTINCT_ROWS = 4
_MAX_FLOOR_ROUNDS = 20  # active-set rounds of the floor fit (it settles in 2-4 on our tables)


def _column(table, name: str) -> np.ndarray:
    v = table[name] if isinstance(table, Mapping) else getattr(table, name)
    return np.asarray(v)


def _fit_relative(A: np.ndarray, nonnegative: bool, c: int, yc: np.ndarray) -> np.ndarray:
    """Coefficients minimising ||A x - 1||^2 (A: rows already divided by their seconds)."""
    with np.errstate(over="ignore"):
        scale = np.linalg.norm(A, axis=0)
    scale[scale == 0] = 1.0
    if nonnegative:
        x, _ = nnls(A / scale, np.ones(len(A)), maxiter=50 * A.shape[1])
    else:
        x = np.linalg.lstsq(A / scale, np.ones(len(A)), rcond=None)[0]
    x = x / scale
    if not np.all(np.isfinite(x)) or not np.any(x):
        raise ValueError(
            f"cp_degree={c}: the fit gave coefficients {x.tolist()} (all zero or not "
            f"finite), which predict no time; its seconds span [{yc.min():g}, "
            f"{yc.max():g}], outside what the relative-error fit handles in float64")
    return x


def _objective(A: np.ndarray, x: np.ndarray, floor_rel: np.ndarray) -> float:
    """Sum of squared relative errors of max(floor, form) (`floor_rel`: the floor / y)."""
    return float(np.sum((np.maximum(A @ x, floor_rel) - 1.0) ** 2))


class PrefillCostModel:
    """Predicts prefill seconds per CP degree from fitted coefficients (module doc gives form and
    fit).

    Args:
      coefficients: {cp_degree: (a, b, g, d)} in seconds, s/token, s/token^2, s/token; finite.
      fit_error: optional {cp_degree: (mean_rel_err, max_rel_err)} of the fit.
      floors: optional {cp_degree: (f_C, n_C)}: a prefill of at least n_C new tokens takes at
        least f_C seconds (finite, >= 0; an int n_C >= 0; module doc); a degree not named has
        none, (0.0, 0).

    Raises:
      ValueError: on a degree that is not a power of two >= 1, a coefficient tuple not of length
        4 or not finite, d != 0 for degree 1, or a floor negative, not finite or of a degree
        without coefficients.
    """

    def __init__(self, coefficients: Mapping[int, tuple[float, float, float, float]],
                 fit_error: Mapping[int, tuple[float, float]] | None = None,
                 floors: Mapping[int, tuple[float, int]] | None = None):
        coef = {}
        for c, v in coefficients.items():
            c = int(c)
            if not is_power_of_two(c):
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
        self._floor = {c: (0.0, 0) for c in self._coef}
        if floors is not None and not isinstance(floors, Mapping):
            raise ValueError(f"floors must be a mapping cp_degree -> (seconds, new tokens), got "
                             f"{type(floors).__name__}")
        for c, v in (floors or {}).items():
            if isinstance(c, bool) or not isinstance(c, (int, np.integer)) or int(c) not in coef:
                raise ValueError(f"floors[{c}] names a cp_degree without coefficients; "
                                 f"degrees: {tuple(self._coef)}")
            try:
                f, nf = v
            except (TypeError, ValueError):
                raise ValueError(f"floors[{c}]={v!r} must be a pair (seconds, new tokens)") \
                    from None
            if isinstance(f, bool) or not isinstance(f, (int, float, np.integer, np.floating)) \
                    or not (np.isfinite(f) and f >= 0.0):
                raise ValueError(f"floors[{c}] seconds={f!r} must be finite and >= 0")
            if isinstance(nf, bool) or not isinstance(nf, (int, np.integer)) or nf < 0:
                raise ValueError(f"floors[{c}] new tokens={nf!r} must be an int >= 0")
            self._floor[int(c)] = (float(f) + 0.0, int(nf))  # (+ 0.0: no -0.0)
        # (a, b, g, d, f, n_f) per degree: the hot path reads one tuple
        self._terms = {c: v + self._floor[c] for c, v in self._coef.items()}
        self._fit_error = {int(c): (float(e[0]), float(e[1]))
                           for c, e in (fit_error or {}).items()}

    @classmethod
    def fit(cls, table, nonnegative: bool = True, floor: bool = True) -> PrefillCostModel:
        """Fits every degree of `table` (a `ProfileTable`, or any object or mapping with columns
        cp, input_len, cached_len, seconds as 1-D arrays); with `floor`, each degree's floor
        too (module doc).

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
        coef, err, floors = {}, {}, {}
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
            full = hc == 0
            f, nf = 0.0, 0
            if floor and full.any():  # the quickest full prefill, from the shortest one on
                f, nf = float(yc[full].min()), int(Lc[full].min())
            x = plain = _fit_relative(A, nonnegative, c, yc)
            if f > 0.0:
                # The rows the form puts below the floor are the floor's; refit the form on the
                # others until that set is stable (an active-set fit of the hinge max(f, form)),
                # keeping the fit of least squared relative error.
                lo = np.where(Lc - hc >= nf, f / yc, 0.0)  # the floor of each row, over y
                best, best_x, seen = _objective(A, x, lo), x, set()
                for _ in range(_MAX_FLOOR_ROUNDS):
                    above = A @ x >= lo
                    key = above.tobytes()
                    if key in seen or len(set(zip(Lc[above].tolist(), hc[above].tolist()))) \
                            < _MIN_DISTINCT_ROWS:
                        break
                    seen.add(key)
                    x = _fit_relative(A[above], nonnegative, c, yc[above])
                    obj = _objective(A, x, lo)
                    if obj < best:
                        best, best_x = obj, x
                x = best_x
                if _objective(A, plain, np.zeros_like(yc)) < best:  # the form alone fits better
                    x, f, nf, lo = plain, 0.0, 0, np.zeros_like(yc)
            else:
                lo = np.zeros_like(yc)
            coef[c] = tuple(float(v) for v in x) + ((0.0,) if c == 1 else ())
            floors[c] = (f, nf)
            rel = np.abs(np.maximum(A @ x, lo) - 1.0)  # |pred - y| / y
            err[c] = (float(rel.mean()), float(rel.max()))
        return cls(coef, err, floors)

    @property
    def degrees(self) -> tuple[int, ...]:
        """Fitted CP degrees, ascending."""
        return tuple(self._coef)

    def _unknown(self, cp_degree) -> ValueError:
        return ValueError(f"cp_degree={cp_degree} has no fitted coefficients; "
                          f"fitted degrees: {self.degrees}")

    def predict(self, cp_degree: int, input_len: int, cached_len: int) -> float:
        """Predicted prefill seconds: max(f_C, T_C(L, h)) for at least n_C new tokens, else
        T_C(L, h) (module doc; plain Python float arithmetic, the router's hot path).

        Raises:
          ValueError: unknown cp_degree (naming the fitted degrees), or unless
            0 <= cached_len <= input_len and input_len >= 1 token.
        """
        terms = self._terms.get(cp_degree)
        if terms is None or not (0 <= cached_len <= input_len and input_len >= 1):
            if terms is None:
                raise self._unknown(cp_degree)
            raise ValueError(f"need input_len >= 1 and 0 <= cached_len <= input_len, got "
                             f"cached_len={cached_len}, input_len={input_len}")
        a, b, g, d, f, nf = terms
        n = input_len - cached_len
        t = a + b * n + g * (input_len * input_len - cached_len * cached_len) + d * input_len
        return f if t < f and n >= nf else t

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
        f, nf = self._floor[cp_degree]
        t = a + b * (L - h) + g * (L * L - h * h) + d * L
        return np.where((t < f) & (L - h >= nf), f, t)

    def coefficients(self, cp_degree: int) -> dict[str, float]:
        """{'a', 'b', 'g', 'd'} of one degree (units in the class doc)."""
        if cp_degree not in self._coef:
            raise self._unknown(cp_degree)
        return dict(zip(_NAMES, self._coef[cp_degree]))

    def floors(self) -> dict[int, tuple[float, int]]:
        """{cp_degree: (f_C, n_C)}: a prefill of at least n_C new tokens takes at least f_C
        seconds ((0.0, 0): none; module doc)."""
        return dict(self._floor)

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
            "floors": {str(c): {"seconds": f, "min_new_tokens": nf}
                       for c, (f, nf) in self._floor.items()},
            "fit_error": {str(c): {"mean_rel_err": e[0], "max_rel_err": e[1]}
                          for c, e in self._fit_error.items()},
        }

    @classmethod
    def from_json(cls, data: Mapping) -> PrefillCostModel:
        """Inverse of `to_json` (a JSON without 'floors', as written before floors existed,
        reads as the form alone).

        Raises:
          ValueError: when 'coefficients' is missing or an entry lacks one of a, b, g, d; on a
            floor the constructor refuses.
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
        floors = {}
        given = data.get("floors", {})
        if not isinstance(given, Mapping):
            raise ValueError(f"cost-model JSON 'floors' must be an object, got "
                             f"{type(given).__name__}")
        for c, v in given.items():
            if not isinstance(v, Mapping) or "seconds" not in v or "min_new_tokens" not in v:
                raise ValueError(f"floors[{c}] must have 'seconds' and 'min_new_tokens'")
            try:
                key = int(c)
            except (TypeError, ValueError):
                raise ValueError(f"floors key {c!r} must be a cp_degree (an integer)") from None
            floors[key] = (v["seconds"], v["min_new_tokens"])
        return cls(coef, err, floors)
