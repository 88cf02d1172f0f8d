"""The global prefix trie: which worker holds which cached prefix, and how much each is wanted.

Nodes are blocks identified by their chain hash (block k's hash names the whole prefix up to
block k, `serving.policy.request`), so the trie is stored flat: from `PrefixIndex`, the blocks each
worker holds; and for each node with demand statistics, the hash chain of a request that
reached it (a reference to that request's hash tuple, no copy), which gives the node's path from
the root. Per node it keeps (paper section 7):

- replica holders (worker ids) and `ReplicaCount(z, C)`: holders of z whose CP degree is C;
- access counts per degree: requests whose global match ended at z and that were routed to a
  worker of degree C;
- missed benefit per degree: tokens a request could have reused (its global match at z) but did
  not, because no worker of the degree the router chose held z.

Counts are kept at the *tip* of each request's global match (the deepest matched node), where a
replica decision is taken; `decay` ages them so demand stays recent. Only the tips seen since the
last `decay` are scanned by the cache manager (`serving.policy.cache_manager`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from serving.policy.prefix_index import PrefixIndex, count_elements
from serving.policy.request import Request


class GlobalPrefixTrie(PrefixIndex):
    """`PrefixIndex` plus trie structure, worker degrees and per-node demand statistics."""

    __slots__ = ("_paths", "_degree", "access", "missed", "global_tokens", "reused_tokens",
                 "block_size")

    def __init__(self) -> None:
        super().__init__()
        # tip -> (hash chain of a request whose global match ended there, index of the tip)
        self._paths: dict[int, tuple[Sequence[int], int]] = {}
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

    def chain(self, block_hash: int) -> list[int]:
        """The hashes from the root to the tip `block_hash` (inclusive).

        Raises:
          KeyError: `block_hash` is not a tip with demand statistics (`tips()`).
        """
        hashes, i = self._paths[block_hash]
        return list(hashes[:i + 1])

    def replica_count(self, block_hash: int, cp_degree: int) -> int:
        """`ReplicaCount(z, C)`: workers of degree C holding block z."""
        degree = self._degree
        n = 0
        for w, s in self._blocks.items():
            if block_hash in s and degree.get(w) == cp_degree:
                n += 1
        return n

    def replica_counts(self, block_hashes: Iterable[int], cp_degree: int) -> dict[int, int]:
        """`ReplicaCount(z, C)` of many blocks at once: {z: count}, blocks held by no worker of
        degree C left out. O(sum over those workers of min(their blocks, len(block_hashes)))."""
        if not isinstance(block_hashes, (set, frozenset)):
            block_hashes = set(block_hashes)
        out: dict[int, int] = {}
        degree = self._degree
        for w, s in self._blocks.items():
            if degree.get(w) == cp_degree:
                count_elements(out, s & block_hashes)  # a set or a shared view (`share_blocks`)
        return out

    def holders_at(self, block_hash: int, cp_degree: int) -> list[int]:
        """Workers of degree C holding block z, sorted by id."""
        degree = self._degree
        return sorted(w for w, s in self._blocks.items()
                      if block_hash in s and degree.get(w) == cp_degree)

    # --------------------------------------------------------------------------- statistics
    def record(self, request: Request, cp_degree: int, global_blocks: int, reused_blocks: int) -> None:
        """Counts one routed request (called by the scheduler after routing).

        Args:
          request: the request (its chain gives the path of its tip).
          cp_degree: degree of the worker the router chose.
          global_blocks: leading blocks of the request held by *some* worker.
          reused_blocks: leading blocks held by the chosen worker.
        """
        bs = self.block_size = request.block_size
        self.global_tokens += global_blocks * bs
        self.reused_tokens += reused_blocks * bs
        if global_blocks == 0:
            return
        hashes = request.block_hashes
        tip = hashes[global_blocks - 1]
        if tip not in self._paths:
            self._paths[tip] = (hashes, global_blocks - 1)
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
        """Multiplies every count by `factor` (in [0, 1)); drops counts below `floor`, and the
        paths of tips left without counts."""
        for table in (self.access, self.missed):
            emptied = []
            for tip, per in table.items():
                if len(per) == 1:  # the usual case, one degree: no list copies
                    ((c, v),) = per.items()
                    v *= factor
                    if v < floor:
                        emptied.append(tip)
                    else:
                        per[c] = v
                    continue
                for c in list(per):
                    per[c] *= factor
                    if per[c] < floor:
                        del per[c]
                if not per:
                    emptied.append(tip)
            for tip in emptied:
                del table[tip]
        paths, access, missed = self._paths, self.access, self.missed
        for tip in [t for t in paths if t not in access and t not in missed]:
            del paths[tip]

    def tips(self) -> list[int]:
        """Nodes with demand statistics (the cache manager's scan set), in a stable order."""
        return sorted(self.access.keys() | self.missed.keys())
