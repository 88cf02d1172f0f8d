"""Vertumnus' request-level router: least placement cost (paper section 5).

For request r and eligible worker w of CP degree C_w, with h_w(r) the prefix of r that *that*
worker holds (from the cluster's prefix index) and T the fitted prefill-time model:

    cost(w) = Q_w + beta * S_w(r) + lambda * G_w(r)
    S_w(r) = T(C_w, L_r, h_w(r))                       cache-aware prefill time (s)
    G_w(r) = C_w * S_w(r) - min_w' C_w' * S_w'(r)      GPU-seconds beyond the cheapest worker's

`Q_w` is the predicted queueing delay: reserved, not yet finished prefill work on w (seconds).
The scheduler reserves S_w(r) on the chosen worker at once and replaces the estimate by the
actual time at completion. Ties go round-robin (deterministic, no bias toward worker 0).

With one degree only (a homogeneous pool) G is 0 for every worker and the rule is cache-aware
least-cost routing, the paper's homogeneous baseline.
"""

from __future__ import annotations

from collections.abc import Sequence

from serving.policy.request import Request
from serving.policy.worker import WorkerState


class VertumnusRouter:
    """Least placement cost; see the module docstring.

    Args:
      beta: weight of the cache-aware prefill time S_w (dimensionless), >= 0. Default 1: the
        cost is then the predicted completion time of r on w.
      lam: weight of the GPU-time cost G_w, in seconds per GPU-second, >= 0. Default 1: a
        GPU-second wasted is worth a second of this request's latency. Long prompts scale
        almost linearly with C (G ~ 0), so they take the fastest worker; short prompts are
        dominated by fixed costs (G ~ (C - 1) * T), so they stay on small degrees.
      cost_model: `predict(cp_degree, input_len, cached_len) -> seconds`; when None, the
        scheduler's (set by `bind`).

    Raises:
      ValueError: negative beta or lam.
    """

    def __init__(self, beta: float = 1.0, lam: float = 1.0, cost_model=None,
                 name: str = "vertumnus") -> None:
        if not beta >= 0:
            raise ValueError(f"beta must be >= 0, got {beta}")
        if not lam >= 0:
            raise ValueError(f"lam (lambda) must be >= 0, got {lam}")
        self.beta, self.lam, self.name = float(beta), float(lam), name
        # h_w(r) counts blocks promised by prefills queued on w (FIFO: cached when r starts).
        self.uses_pending_prefixes = True
        self.cost_model = cost_model
        self._rotation = 0

    def bind(self, scheduler) -> None:
        if self.cost_model is None:
            self.cost_model = scheduler.cost_model

    def costs(self, request: Request, candidates: Sequence[WorkerState],
              matched_blocks: Sequence[int], now: float) -> list[float]:
        """Placement cost of each candidate, in seconds (the formula above)."""
        predict, n, bs = self.cost_model.predict, request.input_len, request.block_size
        memo: dict[int, tuple[float, float]] = {}  # c * 2**32 + m -> (T, C * T)
        st = []
        cheapest = float("inf")
        for w, m in zip(candidates, matched_blocks):
            c = w.spec.cp_degree
            key = (c << 32) | m
            tg = memo.get(key)
            if tg is None:
                t = predict(c, n, m * bs)
                tg = memo[key] = (t, c * t)
                if tg[1] < cheapest:
                    cheapest = tg[1]
            st.append(tg)
        beta, lam = self.beta, self.lam
        base = -lam * cheapest
        out = []
        for w, (t, g) in zip(candidates, st):
            q = w.queued_seconds  # inline of WorkerState.outstanding_seconds (hot path)
            if w.running is not None:
                r = w.running_estimate - (now - w.running_start)
                if r > 0:
                    q += r
            out.append(q + beta * t + lam * g + base)
        return out

    def choose(self, request: Request, candidates: Sequence[WorkerState],
               matched_blocks: Sequence[int], now: float) -> int:
        """Index into `candidates` of the least placement cost (`costs`), ties round-robin.

        Computes exactly the floats `costs` returns (same operations, same order), with one
        prediction per distinct (degree, match): the simulator's hot path.

        Raises:
          ValueError: no candidate has a finite cost (the cost model returned NaN or inf).
        """
        predict, n, bs = self.cost_model.predict, request.input_len, request.block_size
        beta, lam = self.beta, self.lam
        memo: dict[int, dict[int, tuple[float, float]]] = {}  # C -> m -> (beta*T, lam*C*T)
        partial = []  # Q + beta * S + lambda * C * S, per candidate
        append = partial.append
        cheapest = float("inf")
        last_c = by_m = None
        for w, m in zip(candidates, matched_blocks):
            c = w.spec.cp_degree
            if c != last_c:  # candidates of one degree usually come together
                by_m = memo.get(c)
                if by_m is None:
                    by_m = memo[c] = {}
                last_c = c
            st = by_m.get(m)
            if st is None:
                t = predict(c, n, m * bs)
                g = c * t
                if g < cheapest:
                    cheapest = g
                st = by_m[m] = (beta * t, lam * g)
            q = w.queued_seconds  # inline of WorkerState.outstanding_seconds
            if w.running is not None:
                r = w.running_estimate - (now - w.running_start)
                if r > 0:
                    q += r
            append(q + st[0] + st[1])
        base = -lam * cheapest
        k = len(partial)
        start = self._rotation % k
        self._rotation += 1
        best, best_cost = -1, float("inf")
        for i in range(start, k):
            v = partial[i] + base
            if v < best_cost:
                best, best_cost = i, v
        for i in range(start):
            v = partial[i] + base
            if v < best_cost:
                best, best_cost = i, v
        if best < 0:
            raise ValueError(f"no finite placement cost for request {request.request_id!r}: the "
                             f"cost model returned {[p + base for p in partial]}")
        return best
