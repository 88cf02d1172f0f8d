"""KV holds of the P/D hand-off: prompts whose KV blocks stay pinned for the decode side.

With vLLM's disaggregated-prefill convention a request sent with `kv_transfer_params:
{"do_remote_decode": true}` keeps its prompt's KV after the prefill, until the decode side
pulls it (`GET /v1/kv/{id}`), releases it (`DELETE /v1/kv/{id}`) or the hold time passes
(vLLM's `VLLM_NIXL_ABORT_REQUEST_TIMEOUT`, our `--kv_hold_s`); then its full blocks return to
the worker's LRU (they stay cached as prefixes) and its partial last block is freed.

`KVHolds` is the registry: plain Python, thread-safe (the backend's worker threads add and
release holds, the asyncio loop reads them). A hold id is first *reserved* when the request is
admitted (so two live requests can never share one), then becomes a `KVHold` when the prefill
ends. A released id is remembered for a while (the last `RECENT_LIMIT`) so a late pull gets
"gone, and why" instead of "unknown".

How a hold ends, counted per reason in `KVHolds.released`:
  pulled    the decode side read it with `GET` (`release=true`, the default);
  released  `DELETE`;
  expired   `hold_seconds` passed;
  preempted a prefill on the same worker needed the blocks and nothing else could be evicted
            (the oldest hold whose id was already answered goes first; without this a pool full
            of pins would fail every prefill);
  failed    the request failed after its prefill (another prompt of its batch failed), so no
            decode side ever learns its id;
  host_lost the host agent holding it died (multi-host pool, `serving.ray_handoff`).
A hold on a worker that is split or merged is *offloaded* first: its KV is copied to host memory
and its blocks released, so the re-carve finds the worker idle (`KVHolds.offloaded` counts them).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Iterable, Sequence

import numpy as np

RELEASE_REASONS = ("pulled", "released", "expired", "preempted", "failed", "host_lost")
# Released hold ids remembered for 410 answers.
RECENT_LIMIT = 4096


def release_each(release, hold_ids: Iterable[str], reason: str) -> int:
    """`release(hold_id, reason)` for each id, skipping those no longer held (`KeyError`,
    `HoldGone` included); returns how many were released."""
    done = 0
    for hold_id in hold_ids:
        try:
            release(hold_id, reason)
            done += 1
        except KeyError:  # ended meanwhile
            pass
    return done


class HoldGone(KeyError):
    """The hold existed and ended; `reason` says how (one of `RELEASE_REASONS`)."""

    def __init__(self, hold_id: str, reason: str):
        super().__init__(hold_id)
        self.hold_id, self.reason = hold_id, reason


class HoldExists(ValueError):
    """A hold id is already reserved or held."""


@dataclasses.dataclass
class KVHold:
    """One prompt's held KV.

    Attributes:
      hold_id: the id the decode side pulls it by (`remote_request_id`).
      worker_id: the worker whose pool holds the blocks; None once offloaded to the host.
      cp_degree, device_ids, block_size: where and how the blocks lie (block i on rank
        `i % cp_degree`).
      block_ids: all `ceil(num_tokens / block_size)` blocks, the partial last one included.
      num_tokens: the prompt's length in tokens.
      created, expires: seconds on the backend's clock.
      handle: the backend's handle of the live request (`vertumnus_jax.RequestResult`) while
        the blocks are pinned; None once offloaded.
      host: `(k, v)` numpy `[layers, num_tokens, kv_heads, head_dim]` once offloaded.
      issued: its id was handed to the client (`KVHolds.issue`); only then may a prefill that
        needs the blocks preempt it (a hold nobody has heard of yet must not vanish).
    """

    hold_id: str
    worker_id: int | None
    cp_degree: int
    device_ids: tuple[int, ...]
    block_size: int
    block_ids: tuple[int, ...]
    num_tokens: int
    created: float
    expires: float
    handle: object | None = None
    host: tuple[np.ndarray, np.ndarray] | None = None
    issued: bool = False


class KVHolds:
    """The thread-safe registry of KV holds.

    Args:
      hold_seconds: how long a hold lasts without a pull or release, > 0 seconds.

    Raises:
      ValueError: `hold_seconds` not a finite number > 0.
    """

    def __init__(self, hold_seconds: float):
        if not (np.isfinite(hold_seconds) and hold_seconds > 0):
            raise ValueError(f"hold_seconds must be a finite number > 0, got {hold_seconds}")
        self.hold_seconds = float(hold_seconds)
        self.lock = threading.RLock()
        self._holds: dict[str, KVHold] = {}
        self._reserved: set[str] = set()
        self._recent: collections.OrderedDict[str, str] = collections.OrderedDict()
        self.created = 0
        self.offloaded = 0
        self.released = collections.Counter({r: 0 for r in RELEASE_REASONS})

    def __len__(self) -> int:
        with self.lock:
            return len(self._holds)

    def reserve(self, hold_ids: Sequence[str]) -> None:
        """Reserves ids for requests about to be admitted; all or none.

        Raises:
          HoldExists: an id is reserved or held already, or repeated in `hold_ids`.
        """
        with self.lock:
            taken = [h for h in hold_ids if h in self._reserved or h in self._holds]
            if taken or len(set(hold_ids)) != len(hold_ids):
                raise HoldExists(f"request id {(taken or list(hold_ids))[0]!r} already has KV "
                                 "held or in prefill; use a fresh X-Request-Id")
            self._reserved.update(hold_ids)
            for h in hold_ids:
                self._recent.pop(h, None)

    def unreserve(self, hold_ids: Iterable[str]) -> None:
        """Drops reservations that did not become holds (a failed or aborted request)."""
        with self.lock:
            self._reserved.difference_update(hold_ids)

    def is_reserved(self, hold_id: str) -> bool:
        with self.lock:
            return hold_id in self._reserved

    def add(self, hold: KVHold) -> None:
        """Turns a reservation into a hold.

        Raises:
          KeyError: `hold.hold_id` was not reserved (its request was withdrawn meanwhile).
        """
        with self.lock:
            if hold.hold_id not in self._reserved:
                raise KeyError(hold.hold_id)
            self._reserved.discard(hold.hold_id)
            self._holds[hold.hold_id] = hold
            self.created += 1

    def get(self, hold_id: str) -> KVHold:
        """The live hold.

        Raises:
          HoldGone: it ended (the reason attached); KeyError: never known (or long gone).
        """
        with self.lock:
            hold = self._holds.get(hold_id)
            if hold is not None:
                return hold
            if hold_id in self._recent:
                raise HoldGone(hold_id, self._recent[hold_id])
            raise KeyError(hold_id)

    def pop(self, hold_id: str, reason: str) -> KVHold:
        """Ends a hold (the caller frees its blocks); raises as `get`."""
        if reason not in RELEASE_REASONS:
            raise ValueError(f"reason must be one of {RELEASE_REASONS}, got {reason!r}")
        with self.lock:
            hold = self.get(hold_id)
            del self._holds[hold_id]
            self._recent[hold_id] = reason
            while len(self._recent) > RECENT_LIMIT:
                self._recent.popitem(last=False)
            self.released[reason] += 1
            return hold

    def issue(self, hold_ids: Iterable[str]) -> None:
        """Marks holds whose ids are being answered to the client (see `KVHold.issued`)."""
        with self.lock:
            for h in hold_ids:
                if h in self._holds:
                    self._holds[h].issued = True

    def on_worker(self, worker_id: int, issued_only: bool = False) -> list[KVHold]:
        """The worker's device-resident holds (with `issued_only`, those answered), oldest
        first."""
        with self.lock:
            return sorted((h for h in self._holds.values() if h.worker_id == worker_id
                           and (h.issued or not issued_only)), key=lambda h: h.created)

    def ids(self, where=lambda hold: True) -> list[str]:
        """Ids of the live holds for which `where(hold)` is true."""
        with self.lock:
            return [h.hold_id for h in self._holds.values() if where(h)]

    def expired(self, now: float) -> list[str]:
        """Ids of the holds whose time passed at `now` (seconds, the backend's clock)."""
        with self.lock:
            return [h.hold_id for h in self._holds.values() if h.expires <= now]

    def held_blocks(self) -> dict[int, int]:
        """Blocks pinned per worker id (device-resident holds only)."""
        with self.lock:
            out: collections.Counter = collections.Counter()
            for h in self._holds.values():
                if h.worker_id is not None:
                    out[h.worker_id] += len(h.block_ids)
            return dict(out)

    def host_bytes(self) -> int:
        """Bytes of offloaded KV kept in host memory."""
        with self.lock:
            return sum(h.host[0].nbytes + h.host[1].nbytes for h in self._holds.values()
                       if h.host is not None)
