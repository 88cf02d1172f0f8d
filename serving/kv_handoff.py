"""The live backend's side of the P/D hand-off: pin a prompt's KV, read it, release it.

`KVHandOff` works on the `LiveBackend`'s workers and their locks. Its rule: a device-resident
hold changes only under its worker's lock (the lock every prefill, copy and re-carve of that
worker takes), and the registry's own lock (`KVHolds.lock`) is always taken after a worker's,
never before. So a pull that races a split either reads the pinned blocks before the re-carve
or the host copy the re-carve made (`offload`); never a half-moved pool.

Reads and releases block for up to one prefill (the worker's lock): call them from a thread
(`asyncio.to_thread`), never on the event loop.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping

import numpy as np

from serving.kv_hold import HoldGone, KVHold, KVHolds, release_each
from vertumnus_jax import release_request

_log = logging.getLogger(__name__)


class KVHandOff:
    """Holds of one `LiveBackend`.

    Args:
      holds: the registry (`KVHolds`; its `hold_seconds` is the hold time).
      workers, locks: the backend's worker id -> `vertumnus_jax.Worker` and -> lock maps (read
        live: re-carves replace entries).
      clock: seconds on the backend's clock.

    Attributes:
      wanted: request id -> hold id, for admitted requests that asked for a hold (the engine
        fills it before submitting; entries of requests that never ran are dropped by it).
    """

    def __init__(self, holds: KVHolds, workers: Mapping, locks: Mapping,
                 clock: Callable[[], float]):
        self.holds, self._workers, self._locks, self._clock = holds, workers, locks, clock
        self.wanted: dict[object, str] = {}

    # ----------------------------------------------------------- under the worker's lock
    def pin(self, worker_id: int, worker, request, result) -> str | None:
        """After a prefill: keeps `result`'s blocks as a hold if its request asked for one and
        its reservation still stands. Returns the hold id, or None (the caller releases)."""
        hold_id = self.wanted.pop(request.request_id, None)
        if hold_id is None:
            return None
        now = self._clock()
        hold = KVHold(hold_id, worker_id, worker.cp_degree, worker.device_ids,
                      worker.block_size, tuple(int(b) for b in result.block_ids),
                      request.input_len, now, now + self.holds.hold_seconds, handle=result)
        try:
            self.holds.add(hold)
        except KeyError:  # the request was withdrawn meanwhile: nobody will pull it
            return None
        return hold_id

    def preempt_oldest(self, worker_id: int, worker) -> bool:
        """Releases the worker's oldest answered hold (a prefill needs its blocks). False if
        none."""
        holds = self.holds.on_worker(worker_id, issued_only=True)
        if not holds:
            return False
        _log.warning("KV hold %r released early: a prefill on worker %d needed its %d blocks",
                     holds[0].hold_id, worker_id, len(holds[0].block_ids))
        self._free(worker, self.holds.pop(holds[0].hold_id, "preempted"))
        return True

    def offload(self, worker_id: int, worker) -> int:
        """Before a re-carve: copies each of the worker's holds to host memory and releases its
        blocks (the re-carve wants an idle worker). Returns how many were offloaded."""
        holds = self.holds.on_worker(worker_id)
        for hold in holds:
            k, v = _read(worker, hold)
            with self.holds.lock:
                handle, hold.handle, hold.host, hold.worker_id = hold.handle, None, (k, v), None
                self.holds.offloaded += 1
            release_request(worker, handle)
        return len(holds)

    @staticmethod
    def _free(worker, hold: KVHold) -> None:
        if hold.handle is not None:
            release_request(worker, hold.handle)

    # ----------------------------------------------------------- from any thread
    def read(self, hold_id: str, release: bool) -> tuple[np.ndarray, np.ndarray, KVHold]:
        """The hold's KV, `[layers, num_tokens, kv_heads, head_dim]` K and V (numpy, natural
        token order), and the hold; with `release`, the hold ends (reason `pulled`).

        Raises:
          HoldGone: it ended already (reason attached); KeyError: unknown id.
        """
        with self._hold_lock(hold_id) as (hold, worker):
            k, v = hold.host if hold.host is not None else _read(worker, hold)
            if release:
                self._free(worker, self.holds.pop(hold_id, "pulled"))
            return k, v, hold

    def release(self, hold_id: str, reason: str = "released") -> KVHold:
        """Ends the hold: its full blocks return to the worker's LRU, its partial block is
        freed. Raises as `read`."""
        with self._hold_lock(hold_id) as (hold, worker):
            self._free(worker, self.holds.pop(hold_id, reason))
            return hold

    def release_quietly(self, hold_ids, reason: str) -> int:
        """`release` of each id that is still held; returns how many were."""
        return release_each(self.release, hold_ids, reason)

    def issue(self, hold_ids) -> None:
        """The holds' ids are being answered: preemptable from now on (`KVHolds.issue`)."""
        self.holds.issue(hold_ids)

    def expire(self, now: float) -> int:
        """Releases every hold whose time passed at `now`; returns how many."""
        return self.release_quietly(self.holds.expired(now), "expired")

    @contextlib.contextmanager
    def _hold_lock(self, hold_id: str):
        """Yields `(hold, worker)` with the hold's worker locked (worker None for a host-resident
        hold); the hold is looked up again under the lock."""
        for _ in range(8):  # a re-carve moves a hold at most once: a retry or two suffices
            hold = self.holds.get(hold_id)
            if hold.worker_id is None:
                yield hold, None
                return
            wid = hold.worker_id
            lock = self._locks.get(wid)
            if lock is None:  # re-carved meanwhile: the hold is on the host now
                continue
            with lock:
                again = self.holds.get(hold_id)
                if again.worker_id != wid:
                    continue
                yield again, self._workers[wid]
                return
        raise RuntimeError(f"KV hold {hold_id!r} names worker {hold.worker_id}, which is gone")


def _read(worker, hold: KVHold) -> tuple[np.ndarray, np.ndarray]:
    k, v = worker.pool.read_sequence(hold.block_ids)
    return k[:, :hold.num_tokens], v[:, :hold.num_tokens]


__all__ = ["KVHandOff", "HoldGone"]
