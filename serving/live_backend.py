"""The live backend: real zigzag CP prefill on JAX submeshes, driving the same `Scheduler`.

`LiveBackend` implements `serving.policy.backend.Backend` over `vertumnus_jax` workers carved from a
`mesh.DevicePool`. Each worker has one executor thread that runs its operations in order
(prefills, and the copies and frees of the prefix-cache manager); a per-worker lock also
serialises the operations that touch two workers (a replication reads its source). Nothing here
blocks the caller: every `Backend` call enqueues work and returns; the outcome is handed back
through `post(fn)`, which must run `fn` on the thread that owns the scheduler (the service's
asyncio loop, `serving.engine.Engine`). Times given to the scheduler come from `clock()`
(seconds since the service started).

A failure inside one prefill (an exception from JAX, `OutOfBlocksError`) fails that request
through `Scheduler.fail` with the exception's type and message; the worker goes on with its
queue. Split and merge run on a separate re-carve thread once the scheduler has drained the old
workers: weights are re-wrapped (zero bytes moved), KV blocks of retained prefixes are moved
under the new striping (`vertumnus_jax.recarve`; a split into more than two parts halves
repeatedly within the one re-carve, `vertumnus_jax.recarve_parts`), every rank of each new
worker is marked ready in the `DevicePool`, the new epoch is committed, and only then does the
scheduler see the new workers (`finish_reconfiguration`); a change the `DevicePool` refuses
changed nothing and is given up (`abandon_reconfiguration`: the old workers serve again), and
one that fails once the KV move retired an old worker takes the old workers out of the pool
(`lose_workers`; `serving.live_recarve`). A
replica is reported only after its copy has completed; a reclaimed prefix leaves the index
only after its blocks were freed.

KV holds (the P/D hand-off, `serving.kv_handoff`): a prefill whose request asked for one keeps
its blocks pinned after it ends instead of releasing them; a prefill that runs out of blocks
while holds pin some releases the worker's oldest hold and tries again; a worker about to be
re-carved first copies its holds to host memory; expired holds are released on a background
thread (`tick`, called by the engine's tick).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence

from mesh import DevicePool, ParamReplicas, worker_mesh
from serving import live_recarve
from serving.background_errors import BackgroundErrors
from serving.kv_handoff import KVHandOff
from serving.kv_hold import KVHolds
from serving.policy.backend import PrefillResult
from serving.policy.request import Request
from vertumnus_jax import OutOfBlocksError, Worker, prefill_request, release_request
from vertumnus_jax.recarve import reclaim_prefix, replicate_prefix

_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LivePrefill:
    """What the API returns beyond the scheduler's `RequestRecord`, for one finished prefill.

    Attributes:
      worker_id, cp_degree: where it ran (the epoch is the scheduler's, in `RequestRecord`).
      device_ids: the worker's device ids in rank order.
      block_ids: the prompt's KV blocks (block i on rank `i % cp_degree`): with a hold, all
        of them, pinned (the partial last one included); without, the full ones, left
        unpinned in the worker's prefix cache.
      block_size: tokens per block.
      num_tokens: tokens those blocks hold (the prompt's length with a hold; full blocks'
        tokens without).
      hold_id: the KV hold's id (`serving.kv_hold`), or None when nothing is held.
    """

    worker_id: int
    cp_degree: int
    device_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    block_size: int
    num_tokens: int = 0
    hold_id: str | None = None


class LiveBackend:
    """`Backend` over JAX workers (one per `DevicePool` group).

    Args:
      pool: the device pool; its groups are the initial workers (worker id = group id).
      replicas: the model's weights, one replica per device (`mesh.ParamReplicas`).
      graphdef: the model's `flax.nnx` graph definition (`nnx.split(model)[0]`).
      num_blocks: KV blocks per device, >= 1.
      block_size: tokens per KV block, a power of two.
      post: `post(fn)` runs `fn()` on the scheduler's thread (thread-safe; e.g.
        `loop.call_soon_threadsafe`).
      clock: seconds since the service started (monotonic).
      kv_hold_seconds: how long a prompt's KV stays pinned for the decode side when its request
        asked for it (`serving.kv_hold`), > 0.
      worker_kwargs: extra `vertumnus_jax.Worker` arguments (`interpret`, `block_sizes`,
        `min_bucket`).

    Attributes:
      scheduler: set by the owner before the first request.
      workers: worker id -> `vertumnus_jax.Worker`.
      prefills: request id -> `LivePrefill`, filled before `Scheduler.complete` is posted;
        the owner pops it when it answers the request.
      handoff: the KV holds of the P/D hand-off (`serving.kv_handoff.KVHandOff`).
    """

    def __init__(self, pool: DevicePool, replicas: ParamReplicas, graphdef, *, num_blocks: int,
                 block_size: int, post: Callable[[Callable[[], None]], None],
                 clock: Callable[[], float], kv_hold_seconds: float = 60.0,
                 **worker_kwargs) -> None:
        self.pool, self.replicas, self.graphdef = pool, replicas, graphdef
        self.num_blocks, self.block_size = int(num_blocks), int(block_size)
        self._post, self._clock = post, clock
        self._worker_kwargs = worker_kwargs
        self.scheduler = None
        self.workers: dict[int, Worker] = {}
        self._executors: dict[int, concurrent.futures.ThreadPoolExecutor] = {}
        self._locks: dict[int, threading.Lock] = {}
        self._recarver = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="recarve")
        self._hold_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-hold")
        self.prefills: dict[str | int, LivePrefill] = {}
        self.errors = BackgroundErrors(_log)  # failures of background operations (logged)
        self._closed = False
        self.handoff = KVHandOff(KVHolds(kv_hold_seconds), self.workers, self._locks, clock)
        self._expiring: concurrent.futures.Future | None = None
        for group in pool.groups:
            self._add(group.worker_id, self._new_worker(group.worker_id))

    # ------------------------------------------------------------------------------ workers
    def _new_worker(self, worker_id: int) -> Worker:
        return self._worker_on(self.pool.mesh(worker_id))

    def _worker_on(self, mesh) -> Worker:
        return Worker.from_replicas(mesh, self.graphdef, self.replicas,
                                    num_blocks=self.num_blocks, block_size=self.block_size,
                                    **self._worker_kwargs)

    def _mesh(self, group):
        return worker_mesh(self.pool.devices, group.first_device, group.cp_degree)

    def _add(self, worker_id: int, worker: Worker) -> None:
        self.workers[worker_id] = worker
        self._locks[worker_id] = threading.Lock()
        self._executors[worker_id] = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix=f"worker{worker_id}")

    def _remove(self, worker_id: int) -> None:
        self.workers.pop(worker_id)
        self._locks.pop(worker_id)
        self._executors.pop(worker_id).shutdown(wait=False)

    def _submit(self, worker_id: int, fn: Callable[[], None],
                on_refused: Callable[[str], None]) -> None:
        """Runs `fn` on the worker's executor; `on_refused(reason)` when shut down."""
        def guarded():
            try:
                fn()
            except BaseException as e:  # never lose a background failure silently
                self.errors.append(f"worker {worker_id}: {type(e).__name__}: {e}")
                raise
        if self._closed:
            on_refused("the server is shutting down")
            return
        try:
            self._executors[worker_id].submit(guarded)
        except RuntimeError as e:  # executor shut down meanwhile
            on_refused(str(e))

    # ------------------------------------------------------------------------------ Backend
    def start_prefill(self, worker_id: int, request: Request, now: float) -> None:
        """Enqueues the prefill on the worker's executor; reports through `post`."""
        worker, lock = self.workers[worker_id], self._locks[worker_id]

        def run():
            try:
                with lock:
                    result = self._prefill_making_room(worker_id, worker, request)
                    hold_id = self.handoff.pin(worker_id, worker, request, result)
                    if hold_id is None:
                        release_request(worker, result)
                    inserted, evicted = _drain(worker)
            except Exception as e:  # JAX errors, OutOfBlocksError: this request fails alone
                self.handoff.wanted.pop(request.request_id, None)
                message = f"prefill failed on worker {worker_id}: {type(e).__name__}: {e}"
                self._post(lambda: self.scheduler.fail(worker_id, request.request_id,
                                                       self._clock(), message))
                return
            finish = self._clock()
            n_full = request.input_len // self.block_size
            blocks = result.block_ids if hold_id is not None else result.block_ids[:n_full]
            self.prefills[request.request_id] = LivePrefill(
                worker_id, worker.cp_degree, worker.device_ids, tuple(int(b) for b in blocks),
                self.block_size, request.input_len if hold_id is not None
                else n_full * self.block_size, hold_id)
            done = PrefillResult(result.cached_tokens, finish, finish, inserted, evicted,
                                 int(result.first_token))
            self._post(lambda: self.scheduler.complete(worker_id, request.request_id, finish, done))

        def refused(reason: str) -> None:
            self._post(lambda: self.scheduler.fail(worker_id, request.request_id, self._clock(),
                                                   f"prefill not started: {reason}"))

        self._submit(worker_id, run, refused)

    def _prefill_making_room(self, worker_id: int, worker: Worker, request: Request):
        """`prefill_request`; when the pool is out of blocks and KV holds pin some of them,
        releases the oldest hold (`preempted`) and tries again."""
        while True:
            try:
                return prefill_request(worker, request.token_ids, request.block_hashes)
            except OutOfBlocksError:
                if not self.handoff.preempt_oldest(worker_id, worker):
                    raise

    def describe_worker(self, worker_id: int) -> dict | None:
        """`GET /v1/workers`' view of a worker: cached blocks and the prefill executables made
        for its devices; None while it is being re-carved (replaced when `finish` runs)."""
        live = self.workers.get(worker_id)
        if live is None or live.retired is not None:
            return None
        devices = live.device_ids  # list(): a prefill thread may add one meanwhile
        return {"kv_blocks_cached": len(live.cache),
                "prefill_executables": sum(1 for k in list(live.executables) if k[0] == devices)}

    def tick(self, now: float) -> None:
        """The engine's periodic call: releases, on a background thread, the KV holds whose
        time passed at `now` (seconds on the backend's clock). Cheap when none did; at most one
        such job runs at a time."""
        if self._closed or not self.handoff.holds.expired(now) or (
                self._expiring is not None and not self._expiring.done()):
            return
        self._expiring = self._hold_thread.submit(self.handoff.expire, now)

    def recarve(self, reconfiguration, now: float) -> None:
        """Splits or merges the drained workers on the re-carve thread (`serving.live_recarve`;
        a failure gives the change up or, once the KV move retired an old worker, takes the
        old workers out of the pool: never left in progress)."""
        live_recarve.recarve(self, reconfiguration)

    def replicate(self, replication, now: float) -> None:
        """Copies the missing blocks on the destination's executor; visible once copied. A copy
        made for a request (`FetchOnDispatch`) is submitted before that request's prefill, to
        the same one-thread executor, so the prefill runs once the copy has landed
        (`serving.fetch_wait`)."""
        rep = replication
        src, dst = self.workers.get(rep.src), self.workers.get(rep.dst)
        if src is None or dst is None:
            self._post(lambda: self.scheduler.copies.finish(rep, self._clock(), (), ()))
            return
        locks = [self._locks[w] for w in sorted({rep.src, rep.dst})]

        def run():
            inserted = evicted = ()
            for lock in locks:
                lock.acquire()
            try:
                result = replicate_prefix(src, dst, rep.chain)
                inserted, evicted = tuple(result.inserted), tuple(result.evicted)
                _drain(dst)  # reported through PrefixCopies.finish instead
            except Exception as e:  # the source lost the prefix, or no room: nothing copied
                self.errors.append(f"replication {rep.src}->{rep.dst} failed: "
                                   f"{type(e).__name__}: {e}")
            finally:
                for lock in reversed(locks):
                    lock.release()
            self._post(lambda: self.scheduler.copies.finish(
                rep, self._clock(), inserted, evicted))

        self._submit(rep.dst, run, lambda reason: self._post(
            lambda: self.scheduler.copies.finish(rep, self._clock(), (), ())))

    def reclaim(self, worker_id: int, chain, now: float) -> None:
        """Frees the worker's unshared tail of `chain` on its executor; then confirms."""
        worker = self.workers.get(worker_id)
        chain = tuple(chain)
        if worker is None:
            self._post(lambda: self.scheduler.copies.finish_reclaim(worker_id, chain,
                                                                    self._clock(), ()))
            return
        lock = self._locks[worker_id]

        def run():
            evicted: Sequence[int] = ()
            try:
                with lock:
                    evicted = tuple(reclaim_prefix(worker, chain))
                    _drain(worker)
            except Exception as e:
                self.errors.append(f"reclaim on worker {worker_id} failed: {type(e).__name__}: {e}")
            self._post(lambda: self.scheduler.copies.finish_reclaim(
                worker_id, chain, self._clock(), evicted))

        self._submit(worker_id, run, lambda reason: self._post(
            lambda: self.scheduler.copies.finish_reclaim(worker_id, chain, self._clock(), ())))

    def reset_prefix_cache(self) -> dict[int, tuple[int, ...]]:
        """Evicts every unreferenced cached block of every worker (vLLM's `reset_prefix_cache`).

        Call only with no operation in flight (the engine checks). Returns, per worker id, the
        evicted block hashes, for `Scheduler.kv_events`.
        """
        out = {}
        for wid, worker in self.workers.items():
            with self._locks[wid]:
                worker.cache.evict(len(worker.cache))
                out[wid] = _drain(worker)[1]
        return out

    # ------------------------------------------------------------------------------ lifecycle
    def shutdown(self, wait: bool = True) -> None:
        """Refuses new work (prefills are then failed through the scheduler), drops work not yet
        started, and waits for running operations when `wait`."""
        self._closed = True
        self._recarver.shutdown(wait=wait)
        self._hold_thread.shutdown(wait=wait, cancel_futures=True)
        for ex in list(self._executors.values()):
            ex.shutdown(wait=wait, cancel_futures=True)


def _drain(worker: Worker) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The worker cache's events since the last drain, as (inserted, evicted) hashes in order.

    A block inserted then evicted within one batch is reported as evicted only (and vice versa
    as inserted only), so the scheduler's order "evictions, then insertions" gives the right
    final state.
    """
    state: dict[int, bool] = {}
    for event in worker.cache.drain_events():
        state[event.block_hash] = event.kind == "insert"
    inserted = tuple(h for h, present in state.items() if present)
    evicted = tuple(h for h, present in state.items() if not present)
    return inserted, evicted

