"""FlexLB's static-threshold rule: two fixed worker groups split by input length.

Plain Python over plain data; `now` is passed in, never read from a clock.
"""

from __future__ import annotations

from collections.abc import Sequence

from serving.baselines.common import argmin_rotating
from serving.policy.cost_router import VertumnusRouter
from serving.policy.request import Request
from serving.policy.worker import WorkerState


class StaticThresholdRouter:
    """Two fixed pools split by input length; cache-aware least cost inside the pool.

    Rule: a request with `input_len >= threshold_tokens` goes to the *long* group (the workers
    of the largest CP degree in the pool), any other to the *short* group (all other workers).
    Inside the group the worker of least `Q_w + S_w(r)` wins (queueing delay plus cache-aware
    prefill time: `VertumnusRouter` with beta=1, lambda=0 on the group's candidates). When the
    group has no eligible worker (or the pool has a single degree, so the short group is
    empty) the request falls back to the other group.

    Source: the FlexLB rule of the Vertumnus paper's baseline (inputs of >= 8192 tokens to a
    long-context group; issue 3). FlexLB is RTP-LLM's load balancer (alibaba/rtp-llm,
    `rtp_llm/flexlb`, `docs/backend/flexlb.md`); its in-group choice, "running queue time +
    estimated prefill time with the cache-matched prefix, lowest wins", is
    `rtp_llm/flexlb/flexlb-sync/src/main/java/org/flexlb/balance/dp/CacheAwareGroupSelector.java`.
    The 8192-token constant itself is taken from the issue; it is not located in the public
    FlexLB source.

    Args:
      threshold_tokens: input length (tokens) from which a request is long, >= 1.
      long_degree: CP degree of the long group; None = the largest degree among the scheduler's
        workers (all of them, draining ones included) or, before `bind`, among the candidates.
      cost_model: `predict(cp_degree, input_len, cached_len) -> seconds`; None = the
        scheduler's (set by `bind`).

    Raises:
      ValueError: threshold_tokens < 1 or long_degree < 1.
    """

    def __init__(self, threshold_tokens: int = 8192, long_degree: int | None = None,
                 cost_model=None, name: str = "static-threshold") -> None:
        if not threshold_tokens >= 1:
            raise ValueError(f"threshold_tokens must be >= 1, got {threshold_tokens}")
        if long_degree is not None and long_degree < 1:
            raise ValueError(f"long_degree must be >= 1 or None, got {long_degree}")
        self.threshold_tokens, self.long_degree = int(threshold_tokens), long_degree
        self.name = name
        self._inner = VertumnusRouter(beta=1.0, lam=0.0, cost_model=cost_model)
        self._scheduler = None
        self._rotation = 0

    def bind(self, scheduler) -> None:
        self._inner.bind(scheduler)
        self._scheduler = scheduler

    def group(self, request: Request, candidates: Sequence[WorkerState]) -> list[int]:
        """Indices into `candidates` of the group `request` is routed within (after fallback)."""
        big = self.long_degree
        if big is None:
            pool = self._scheduler.workers.values() if self._scheduler is not None else candidates
            big = max(w.cp_degree for w in pool)
        want_long = request.input_len >= self.threshold_tokens
        idx = [i for i, w in enumerate(candidates) if (w.cp_degree == big) == want_long]
        return idx or list(range(len(candidates)))

    def choose(self, request: Request, candidates: Sequence[WorkerState],
               matched_blocks: Sequence[int], now: float) -> int:
        idx = self.group(request, candidates)
        costs = self._inner.costs(request, [candidates[i] for i in idx],
                                  [matched_blocks[i] for i in idx], now)
        j = argmin_rotating(costs, self._rotation)
        self._rotation += 1
        return idx[j]
