"""Vertumnus' request-level router: least placement cost (paper section 5).

For request r and eligible worker w of CP degree C_w, with h_w(r) the prefix of r that *that*
worker holds (from the cluster's prefix index) and T the fitted prefill-time model:

    cost(w) = Q_w + beta * S_w(r) + lambda * G_w(r)
    S_w(r) = T(C_w, L_r, h_w(r))                       cache-aware prefill time (s)
    G_w(r) = C_w * S_w(r) - min_w' C_w' * S_w'(r)      GPU-seconds beyond the cheapest worker's

`Q_w` is the predicted queueing delay: reserved, not yet finished prefill work on w (seconds).
The scheduler reserves S_w(r) on the chosen worker at once and replaces the estimate by the
actual time at completion. Ties go round-robin (deterministic, no bias toward worker 0).

G as above (`gpu_cost="worker"`, the default and the paper's reading) also prices the cache: a
worker without r's prefix is charged `(beta + lambda C)(S_cold - S_hit)` more on every request,
which keeps traffic near its prefixes (fewer GPU-seconds under overload) but lets one warm
worker take a shared system prompt's traffic until its queue exceeds that (issue 15: 316 vs
46 requests per worker at 70 % load). `gpu_cost="degree"` prices only the degree,

    G_w(r) = C_w * S_w(r) - min_C C * T(C, L_r, h_w(r))  (at w's own cached prefix)

so a cache miss is paid once, in S, and with one degree G is 0 for every worker (cache-aware
least-cost routing). The default system chooses between them by replaying its demand
(`eval.whatif_sim`).

With `live_horizon_s` the cost also charges the live context a placement evicts, to be
prefilled again (`serving.policy.live_set`):

    cost(w) = Q_w + beta * S_w(r) + lambda * G_w(r) + E_w(r)
    E_w(r)  = p * (beta + lambda * C_w) * T(C_w, over_w * B, 0)

with `over_w` the blocks of w's live working set (the blocks requests placed on w in the last
`live_horizon_s` seconds use) that r's new blocks push out of w's KV capacity (0 while the
live set fits), and `p` the observed chance that a live block pushed out is asked for again
(`LiveWorkingSet.victim_reuse_rate`).

With `congestion_price` lambda grows with the backlog the whole pool carries (issue 15: past
saturation a GPU-second spent is a second of delay for every request waiting behind it):

    lambda_eff = lambda + n_min * K / N_gpu

with `n_min` the requests queued (not started) on the least-queued candidate, `K` the
candidates and `N_gpu` their GPUs: `n_min * K` requests are queued that no idle worker can
take. A placement's GPU-seconds x then delay the pool's later work by about x / N_gpu (a
balancing router spreads it), and by Little's law about as many requests as are queued arrive
while that backlog drains, so x costs the others about x * n_min * K / N_gpu seconds of TTFT:
the externality a queue's toll prices (P. Naor, "The Regulation of Queue Size by Levying
Tolls", Econometrica 37(1), 1969; H. Mendelson, "Pricing Computer Services: Queueing
Effects", CACM 28(3), 1985). While any candidate's queue is empty the cost is the paper's:
work sent to a busy worker for its cache then idles no GPU. Past saturation cache hits and
efficient degrees win over a shorter queue, and the live-context price `E_w` weighs the
GPU-seconds of a re-prefill the same way. The what-if models of the composition controller
(`serving.policy.whatif`, `choose_initial`) still price GPU time at the fixed lambda; the
simulated replay of the initial choice (`eval.whatif_sim`) runs these routers, price included.
Counting every queued request instead (the sum over the candidates) was tried first: it
concentrated long documents on their holders while other workers ran dry, +10.7 % mean TTFT
on long documents with Qwen3-32B at load 1.5 (eval/RESULTS.md item 7).
"""

from __future__ import annotations

from collections.abc import Sequence

from serving.policy.live_set import LiveWorkingSet
from serving.policy.queue_order import FCFS, QueueOrder
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
      gpu_cost: "worker" (the paper's: G against the cheapest worker, the default) or "degree"
        (against the cheapest degree at w's cached prefix); module doc.
      live_horizon_s: None (the paper's cost, the default), or the window in seconds of the
        workers' live working sets whose evictions the cost charges (`E_w`, module doc).
      congestion_price: price GPU time at `lam + n_min * K / N_gpu` (module doc); False (the
        paper's fixed lambda) by default.
      queue_order: the order in which a worker's queued prefills start, a `QueueOrder`
        (`serving.policy.queue_order`; the scheduler reads it): FCFS (the paper's) by default.
        `Q_w` stays the whole reserved work under any order: under SJF a short request waits
        less than that, a long one may wait more (shorter ones placed after it start first).

    Raises:
      ValueError: negative beta or lam, an unknown gpu_cost, a live_horizon_s that is not
        finite and > 0, a congestion_price that is not a bool, or a queue_order that is not a
        `QueueOrder`.
    """

    def __init__(self, beta: float = 1.0, lam: float = 1.0, cost_model=None,
                 name: str = "vertumnus", gpu_cost: str = "worker",
                 live_horizon_s: float | None = None, congestion_price: bool = False,
                 queue_order: QueueOrder = FCFS) -> None:
        if not beta >= 0:
            raise ValueError(f"beta must be >= 0, got {beta}")
        if not lam >= 0:
            raise ValueError(f"lam (lambda) must be >= 0, got {lam}")
        if gpu_cost not in ("degree", "worker"):
            raise ValueError(f"gpu_cost must be 'degree' or 'worker', got {gpu_cost!r}")
        if not isinstance(congestion_price, bool):
            raise ValueError(f"congestion_price must be True or False, got {congestion_price!r}")
        self.beta, self.lam, self.name = float(beta), float(lam), name
        self.gpu_cost = gpu_cost
        # h_w(r) counts blocks promised by prefills queued on w (cached when r starts; under SJF
        # only when r is the longer of the two: `serving.policy.queue_order`).
        self.uses_pending_prefixes = True
        self.cost_model = cost_model
        self.live = LiveWorkingSet(live_horizon_s) if live_horizon_s is not None else None
        self.congestion_price = congestion_price
        if not isinstance(queue_order, QueueOrder):
            raise ValueError(f"queue_order must be a QueueOrder, got {queue_order!r}")
        self.queue_order = queue_order
        self._rotation = 0

    def gpu_price(self, candidates: Sequence[WorkerState]) -> float:
        """lambda of this placement, in seconds per GPU-second: `lam`, plus with
        `congestion_price` the requests queued on the least-queued of `candidates` times
        their number, per GPU of theirs (module doc)."""
        if not self.congestion_price or not candidates:
            return self.lam
        least, gpus = len(candidates[0].queue), 0
        for w in candidates:
            n = len(w.queue)
            if n < least:
                least = n
            gpus += w.spec.cp_degree
        return self.lam + least * len(candidates) / gpus if least else self.lam

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
        beta, lam = self.beta, self.gpu_price(candidates)
        if self.gpu_cost == "degree":
            degrees = {w.spec.cp_degree for w in candidates}
            floor = {m: min(c * predict(c, n, m * bs) for c in degrees)
                     for m in set(matched_blocks)}
            refs = [floor[m] for m in matched_blocks]
        else:
            refs = [cheapest] * len(candidates)
        out = []
        for w, (t, g), ref in zip(candidates, st, refs):
            q = w.queued_seconds  # inline of WorkerState.outstanding_seconds (hot path)
            if w.running is not None:
                r = w.running_estimate - (now - w.running_start)
                if r > 0:
                    q += r
            out.append(q + beta * t + lam * g)
        if self.live is not None:  # added where `choose` adds it, so both give the same floats
            self._add_eviction_costs(out, request, candidates, matched_blocks, now, lam)
        return [c - lam * ref for c, ref in zip(out, refs)]

    def _add_eviction_costs(self, costs: list[float], request: Request,
                            candidates: Sequence[WorkerState], matched_blocks: Sequence[int],
                            now: float, lam: float) -> None:
        """Adds `E_w` to each candidate's cost in place, GPU time at `lam` (callers check
        `self.live` first: without live sets neither this nor `_placed` is called, on the hot
        path)."""
        self.live.add_eviction_costs(costs, request, candidates, matched_blocks, now,
                                     self.cost_model.predict, self.beta, lam)

    def _placed(self, request: Request, candidates: Sequence[WorkerState],
                matched_blocks: Sequence[int], best: int, now: float) -> None:
        """Records the choice of `candidates[best]` in the live working sets."""
        full = request.full_blocks
        pool_matched = max(matched_blocks)
        if pool_matched >= request.max_cacheable_blocks:  # matches stop there: the last full
            pool_matched = full  # block of a prompt of k * B tokens is never matched, nor lost
        spec = candidates[best].spec
        self.live.touch(spec.worker_id, request.block_hashes[:full], now, matched_blocks[best],
                        pool_matched, spec.kv_capacity_blocks, request.request_id)

    def choose(self, request: Request, candidates: Sequence[WorkerState],
               matched_blocks: Sequence[int], now: float) -> int:
        """Index into `candidates` of the least placement cost (`costs`), ties round-robin.

        Computes the costs `costs` returns, with one prediction per distinct (degree, match):
        the simulator's hot path.

        Raises:
          ValueError: no candidate has a finite cost (the cost model returned NaN or inf).
        """
        if self.gpu_cost == "degree":
            return self._choose_by_degree(request, candidates, matched_blocks, now)
        predict, n, bs = self.cost_model.predict, request.input_len, request.block_size
        beta, lam = self.beta, self.gpu_price(candidates)
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
        if self.live is not None:
            self._add_eviction_costs(partial, request, candidates, matched_blocks, now, lam)
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
        if self.live is not None:
            self._placed(request, candidates, matched_blocks, best, now)
        return best

    def _choose_by_degree(self, request: Request, candidates: Sequence[WorkerState],
                          matched_blocks: Sequence[int], now: float) -> int:
        """`choose` with G against the cheapest degree at each worker's own match."""
        predict, n, bs = self.cost_model.predict, request.input_len, request.block_size
        beta, lam = self.beta, self.gpu_price(candidates)
        seconds: dict[tuple[int, int], float] = {}  # (C, m) -> T(C, L, m * bs)
        extra: dict[tuple[int, int], float] = {}  # (C, m) -> beta * T + lam * G
        degrees = None
        total = []
        append = total.append
        for w, m in zip(candidates, matched_blocks):
            c = w.spec.cp_degree
            key = (c, m)
            e = extra.get(key)
            if e is None:
                if degrees is None:
                    degrees = {x.spec.cp_degree for x in candidates}
                floor = float("inf")
                for d in degrees:
                    t = seconds.get((d, m))
                    if t is None:
                        t = seconds[(d, m)] = predict(d, n, m * bs)
                    if d * t < floor:
                        floor = d * t
                t = seconds[key]
                e = extra[key] = beta * t + lam * (c * t - floor)
            q = w.queued_seconds  # inline of WorkerState.outstanding_seconds
            if w.running is not None:
                r = w.running_estimate - (now - w.running_start)
                if r > 0:
                    q += r
            append(q + e)
        if self.live is not None:
            self._add_eviction_costs(total, request, candidates, matched_blocks, now, lam)
        k = len(total)
        start = self._rotation % k
        self._rotation += 1
        best, best_cost = -1, float("inf")
        for i in range(start, k):
            if total[i] < best_cost:
                best, best_cost = i, total[i]
        for i in range(start):
            if total[i] < best_cost:
                best, best_cost = i, total[i]
        if best < 0:
            raise ValueError(f"no finite placement cost for request {request.request_id!r}: the "
                             f"cost model returned {total}")
        if self.live is not None:
            self._placed(request, candidates, matched_blocks, best, now)
        return best


def live_set_of(router) -> LiveWorkingSet | None:
    """The router's live sets (its `live` attribute, as `VertumnusRouter` keeps them), or None
    when it keeps none: no such attribute, None, or an attribute of that name that is not a
    `LiveWorkingSet` (a plug-in router's own)."""
    live = getattr(router, "live", None)
    return live if isinstance(live, LiveWorkingSet) else None
