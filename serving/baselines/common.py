"""Pieces shared by the baseline routers (`serving.baselines`).

- `argmin_rotating`: the least value, ties broken by a rotating start (deterministic, no bias
  toward worker 0; the rule `serving.policy.cost_router.VertumnusRouter` uses).
- `RoutedPrefixTrie`: the *approximate* prefix tree that vLLM production-stack's and SGLang's
  routers keep: it records where the router *sent* each prompt (at routing time, not from the
  workers' KV events), optionally bounded per worker by LRU eviction of leaves.
- `ActiveRequests`: per worker, the requests placed and not yet finished (tokens to prefill and
  the set of their KV blocks), as Dynamo's router tracks its "active sequences".

Plain Python over plain data; no clock (time is never needed here).
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Sequence

from serving.policy.prefix_index import PrefixIndex
from serving.policy.worker import WorkerState


def argmin_rotating(values: Sequence[float], start: int) -> int:
    """Index of the smallest value; among equal values the first at or after `start` (cyclic).

    Args:
      values: non-empty sequence of mutually comparable values (numbers, or tuples of numbers).
      start: where the cyclic scan begins (taken modulo `len(values)`).

    Raises:
      ValueError: empty `values`.
    """
    n = len(values)
    if n == 0:
        raise ValueError("values must be non-empty")
    start %= n
    best, best_v = start, values[start]
    for i in (*range(start + 1, n), *range(start)):
        if values[i] < best_v:
            best, best_v = i, values[i]
    return best


class RoutedPrefixTrie:
    """Which worker each prompt block was routed to; a router's own approximate cache view.

    Nodes are block hashes (a hash chain, so a block identifies its whole prefix); a worker
    "holds" a block once a request containing it was routed there. With `capacity(worker_id)`
    returning a block count, each worker keeps at most that many blocks, evicting the least
    recently routed first; a request's blocks are touched last-to-first, so a parent is always
    at least as recent as its children and eviction removes leaves first (SGLang's
    `evict_tenant_by_size`). With `capacity` None nothing is evicted (production-stack's
    `HashTrie`: "we assume that there is no eviction of prefix cache").

    Args:
      capacity: `worker_id -> max blocks` or None (unbounded).
    """

    def __init__(self, capacity: Callable[[int], int] | None = None) -> None:
        self._index = PrefixIndex()
        self._lru: dict[int, OrderedDict] = {}
        self._capacity = capacity

    def match(self, block_hashes: Sequence[int], worker_ids: Sequence[int]) -> list[int]:
        """Per worker, the leading blocks of `block_hashes` routed to it (all blocks, the last
        partial one included, as the source trees match whole text chunks)."""
        return self._index.match_blocks(block_hashes, len(block_hashes), worker_ids)

    def insert(self, worker_id: int, block_hashes: Sequence[int]) -> None:
        """Records that a prompt with `block_hashes` was routed to `worker_id`; evicts LRU leaves
        beyond the worker's capacity."""
        lru = self._lru.setdefault(worker_id, OrderedDict())
        new = [h for h in block_hashes if h not in lru]
        for h in reversed(block_hashes):
            lru[h] = None
            lru.move_to_end(h)
        self._index.insert(worker_id, new)
        if self._capacity is not None:
            cap = max(1, int(self._capacity(worker_id)))
            evicted = []
            while len(lru) > cap:
                evicted.append(lru.popitem(last=False)[0])
            self._index.evict(worker_id, evicted)

    def size(self, worker_id: int) -> int:
        """Blocks currently recorded for `worker_id` (SGLang's per-tenant tree size)."""
        lru = self._lru.get(worker_id)
        return len(lru) if lru is not None else 0


class ActiveRequests:
    """Per worker: requests placed and not finished, their prefill tokens and their KV blocks.

    The scheduler runs each worker's queue in FIFO order, so a worker's finished requests are
    always its oldest placements: `sync(worker)` drops the oldest entries until as many remain
    as `worker.outstanding_requests` (queued + running). Requests re-routed away from a
    draining worker leave stale entries there; a draining worker is never a candidate again.

    Blocks are reference-counted per worker, so a block shared by several active requests counts
    once (Dynamo's `ActiveSequences.unique_blocks`).
    """

    def __init__(self) -> None:
        self._entries: dict[int, deque] = {}
        self._blocks: dict[int, Counter] = {}
        self._tokens: dict[int, int] = {}

    def sync(self, worker: WorkerState) -> None:
        """Forgets `worker`'s requests that have finished (see the class docstring)."""
        wid = worker.worker_id
        entries = self._entries.get(wid)
        if not entries:
            return
        blocks = self._blocks[wid]
        while len(entries) > worker.outstanding_requests:
            tokens, hashes = entries.popleft()
            self._tokens[wid] -= tokens
            for h in hashes:
                c = blocks[h] - 1
                if c:
                    blocks[h] = c
                else:
                    del blocks[h]

    def add(self, worker_id: int, prefill_tokens: int, block_hashes: Sequence[int]) -> None:
        """Records a request placed on `worker_id` with `prefill_tokens` tokens to compute."""
        self._entries.setdefault(worker_id, deque()).append((prefill_tokens, tuple(block_hashes)))
        blocks = self._blocks.setdefault(worker_id, Counter())
        for h in block_hashes:
            blocks[h] += 1
        self._tokens[worker_id] = self._tokens.get(worker_id, 0) + prefill_tokens

    def tokens(self, worker_id: int) -> int:
        """Tokens still to prefill on `worker_id` (sum over its active requests)."""
        return self._tokens.get(worker_id, 0)

    def blocks(self, worker_id: int) -> int:
        """Distinct KV blocks of `worker_id`'s active requests."""
        b = self._blocks.get(worker_id)
        return len(b) if b is not None else 0

    def new_blocks(self, worker_id: int, block_hashes: Sequence[int]) -> int:
        """Blocks of `block_hashes` not among `worker_id`'s active blocks."""
        b = self._blocks.get(worker_id)
        if not b:
            return len(block_hashes)
        return sum(1 for h in block_hashes if h not in b)
