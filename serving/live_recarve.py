"""The live backend's split and merge (`LiveBackend.recarve`), on its one re-carve thread.

Once the scheduler has drained the old workers: their KV holds go to host memory
(`KVHandOff.offload`), the `DevicePool` begins the change and carves the new groups, the KV
blocks of retained prefixes move under the new striping with the weights re-wrapped
(`vertumnus_jax.recarve.merge_workers`, `vertumnus_jax.recarve_parts.split_worker_into`; a
move that fails leaves the new workers cold), every rank of every new worker is marked ready,
the epoch is committed, and only then does the scheduler see the new workers
(`Scheduler.finish_reconfiguration`, on the scheduler's thread through `post`).

Failures end the change one way or the other, never leaving it in progress (a change in
progress holds its workers' devices and the controller's next change):
- refused by the device pool, or failing while every old worker is intact (the KV move retires
  them before it donates the first of their buffers, `vertumnus_jax.recarve`): the pool's
  change is dropped and the scheduler gives it up (`Scheduler.abandon_reconfiguration`): the
  old workers serve again;
- failing once the move retired the old workers (the cold new workers could not be built
  either, or the commit failed): the pool's change is dropped and the old workers leave the
  pool as a lost host's do (`Scheduler.lose_workers`: their queues placed again, their blocks
  out of the index); their devices stay idle until the server restarts (the pool's
  `DevicePool` still lists their groups). A host agent's stand-in scheduler answers its pool
  with the failure, and the pool starts that host afresh (`serving.ray_backend`).
Each failure is logged in `LiveBackend.errors`.
"""

from __future__ import annotations

from vertumnus_jax.recarve import merge_workers
from vertumnus_jax.recarve_parts import split_worker_into


def recarve(backend, rec) -> None:
    """Submits the re-carve of `rec` (a `serving.policy.reconfiguration.Reconfiguration`
    whose old workers are drained) to `backend`'s (`LiveBackend`) re-carve thread; returns at
    once (module doc)."""
    olds = [backend.workers[w] for w in rec.old_ids]
    locks = [backend._locks[w] for w in sorted(rec.old_ids)]  # one global order: by worker id

    def run():
        for lock in locks:
            lock.acquire()
        change = None
        try:
            for wid, old in zip(rec.old_ids, olds):  # the re-carve wants idle workers
                backend.handoff.offload(wid, old)
            try:
                if rec.kind == "split":
                    specs = sorted(rec.new_specs, key=lambda s: s.first_device)
                    change = backend.pool.begin_split(rec.old_ids[0],
                                                      new_ids=tuple(s.worker_id for s in specs),
                                                      parts=tuple(s.cp_degree for s in specs))
                else:
                    change = backend.pool.begin_merge(*rec.old_ids,
                                                      new_id=rec.new_specs[0].worker_id)
                meshes = [backend._mesh(g) for g in change.new_groups]
            except Exception as e:  # refused before any KV moved: undone, given up
                _end_failed(backend, rec, olds, change, "refused before any KV moved, old "
                            f"workers kept: {type(e).__name__}: {e}")
                return
            try:
                if rec.kind == "split":  # (halves, or more parts in one re-carve)
                    workers, _ = split_worker_into(olds[0], meshes, replicas=backend.replicas)
                else:
                    merged, _ = merge_workers(olds[0], olds[1], meshes[0],
                                              replicas=backend.replicas)
                    workers = (merged,)
            except Exception as e:  # keep serving: the new workers start with empty caches
                backend.errors.append(f"KV move of epoch {rec.epoch} failed, new workers start "
                                      f"cold: {type(e).__name__}: {e}")
                workers = tuple(backend._worker_on(m) for m in meshes)
            new = dict(zip(change.new_ids, workers))
            for wid, worker in new.items():
                for rank in range(worker.cp_degree):
                    change.mark_ready(wid, rank)
            backend.pool.commit(change)
        except Exception as e:
            _end_failed(backend, rec, olds, change, f"failed: {type(e).__name__}: {e}")
            return
        finally:
            for lock in locks:
                lock.release()

        def finish():
            for wid in rec.old_ids:
                backend._remove(wid)
            for wid, worker in new.items():
                backend._add(wid, worker)
                worker.cache.drain_events()  # the new workers report their holdings whole
            cached = {wid: list(w.cached_hashes()) for wid, w in new.items()}
            backend.scheduler.finish_reconfiguration(rec.epoch, backend._clock(), cached)

        backend._post(finish)

    backend._recarver.submit(run)


def _end_failed(backend, rec, olds, change, what: str) -> None:
    """Ends a re-carve that failed (module doc): the device pool's change, if begun, is
    dropped; with every old worker intact the scheduler gives the change up, else the old
    workers leave the pool. On the re-carve thread, the old workers' locks held."""
    if change is not None and change in backend.pool.pending:
        backend.pool.abort(change)
    retired = [wid for wid, old in zip(rec.old_ids, olds) if old.retired is not None]
    if not retired:
        backend.errors.append(f"re-carve of epoch {rec.epoch} {what}")
        backend._post(lambda: give_up(backend, rec.epoch))
        return
    reason = (f"re-carve of epoch {rec.epoch} {what}; the KV move had retired workers "
              f"{retired}: workers {list(rec.old_ids)} leave the pool")
    backend.errors.append(reason)

    def lose():
        for wid in rec.old_ids:
            backend._remove(wid)
        backend.scheduler.lose_workers(list(rec.old_ids), backend._clock(), reason)

    backend._post(lose)


def give_up(backend, epoch: int) -> None:
    """A change that changed nothing: the scheduler gives it up, unless a lost worker already
    made it (`Scheduler.abandon_reconfiguration`; a host agent's stand-in scheduler, which has
    no `reconfig`, reports it to the pool's). On the scheduler's thread."""
    reconfig = getattr(backend.scheduler, "reconfig", None)
    if reconfig is None or epoch in reconfig.in_progress:
        backend.scheduler.abandon_reconfiguration(epoch, backend._clock())
