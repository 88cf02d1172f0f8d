"""Global prefix-cache manager: replicate and reclaim prefixes across workers and degrees.

A periodic scan over the global trie's demand statistics (paper section 7) plans, per prefix
tip z and CP degree C:

- **inter-degree replication**: no worker of degree C holds z (`ReplicaCount(z, C) == 0`) and
  requests routed to degree C missed at least `min_missed_tokens` of z since the last scan ->
  copy z to one worker of degree C;
- **intra-degree replication**: `access(z, C) / ReplicaCount(z, C) > intra_high` requests per
  replica per scan -> one more replica at degree C;
- **reclamation**: `ReplicaCount(z, C) >= 2` and `access(z, C) / ReplicaCount(z, C) <
  reclaim_low` -> free z's tail on the most loaded holder of degree C; where the router keeps
  live working sets (`serving.policy.live_set`, its `live`), only on a holder whose live set
  (the blocks placed on it within the horizon) is at least its KV capacity.

The last condition is ours, not the paper's. A cache evicts least recently used blocks, so while
a worker's live set fits, what its next writes evict is mostly context no placement has used
within the horizon: freeing a replica there frees little that is needed and loses a copy that
may be (a session's context on the worker it returns to: the access counts decay within
seconds, the session comes back within minutes). Where the live set does not fit, the writes
push out live context, and a replica kept elsewhere is the cheapest to give up. Two kinds of
blocks the live set does not count make that approximate: a replica this manager copied in is
cached, more recently used than older live context, yet placed by no request (a cold one is
exactly what the rule leaves in place while the live set fits), and a worker made by a split or
merge starts with an empty live set under its new id while its cache holds its predecessors'
context, so no replica is reclaimed on it for up to one horizon. Measured on the comparison
(`eval.paper`, `vertumnus` against `vertumnus-nocache` at each load; eval/RESULTS.md item 16):
with the paper's rule the manager cost the agent sessions up to 9.8 % mean TTFT below the
highest load, and with this one it is neutral there; the reclaims under pressure kept the
Mooncake long documents' gain from the manager (up to 2.8 %).

A copy sends only the blocks the destination lacks, to the worker of degree C with the longest
retained ancestor path of z, then enough free blocks, then the shortest copy, then the lowest
load (outstanding seconds). Its source is, per destination, a holder of all of z on the
destination's host when there is one (its copy runs at the intra-host bandwidth, not the
scale-out one: `serving.policy.replication.link_gb_per_s`), then the least loaded. At most `max_actions` actions per scan; then demand counts decay by `decay`.
"""

from __future__ import annotations

import dataclasses

from serving.policy.checks import require_finite
from serving.policy.cost_router import live_set_of
from serving.policy.prefix_trie import GlobalPrefixTrie
from serving.policy.replication import SCALEOUT_GB_PER_S, check_transfer_args, link_gb_per_s
from serving.policy.worker import WorkerStatus


@dataclasses.dataclass(frozen=True)
class CacheManagerConfig:
    """Thresholds of the prefix-cache manager (module docstring); times in seconds.

    Raises:
      ValueError: naming the field, for a value out of range.
    """

    scan_interval_s: float = 5.0
    decay: float = 0.5
    min_missed_tokens: float = 8192.0
    intra_high: float = 16.0
    reclaim_low: float = 0.25
    max_actions: int = 8
    min_blocks: int = 2

    def __post_init__(self) -> None:
        require_finite(self, ("scan_interval_s", "decay", "min_missed_tokens", "intra_high", "reclaim_low"))
        if not isinstance(self.max_actions, int) or not isinstance(self.min_blocks, int):
            raise ValueError("max_actions and min_blocks must be integers")
        if not self.scan_interval_s > 0:
            raise ValueError(f"scan_interval_s must be > 0, got {self.scan_interval_s}")
        if not 0 <= self.decay < 1:
            raise ValueError(f"decay must be in [0, 1), got {self.decay}")
        if not 0 <= self.reclaim_low < self.intra_high:
            raise ValueError(f"need 0 <= reclaim_low < intra_high, got {self.reclaim_low}, {self.intra_high}")
        if self.max_actions < 0 or self.min_blocks < 1 or self.min_missed_tokens < 0:
            raise ValueError("max_actions >= 0, min_blocks >= 1 and min_missed_tokens >= 0 required")


class PrefixCacheManager:
    """The periodic scan; `attach(scheduler)` registers it as a tick hook.

    The scheduler's prefix index must be a `GlobalPrefixTrie`. `actions` logs every planned
    action (time, kind, tip depth, degree, workers, blocks).

    Args:
      config: `CacheManagerConfig`.
      copy_gb_per_s, scaleout_gb_per_s: bandwidths (GB/s, >= 0, 0 = free) of a copy within a
        host and across hosts, to rank destinations by copy time (the simulator's defaults).

    Raises:
      ValueError: a bandwidth out of range.
    """

    def __init__(self, config: CacheManagerConfig = CacheManagerConfig(),
                 copy_gb_per_s: float = 100.0,
                 scaleout_gb_per_s: float = SCALEOUT_GB_PER_S) -> None:
        check_transfer_args(0, copy_gb_per_s)
        check_transfer_args(0, scaleout_gb_per_s)
        self.config = config
        self.bandwidths = (float(copy_gb_per_s), float(scaleout_gb_per_s))
        self.actions: list[dict] = []
        self._next_scan = 0.0

    def attach(self, scheduler) -> None:
        if not isinstance(scheduler.prefix_index, GlobalPrefixTrie):
            raise ValueError("PrefixCacheManager needs the scheduler's prefix_index to be a GlobalPrefixTrie")
        scheduler.tick_hooks.append(self.tick)
        self._next_scan = self.config.scan_interval_s

    def tick(self, scheduler, now: float) -> None:
        if now < self._next_scan:
            return
        self._next_scan = now + self.config.scan_interval_s
        self.scan(scheduler, now)
        scheduler.prefix_index.decay(self.config.decay)

    def scan(self, scheduler, now: float) -> int:
        """Plans and starts at most `max_actions` actions; returns how many started."""
        cfg, trie = self.config, scheduler.prefix_index
        active = [w for w in scheduler.workers.values() if w.status is WorkerStatus.ACTIVE]
        degrees = sorted({w.cp_degree for w in active})
        started = 0
        candidates = []
        tips = trie.tips()
        replicas = {c: trie.replica_counts(tips, c) for c in degrees}  # ReplicaCount(z, C)
        access, missed, none = trie.access.get, trie.missed.get, {}
        min_missed, high, low = cfg.min_missed_tokens, cfg.intra_high, cfg.reclaim_low
        per_degree = [(c, replicas[c].get) for c in degrees]
        for tip in tips:
            acc, miss = access(tip, none), missed(tip, none)
            for c, replica in per_degree:
                r = replica(tip, 0)
                a = acc.get(c, 0.0)
                m = miss.get(c, 0.0)
                if r == 0 and m > 0 and m >= min_missed:
                    candidates.append((-m, "inter-degree", tip, c))
                elif r >= 1 and a / r > high:
                    candidates.append((-a / r, "intra-degree", tip, c))
                elif r >= 2 and a / r < low:
                    candidates.append((a / r, "reclaim", tip, c))
        for _, kind, tip, c in sorted(candidates, key=lambda x: (x[0], x[1], x[3])):
            if started >= cfg.max_actions:
                break
            chain = trie.chain(tip)
            if len(chain) < cfg.min_blocks:
                continue
            if kind == "reclaim":
                ok = self._reclaim(scheduler, chain, c, now)
            else:
                ok = self._replicate(scheduler, chain, c, kind, now)
            started += ok
        return started

    def _replicate(self, scheduler, chain, c, kind, now) -> bool:
        trie = scheduler.prefix_index
        holders = [w for w in trie.holders(chain[-1]) if w in scheduler.workers]
        whole = [w for w, m in zip(holders, trie.match_blocks(chain, len(chain), holders))
                 if m == len(chain)]  # a copy's source must hold the whole prefix
        if not whole:
            return False
        workers = scheduler.workers
        load = {w: workers[w].outstanding_seconds(now) for w in whole}
        by_host = {}  # host -> the source its destinations copy from (same host first)
        for w in sorted(whole, key=lambda w: (load[w], w)):
            by_host.setdefault(workers[w].spec.host, w)
        first = min(whole, key=lambda w: (load[w], w))  # for a host without a holder
        dests = [w for w in scheduler.workers.values()
                 if w.status is WorkerStatus.ACTIVE and w.cp_degree == c and w.worker_id not in holders
                 and (w.worker_id, chain[-1]) not in scheduler.copies.in_flight]
        if not dests:
            return False
        retained = trie.match_blocks(chain, len(chain), [w.worker_id for w in dests])
        best = None
        for w, keep in zip(dests, retained):
            free = w.spec.kv_capacity_blocks - trie.num_blocks(w.worker_id)
            if free < len(chain) - keep:
                continue
            src = by_host.get(w.spec.host, first)
            bw = link_gb_per_s(workers[src].spec.host, w.spec.host, *self.bandwidths)
            key = (-keep, (len(chain) - keep) / bw if bw > 0 else 0.0,
                   w.outstanding_seconds(now), w.worker_id)
            if best is None or key < best[0]:
                best = (key, w, src)
        if best is None:
            return False
        _, dst, src = best
        rep = scheduler.copies.begin(src, dst.worker_id, chain, trie.block_size, now, kind)
        self.actions.append({"time": now, "kind": kind, "depth": len(chain), "cp_degree": c,
                             "src": src, "dst": rep.dst, "blocks": rep.num_blocks})
        return True

    def _reclaim(self, scheduler, chain, c, now) -> bool:
        trie = scheduler.prefix_index
        holders = [w for w in trie.holders_at(chain[-1], c) if w in scheduler.workers
                   and (w, chain[-1]) not in scheduler.copies.reclaims]
        if len(holders) < 2:
            return False
        workers, live = scheduler.workers, live_set_of(scheduler.router)
        if live is not None:  # the live set does not fit (module doc)
            holders = [w for w in holders
                       if live.size(w, now) >= workers[w].spec.kv_capacity_blocks]
            if not holders:
                return False
        victim = max(holders, key=lambda w: (workers[w].outstanding_seconds(now), w))
        scheduler.copies.begin_reclaim(victim, chain, now)
        self.actions.append({"time": now, "kind": "reclaim", "depth": len(chain), "cp_degree": c,
                             "worker": victim})
        return True
