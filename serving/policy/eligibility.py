"""Which workers can take a request, and how much of its prompt each one already caches.

`eligible_workers` is the scheduler's first step for every placement (`Scheduler.eligible`):
only status, length and KV capacity exclude a worker; a cache miss never does.
"""

from __future__ import annotations

from collections.abc import Iterable

from serving.policy.prefix_index import PendingPrefixes, PrefixIndex
from serving.policy.request import Request
from serving.policy.worker import WorkerState, WorkerStatus


def eligible_workers(workers: Iterable[WorkerState], index: PrefixIndex,
                     pending: PendingPrefixes | None, request: Request, with_global: bool
                     ) -> tuple[list[WorkerState], list[int], int, list[int]]:
    """ACTIVE workers able to hold `request`, each one's matched leading blocks, and the
    request's global match.

    Args:
      workers: the pool's workers.
      index: the cluster's block-holder index.
      pending: blocks promised by queued prefills (counted as held), or None to ignore them.
      request: the request to place.
      with_global: also return the blocks of the request's prefix held by *some* worker
        (`PrefixIndex.global_match_blocks`, one pass over the index); else 0.

    Returns:
      `(candidates, matched blocks per candidate, global blocks, cached blocks per candidate)`,
      the last without `pending`'s promises (the same list as the second when `pending` is
      None); `([], [], 0, [])` when no ACTIVE worker has `max_input_len >= input_len` and
      enough KV blocks.
    """
    n = request.input_len
    need = -(-n // request.block_size)
    active = WorkerStatus.ACTIVE
    candidates = [w for w in workers if w.status is active and n <= w.spec.max_input_len
                  and need <= w.spec.kv_capacity_blocks]
    ids = [w.spec.worker_id for w in candidates]
    if not candidates:
        return candidates, [], 0, []
    hashes, limit = request.block_hashes, (n - 1) // request.block_size  # max_cacheable_blocks
    if not with_global:
        matched, global_blocks = index.match_blocks(hashes, limit, ids), 0
    elif hasattr(index, "match_blocks_and_global"):  # `PrefixIndex` and subclasses
        matched, global_blocks = index.match_blocks_and_global(hashes, limit, ids)
    else:
        matched = index.match_blocks(hashes, limit, ids)
        global_blocks = index.global_match_blocks(hashes, limit)
    if pending is None:
        return candidates, matched, global_blocks, matched
    return candidates, pending.extend_matches(hashes, limit, ids, matched), global_blocks, matched
