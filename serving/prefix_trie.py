"""The global prefix trie: which worker holds which cached prefix, and how much each is wanted.

Nodes are blocks identified by their chain hash (block k's hash names the whole prefix up to
block k), so the trie is stored flat: `hash -> parent hash` plus, from `PrefixIndex`, `hash ->
holders`. Per node it keeps (paper section 7):

- replica holders (worker ids) and `ReplicaCount(z, C)`: holders of z whose CP degree is C;
- access counts per degree: requests whose global match ended at z and that were routed to a
  worker of degree C;
- missed benefit per degree: tokens a request could have reused (its global match at z) but did
  not, because no worker of the degree the router chose held z.

Counts are kept at the *tip* of each request's global match (the deepest matched node), where a
replica decision is taken; `decay` ages them so demand stays recent. Only the tips seen since the
last `decay` are scanned by the cache manager (`serving.cache_manager`).
"""

from __future__ import annotations

from collections.abc import Sequence

from serving.prefix_index import PrefixIndex
from serving.request import Request


class GlobalPrefixTrie(PrefixIndex):
    """`PrefixIndex` plus trie structure, worker degrees and per-node demand statistics."""

    __slots__ = ("_parent", "_degree", "access", "missed", "global_tokens", "reused_tokens",
                 "block_size")

    def __init__(self) -> None:
        super().__init__()
        self._parent: dict[int, int | None] = {}
        self._degree: dict[int, int] = {}
        self.access: dict[int, dict[int, float]] = {}  # tip -> {C: requests}
        self.missed: dict[int, dict[int, float]] = {}  # tip -> {C: tokens}
        self.global_tokens = 0  # sum over requests of the global match, tokens
        self.reused_tokens = 0  # sum over requests of the part reused on the chosen worker
        self.block_size = 0  # tokens per block, from the requests seen

    # --------------------------------------------------------------------------- structure
    def register_worker(self, worker_id: int, cp_degree: int) -> None:
        """Declares a worker's CP degree (before it reports blocks)."""
        self._degree[worker_id] = cp_degree

    def drop_worker(self, worker_id: int) -> list[int]:
        blocks = super().drop_worker(worker_id)
        self._degree.pop(worker_id, None)
        return blocks

    def degree_of(self, worker_id: int) -> int:
        return self._degree[worker_id]

    def learn_chain(self, block_hashes: Sequence[int]) -> None:
        """Records the parent links of a request's hash chain."""
        parent = self._parent
        prev = None
        for h in block_hashes:
            if h not in parent:
                parent[h] = prev
            prev = h

    def chain(self, block_hash: int) -> list[int]:
        """The hashes from the root to `block_hash` (inclusive), via learned parent links.

        Raises:
          KeyError: `block_hash` was never seen in a request's chain.
        """
        out = []
        h: int | None = block_hash
        parent = self._parent
        while h is not None:
            out.append(h)
            h = parent[h]
        out.reverse()
        return out

    def replica_count(self, block_hash: int, cp_degree: int) -> int:
        """`ReplicaCount(z, C)`: workers of degree C holding block z."""
        degree = self._degree
        return sum(1 for w in self._holders.get(block_hash, ()) if degree.get(w) == cp_degree)

    def holders_at(self, block_hash: int, cp_degree: int) -> list[int]:
        """Workers of degree C holding block z, sorted by id."""
        degree = self._degree
        return sorted(w for w in self._holders.get(block_hash, ()) if degree.get(w) == cp_degree)

    # --------------------------------------------------------------------------- statistics
    def record(self, request: Request, cp_degree: int, global_blocks: int, reused_blocks: int) -> None:
        """Counts one routed request (called by the scheduler after routing).

        Args:
          request: the request (its chain is learned).
          cp_degree: degree of the worker the router chose.
          global_blocks: leading blocks of the request held by *some* worker.
          reused_blocks: leading blocks held by the chosen worker.
        """
        self.learn_chain(request.block_hashes)
        bs = self.block_size = request.block_size
        self.global_tokens += global_blocks * bs
        self.reused_tokens += reused_blocks * bs
        if global_blocks == 0:
            return
        tip = request.block_hashes[global_blocks - 1]
        acc = self.access.get(tip)
        if acc is None:
            acc = self.access[tip] = {}
        acc[cp_degree] = acc.get(cp_degree, 0.0) + 1.0
        if reused_blocks < global_blocks and self.replica_count(tip, cp_degree) == 0:
            miss = self.missed.get(tip)
            if miss is None:
                miss = self.missed[tip] = {}
            miss[cp_degree] = miss.get(cp_degree, 0.0) + (global_blocks - reused_blocks) * bs

    def decay(self, factor: float, floor: float = 0.05) -> None:
        """Multiplies every count by `factor` (in [0, 1)); drops counts below `floor`."""
        for table in (self.access, self.missed):
            for tip in list(table):
                per = table[tip]
                for c in list(per):
                    per[c] *= factor
                    if per[c] < floor:
                        del per[c]
                if not per:
                    del table[tip]

    def tips(self) -> list[int]:
        """Nodes with demand statistics (the cache manager's scan set), in a stable order."""
        return sorted(set(self.access) | set(self.missed))
