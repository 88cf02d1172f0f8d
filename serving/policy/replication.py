"""Prefix replication and reclamation, execution side (paper section 7).

A copy moves only the blocks the destination lacks; the destination's replica becomes visible in
the prefix index only when the backend reports the copy complete (`PrefixCopies.finish`). A
reclamation frees a worker's copy of a prefix tail; it disappears from the index only when the
backend confirms (`PrefixCopies.finish_reclaim`). The policy choosing *what* to copy or free is
`serving.policy.cache_manager.PrefixCacheManager`.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Sequence

from serving.policy.worker import WorkerStatus


@dataclasses.dataclass(frozen=True)
class Replication:
    """A prefix copy in flight.

    Attributes:
      src, dst: worker ids (source holds the whole chain; destination lacks `chain[start:]`).
      chain: block hashes from the root to the prefix's tip.
      start: index of the first block the destination lacks (blocks before it are retained).
      block_size: tokens per block.
      started: seconds.
      reason: "inter-degree" or "intra-degree" (the prefix-cache manager's), or
        "request-transfer" (a router's plan to fetch a request's prefix, Mooncake's Conductor).
      request_id: for "request-transfer", the request whose prefill waits for the copy: the
        backends start that prefill only once the copy ends, or a worker of it is lost
        (`serving.fetch_wait`).
    """

    src: int
    dst: int
    chain: tuple[int, ...]
    start: int
    block_size: int
    started: float
    reason: str
    request_id: str | int | None = None

    @property
    def num_blocks(self) -> int:
        """Blocks moved."""
        return len(self.chain) - self.start


REASONS = ("inter-degree", "intra-degree", "request-transfer")


def copy_seconds(blocks: int, block_size: int, kv_bytes_per_token: int,
                 gb_per_s: float) -> float:
    """Seconds to copy `blocks` KV blocks of `block_size` tokens between workers:
    `blocks * block_size * kv_bytes_per_token / (gb_per_s * 1e9)`; 0 when `gb_per_s` is 0
    (free copies). The one formula routers price copies with and the simulator charges."""
    if gb_per_s <= 0:
        return 0.0
    return blocks * block_size * kv_bytes_per_token / (gb_per_s * 1e9)


# Default bandwidth of a KV copy between workers of different hosts, GB/s per direction: one
# 200 Gb/s NIC (NVIDIA ConnectX-6 HDR InfiniBand / 200GbE, 200 Gb/s = 25 GB/s), or half of a
# 400 Gb/s ConnectX-7 NIC that the copy shares with the KV hand-off to the decode pool
# (`eval.sim.backend.SimConfig.kv_transfer_gb_per_s`, 50 GB/s). Within a host copies go over
# NVLink (the callers' `gb_per_s`, 100 GB/s by default).
SCALEOUT_GB_PER_S = 25.0


def link_gb_per_s(src_host: int, dst_host: int, gb_per_s: float,
                  scaleout_gb_per_s: float = SCALEOUT_GB_PER_S) -> float:
    """Bandwidth of a KV copy from a worker on `src_host` to one on `dst_host`, GB/s:
    `gb_per_s` (intra-host, NVLink) when the hosts are equal, else `scaleout_gb_per_s` (the
    scale-out network, `--scaleout_gb_per_s`). Give the result to `copy_seconds` (0 = free)."""
    return gb_per_s if src_host == dst_host else scaleout_gb_per_s


def check_transfer_args(kv_bytes_per_token, transfer_gb_per_s) -> None:
    """Validates a router's KV-copy pricing: an integer number of bytes per token >= 0 and a
    finite bandwidth >= 0 GB/s (0 = free copies). Raises ValueError naming the field."""
    if isinstance(kv_bytes_per_token, bool) or not (
            isinstance(kv_bytes_per_token, int) and kv_bytes_per_token >= 0):
        raise ValueError(f"kv_bytes_per_token must be an integer >= 0 bytes, got "
                         f"{kv_bytes_per_token!r}")
    if not (isinstance(transfer_gb_per_s, (int, float)) and math.isfinite(transfer_gb_per_s)
            and transfer_gb_per_s >= 0):
        raise ValueError(f"transfer_gb_per_s must be a finite number >= 0 GB/s, got "
                         f"{transfer_gb_per_s!r}")


class PrefixCopies:
    """Prefix copies in flight and reclamations pending, and their logs (paper section 7).

    The collaborator `serving.policy.scheduler.Scheduler` holds as `scheduler.copies`; the one
    owner of this state. It reads the scheduler's workers and prefix index (the same objects,
    not copies) and asks the backend to copy or free blocks.

    Args:
      workers: the scheduler's workers by id (read only here).
      prefix_index: the scheduler's block-holder index (`serving.policy.prefix_index`).
      backend: runs copies and reclamations (`Backend.replicate`, `Backend.reclaim`).

    Attributes:
      in_flight: copies started and not finished, by (destination, prefix tip hash).
      failed: one dict per copy given up because its source or destination was lost (src,
        dst, blocks, reason, started, failed, error); such a copy never changes the index.
      reclaims: reclamations asked for and not confirmed, by (worker, prefix tip hash): start
        time in seconds.
      log: one dict per finished copy (src, dst, blocks, reason, started, finished); the
        last `log_limit` of them (None: all).
      reclaim_log: one dict per confirmed reclamation (worker, blocks, time); the last
        `log_limit`.
      num_copies, num_reclaims: finished copies and confirmed reclamations, all of them.
    """

    def __init__(self, workers, prefix_index, backend, log_limit: int | None = None) -> None:
        self._workers = workers
        self._index = prefix_index
        self._backend = backend
        self.in_flight: dict[tuple[int, int], Replication] = {}
        self.reclaims: dict[tuple[int, int], float] = {}
        self.log: list[dict] | deque[dict] = [] if log_limit is None else deque(maxlen=log_limit)
        self.reclaim_log: list[dict] | deque[dict] = ([] if log_limit is None
                                                      else deque(maxlen=log_limit))
        self.num_copies = self.num_reclaims = 0
        self.failed: list[dict] = []
        self._dropped: dict[int, Replication] = {}  # id(copy) -> copy given up (`drop_workers`)
        self._dropped_reclaims: set[tuple[int, int]] = set()

    def begin(self, src: int, dst: int, chain: Sequence[int], block_size: int, now: float,
              reason: str = "intra-degree", request_id: str | int | None = None) -> Replication:
        """Starts copying the prefix `chain` from `src` to `dst` (only the missing blocks).

        `request_id` names the request whose prefill waits for the copy (reason
        "request-transfer"); None for copies no prefill waits for.

        Raises:
          ValueError: (nothing changed) src == dst, an unknown or non-ACTIVE destination, a
            source that does not hold the whole chain, a destination that already holds it,
            a copy of this prefix to `dst` already in flight, an unknown reason, or a
            `request_id` given without reason "request-transfer" (or that reason without one).
          NotImplementedError: (nothing changed) the backend does not copy between workers.
        """
        if src == dst:
            raise ValueError(f"src and dst are both worker {src}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
        if reason not in REASONS:
            raise ValueError(f"reason must be one of {REASONS}, got {reason!r}")
        if (request_id is not None) != (reason == "request-transfer"):
            raise ValueError(f"request_id must be given exactly for reason 'request-transfer', "
                             f"got reason={reason!r}, request_id={request_id!r}")
        if not math.isfinite(now):
            raise ValueError(f"now must be finite, got {now}")
        w = self._workers.get(dst)
        if w is None or w.status is not WorkerStatus.ACTIVE:
            raise ValueError(f"destination worker {dst} is not an ACTIVE worker of the pool")
        chain = tuple(chain)
        if not chain:
            raise ValueError("chain must name at least one block")
        have_src, have_dst = self._index.match_blocks(chain, len(chain), [src, dst])
        if have_src < len(chain):
            raise ValueError(f"source worker {src} holds only {have_src} of {len(chain)} blocks")
        if have_dst == len(chain):
            raise ValueError(f"destination worker {dst} already holds the prefix")
        key = (dst, chain[-1])
        if key in self.in_flight:
            raise ValueError(f"a copy of this prefix to worker {dst} is already in flight")
        rep = Replication(src, dst, chain, have_dst, block_size, now, reason, request_id)
        self.in_flight[key] = rep
        try:
            self._backend.replicate(rep, now)
        except BaseException:
            del self.in_flight[key]  # the backend did not take the copy: nothing in flight
            raise
        return rep

    def fetch_for_request(self, request, dst: int, max_blocks: int, now: float
                          ) -> Replication | None:
        """Copies to `dst` the longest leading run of `request`'s blocks (at most `max_blocks`,
        and at most its cacheable blocks) that another worker of the pool holds, when that is
        longer than what `dst` holds: a copy for that request (reason "request-transfer"; the
        backend holds the request's prefill until it is done). The source is the
        holder of the longest run (the lowest worker id among equals).

        Returns:
          The copy started, or None: nothing longer to fetch, or the scheduler or backend
          refused the copy (a copy of that prefix to `dst` already in flight, a destination
          that is not ACTIVE, a backend without copies); nothing changed then.
        """
        limit = min(max_blocks, (request.input_len - 1) // request.block_size)
        others = sorted(w for w in self._workers if w != dst)
        if limit <= 0 or not others:
            return None
        held = self._index.match_blocks(request.block_hashes, limit, [dst, *others])
        best = max(held[1:])
        if best <= held[0]:
            return None
        workers = self._workers
        host = workers[dst].spec.host if dst in workers else None
        holders = [w for w, h in zip(others, held[1:]) if h == best]
        src = holders[0] if len(holders) == 1 else min(
            holders, key=lambda w: (workers[w].spec.host != host, w))
        try:
            return self.begin(src, dst, request.block_hashes[:best], request.block_size, now,
                              reason="request-transfer", request_id=request.request_id)
        except (ValueError, NotImplementedError):
            return None

    def finish(self, rep: Replication, now: float, inserted: Sequence[int],
               evicted: Sequence[int]) -> None:
        """The backend finished a copy: the destination's new blocks become visible.

        `inserted` / `evicted` are the destination cache's changes. A destination that left the
        pool meanwhile (split or merge) is ignored.

        A copy given up because a worker of it was lost (`drop_workers`) is ignored: the
        backend's caller must not apply its blocks (`is_dropped`).

        Raises:
          ValueError: no such copy is in flight.
        """
        if self._dropped.pop(id(rep), None) is not None:
            return
        if self.in_flight.pop((rep.dst, rep.chain[-1]), None) is None:
            raise ValueError(f"no copy of that prefix to worker {rep.dst} is in flight")
        if rep.dst in self._workers:
            if evicted:
                self._index.evict(rep.dst, evicted)
            if inserted:
                self._index.insert(rep.dst, inserted)
        self.num_copies += 1
        self.log.append({"src": rep.src, "dst": rep.dst, "blocks": rep.num_blocks,
                         "reason": rep.reason, "started": rep.started, "finished": now})

    def begin_reclaim(self, worker_id: int, chain: Sequence[int], now: float) -> None:
        """Asks the backend to free `worker_id`'s copy of the prefix tail `chain`.

        Raises:
          ValueError: an unknown worker, or a reclamation of this prefix there already pending.
        """
        if worker_id not in self._workers:
            raise ValueError(f"worker {worker_id} is not in the pool")
        if not chain:
            raise ValueError("chain must name at least one block")
        key = (worker_id, chain[-1])
        if key in self.reclaims:
            raise ValueError(f"a reclamation of this prefix on worker {worker_id} is pending")
        self.reclaims[key] = now
        self._backend.reclaim(worker_id, tuple(chain), now)

    def finish_reclaim(self, worker_id: int, chain: Sequence[int], now: float,
                       evicted: Sequence[int]) -> None:
        """The backend confirmed a reclamation: the freed blocks leave the index.

        A reclamation on a worker lost meanwhile (`drop_workers`) is ignored.

        Raises:
          ValueError: no such reclamation is pending.
        """
        if chain and (worker_id, chain[-1]) in self._dropped_reclaims:
            self._dropped_reclaims.discard((worker_id, chain[-1]))
            return
        if not chain or self.reclaims.pop((worker_id, chain[-1]), None) is None:
            raise ValueError(f"no reclamation of that prefix on worker {worker_id} is pending")
        if worker_id in self._workers and evicted:
            self._index.evict(worker_id, evicted)
        self.num_reclaims += 1
        self.reclaim_log.append({"worker": worker_id, "blocks": len(evicted), "time": now})

    def is_dropped(self, rep: Replication) -> bool:
        """Whether `rep` was given up (`drop_workers`): its blocks must not be applied."""
        return id(rep) in self._dropped

    def drop_workers(self, worker_ids, now: float, error: str) -> int:
        """Workers left the pool at once (their host died, `serving.policy.membership`): every
        copy in flight to or from one of them ends as failed (logged in `failed`; the backend's
        later `finish` for it is ignored and the index does not change), and reclamations
        pending on them are dropped (a later `finish_reclaim` is ignored).

        Returns:
          The copies given up.
        """
        gone = set(worker_ids)
        dropped = [(k, r) for k, r in self.in_flight.items() if r.src in gone or r.dst in gone]
        for key, rep in dropped:
            del self.in_flight[key]
            self._dropped[id(rep)] = rep
            self.failed.append({"src": rep.src, "dst": rep.dst, "blocks": rep.num_blocks,
                                "reason": rep.reason, "started": rep.started, "failed": now,
                                "error": error})
        for key in [k for k in self.reclaims if k[0] in gone]:
            del self.reclaims[key]
            self._dropped_reclaims.add(key)
        return len(dropped)


_PRUNE_FLOOR = 256  # plans kept before the first pruning (`FetchOnDispatch._prune`)


class FetchOnDispatch:
    """A router's per-request prefix fetches, made when each request is dispatched.

    A router that plans to fetch a request's prefix from another worker (Mooncake's Conductor,
    `serving.policy.fetch_router`) records the plan at routing time (`plan`); when the request leaves
    its worker's queue the scheduler's dispatch hook starts the copy
    (`PrefixCopies.fetch_for_request`: the longest prefix any other worker holds *then*, only
    the blocks the worker lacks), and the backend holds the prefill until the copy is done
    (the simulator, and the live backends: `serving.fetch_wait`). So TTFT = queue + transfer +
    prefill, as Mooncake's Algorithm 1 estimates it, and the fetched blocks are not evicted
    while the request waits in the queue.

    Attributes:
      started: copies started for requests.
      skipped: planned fetches not made (nothing longer to fetch by then, the request ran
        elsewhere, or the scheduler or backend refused the copy).
    """

    def __init__(self) -> None:
        self.started = self.skipped = 0
        self._plans: dict = {}  # request id -> (worker id, blocks wanted)
        self._prune_at = _PRUNE_FLOOR
        self._scheduler = None

    def attach(self, scheduler) -> None:
        """Hooks into `scheduler` (a no-op for schedulers without dispatch hooks)."""
        if hasattr(scheduler, "dispatch_hooks") and hasattr(scheduler, "copies"):
            self._scheduler = scheduler
            scheduler.dispatch_hooks.append(self._on_dispatch)

    def plan(self, request, worker_id: int, blocks: int) -> None:
        """Records that `request`, placed on `worker_id`, should have its first `blocks` blocks
        fetched when it starts (a later plan for the same request replaces it)."""
        if self._scheduler is not None:
            self._plans[request.request_id] = (worker_id, blocks)
            if len(self._plans) > self._prune_at:
                self._prune(request.request_id)

    def _prune(self, keep) -> None:
        """Forgets the plans of requests queued on no worker (aborted, or failed, before they
        started: no dispatch pops their plan), but `keep`'s (being placed). Called when the
        plans double past the last count: O(1) amortized per plan, memory bounded by twice
        the queued requests."""
        queued = {r.request_id for w in self._scheduler.workers.values() for r in w.queue}
        queued.add(keep)
        self._plans = {rid: p for rid, p in self._plans.items() if rid in queued}
        self._prune_at = max(_PRUNE_FLOOR, 2 * len(self._plans))

    def cancel(self, request) -> None:
        """Forgets `request`'s plan, if any (it was routed again and fetches nothing now)."""
        if self._plans:
            self._plans.pop(request.request_id, None)

    def _on_dispatch(self, request, worker_id: int, now: float) -> None:
        plan = self._plans.pop(request.request_id, None)
        if plan is None:
            return
        rep = (self._scheduler.copies.fetch_for_request(request, worker_id, plan[1], now)
               if plan[0] == worker_id else None)
        if rep is None:
            self.skipped += 1
        else:
            self.started += 1

