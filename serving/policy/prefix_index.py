"""Which worker holds which cached block: the scheduler's view of the workers' prefix caches.

Built from the workers' KV events (insertions and evictions), as vLLM's KV-event stream feeds
its router. Blocks are keyed by their chain hash, so "worker w holds block k of request r"
implies (for caches that evict leaves first) that it holds blocks 0..k-1 as well; the match
walk below nevertheless stops at the first missing block, so a stray block never counts.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence, Set as AbstractSet

try:  # the C loop behind `collections.Counter.update`: counts an iterable into a dict
    from collections import _count_elements as count_elements
except ImportError:  # pragma: no cover (Python builds without the C helper)
    def count_elements(mapping: dict, iterable: Iterable) -> None:
        """`mapping[x] += 1` for each x of `iterable` (missing keys start at 0)."""
        get = mapping.get
        for x in iterable:
            mapping[x] = get(x, 0) + 1


class PrefixIndex:
    """Which worker holds which block: one set of block hashes per worker.

    Per-worker sets make a worker's KV events bulk set operations (`insert` / `evict` run at C
    speed, and the vertumnus simulator applies tens of them per request), while a match walks
    only the workers that hold the request's first block.

    Costs: `insert`/`evict` O(blocks); `match_blocks` O(workers + matched blocks);
    `global_match_blocks` O(all workers + matched blocks); `holders` O(workers).

    A backend that runs in the scheduler's process and applies each worker's KV events to the
    index in the same call as to the worker's cache (the simulator) may instead `share_blocks`:
    the index then reads that worker's live block set and ignores its `insert` / `evict`, the
    same contents at every call without a second copy to update.
    """

    __slots__ = ("_blocks", "_shared")

    def __init__(self) -> None:
        # worker id -> hashes of the blocks it holds (a set, or a shared live view)
        self._blocks: dict[int, AbstractSet[int]] = {}
        self._shared: set[int] = set()  # workers whose entry is a shared view (`share_blocks`)

    def share_blocks(self, worker_id: int, blocks: AbstractSet[int]) -> None:
        """From now on `worker_id`'s blocks are `blocks`, a live set-like view its owner keeps
        current (e.g. `dict.keys()` of the worker's cache); `insert` and `evict` for the worker
        are then no-ops, until `drop_worker`.

        Raises:
          TypeError: `blocks` is not a set-like container (`collections.abc.Set`).
          ValueError: the index holds blocks for the worker that `blocks` does not equal (the
            view would silently change what the index reports).
        """
        if not isinstance(blocks, AbstractSet):
            raise TypeError(f"blocks must be a set-like view (collections.abc.Set, e.g. "
                            f"dict.keys()), got {type(blocks).__name__}")
        held = self._blocks.get(worker_id)
        if held is not None and held != blocks:
            raise ValueError(f"worker {worker_id}: the shared blocks differ from the blocks the "
                             f"index holds for it ({len(blocks)} shared, {len(held)} held)")
        self._blocks[worker_id] = blocks
        self._shared.add(worker_id)

    def register_worker(self, worker_id: int, cp_degree: int) -> None:
        """Declares a worker and its CP degree (unused here; `GlobalPrefixTrie` keeps it)."""

    def insert(self, worker_id: int, block_hashes: Iterable[int]) -> None:
        """Records that `worker_id` now holds each block of `block_hashes`."""
        s = self._blocks.get(worker_id)
        if s is None:
            self._blocks[worker_id] = set(block_hashes)
        elif worker_id not in self._shared:
            s.update(block_hashes)

    def evict(self, worker_id: int, block_hashes: Iterable[int]) -> None:
        """Records that `worker_id` no longer holds each block (unknown blocks are ignored)."""
        s = self._blocks.get(worker_id)
        if s is not None and worker_id not in self._shared:
            s.difference_update(block_hashes)

    def drop_worker(self, worker_id: int) -> list[int]:
        """Forgets every block of `worker_id` (the worker left the pool); returns those blocks."""
        self._shared.discard(worker_id)
        return list(self._blocks.pop(worker_id, ()))

    def num_blocks(self, worker_id: int) -> int:
        """Blocks `worker_id` holds."""
        s = self._blocks.get(worker_id)
        return len(s) if s is not None else 0

    def holders(self, block_hash: int) -> frozenset[int]:
        """Workers holding `block_hash`."""
        return frozenset(w for w, s in self._blocks.items() if block_hash in s)

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
        limit = min(max_blocks, len(block_hashes))
        out = [0] * len(worker_ids)
        if limit == 0:
            return out
        first = block_hashes[0]
        get = self._blocks.get
        for i, w in enumerate(worker_ids):
            s = get(w)
            if s is not None and first in s:
                k = 1
                while k < limit and block_hashes[k] in s:
                    k += 1
                out[i] = k
        return out

    def global_match_blocks(self, block_hashes: Sequence[int], max_blocks: int) -> int:
        """Longest leading run of `block_hashes` held by *some* worker (not necessarily one):
        block k counts when any worker holds it, whichever worker held blocks before it."""
        return self.match_blocks_and_global(block_hashes, max_blocks, ())[1]

    def match_blocks_and_global(self, block_hashes: Sequence[int], max_blocks: int,
                                worker_ids: Sequence[int]) -> tuple[list[int], int]:
        """`(match_blocks(...), global_match_blocks(...))` in one pass over the workers.

        The global run is at least the longest run of a single worker; from there on it
        continues while any worker holds the next block.
        """
        limit = min(max_blocks, len(block_hashes))
        out = [0] * len(worker_ids)
        if limit == 0:
            return out, 0
        first = block_hashes[0]
        blocks = self._blocks
        get = blocks.get
        k = found = 0
        for i, w in enumerate(worker_ids):
            s = get(w)
            if s is None:
                continue
            found += 1
            if first in s:
                j = 1
                while j < limit and block_hashes[j] in s:
                    j += 1
                out[i] = j
                if j > k:
                    k = j
        if found < len(blocks):  # workers not asked about also count for the global run
            asked = set(worker_ids)
            for w, s in blocks.items():
                if w not in asked and first in s:
                    j = 1
                    while j < limit and block_hashes[j] in s:
                        j += 1
                    if j > k:
                        k = j
        if k == 0:
            return out, 0
        sets = blocks.values()
        while k < limit:
            h = block_hashes[k]
            for s in sets:
                if h in s:
                    break
            else:
                break
            k += 1
        return out, k

    def __len__(self) -> int:
        """Distinct blocks held by at least one worker."""
        return len(set().union(*self._blocks.values()))


_LIST_MAX = 8  # promise groups a worker keeps as a list before counting per block


class PendingPrefixes:
    """Blocks that workers *will* hold once the prefills queued on them have run.

    Under FCFS a worker runs its queue in order, so a request placed behind another one with
    the same prefix finds that prefix cached when it starts (under SJF it usually does too, but
    not always: `serving.policy.queue_order`). Routing on cached blocks alone misses
    this: under load, requests that share a new prefix arrive before its first prefill has
    finished and get spread over many workers, each recomputing (and caching) the same prefix.
    Counting promised blocks keeps them together, as SGLang's router does by inserting a prompt
    into its tree at routing time.

    `add` and `remove` take a request's leading blocks: a hash chain from the root
    (`serving.policy.request`), each hash naming its whole prefix; `remove` gives back the blocks of
    one earlier `add`. A worker's promises are kept as the list of its groups (one per `add`)
    while it has at most `_LIST_MAX` of them (its running request and a few queued ones, the
    usual case): adding and removing is O(1), and since a chain hash names its prefix, block k
    of a request is promised exactly when a group holds the same hash at position k. Past
    that, they are reference-counted per block: the set of promised blocks (bulk set
    operations, C speed) plus the promises beyond the first of blocks promised more than once
    (a shared system prompt); a repeated hash is counted exactly, on a slower path.
    """

    __slots__ = ("_extra", "_groups", "_held")

    def __init__(self) -> None:
        # A worker's promises are kept one of two ways: as the list of its promise groups (the
        # hash chains given to `add`) while it has at most `_LIST_MAX` of them, the usual case
        # (its running and a few queued requests): add and remove are then O(1); beyond that,
        # counted per block.
        self._groups: dict[int, list[tuple[int, ...]]] = {}
        self._held: dict[int, set[int]] = {}  # worker id -> blocks promised at least once
        self._extra: dict[int, dict[int, int]] = {}  # worker id -> {block: promises - 1 (>0)}

    def add(self, worker_id: int, block_hashes: Iterable[int]) -> None:
        """Adds one promise of each block on `worker_id` (a request was placed there)."""
        if not isinstance(block_hashes, tuple):
            block_hashes = tuple(block_hashes)
        if not block_hashes:
            return
        if worker_id not in self._held:
            groups = self._groups.get(worker_id)
            if groups is None:
                self._groups[worker_id] = [block_hashes]
                return
            if len(groups) < _LIST_MAX:
                groups.append(block_hashes)
                return
            del self._groups[worker_id]  # too many groups: count per block from now on
            for group in groups:
                self._add_counted(worker_id, group)
        self._add_counted(worker_id, block_hashes)

    def _add_counted(self, worker_id: int, block_hashes: tuple[int, ...]) -> None:
        held = self._held.get(worker_id)
        if held is None:
            self._held[worker_id] = set(block_hashes)
            if len(self._held[worker_id]) != len(block_hashes):  # a repeated hash
                self._held[worker_id] = set()
                self._add_slow(worker_id, self._held[worker_id], block_hashes)
            return
        again = held.intersection(block_hashes)  # promised already: one more promise each
        n = len(held)
        held.update(block_hashes)
        if len(held) - n + len(again) != len(block_hashes):  # a repeated hash in the chain
            held.difference_update(set(block_hashes) - again)  # undo, then count exactly
            self._add_slow(worker_id, held, block_hashes)
            return
        if again:
            extra = self._extra.get(worker_id)
            if extra is None:
                extra = self._extra[worker_id] = {}
            count_elements(extra, again)

    def _add_slow(self, worker_id: int, held: set[int], block_hashes: Sequence[int]) -> None:
        extra = self._extra.setdefault(worker_id, {})
        for h in block_hashes:
            if h in held:
                extra[h] = extra.get(h, 0) + 1
            else:
                held.add(h)
        if not extra:
            del self._extra[worker_id]

    def remove(self, worker_id: int, block_hashes: Iterable[int]) -> None:
        """Drops one promise of each block (the prefill ended or the request moved):
        `block_hashes` are the blocks of one earlier `add` on `worker_id`.

        Raises:
          KeyError: `worker_id` was not promised these blocks (a bookkeeping error of the
            caller).
        """
        if not isinstance(block_hashes, tuple):
            block_hashes = tuple(block_hashes)
        if not block_hashes:
            return
        groups = self._groups.get(worker_id)
        if groups is not None:
            try:
                groups.remove(block_hashes)
            except ValueError:
                raise KeyError(f"worker {worker_id} was not promised these blocks") from None
            if not groups:
                del self._groups[worker_id]
            return
        held = self._held.get(worker_id)
        if held is None:
            raise KeyError(f"worker {worker_id} holds no promises")
        extra = self._extra.get(worker_id)
        if extra is None:  # every block promised once: all of them go
            n = len(held)
            held.difference_update(block_hashes)
            if n - len(held) != len(block_hashes):
                raise KeyError(f"worker {worker_id} was not promised every block removed")
        else:
            # A hash chain's blocks promised more than once form a leading run (another
            # request shares that prefix): step through it, drop the rest in bulk.
            k, n = 0, len(block_hashes)
            while k < n and block_hashes[k] in extra:
                k += 1
            rest = block_hashes[k:]
            size = len(held)
            if extra.keys().isdisjoint(rest) and held.issuperset(rest):
                held.difference_update(rest)
                if size - len(held) == len(rest):
                    block_hashes = block_hashes[:k]  # the rest is done
                else:  # a repeated hash: undo, then one block at a time
                    held.update(rest)
            for h in block_hashes:
                c = extra.get(h)
                if c is None:
                    held.remove(h)  # KeyError when not promised
                elif c == 1:
                    del extra[h]
                else:
                    extra[h] = c - 1
            if not extra:
                del self._extra[worker_id]
        if not held:
            del self._held[worker_id]

    def extend_matches(self, block_hashes: Sequence[int], max_blocks: int,
                       worker_ids: Sequence[int], matched: list[int]) -> list[int]:
        """`matched` raised, per worker, to the leading run of blocks cached *or promised*.

        A promised block continues a cached run: the match walks from each worker's cached
        match on while the worker is promised the next block.
        """
        limit = min(max_blocks, len(block_hashes))
        out = list(matched)
        if limit == 0 or not (self._groups or self._held):
            return out
        get_groups, get_held = self._groups.get, self._held.get
        for i, w in enumerate(worker_ids):
            k = out[i]
            if k >= limit:
                continue
            groups = get_groups(w)
            if groups is not None:
                # A chain hash names its whole prefix, so block j is promised exactly when a
                # group has the same hash at position j (and then at every position before):
                # the run ends where the group that agrees longest with the request stops.
                end = k
                for group in groups:
                    if end < len(group) and group[end] == block_hashes[end]:
                        stop = min(limit, len(group))
                        end += 1
                        while end < stop and group[end] == block_hashes[end]:
                            end += 1
                        if end == limit:
                            break
                out[i] = end
                continue
            per = get_held(w)
            if per is not None and block_hashes[k] in per:
                k += 1
                while k < limit and block_hashes[k] in per:
                    k += 1
                out[i] = k
        return out

    @property
    def _count(self) -> dict[int, dict[int, int]]:
        """Promises held, {worker id: {block hash: count}} (computed; for tests)."""
        out: dict[int, dict[int, int]] = {}
        for w, groups in self._groups.items():
            per = out[w] = {}
            for group in groups:
                count_elements(per, group)
        for w, held in self._held.items():
            extra = self._extra.get(w, {})
            out[w] = {h: 1 + extra.get(h, 0) for h in held}
        return out

    def __len__(self) -> int:
        """Distinct blocks promised to at least one worker."""
        return len(set().union(*self._count.values()))
