"""Vertumnus' placement cost with a per-request prefix fetch (an extension beyond the paper).

The paper's router (`serving.policy.cost_router`, section 5) prices each worker with the prefix *that
worker* holds, `h_w(r)`; prefixes move between workers only through the prefix-cache manager's
periodic replication (section 7). Mooncake's Conductor (FAST '25, section 6.1, Algorithm 1)
instead fetches the longest prefix any worker holds when that beats recomputing it. With the
fetch executed in the simulator the Conductor beats the paper's router at low and medium load
on the Mooncake traces (eval/RESULTS.md), so this router adds the fetch to the placement cost:

    best     = the longest leading run of r cached on any candidate (blocks), on worker src
    local(w) = T(C_w, L_r, h_w)
    fetch(w) = X(best - c_w) + T(C_w, L_r, best)          if best > h_w, else inf
    S_w(r)   = min(local(w), fetch(w))
    cost(w)  = Q_w + beta * S_w(r) + lambda * (C_w * S_w(r) - min_w' C_w' * S_w'(r))

with `h_w` the prefix cached or promised on w (as `VertumnusRouter`), `c_w` the part of it
cached now (the blocks a copy must bring are `best - c_w`), and `X(k) = k * B *
kv_bytes_per_token / (bw * 1e9)` seconds, `bw` being `transfer_gb_per_s` when src and w are on
one host, `scaleout_gb_per_s` across hosts (`serving.policy.replication.link_gb_per_s`). With
several hosts the source is chosen per w: each host's longest run is a candidate source, and
the cheapest fetch wins (so a shorter prefix on w's own host can beat a longer one across the
scale-out network). When the chosen plan fetches, the
copy is made when the request leaves the worker's queue (`serving.policy.replication.
FetchOnDispatch`: the longest prefix another worker holds then, only the missing blocks, reason
"request-transfer"), and the backend starts the prefill when the copy is done (the simulator,
and the live backends: `serving.fetch_wait`): TTFT = queue + transfer + prefill, as priced.
A fetch not made (nothing longer to fetch by then, or the copy refused) leaves the request on
its local prefix. Among equal costs the plan that copies less wins (then round-robin). The
scheduler reserves the local-prefix estimate `T(C_w, L_r, h_w)`, not `S_w`.

With `congestion_price`, no fetch is planned while every candidate has a request queued (the
price is above `lam`: `VertumnusRouter.gpu_price`). A fetch moves a request off its prefix's
holder to a shorter queue; with no queue empty that relieves no idle worker, while the copy
occupies KV on the destination (pushing out other prefixes: the copies spread every hot prefix
to every worker) and holds it idle until it lands. Measured on the L-Eval request CSV with
Qwen3-32B at 4x the cold capacity rate, ten CP-4 workers: 46.4 s mean TTFT with fetches (prefix
hits 0.607 of the tokens, 7,835 GPU-s), 24.3 s without (0.751, 5,159 GPU-s) (eval/RESULTS.md
item 8).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

from serving.policy.cost_router import VertumnusRouter
from serving.policy.queue_order import FCFS, QueueOrder
from serving.policy.replication import (SCALEOUT_GB_PER_S, FetchOnDispatch, check_transfer_args,
                                        copy_seconds)
from serving.policy.request import Request
from serving.policy.worker import WorkerState

_INF = float("inf")


class FetchingVertumnusRouter(VertumnusRouter):
    """`VertumnusRouter` whose prefill time may fetch the longest cached prefix from another
    worker; see the module docstring.

    Args:
      kv_bytes_per_token: K and V bytes of one token, all layers (`ModelSpec.kv_bytes_per_token`),
        >= 0.
      transfer_gb_per_s: bandwidth of a KV copy between workers of one host, GB/s (1e9
        bytes/s), >= 0; 0 = free. Default 100, the simulator's `replication_gb_per_s`.
      beta, lam, cost_model, name: as `VertumnusRouter`.
      scaleout_gb_per_s: bandwidth of a KV copy between workers of different hosts, GB/s,
        >= 0; 0 = free. Default `SCALEOUT_GB_PER_S` (25: one 200 Gb/s NIC).
      live_horizon_s: as `VertumnusRouter` (the evictions' cost `E_w` is added to every plan;
        `new_w` counts from w's own prefix, so a fetched prefix counts as written).
      congestion_price: as `VertumnusRouter` (the copy's time counts in S_w, so in G_w too);
        and no fetch is planned while every candidate has a request queued (module doc).
      queue_order: as `VertumnusRouter` (a fetch starts when its request leaves the queue).

    Raises:
      ValueError: an argument outside the ranges above.
    """

    def __init__(self, kv_bytes_per_token: int, transfer_gb_per_s: float = 100.0,
                 beta: float = 1.0, lam: float = 1.0, cost_model=None,
                 name: str = "vertumnus-fetch",
                 scaleout_gb_per_s: float = SCALEOUT_GB_PER_S,
                 live_horizon_s: float | None = None, congestion_price: bool = False,
                 queue_order: QueueOrder = FCFS) -> None:
        super().__init__(beta, lam, cost_model, name, live_horizon_s=live_horizon_s,
                         congestion_price=congestion_price, queue_order=queue_order)
        check_transfer_args(kv_bytes_per_token, transfer_gb_per_s)
        check_transfer_args(0, scaleout_gb_per_s)
        self.kv_bytes_per_token = int(kv_bytes_per_token)
        self.transfer_gb_per_s = float(transfer_gb_per_s)
        self.scaleout_gb_per_s = float(scaleout_gb_per_s)
        self.fetches = FetchOnDispatch()
        self._scheduler = None

    def bind(self, scheduler) -> None:
        super().bind(scheduler)
        self._scheduler = scheduler
        self.fetches.attach(scheduler)

    def transfer_seconds(self, blocks: int, block_size: int, cross_host: bool = False) -> float:
        """Time to copy `blocks` KV blocks of `block_size` tokens between workers (seconds), of
        one host or (`cross_host`) of two."""
        return copy_seconds(blocks, block_size, self.kv_bytes_per_token,
                            self.scaleout_gb_per_s if cross_host else self.transfer_gb_per_s)

    def plans(self, request: Request, candidates: Sequence[WorkerState],
              matched_blocks: Sequence[int], now: float) -> list[tuple[float, int, int, int]]:
        """Per candidate: (placement cost in seconds, blocks its plan copies, index of the
        source candidate, leading blocks of the request the source holds); the last two are -1
        and 0 when the plan copies nothing.
        """
        costs, st = self._price(request, candidates, matched_blocks, now)
        return [(cost, p[1], p[2], p[3]) for cost, p in zip(costs, st)]

    def _price(self, request: Request, candidates: Sequence[WorkerState],
               matched_blocks: Sequence[int], now: float
               ) -> tuple[list[float], list[tuple[float, int, int, int, float]]]:
        """`plans` as two lists: the costs, and per candidate (S_w, blocks copied, source
        index, blocks fetched, C_w * S_w)."""
        predict, n, bs = self.cost_model.predict, request.input_len, request.block_size
        lam = self.gpu_price(candidates)
        if lam > self.lam:  # every candidate has a queue: no fetch (module doc)
            cached = [0] * len(candidates)
        else:
            cached = self._cached_blocks(request, candidates)
        best = max(cached, default=0)
        sources: dict[int, tuple[int, int]] = {}  # host -> (its longest run, first holder)
        if best:
            for i, (w, c) in enumerate(zip(candidates, cached)):
                if c and c > sources.get(w.spec.host, (0, -1))[0]:
                    sources[w.spec.host] = (c, i)
        # `transfer_seconds` inlined (hot path): copy_seconds' formula, one divisor per link
        kv, near, far = self.kv_bytes_per_token, self.transfer_gb_per_s, self.scaleout_gb_per_s
        near, far = (near * 1e9 if near > 0 else 0.0), (far * 1e9 if far > 0 else 0.0)
        beta = self.beta
        memo: dict[tuple[int, int], float] = {}  # (C, blocks cached) -> T(C, L, blocks * B)
        # A plan depends only on (C_w, h_w, c_w, host): most candidates share one (a common
        # prefix cached everywhere), so each distinct plan is priced once.
        plan_of: dict[tuple[int, int, int, int], tuple[float, int, int, int, float]] = {}
        st = []  # per candidate (S_w, blocks copied, source index, blocks fetched, C_w * S_w)
        part = []  # per candidate Q_w + beta * S_w, the cost's first terms
        for w, m, c in zip(candidates, matched_blocks, cached):
            spec = w.spec
            deg, host = spec.cp_degree, spec.host
            plan = plan_of.get((deg, m, c, host))
            if plan is None:
                t = memo.get((deg, m))
                if t is None:
                    t = memo[(deg, m)] = predict(deg, n, m * bs)
                copied, src, fetched = 0, -1, 0
                if best > m:
                    for h, (run, i) in sources.items():
                        if run <= m:
                            continue
                        tb = memo.get((deg, run))
                        if tb is None:
                            tb = memo[(deg, run)] = predict(deg, n, run * bs)
                        bw = near if h == host else far
                        fetch = ((run - c) * bs * kv / bw if bw else 0.0) + tb
                        if fetch < t or (fetch == t and copied and run - c < copied):
                            t, copied, src, fetched = fetch, run - c, i, run
                plan = plan_of[(deg, m, c, host)] = (t, copied, src, fetched, deg * t)
            st.append(plan)
            q = w.queued_seconds  # inline of WorkerState.outstanding_seconds (hot path)
            if w.running is not None:
                r = w.running_estimate - (now - w.running_start)
                if r > 0:
                    q += r
            part.append(q + beta * plan[0])
        # (the minimum over the candidates: each one's plan is one of these, first seen first)
        cheapest = min(p[4] for p in plan_of.values())
        # Q_w + beta * S_w + lam * (C_w * S_w - cheapest), added in that order
        costs = [a + lam * (p[4] - cheapest) for a, p in zip(part, st)]
        if self.live is not None:
            self._add_eviction_costs(costs, request, candidates, matched_blocks, now, lam)
        return costs, st

    def costs(self, request: Request, candidates: Sequence[WorkerState],
              matched_blocks: Sequence[int], now: float) -> list[float]:
        """Placement cost of each candidate, in seconds (the module docstring's formula)."""
        return [p[0] for p in self.plans(request, candidates, matched_blocks, now)]

    def choose(self, request: Request, candidates: Sequence[WorkerState],
               matched_blocks: Sequence[int], now: float) -> int:
        """Index of the least placement cost (equal costs: the plan copying less, then
        round-robin); plans its fetch (made at dispatch) if it fetches.

        Raises:
          ValueError: no candidate has a finite cost.
        """
        costs, st = self._price(request, candidates, matched_blocks, now)
        k = len(costs)
        start = self._rotation % k
        self._rotation += 1
        # The first, from `start` on (cyclic), of the least (cost, copied) among the costs that
        # are not NaN. `min` gives the least cost unless costs[0] is NaN; else, and when no
        # cost is finite, the loop compares pairs one by one.
        least = min(costs)
        if least < _INF and costs.count(least) == 1:
            best = costs.index(least)
        elif least < _INF:
            ties = [i for i, cost in enumerate(costs) if cost == least]
            fewest = min(st[i][1] for i in ties)
            ties = [i for i in ties if st[i][1] == fewest]
            best = next((i for i in ties if i >= start), ties[0])
        else:
            best, best_cost, best_copied = -1, _INF, 0
            for i in chain(range(start, k), range(start)):
                cost, copied = costs[i], st[i][1]
                if cost < best_cost or (cost == best_cost and copied < best_copied):
                    best, best_cost, best_copied = i, cost, copied
        if best < 0:
            raise ValueError(f"no finite placement cost for request {request.request_id!r}: "
                             f"{costs}")
        _, copied, _, length, _ = st[best]
        if copied:
            self.fetches.plan(request, candidates[best].spec.worker_id, length)
        else:  # a plan of an earlier routing of this request (re-routed) no longer applies
            self.fetches.cancel(request)
        if self.live is not None:
            self._placed(request, candidates, matched_blocks, best, now)
        return best

    def _cached_blocks(self, request: Request, candidates: Sequence[WorkerState]) -> list[int]:
        """Per candidate, the leading blocks of `request` it has cached now (no promises)."""
        if self._scheduler is None:
            return [0] * len(candidates)
        routing = getattr(self._scheduler, "routing", None)
        if routing is not None and routing[0] is request and routing[1] is candidates:
            return routing[2]  # the scheduler's own match, while it routes this request
        limit = (request.input_len - 1) // request.block_size  # max_cacheable_blocks
        return self._scheduler.prefix_index.match_blocks(
            request.block_hashes, limit, [w.spec.worker_id for w in candidates])
