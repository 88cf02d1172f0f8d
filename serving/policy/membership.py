"""Workers leaving or joining the pool at once: a host lost, a host back (issue 19).

`Membership` is the collaborator `serving.policy.scheduler.Scheduler` holds as
`scheduler.membership`, in the style of `Reconfigurations` and `PrefixCopies`; the scheduler's
`lose_workers` / `add_workers` call it. It works on the scheduler's own queues, placements and
promises (the same objects), so that a loss is one step that leaves consistent state:

- changes in progress (splits, merges) that involve a lost worker are abandoned: a draining
  change's surviving old workers take placements again; a change the backend was already
  re-carving takes its surviving old workers with it (their devices are being re-carved;
  they come back through `add_workers`), and the backend's late `finish_reconfiguration` for
  it is ignored;
- each lost worker's queued (not started) requests are re-routed over the workers left, as a
  drain re-routes them; its running prefill fails through `Scheduler.fail` with an error naming
  the worker and its host (the listener gets exactly one record per request, and a late report
  of the backend for a lost worker is ignored);
- requests queued or waiting that no worker left (nor one being created) can hold fail, saying
  so;
- the workers leave the pool and the prefix index (their cached blocks), and copies to or from
  them end as failed (`PrefixCopies.drop_workers`: the index does not change);
- `hooks` are told (the controllers then plan with the GPUs left).

It also takes requests off the queues and places them again for the scheduler (`unqueue`,
`place_again`: a drain's re-routes, the waiting requests retried; `withdraw`: an abort): a
request the router fails on then fails with that error rather than being lost, and the step
that placed it (a drain, a loss, a retry) is made whole, its errors kept in `errors` (and
logged as warnings, counted in `num_errors`; the server exports `vertumnus:policy_errors_total`).

A worker id is never reused: a host that comes back joins as new workers
(`Scheduler.new_worker_ids`, then `add_workers`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections import deque
from collections.abc import Callable, Sequence

from serving.policy.placement import withdraw_queued
from serving.policy.request import Request, RequestRecord
from serving.policy.worker import WorkerSpec, WorkerState, WorkerStatus


ERRORS_KEPT = 1000  # `Membership.errors`: the latest errors kept
_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LostWorkers:
    """What one `Scheduler.lose_workers` call did.

    Attributes:
      time: when (seconds); reason: the caller's reason (e.g. "host 2 agent died").
      worker_ids: the workers that left the pool, sorted: those named that were in it, plus
        the surviving old workers of a change the backend was re-carving.
      hosts: their hosts, sorted; gpus: their devices in all.
      rerouted: ids of the queued requests moved to other workers (or waiting for one).
      failed_running: ids of the running prefills failed (one error record each).
      failed_unplaceable: ids of queued or waiting requests no worker left can hold, failed.
      abandoned_epochs: the splits and merges given up.
      failed_copies: prefix copies to or from the lost workers given up.
    """

    time: float
    reason: str
    worker_ids: tuple[int, ...]
    hosts: tuple[int, ...]
    gpus: int
    rerouted: tuple[str | int, ...] = ()
    failed_running: tuple[str | int, ...] = ()
    failed_unplaceable: tuple[str | int, ...] = ()
    abandoned_epochs: tuple[int, ...] = ()
    failed_copies: int = 0

    def as_dict(self) -> dict:
        """JSON-ready summary (request ids as counts)."""
        return {"time": self.time, "reason": self.reason, "workers": list(self.worker_ids),
                "hosts": list(self.hosts), "gpus": self.gpus, "rerouted": len(self.rerouted),
                "failed_running": len(self.failed_running),
                "failed_unplaceable": len(self.failed_unplaceable),
                "abandoned_epochs": list(self.abandoned_epochs),
                "failed_copies": self.failed_copies}


MembershipHook = Callable[[Sequence[WorkerSpec], Sequence[WorkerSpec], float], None]


class Membership:
    """Losing and adding workers; see the module docstring.

    Attributes:
      lost: ids of every worker lost (never reused; reports of the backend for them are
        ignored by the scheduler).
      log: one dict per loss (`LostWorkers.as_dict`, kind "lost") or addition (kind "added":
        time, workers, hosts, gpus), in order.
      hooks: called as `hook(lost_specs, added_specs, now)` after each change (e.g. a
        controller counting the pool's GPUs).
    """

    def __init__(self, scheduler) -> None:
        self._s = scheduler
        self.lost: set[int] = scheduler.reconfig.retired  # (one set: never new ids again)
        self.log: list[dict] = []
        self.hooks: list[MembershipHook] = []
        # errors of the router or a hook while requests were placed again (`place_again`) or
        # failed by a loss: {"time", "request_id", "error"}, the latest `ERRORS_KEPT`
        self.errors: deque[dict] = deque(maxlen=ERRORS_KEPT)
        self.num_errors = 0  # every error kept so far (`errors` holds the latest)
        # the requests `place_again` has yet to place, one deque per call in progress (a hook
        # may drain a worker while a batch is placed): in flight, seen by `waiting`/`withdraw`
        self.placing: list[deque[Request]] = []

    def host_worker_ids(self, host: int) -> list[int]:
        """Ids of the workers on `host`, sorted: the pool's and those a change in progress is
        creating there."""
        s = self._s
        ids = {w for w, st in s.workers.items() if st.spec.host == host}
        ids |= {sp.worker_id for rec in s.reconfig.in_progress.values() for sp in rec.new_specs
                if sp.host == host}
        return sorted(ids)

    def unqueue(self, worker: WorkerState) -> list[Request]:
        """Takes every queued (not started) request off `worker`: placements and promised
        blocks released, reservation cleared, ids noted in `Scheduler.rerouted`. Returns them in
        queue order, to be re-routed."""
        s, out = self._s, []
        while worker.queue:
            r = worker.queue.popleft()
            del s._placements[r.request_id]
            s.rerouted.add(r.request_id)
            if s._use_pending:
                s.pending.remove(worker.worker_id, r.block_hashes[:r.full_blocks])
            out.append(r)
        worker.queued_seconds = 0.0
        return out

    def unqueue_ids(self, request_ids: Sequence[str | int]) -> list[Request]:
        """Takes those of `request_ids` still queued (not started) off their queues, as
        `unqueue` does; returns them in the order given (running, ended or waiting ones are
        left as they are)."""
        s, out = self._s, []
        for rid in request_ids:
            if rid in s._placements:
                r = withdraw_queued(s._placements, rid, s.pending if s._use_pending else None)
                if r is not None:
                    s.rerouted.add(rid)
                    out.append(r)
        return out

    def withdraw(self, request_id: str | int, now: float, reason: str) -> bool:
        """`Scheduler.abort`: withdraws a request queued or waiting; False if running or
        not in flight."""
        s = self._s
        if request_id in s._placements:
            request = withdraw_queued(s._placements, request_id,
                                      s.pending if s._use_pending else None)
            if request is None:
                return False  # running
        else:
            found = self._find_waiting(request_id)
            if found is None:
                return False
            waiting, request = found
            waiting.remove(request)
            s.rerouted.discard(request_id)
        s.num_aborted += 1
        s.listener(RequestRecord(request, finish_time=now, error=reason, aborted=True))
        return True

    def place_again(self, requests: Sequence[Request], now: float) -> None:
        """Routes `requests` again, in the order given: taken off a queue (`unqueue`) or
        waiting for a worker. An error of the router or a hook does not stop the others (the
        step that called this is made: a drain, a loss, a retry) and is kept in `errors`; a
        request the router failed on fails, its record naming the error: none is lost."""
        with self._in_flight(deque(requests)) as batch:
            self._place_batch(batch, now)

    def waiting(self, request_id: str | int) -> bool:
        """Whether `request_id` waits for a worker or for `place_again` to place it."""
        return self._find_waiting(request_id) is not None

    def _find_waiting(self, request_id: str | int) -> tuple[deque[Request], Request] | None:
        """`(the deque holding it, the request)` of `request_id` waiting for a worker or in a
        batch being placed again; None if neither."""
        for waiting in (self._s._pending, *self.placing):
            for r in waiting:
                if r.request_id == request_id:
                    return waiting, r
        return None

    @contextlib.contextmanager
    def _in_flight(self, batch: deque[Request]):
        """Keeps `batch` in `placing` (in flight for `waiting` and `withdraw`) while the block
        runs; nested blocks may end in any order."""
        self.placing.append(batch)
        try:
            yield batch
        finally:
            del self.placing[next(i for i, b in enumerate(self.placing) if b is batch)]

    def _place_batch(self, batch: deque[Request], now: float) -> None:
        s = self._s
        while batch:
            r = batch.popleft()
            ended = self.num_ended()
            try:
                s._route(r, now)
            except Exception as e:  # noqa: BLE001 (kept in `errors`)
                self.error(r, now, e)
                if not self.taken(r, ended):  # (a router or cost-model error): it fails
                    s.num_failed += 1
                    s.rerouted.discard(r.request_id)
                    s.listener(RequestRecord(r, finish_time=now, error=(
                        f"routing failed: {type(e).__name__}: {e}")))

    def num_ended(self) -> int:
        """Requests ended so far: completed, failed or aborted."""
        s = self._s
        return s.num_completed + s.num_failed + s.num_aborted

    def taken(self, request: Request, ended_before: int) -> bool:
        """Whether an error out of `Scheduler._route(request)` came after the request was taken:
        it is placed, waiting for a worker, or a request ended since `num_ended()` was
        `ended_before` (the router raises before any can end; a hook after)."""
        s = self._s
        return (self.num_ended() != ended_before or request.request_id in s._placements
                or any(p is request for p in s._pending))

    def error(self, request: Request, now: float, e: Exception) -> None:
        """Keeps an error of a router, hook or backend call that did not stop the step making it
        (`errors`, `num_errors`) and logs it as a warning."""
        _log.warning("policy error (request %r kept in flight or failed): %s: %s",
                     request.request_id, type(e).__name__, e)
        self.num_errors += 1
        self.errors.append({"time": now, "request_id": request.request_id,
                            "error": f"{type(e).__name__}: {e}"})

    def lose(self, worker_ids: Sequence[int], now: float, reason: str) -> LostWorkers:
        """Removes `worker_ids` from the pool at once (`Scheduler.lose_workers`).

        Args:
          worker_ids: workers of the pool, or new workers of a change in progress; ids lost
            before are skipped (losing a host twice is a no-op).
          now: seconds.
          reason: what happened, e.g. "host 2 agent died"; it starts every error it causes.

        Returns:
          `LostWorkers`.

        Raises:
          ValueError: (nothing changed) no id, an id never in the pool, an empty reason, or a
            `now` that is not finite.
        """
        s = self._s
        named = list(dict.fromkeys(worker_ids))
        ids = [w for w in named if w not in self.lost]
        creating = {sp.worker_id for rec in s.reconfig.in_progress.values() for sp in rec.new_specs}
        unknown = [w for w in ids if w not in s.workers and w not in creating]
        if not named or unknown:
            raise ValueError(f"worker_ids must name workers of the pool (or being created), got "
                             f"{list(worker_ids)}" + (f"; unknown: {unknown}" if unknown else ""))
        if not isinstance(reason, str) or not reason:
            raise ValueError(f"reason must be a non-empty string, got {reason!r}")
        if not math.isfinite(now):
            raise ValueError(f"now must be finite, got {now}")
        if not ids:
            return LostWorkers(now, reason, (), (), 0)  # all lost before: nothing to do
        lost, abandoned = set(ids), []
        for rec in list(s.reconfig.in_progress.values()):
            if lost.isdisjoint(rec.old_ids) and lost.isdisjoint(
                    sp.worker_id for sp in rec.new_specs):
                continue
            s.reconfig.abandon(rec.epoch)
            abandoned.append(rec.epoch)
            if rec.recarve_started is not None:
                lost.update(rec.old_ids)  # mid re-carve in the backend: they go too
            else:
                for wid in rec.old_ids:
                    if wid not in lost:
                        s.workers[wid].status = WorkerStatus.ACTIVE
        gone = [s.workers[w] for w in sorted(lost) if w in s.workers]
        with self._in_flight(deque()) as batch:  # taken off the lost queues: in flight
            return self._lose(gone, lost, abandoned, batch, now, reason)

    def _lose(self, gone: list[WorkerState], lost: set[int], abandoned: list[int],
              batch: deque[Request], now: float, reason: str) -> LostWorkers:
        s = self._s
        for w in gone:
            w.status = WorkerStatus.UNAVAILABLE
            batch.extend(self.unqueue(w))
        ordered = sorted(batch, key=lambda r: r.arrival_time)
        batch.clear()
        batch.extend(ordered)
        running = []
        for w in gone:
            if w.running is not None:
                running.append(w.running.request_id)
                s.fail(w.worker_id, w.running.request_id, now, (
                    f"{reason}: worker {w.worker_id} on host {w.spec.host} was lost while "
                    "running this prefill"), retryable=True)
        for w in gone:
            del s.workers[w.worker_id]
            s.prefix_index.drop_worker(w.worker_id)
        self.lost |= lost
        hosts = sorted({w.spec.host for w in gone})
        copies = s.copies.drop_workers(lost, now, reason)

        def holdable(r: Request) -> bool:
            return any(w.can_hold(r) for w in s.workers.values()) or s.reconfig.will_hold(r)

        def fail(r: Request) -> None:
            try:  # (a refused hook's error does not stop the loss: kept in `errors`)
                s._fail_unplaced(r, now, (
                    f"{reason}: input_len={r.input_len} tokens cannot be held by any worker "
                    f"left after losing worker(s) {[w.worker_id for w in gone]} on host(s) "
                    f"{hosts}"))
            except Exception as e:  # noqa: BLE001
                self.error(r, now, e)

        unplaceable = []
        for waiting in (s._pending, batch):  # (a hook may have ended one meanwhile: skipped)
            for r in [r for r in waiting if not holdable(r)]:
                if any(p is r for p in waiting):
                    waiting.remove(r)
                    unplaceable.append(r)
                    fail(r)
        rerouted = list(batch)
        self._place_batch(batch, now)
        for hook in self.hooks:
            hook([w.spec for w in gone], [], now)
        out = LostWorkers(now, reason, tuple(w.worker_id for w in gone), tuple(hosts),
                          sum(w.cp_degree for w in gone), tuple(r.request_id for r in rerouted),
                          tuple(running),
                          tuple(r.request_id for r in unplaceable), tuple(abandoned), copies)
        self.log.append({"kind": "lost", **out.as_dict()})
        return out

    def add(self, specs: Sequence[WorkerSpec], now: float) -> list[WorkerState]:
        """New workers join the pool, ACTIVE under the current epoch (`Scheduler.add_workers`);
        requests waiting for a worker are retried.

        Returns:
          The new workers' `WorkerState`s, in `specs` order.

        Raises:
          ValueError: (nothing changed) no spec; an id repeated, in use, lost before, or not
            handed out by `Scheduler.new_worker_ids`; or devices that overlap a worker of the
            pool or one being created (device indices are pool-wide).
        """
        s = self._s
        specs = list(specs)
        ids = [sp.worker_id for sp in specs]
        creating = [sp for rec in s.reconfig.in_progress.values() for sp in rec.new_specs]
        bad = [w for w in ids if w in s.workers or w in self.lost or not s.reconfig.handed_out(w)
               or any(sp.worker_id == w for sp in creating)]
        if not specs or len(set(ids)) != len(ids) or bad:
            raise ValueError(f"new workers need distinct fresh ids from new_worker_ids(), got "
                             f"{ids}" + (f"; not usable: {bad}" if bad else ""))
        taken = {d for st in s.workers.values() for d in st.spec.devices}
        taken |= {d for sp in creating for d in sp.devices}
        for sp in specs:
            if taken & set(sp.devices):
                raise ValueError(f"worker {sp.worker_id}'s devices {sp.first_device}.."
                                 f"{sp.devices[-1]} overlap workers of the pool")
            taken |= set(sp.devices)
        states = []
        for sp in specs:
            st = s.workers[sp.worker_id] = WorkerState(sp, epoch=s.reconfig.epoch)
            s.prefix_index.register_worker(sp.worker_id, sp.cp_degree)
            states.append(st)
        for hook in self.hooks:
            hook([], specs, now)
        self.log.append({"kind": "added", "time": now, "workers": ids,
                         "hosts": sorted({sp.host for sp in specs}),
                         "gpus": sum(sp.cp_degree for sp in specs)})
        s._retry_pending(now)
        return states
