"""SGLang router's `cache_aware` policy.

Plain Python over plain data; `now` is passed in, never read from a clock.
"""

from __future__ import annotations

from collections.abc import Sequence

from serving.baselines.common import RoutedPrefixTrie, argmin_rotating
from serving.policy.request import Request
from serving.policy.worker import WorkerState


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
