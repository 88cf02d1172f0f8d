"""Which worker holds which cached block: the scheduler's view of the workers' prefix caches.

Built from the workers' KV events (insertions and evictions), as vLLM's KV-event stream feeds
its router. Blocks are keyed by their chain hash, so "worker w holds block k of request r"
implies (for caches that evict leaves first) that it holds blocks 0..k-1 as well; the match
walk below nevertheless stops at the first missing block, so a stray block never counts.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class PrefixIndex:
    """Map from block hash to the set of workers that hold that block.

    Costs: `insert`/`evict` O(blocks); `match_blocks` O(matched blocks + workers).
    """

    __slots__ = ("_holders", "_counts")

    def __init__(self) -> None:
        self._holders: dict[int, set[int]] = {}
        self._counts: dict[int, int] = {}

    def register_worker(self, worker_id: int, cp_degree: int) -> None:
        """Declares a worker and its CP degree (unused here; `GlobalPrefixTrie` keeps it)."""

    def insert(self, worker_id: int, block_hashes: Iterable[int]) -> None:
        """Records that `worker_id` now holds each block of `block_hashes`."""
        holders = self._holders
        added = 0
        for h in block_hashes:
            s = holders.get(h)
            if s is None:
                holders[h] = {worker_id}
                added += 1
            elif worker_id not in s:
                s.add(worker_id)
                added += 1
        self._counts[worker_id] = self._counts.get(worker_id, 0) + added

    def evict(self, worker_id: int, block_hashes: Iterable[int]) -> None:
        """Records that `worker_id` no longer holds each block (unknown blocks are ignored)."""
        holders = self._holders
        removed = 0
        for h in block_hashes:
            s = holders.get(h)
            if s is not None and worker_id in s:
                s.discard(worker_id)
                removed += 1
                if not s:
                    del holders[h]
        if removed:
            self._counts[worker_id] -= removed

    def drop_worker(self, worker_id: int) -> list[int]:
        """Forgets every block of `worker_id` (the worker left the pool); returns those blocks."""
        blocks = [h for h, s in self._holders.items() if worker_id in s]
        self.evict(worker_id, blocks)
        self._counts.pop(worker_id, None)
        return blocks

    def num_blocks(self, worker_id: int) -> int:
        """Blocks `worker_id` holds."""
        return self._counts.get(worker_id, 0)

    def holders(self, block_hash: int) -> frozenset[int]:
        """Workers holding `block_hash`."""
        return frozenset(self._holders.get(block_hash, ()))

    def match_blocks(self, block_hashes: Sequence[int], max_blocks: int,
                     worker_ids: Sequence[int]) -> list[int]:
        """Longest cached leading run of `block_hashes` on each worker.

        Args:
          block_hashes: the request's hash chain.
          max_blocks: cap on the match (a request's `max_cacheable_blocks`).
          worker_ids: workers to report, in order.

        Returns:
          `matched[i]`: the number of leading blocks (<= max_blocks) `worker_ids[i]` holds.
        """
        holders = self._holders
        limit = min(max_blocks, len(block_hashes))
        if limit == 0 or block_hashes[0] not in holders:
            return [0] * len(worker_ids)  # fast path: nobody holds the first block
        result = dict.fromkeys(worker_ids, 0)
        alive = set(worker_ids)
        k = 0
        while alive and k < limit:
            s = holders.get(block_hashes[k])
            if s is None:
                break
            if not alive <= s:
                for w in alive - s:
                    result[w] = k
                alive &= s
            k += 1
        for w in alive:
            result[w] = k
        return [result[w] for w in worker_ids]

    def global_match_blocks(self, block_hashes: Sequence[int], max_blocks: int) -> int:
        """Longest leading run of `block_hashes` held by *some* worker (not necessarily one)."""
        holders = self._holders
        limit = min(max_blocks, len(block_hashes))
        k = 0
        while k < limit and block_hashes[k] in holders:
            k += 1
        return k

    def __len__(self) -> int:
        return len(self._holders)


class PendingPrefixes:
    """Blocks that workers *will* hold once the prefills queued on them have run.

    A worker runs its queue in FIFO order, so a request placed behind another one with the
    same prefix finds that prefix cached when it starts. Routing on cached blocks alone misses
    this: under load, requests that share a new prefix arrive before its first prefill has
    finished and get spread over many workers, each recomputing (and caching) the same prefix.
    Counting promised blocks keeps them together, as SGLang's router does by inserting a prompt
    into its tree at routing time. Reference-counted per (block, worker).
    """

    __slots__ = ("_count",)

    def __init__(self) -> None:
        self._count: dict[int, dict[int, int]] = {}

    def add(self, worker_id: int, block_hashes: Iterable[int]) -> None:
        count = self._count
        for h in block_hashes:
            per = count.get(h)
            if per is None:
                count[h] = {worker_id: 1}
            else:
                per[worker_id] = per.get(worker_id, 0) + 1

    def remove(self, worker_id: int, block_hashes: Iterable[int]) -> None:
        """Drops one promise of each block (the prefill ended or the request moved)."""
        count = self._count
        for h in block_hashes:
            per = count[h]
            n = per[worker_id] - 1
            if n:
                per[worker_id] = n
            else:
                del per[worker_id]
                if not per:
                    del count[h]

    def extend_matches(self, block_hashes: Sequence[int], max_blocks: int,
                       worker_ids: Sequence[int], matched: list[int]) -> list[int]:
        """`matched` raised, per worker, to the leading run of blocks cached *or promised*.

        A promised block continues a cached run: the match walks from each worker's cached
        match on while the worker is promised the next block.
        """
        count = self._count
        limit = min(max_blocks, len(block_hashes))
        out = list(matched)
        if not count or limit == 0:
            return out
        for i, w in enumerate(worker_ids):
            k = out[i]
            while k < limit:
                per = count.get(block_hashes[k])
                if per is None or w not in per:
                    break
                k += 1
            out[i] = k
        return out

    def __len__(self) -> int:
        return len(self._count)
