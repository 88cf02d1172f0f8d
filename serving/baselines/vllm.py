"""vLLM production-stack's prefix-aware router (`prefixaware` routing logic).

Plain Python over plain data; `now` is passed in, never read from a clock.
"""

from __future__ import annotations

from collections.abc import Sequence

from serving.baselines.common import RoutedPrefixTrie, argmin_rotating
from serving.policy.request import Request
from serving.policy.worker import WorkerState


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
