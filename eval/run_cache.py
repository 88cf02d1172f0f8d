"""A worker's local prefix cache in the simulator, kept as runs of blocks.

The same LRU as `eval.local_cache.LocalPrefixCache` (vLLM-style prefix caching: full blocks
only, a hit is the longest leading run of cached blocks, a request's blocks are touched from
the last to the first so ancestors stay more recent than descendants), block for block: the
same hits, evictions, insertions and recency order after every call (tests check it against
a plain reference). It stores what the LRU order looks like in practice instead of one entry
per block: runs of consecutive blocks of one hash chain that sit together in the LRU order,
deepest block oldest, as a radix tree's nodes do (SGLang's radix cache evicts LRU leaf nodes).
A prefill's touch, insertion and eviction then cost a few operations per run instead of
several per block, and a block's cached children need no per-block count: a block has one when
it is not the last of its run or when another run hangs off it.

Precondition: block hashes are hash chains (`serving.request.chain_block_hashes`): a block's
hash names its whole prefix, so it determines its parent, and no chain repeats a hash.
`LocalPrefixCache` needs neither. Here `begin`, `finish`, `insert_chain` and `reclaim_suffix`
raise `ValueError` before changing anything when a chain they are given contradicts the cached
blocks or repeats a hash; `adopt` takes its `(hash, parent)` pairs as given.
"""

from __future__ import annotations

from collections.abc import Sequence, Set as AbstractSet

from eval.local_cache import ancestor_order


class _Run:
    """Consecutive blocks of one chain, root side first; `parent` is the first one's parent.
    In the LRU order they sit together, the last (deepest) one least recent."""

    __slots__ = ("blocks", "parent", "rid")

    def __init__(self, blocks: tuple[int, ...], parent: int | None, rid: int) -> None:
        self.blocks, self.parent, self.rid = blocks, parent, rid


def _not_a_chain(what: str) -> ValueError:
    return ValueError(f"block hashes are not a hash chain ({what}); RunPrefixCache needs "
                      "chain hashes (serving.request.chain_block_hashes), LocalPrefixCache "
                      "does not")


class RunPrefixCache:
    """LRU block cache of one worker, as runs of blocks; the interface and results of
    `eval.local_cache.LocalPrefixCache` (see the module docstring).

    Args:
      capacity_blocks: blocks the worker's KV pool holds (all ranks together), >= 1.

    Raises:
      ValueError: capacity_blocks < 1.
    """

    __slots__ = ("capacity_blocks", "_blocks", "_runs", "_heads", "_branches", "_reserved",
                 "_next_rid")

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._blocks: set[int] = set()  # every cached block (shared live with the prefix index)
        self._runs: dict[int, _Run] = {}  # run id -> run, least recently used first
        self._heads: dict[int, _Run] = {}  # first block of a run -> the run
        self._branches: dict[int, int] = {}  # hash -> runs whose first block's parent it is
        self._reserved = 0  # blocks allocated to a running prefill, not yet cached
        self._next_rid = 0

    # ------------------------------------------------------------------------------ runs
    def _new_run(self, blocks: tuple[int, ...], parent: int | None) -> None:
        run = _Run(blocks, parent, self._next_rid)
        self._next_rid += 1
        self._runs[run.rid] = run  # the most recent
        self._heads[blocks[0]] = run
        if parent is not None:
            branches = self._branches
            branches[parent] = branches.get(parent, 0) + 1

    def _drop_run(self, run: _Run) -> None:
        del self._runs[run.rid]
        del self._heads[run.blocks[0]]
        self._unbranch(run.parent)

    def _unbranch(self, parent: int | None) -> None:
        if parent is not None:
            branches = self._branches
            c = branches[parent] - 1
            if c:
                branches[parent] = c
            else:
                del branches[parent]

    def _move_to_end(self, run: _Run) -> None:
        runs = self._runs
        del runs[run.rid]
        runs[run.rid] = run

    def _cut_head(self, run: _Run, j: int) -> None:
        """Takes the first `j` blocks (0 < j < len) out of `run`; the rest keeps its place."""
        blocks = run.blocks
        del self._heads[blocks[0]]
        self._unbranch(run.parent)
        run.blocks, run.parent = blocks[j:], blocks[j - 1]
        self._heads[blocks[j]] = run
        branches = self._branches
        branches[blocks[j - 1]] = branches.get(blocks[j - 1], 0) + 1

    def _touch_chain(self, chain: tuple[int, ...], m: int, insert_from: int) -> list[int]:
        """Makes the cached blocks of `chain[:m]` the most recent, deepest first (as touching
        them from the last to the first does), after inserting the missing ones at positions
        >= `insert_from`; missing ones before it stay missing. Returns the inserted hashes,
        deepest first. Nothing changes when it raises.

        Raises:
          ValueError: `chain` is not a hash chain (module docstring).
        """
        cached, heads = self._blocks, self._heads
        cuts: list[tuple[_Run, int]] = []  # (run, j): its first j blocks move
        cut_ids: set[int] = set()
        bulk = gap = False  # tried inserting the rest at once; met a missing block before it
        missing: list[tuple[int, int]] = []  # [a, b) positions to insert
        segments: list[tuple[int, int]] = []  # [a, b) positions that end up as one run
        start, k = -1, 0
        while k < m:
            h = chain[k]
            if h in cached:
                # A cached block is the first of its run here: its run's previous block would
                # be its parent, chain[k - 1], which this walk has passed (or is missing).
                run = heads.get(h)
                if run is None or run.parent != (chain[k - 1] if k else None) or run.rid in cut_ids:
                    raise _not_a_chain(f"block {h} at position {k}")
                cut_ids.add(run.rid)
                blocks = run.blocks
                span = min(len(blocks), m - k)
                if blocks[:span] == chain[k:k + span]:
                    j = span
                else:  # the chain leaves the run (a branch): the rest of the run stays
                    j = 1
                    while blocks[j] == chain[k + j]:
                        j += 1
                cuts.append((run, j))
                if start < 0:
                    start = k
                k += j
            elif k >= insert_from:
                if start < 0:
                    start = k
                a = k
                if not bulk and cached.isdisjoint(chain[k:m]):  # usual: all the rest is new
                    k = m
                else:
                    bulk = True
                    k += 1
                    while k < m and chain[k] not in cached:
                        k += 1
                missing.append((a, k))
            else:  # a gap (evicted since the prefill began): the run of cached blocks ends
                gap = True
                if start >= 0:
                    segments.append((start, k))
                    start = -1
                k += 1
        if start >= 0:
            segments.append((start, m))
        inserted: list[int] = []
        for a, b in missing:
            inserted.extend(chain[a:b])
        if gap and inserted and len(set(chain[:m])) != m:  # a missing hash repeated at a gap
            raise _not_a_chain("a hash repeats")
        if inserted:
            n = len(cached)
            cached.update(inserted)
            if len(cached) - n != len(inserted):  # a hash repeats: undo
                cached.difference_update(inserted)
                raise _not_a_chain("a hash repeats")
        for run, j in cuts:
            if j == len(run.blocks):
                self._drop_run(run)
            else:
                self._cut_head(run, j)
        for a, b in reversed(segments):  # the deepest run least recent
            self._new_run(chain[a:b], chain[a - 1] if a else None)
        inserted.reverse()
        return inserted

    def _evict_lru(self, n: int) -> list[int]:
        runs, evicted = self._runs, []
        while n > 0 and runs:
            run = next(iter(runs.values()))  # the least recent run: its last blocks go first
            blocks = run.blocks
            if len(blocks) <= n:
                evicted.extend(blocks[::-1])
                n -= len(blocks)
                self._drop_run(run)
            else:
                evicted.extend(blocks[:-n - 1:-1])
                run.blocks = blocks[:-n]
                n = 0
        self._blocks.difference_update(evicted)
        return evicted

    def _append(self, items: Sequence[tuple[int, int | None]]) -> None:
        """Adds `(hash, parent)` items not cached yet as the most recent, in the given order
        (least recent first), grouped into runs."""
        cached = self._blocks
        run: list[int] = []  # deepest first
        top_parent = None
        for h, parent in items:
            if h in cached:
                continue
            cached.add(h)
            if run and top_parent == h:
                run.append(h)
            else:
                if run:
                    self._new_run(tuple(reversed(run)), top_parent)
                run = [h]
            top_parent = parent
        if run:
            self._new_run(tuple(reversed(run)), top_parent)

    def _rebuild(self, items: Sequence[tuple[int, int | None]]) -> None:
        self._blocks.clear()  # in place: the prefix index holds this set
        self._runs.clear()
        self._heads.clear()
        self._branches.clear()
        self._append(items)

    # ------------------------------------------------------------------------- interface
    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._blocks

    def block_view(self) -> AbstractSet[int]:
        """The cached block hashes as a live set (for `PrefixIndex.share_blocks`; read it, do
        not change it): it follows every later insertion and eviction."""
        return self._blocks

    @property
    def free_blocks(self) -> int:
        """Blocks neither cached nor reserved by a running prefill."""
        return self.capacity_blocks - len(self._blocks) - self._reserved

    def match(self, block_hashes: Sequence[int], max_blocks: int) -> int:
        """Longest leading run of `block_hashes` (at most `max_blocks`) held here; no side effect."""
        cached, k = self._blocks, 0
        limit = min(max_blocks, len(block_hashes))
        while k < limit and block_hashes[k] in cached:
            k += 1
        return k

    def begin(self, block_hashes: Sequence[int], max_blocks: int, total_blocks: int) -> tuple[int, list[int]]:
        """Starts a prefill; as `LocalPrefixCache.begin`.

        Raises:
          ValueError: `total_blocks` exceeds the capacity, or the hashes are not a chain
            (nothing changed).
        """
        if total_blocks > self.capacity_blocks:
            raise ValueError(
                f"request needs {total_blocks} KV blocks, more than the worker's "
                f"capacity_blocks={self.capacity_blocks}")
        if type(block_hashes) is not tuple:
            block_hashes = tuple(block_hashes)
        cached, hit = self._blocks, 0
        limit = min(max_blocks, len(block_hashes))
        while hit < limit and block_hashes[hit] in cached:
            hit += 1
        if hit:
            run = self._heads.get(block_hashes[0])
            if run is not None and run.blocks == block_hashes[:hit] and run.parent is None:
                self._move_to_end(run)  # the hit is one run (the usual case)
            else:
                self._touch_chain(block_hashes, hit, hit)
        need = total_blocks - hit
        over = len(cached) + self._reserved + need - self.capacity_blocks
        evicted = self._evict_lru(over) if over > 0 else []
        self._reserved += need
        return hit, evicted

    def finish(self, block_hashes: Sequence[int], hit_blocks: int, full_blocks: int,
               total_blocks: int) -> list[int]:
        """Ends a prefill; as `LocalPrefixCache.finish` (returns the inserted hashes, deepest
        first)."""
        if type(block_hashes) is not tuple:
            block_hashes = tuple(block_hashes)
        if 0 < hit_blocks <= full_blocks:
            # The usual case: the hit is still the one run `begin` made of it and none of the
            # new blocks is cached: the run grows by them and becomes the most recent.
            run = self._heads.get(block_hashes[0])
            new = block_hashes[hit_blocks:full_blocks]
            cached = self._blocks
            if (run is not None and run.blocks == block_hashes[:hit_blocks]
                    and run.parent is None and cached.isdisjoint(new)):
                n = len(cached)
                cached.update(new)
                if len(cached) - n != len(new):  # a hash repeats: undo
                    cached.difference_update(new)
                    raise _not_a_chain("a hash repeats")
                run.blocks = block_hashes[:full_blocks]
                self._move_to_end(run)
                self._reserved -= total_blocks - hit_blocks
                return list(new[::-1])
        inserted = self._touch_chain(block_hashes, max(full_blocks, hit_blocks), hit_blocks)
        self._reserved -= total_blocks - hit_blocks
        return inserted

    def evict_blocks(self, block_hashes: Sequence[int]) -> list[int]:
        """Drops the given blocks if present; returns those that were present. O(cached
        blocks): the simulator does not use it."""
        out, drop = [], set()
        for h in block_hashes:
            if h in self._blocks and h not in drop:
                drop.add(h)
                out.append(h)
        if out:
            self._rebuild([item for item in self.blocks() if item[0] not in drop])
        return out

    def insert_chain(self, chain: Sequence[int]) -> tuple[list[int], list[int]]:
        """Adds a copied prefix; as `LocalPrefixCache.insert_chain`."""
        if len(chain) > self.capacity_blocks - self._reserved:
            return [], []
        chain = tuple(chain)
        inserted = self._touch_chain(chain, len(chain), 0)
        over = len(self._blocks) + self._reserved - self.capacity_blocks
        return inserted, self._evict_lru(over) if over > 0 else []

    def reclaim_suffix(self, chain: Sequence[int]) -> list[int]:
        """Drops the cached tail of `chain` that no other cached prefix depends on; as
        `LocalPrefixCache.reclaim_suffix` (the evicted hashes, deepest first).

        Raises:
          ValueError: `chain` contradicts the cached blocks (nothing changed).
        """
        chain = tuple(chain)
        cached, heads, branches = self._blocks, self._heads, self._branches
        plan: list[tuple[_Run, int]] = []  # (run, t): keep its first t + 1 blocks (-1: none)
        dropped_parent = None  # the parent of the run the plan drops last (one branch fewer)
        i = len(chain) - 1
        while i >= 0 and chain[i] in cached:
            j = i  # the run holding block i starts at the last run head at or before it
            while chain[j] not in heads:
                j -= 1
                if j < 0 or chain[j] not in cached:
                    raise _not_a_chain(f"block {chain[i]} at position {i}")
            run = heads[chain[j]]
            blocks, o = run.blocks, i - j
            if (o >= len(blocks) or blocks[:o + 1] != chain[j:i + 1]
                    or run.parent != (chain[j - 1] if j else None)):
                raise _not_a_chain(f"block {chain[i]} at position {i}")
            others = branches.get(chain[i], 0) - (chain[i] == dropped_parent)
            if o != len(blocks) - 1 or others > 0:
                break  # a cached child: the next block of its run, or another run
            t = o - 1  # drop leaves from the run's end while they have no other run hanging off
            while t >= 0 and blocks[t] not in branches:
                t -= 1
            plan.append((run, t))
            if t >= 0:
                break
            dropped_parent = run.parent
            i = j - 1  # the run's parent, if cached, is the last block of another run
        evicted: list[int] = []
        for run, t in plan:
            blocks = run.blocks
            evicted.extend(reversed(blocks[t + 1:]))
            cached.difference_update(blocks[t + 1:])
            if t >= 0:
                run.blocks = blocks[:t + 1]
            else:
                self._drop_run(run)
        return evicted

    def restore_ancestor_order(self) -> None:
        """Reorders the LRU so every cached parent is more recent than its cached children
        (`eval.local_cache.ancestor_order`). O(n log n)."""
        self._rebuild(ancestor_order(self.blocks()))

    def blocks(self) -> list[tuple[int, int | None]]:
        """`(hash, parent hash)` of every cached block, least recently used first."""
        out = []
        for run in self._runs.values():
            blocks = run.blocks
            for i in range(len(blocks) - 1, 0, -1):
                out.append((blocks[i], blocks[i - 1]))
            out.append((blocks[0], run.parent))
        return out

    def adopt(self, blocks: Sequence[tuple[int, int | None]]) -> list[int]:
        """Adds blocks as the most recent; as `LocalPrefixCache.adopt` (returns the evicted)."""
        self._append(blocks)
        over = len(self._blocks) + self._reserved - self.capacity_blocks
        return self._evict_lru(over) if over > 0 else []
