"""Baseline routers: the rules of today's serving systems, on the same `Router` protocol.

Each is a class with `name`, `choose(request, candidates, matched_blocks, now) -> index` and,
where it needs the scheduler's cost model, `bind(scheduler)`. Ties are broken by a rotating
start (`argmin_rotating`): deterministic, no bias toward worker 0. Where the source breaks ties
at random, the rotation stands in for it. Sources are cited on each class.

- `StaticThresholdRouter`: two fixed groups by input length (FlexLB's long-context rule).
- `VllmPrefixAwareRouter`: vLLM production-stack's `prefixaware` routing logic.
- `SglangCacheAwareRouter`: SGLang router's `cache_aware` policy.
- `DynamoKvRouter`, `MooncakeConductorRouter` (in `serving.baselines_kv`, re-exported here):
  Dynamo's KV-router cost and Mooncake's Conductor (earliest estimated TTFT).

numpy-free plain Python over plain data; `now` is passed in, never read from a clock.
"""

from __future__ import annotations

from collections.abc import Sequence

from serving.baselines_common import RoutedPrefixTrie, argmin_rotating
from serving.baselines_kv import DynamoKvRouter, MooncakeConductorRouter
from serving.cost_router import VertumnusRouter
from serving.request import Request
from serving.worker import WorkerState

__all__ = [
    "DynamoKvRouter", "MooncakeConductorRouter", "SglangCacheAwareRouter",
    "StaticThresholdRouter", "VllmPrefixAwareRouter", "argmin_rotating",
]


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


class VllmPrefixAwareRouter:
    """vLLM production-stack's prefix-aware routing: the longest routed prefix wins.

    Source: vllm-project/production-stack, `src/vllm_router/routers/routing_logic.py`
    (`PrefixAwareRouter`, routing logic `prefixaware`) and `src/vllm_router/prefix/hashtrie.py`
    (`HashTrie.longest_prefix_match`). The router keeps its own trie of where it *sent* each
    prompt (inserted at routing time, "we assume that there is no eviction of prefix cache"),
    finds the set of available endpoints sharing the longest matched prefix (every endpoint
    when nothing matches), picks one of them at random and inserts the prompt under it. The
    rule ignores load entirely.

    Mapping: the trie's 128-character chunks are our KV blocks (`request.block_hashes`, the
    last partial block included); the random pick among the tied set is the rotating
    tie-break, so an unmatched stream goes round-robin. The scheduler's `matched_blocks`
    (from KV events) are not used: the source does not see the workers' caches.
    """

    def __init__(self, name: str = "vllm-prefixaware") -> None:
        self.name = name
        self._trie = RoutedPrefixTrie(capacity=None)
        self._rotation = 0

    def choose(self, request: Request, candidates: Sequence[WorkerState],
               matched_blocks: Sequence[int], now: float) -> int:
        ids = [w.worker_id for w in candidates]
        matched = self._trie.match(request.block_hashes, ids)
        i = argmin_rotating([-m for m in matched], self._rotation)
        self._rotation += 1
        self._trie.insert(ids[i], request.block_hashes)
        return i


class SglangCacheAwareRouter:
    """SGLang router's `cache_aware` policy: balance when imbalanced, else follow the cache.

    Source: sgl-project/sglang, `sgl-router/src/policies/cache_aware.rs`
    (`CacheAwarePolicy::select_worker`) with the defaults of
    `sgl-router/py_src/sglang_router/router_args.py` (`RouterArgs`: cache_threshold 0.3,
    balance_abs_threshold 64, balance_rel_threshold 1.5). With `load_w` the worker's in-flight
    requests:

    1. imbalanced, `max load - min load > balance_abs_threshold` and
       `max load > balance_rel_threshold * min load`: the least-loaded worker;
    2. else, with the approximate tree's longest match over all workers and match rate =
       matched tokens / input tokens: if the rate > cache_threshold, the worker holding that
       longest match; otherwise the worker with the *smallest tree* ("most available cache
       capacity"), not the least loaded one;
    3. in either case the prompt is inserted into the tree under the chosen worker.

    Mapping to this prefill pool: `load_w` = `outstanding_requests` (queued + running; a request
    leaves when its prefill finishes, as the router's counter drops when the response ends). The
    tree is the router's own (routing-time inserts, `RoutedPrefixTrie`, blocks instead of
    characters), bounded per worker by LRU eviction of leaves at `max_tree_blocks`; the source
    evicts every `eviction_interval_secs` down to `max_tree_size` characters, here eviction is
    immediate and the default bound is the worker's KV capacity in blocks. Ties (several
    holders of the longest match, equal loads or tree sizes; arbitrary map order in the source)
    use the rotating tie-break.

    Args:
      cache_threshold: match rate above which the cache decides, in [0, 1].
      balance_abs_threshold: load difference (requests) above which the pool may be imbalanced,
        >= 0.
      balance_rel_threshold: load ratio above which the pool may be imbalanced, >= 1.
      max_tree_blocks: per-worker tree bound in blocks (>= 1); None = the worker's
        `kv_capacity_blocks`.

    Raises:
      ValueError: an argument outside the range above.
    """

    def __init__(self, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5, max_tree_blocks: int | None = None,
                 name: str = "sglang-cache-aware") -> None:
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        if not balance_abs_threshold >= 0:
            raise ValueError(f"balance_abs_threshold must be >= 0 requests, "
                             f"got {balance_abs_threshold}")
        if not balance_rel_threshold >= 1.0:
            raise ValueError(f"balance_rel_threshold must be >= 1, got {balance_rel_threshold}")
        if max_tree_blocks is not None and max_tree_blocks < 1:
            raise ValueError(f"max_tree_blocks must be >= 1 or None, got {max_tree_blocks}")
        self.cache_threshold = float(cache_threshold)
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = float(balance_rel_threshold)
        self.max_tree_blocks = max_tree_blocks
        self.name = name
        self._kv_capacity: dict[int, int] = {}
        self._trie = RoutedPrefixTrie(capacity=self._tree_capacity)
        self._rotation = 0

    def _tree_capacity(self, worker_id: int) -> int:
        if self.max_tree_blocks is not None:
            return self.max_tree_blocks
        return self._kv_capacity[worker_id]

    def imbalanced(self, loads: Sequence[int]) -> bool:
        """The source's imbalance test on per-worker in-flight request counts."""
        hi, lo = max(loads), min(loads)
        return hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo

    def choose(self, request: Request, candidates: Sequence[WorkerState],
               matched_blocks: Sequence[int], now: float) -> int:
        ids = [w.worker_id for w in candidates]
        for w in candidates:
            self._kv_capacity[w.worker_id] = w.spec.kv_capacity_blocks
        start = self._rotation
        self._rotation += 1
        loads = [w.outstanding_requests for w in candidates]
        if self.imbalanced(loads):
            i = argmin_rotating(loads, start)
        else:
            matched = self._trie.match(request.block_hashes, ids)
            best = max(matched)
            rate = min(best * request.block_size, request.input_len) / request.input_len
            if rate > self.cache_threshold:
                i = argmin_rotating([-m for m in matched], start)
            else:
                i = argmin_rotating([self._trie.size(w) for w in ids], start)
        self._trie.insert(ids[i], request.block_hashes)
        return i
