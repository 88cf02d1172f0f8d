"""The simulator's ground-truth prefill time: piecewise-linear interpolation of a profile table.

The router predicts with the fitted closed form (`serving.policy.cost_model`); the simulated backend
charges each prefill this table-driven time instead (plus optional seeded noise), so the router is
never omniscient (DESIGN.md, "One policy core, two backends").

Interpolation, per CP degree:
  1. each distinct input length L_i of the table is a *row*; within a row, time is linear in the
     cached fraction r = h / L between the row's points (r computed exactly from each row's
     cached_len), held constant beyond the row's smallest and largest r (so h -> L is charged
     the row's largest-fraction time: conservative, never extrapolated below it);
  2. between the two rows bracketing L (L_i <= L <= L_{i+1}), linear in L, both evaluated at the
     request's own r;
  3. below the smallest row L_0, the row-0 time at r is scaled by L / L_0 (linear through the
     origin: a documented extrapolation that keeps tiny prompts cheap and monotone);
  4. above the largest row: ValueError (a worker declares `max_input_len` and must reject).
Duplicate (L, h) rows (repeated measurements) are averaged.

Noise: the time is multiplied by exp(sigma * z - sigma^2 / 2), z ~ N(0, 1) from a seeded
`numpy.random.Generator` (mean 1, median exp(-sigma^2/2)); draws are taken in blocks, so a run
is deterministic given the seed and the order of calls.
"""

from __future__ import annotations

from bisect import bisect_right

import numpy as np

_NOISE_BLOCK = 4096


def _interp_row(rs: list[float], ts: list[float], r: float) -> float:
    if r <= rs[0]:
        return ts[0]
    if r >= rs[-1]:
        return ts[-1]
    j = bisect_right(rs, r)
    r0, r1 = rs[j - 1], rs[j]
    t0 = ts[j - 1]
    return t0 + (ts[j] - t0) * (r - r0) / (r1 - r0)


class GroundTruthProfile:
    """Ground-truth prefill seconds from a profile table (module doc gives the rules).

    Args:
      table: a `serving.policy.profiles.ProfileTable` (or anything with 1-D columns cp, input_len,
        cached_len, seconds).
      noise_sigma: sigma of the multiplicative lognormal noise, >= 0 (0 = exact table).
      seed: seed of the noise generator.

    Raises:
      ValueError: on noise_sigma < 0 or not finite, or an empty table.
    """

    def __init__(self, table, noise_sigma: float = 0.0, seed: int = 0):
        self._reset_noise(noise_sigma, seed)  # (validates noise_sigma first)
        cp = np.asarray(table.cp)
        L = np.asarray(table.input_len)
        h = np.asarray(table.cached_len)
        s = np.asarray(table.seconds, dtype=np.float64)
        if len(cp) == 0:
            raise ValueError("table has no rows")
        self._degrees: dict[int, tuple[list[int], list[tuple[list[float], list[float]]]]] = {}
        for c in sorted(int(x) for x in np.unique(cp)):
            m = cp == c
            points: dict[int, dict[int, list[float]]] = {}
            for Li, hi, si in zip(L[m].tolist(), h[m].tolist(), s[m].tolist()):
                points.setdefault(int(Li), {}).setdefault(int(hi), []).append(float(si))
            lens = sorted(points)
            rows = []
            for Li in lens:
                hs = sorted(points[Li])
                rows.append(([hh / Li for hh in hs], [sum(points[Li][hh]) / len(points[Li][hh])
                                                      for hh in hs]))
            self._degrees[c] = (lens, rows)

    def with_noise(self, noise_sigma: float = 0.0, seed: int = 0) -> GroundTruthProfile:
        """The profile `GroundTruthProfile(table, noise_sigma, seed)` would give, sharing this
        one's interpolation rows (read-only) instead of parsing the table again: a fresh,
        seeded noise stream. Raises ValueError as the constructor does on noise_sigma."""
        new = object.__new__(GroundTruthProfile)
        new._reset_noise(noise_sigma, seed)
        new._degrees = self._degrees
        return new

    def _reset_noise(self, noise_sigma: float, seed: int) -> None:
        if not (np.isfinite(noise_sigma) and noise_sigma >= 0):
            raise ValueError(f"noise_sigma={noise_sigma} must be finite and >= 0")
        self._sigma = float(noise_sigma)
        self._rng = np.random.default_rng(seed)
        self._noise: list[float] = []
        self._noise_pos = 0

    @property
    def degrees(self) -> tuple[int, ...]:
        """CP degrees in the table, ascending."""
        return tuple(self._degrees)

    def max_input_len(self, cp_degree: int) -> int:
        """Largest input length (tokens) the table covers for `cp_degree`.

        Raises:
          ValueError: naming cp_degree and the known degrees when absent.
        """
        return self._rows(cp_degree)[0][-1]

    def _rows(self, cp_degree):
        try:
            return self._degrees[cp_degree]
        except KeyError:
            raise ValueError(f"cp_degree={cp_degree} not in the profile; degrees "
                             f"{self.degrees}") from None

    def exact_seconds(self, cp_degree: int, input_len: int, cached_len: int) -> float:
        """Noise-free interpolated seconds (see module doc).

        Raises:
          ValueError: unknown cp_degree; unless 1 <= input_len and 0 <= cached_len <= input_len;
            input_len above `max_input_len(cp_degree)` (naming both).
        """
        entry = self._degrees.get(cp_degree)
        if entry is None:
            self._rows(cp_degree)  # raises, naming the degrees
        lens, rows = entry
        if not 0 <= cached_len <= input_len or input_len < 1:
            raise ValueError(f"need 1 <= input_len and 0 <= cached_len <= input_len, got "
                             f"input_len={input_len}, cached_len={cached_len}")
        r = cached_len / input_len
        if input_len <= lens[0]:
            rs, ts = rows[0]
            return _interp_row(rs, ts, r) * input_len / lens[0]
        if input_len > lens[-1]:
            raise ValueError(f"input_len={input_len} exceeds the profile's maximum "
                             f"{lens[-1]} for cp_degree={cp_degree}")
        i = bisect_right(lens, input_len) - 1
        # `_interp_row` inlined for both rows (the simulator's hot path); same arithmetic.
        rs, ts = rows[i]
        if r <= rs[0]:
            t0 = ts[0]
        elif r >= rs[-1]:
            t0 = ts[-1]
        else:
            j = bisect_right(rs, r)
            r0 = rs[j - 1]
            t0 = ts[j - 1] + (ts[j] - ts[j - 1]) * (r - r0) / (rs[j] - r0)
        L0 = lens[i]
        if L0 == input_len:
            return t0
        rs, ts = rows[i + 1]
        if r <= rs[0]:
            t1 = ts[0]
        elif r >= rs[-1]:
            t1 = ts[-1]
        else:
            j = bisect_right(rs, r)
            r0 = rs[j - 1]
            t1 = ts[j - 1] + (ts[j] - ts[j - 1]) * (r - r0) / (rs[j] - r0)
        return t0 + (t1 - t0) * (input_len - L0) / (lens[i + 1] - L0)

    def seconds(self, cp_degree: int, input_len: int, cached_len: int) -> float:
        """Ground-truth prefill seconds: `exact_seconds` times the noise factor (1 when
        noise_sigma == 0). Raises as `exact_seconds`."""
        t = self.exact_seconds(cp_degree, input_len, cached_len)
        if self._sigma == 0.0:
            return t
        if self._noise_pos >= len(self._noise):
            z = self._rng.standard_normal(_NOISE_BLOCK)
            self._noise = np.exp(self._sigma * z - 0.5 * self._sigma ** 2).tolist()
            self._noise_pos = 0
        f = self._noise[self._noise_pos]
        self._noise_pos += 1
        return t * f
