"""The multi-host backend: the policy core's `Backend` over host agents that are Ray actors.

The head process runs the HTTP API, the `Engine` and the `Scheduler` unchanged; `RayBackend`
turns each `Backend` call into a call on the agent (`serving.host_agent.HostAgent`) of the host
that owns the worker, and hands the outcome back to the scheduler's thread through `post`
when the call's `ObjectRef` resolves (no call blocks the event loop). Worker ids are pool-wide;
`WorkerSpec.host` names a worker's host; a worker never spans hosts.

Prefix copies: between workers of one host the agent copies device to device; across hosts the
source agent exports the blocks to host memory and the destination agent imports them, the
`ObjectRef` of the export passed straight to the import so Ray's object store moves the bytes
between nodes. Either way the scheduler hears of a copy only once it has landed
(`PrefixCopies.finish`), so the trie never lists a block that is not there. A copy made for a
request (a fetching router's plan) holds that request's prefill until the copy ends
(`serving.fetch_wait`): agents run calls concurrently, so it would otherwise start first.

Failure: a host whose agent dies (any call raises `RayActorError`, or the periodic `ping` from
`tick` does) is lost: `Scheduler.lose_workers` re-routes its queued requests, fails its running
ones with a clean error, and drops its workers from the pool and the trie; late answers from it
are ignored. An agent that Ray restarts (local hosts are started with restarts allowed) comes
back bare; the next `tick` finds it and sets it up as new workers (`Scheduler.add_workers`).
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Sequence

from serving.background_errors import BackgroundErrors
from serving.fetch_wait import FetchWaits
from serving.kv_hold import KVHolds
from serving.live_backend import LivePrefill
from serving.policy.backend import PrefillResult
from serving.policy.reconfiguration import RecarveRefused
from serving.policy.worker import WorkerSpec
from serving.ray_handoff import RemoteHandOff
from serving.ray_state import HostState, RemoteWorker

_log = logging.getLogger(__name__)
# Seconds between liveness pings of one host agent, and how long one may take.
PING_INTERVAL = 1.0
PING_TIMEOUT = 10.0


class RayBackend:
    """`Backend` over host agents (see the module doc).

    Args:
      hosts: `HostState` per host, agents set up with their workers (`start_host_agents`).
      specs: every worker's `WorkerSpec` (with its host).
      devices_per_host: devices each agent owns (M).
      post: runs `fn()` on the scheduler's thread (thread-safe; `loop.call_soon_threadsafe`).
      clock: seconds on the head's clock.
      kv_capacity_blocks_per_device, max_input_len: for the `WorkerSpec`s of a host that rejoins
        (`max_input_len(cp_degree) -> tokens`).

    Attributes:
      scheduler: set by the owner before the first request.
      workers: worker id -> `RemoteWorker`.
      prefills: request id -> `LivePrefill` (as `LiveBackend`'s).
      handoff: the head's side of KV holds kept on the agents (`serving.ray_handoff`).
      errors: failures of background operations, for logs and tests.
      waits: prefills held until the prefix copy made for them lands (`FetchWaits`).
      dispatch_log: the latest prefills' wall-clock `(sent, entered, left, received)` times
        (`time.time()`: the head's call, its arrival in the agent, the agent's return, the
        head's callback), for `serving.bench_hosts`.
    """

    def __init__(self, hosts: Sequence[HostState], specs: Sequence[WorkerSpec], *,
                 devices_per_host: int, post: Callable, clock: Callable[[], float],
                 kv_blocks_per_device: int, max_input_len: Callable[[int], int],
                 kv_hold_seconds: float = 60.0):
        import ray  # the multi-host mode's dependency only
        self._ray = ray
        self.hosts = {h.host_id: h for h in hosts}
        self.devices_per_host = int(devices_per_host)
        self._post, self._clock = post, clock
        self._kv_blocks, self._max_input_len = int(kv_blocks_per_device), max_input_len
        self.scheduler = None
        self.workers: dict[int, RemoteWorker] = {}
        self.prefills: dict = {}
        self.errors = BackgroundErrors(_log)  # failures of background operations (logged)
        self._running: dict[object, int] = {}  # request id -> worker id, while on an agent
        self.dispatch_log: collections.deque = collections.deque(maxlen=10_000)
        self.handoff = RemoteHandOff(KVHolds(kv_hold_seconds), self)
        self.waits = FetchWaits()
        for s in specs:
            self._track(s)

    def _track(self, spec: WorkerSpec) -> None:
        m = self.devices_per_host
        self.workers[spec.worker_id] = RemoteWorker(
            spec.host, spec.cp_degree, tuple(range(spec.first_device,
                                                   spec.first_device + spec.cp_degree)))
        self.hosts[spec.host].worker_ids.add(spec.worker_id)
        assert spec.first_device // m == spec.host

    def _host_of(self, worker_id: int) -> HostState:
        return self.hosts[self.workers[worker_id].host_id]

    def _then(self, ref, hosts: Sequence[HostState], on_result: Callable, what: str) -> None:
        """Calls `on_result(value)` on the scheduler's thread when `ref` resolves; an exception
        raised inside the agent's method is `on_result(exc)`. When an actor of `hosts` died
        (`RayActorError`; a copy's failed export reaches its import this way too), each of
        `hosts` is pinged first: those that do not answer, or answer restarted, are lost (that
        answers their requests); if none is, the call failed alone: `on_result(exc)`."""
        def done(future):
            try:
                value = future.result()
            except self._ray.exceptions.RayActorError as e:
                err = RuntimeError(f"{what}: {type(e).__name__}")
                self._post(lambda: self._suspect(hosts, str(err), lambda: on_result(err)))
                return
            except Exception as e:  # an error inside the agent's method
                value = e
            self._post(lambda: on_result(value))
        ref.future().add_done_callback(done)

    def _suspect(self, hosts: Sequence[HostState], why: str, if_alive: Callable) -> None:
        """Pings `hosts`; loses each that is dead or restarted; `if_alive()` when none was."""
        pending = {h.host_id for h in hosts}
        lost = []

        def answered(host, info):
            pending.discard(host.host_id)
            if info is None or not info.get("ready") or info.get("pid") != host.info.get("pid"):
                lost.append(host)
                self.host_lost(host.host_id, why)
            if not pending and not lost:
                if_alive()

        for host in hosts:
            self._ping(host, answered)

    def _ping(self, host: HostState, callback: Callable) -> None:
        """`callback(host, info)` on the scheduler's thread: the agent's `info()`, or None when
        the call raised (a dead or restarting agent)."""
        def answered(future):
            try:
                info = future.result()
            except Exception:  # RayActorError, a restarting agent
                info = None
            self._post(lambda: callback(host, info))
        host.agent.info.remote().future().add_done_callback(answered)

    # ------------------------------------------------------------------------------ Backend
    def start_prefill(self, worker_id: int, request, now: float) -> None:
        rid = request.request_id
        if self.waits.hold(worker_id, rid, lambda: self.start_prefill(worker_id, request,
                                                                      self._clock())):
            return  # its prefix is being copied to the worker for it
        host = self._host_of(worker_id)
        self._running[rid] = worker_id
        hold_id = self.handoff.wanted.pop(rid, None)
        sent = time.time()

        def finished(out):
            if isinstance(out, dict) and out.get("restarted") and rid in self._running:
                self.host_lost(host.host_id, "its agent restarted")  # fails this request once
                return
            if self._running.pop(rid, None) is None:  # its host was lost meanwhile: answered
                return
            if isinstance(out, dict) and out.get("ok"):
                self.dispatch_log.append((sent, out["entered"], out["left"], time.time()))
            t = self._clock()
            if isinstance(out, Exception) or not out["ok"]:
                msg = out["error"] if isinstance(out, dict) else f"{type(out).__name__}: {out}"
                self.scheduler.fail(worker_id, rid, t, f"host {host.host_id}: {msg}")
                return
            w = self.workers.get(worker_id)
            if w is not None and out.get("worker"):  # the agent's own count, after the prefill
                w.kv_blocks_cached = out["worker"]["kv_blocks_cached"]
                w.prefill_executables = out["worker"]["prefill_executables"]
            devices = tuple(host.host_id * self.devices_per_host + d for d in out["device_ids"])
            held = out.get("hold_id")
            if held is not None and not self.handoff.pinned(held, worker_id, out, devices,
                                                            request.block_size, t):
                held = None
            self.prefills[rid] = LivePrefill(worker_id, out["cp_degree"], devices,
                                             out["block_ids"], request.block_size,
                                             out["num_tokens"], held)
            self.scheduler.complete(worker_id, rid, t, PrefillResult(
                out["cached_len"], t, t, out["inserted"], out["evicted"], out["first_token"]))

        self._then(host.agent.prefill.remote(worker_id, request, hold_id), [host], finished,
                   "prefill")

    def recarve(self, reconfiguration, now: float) -> None:
        rec = reconfiguration
        host = self._host_of(rec.old_ids[0])

        def finished(cached):
            if host.state != "alive" or rec.epoch not in self.scheduler.reconfig.in_progress:
                return  # the host was lost meanwhile: the change was abandoned with it
            if isinstance(cached, RecarveRefused):  # nothing changed there: the old workers stay
                self.errors.append(f"re-carve of epoch {rec.epoch} on host {host.host_id} "
                                   f"refused, old workers kept: {cached}")
                self.scheduler.abandon_reconfiguration(rec.epoch, self._clock())
                return
            if isinstance(cached, Exception):  # the agent's state is unknown: start it afresh
                self.errors.append(f"re-carve of epoch {rec.epoch} on host {host.host_id} "
                                   f"failed: {cached}")
                self.host_lost(host.host_id, f"re-carve of epoch {rec.epoch} failed")
                return
            for wid in rec.old_ids:
                self.workers.pop(wid, None)
                host.worker_ids.discard(wid)
            for spec in rec.new_specs:
                self._track(spec)
                self.workers[spec.worker_id].kv_blocks_cached = len(cached.get(spec.worker_id, ()))
            self.scheduler.finish_reconfiguration(rec.epoch, self._clock(), cached)

        self._then(host.agent.recarve.remote(rec), [host], finished, "re-carve")

    def replicate(self, replication, now: float) -> None:
        rep = replication
        if rep.src not in self.workers or rep.dst not in self.workers:
            self.waits.copy_started(rep)
            self._post(lambda: self._copied(rep, (), ()))
            return
        src, dst = self._host_of(rep.src), self._host_of(rep.dst)

        def finished(out):
            inserted, evicted = ((), ()) if isinstance(out, Exception) else out
            if isinstance(out, Exception):
                self.errors.append(f"copy {rep.src}->{rep.dst} failed: {out}")
            w = self.workers.get(rep.dst)
            if w is not None:
                w.kv_blocks_cached += len(inserted) - len(evicted)
            self._copied(rep, inserted, evicted)

        if src is dst:
            ref = dst.agent.replicate.remote(rep)
        else:  # through the object store: the export's ref goes straight to the import
            kv = src.agent.export_prefix.remote(rep.src, rep.chain, rep.start)
            ref = dst.agent.import_prefix.remote(rep.dst, rep.chain, rep.start, kv)
        self.waits.copy_started(rep)  # taken: a prefill held for it starts when it ends
        self._then(ref, [src] if src is dst else [src, dst], finished, "copy")

    def _copied(self, rep, inserted, evicted) -> None:
        """A copy ended: the scheduler hears of it, then a prefill held for it starts."""
        try:
            self.scheduler.copies.finish(rep, self._clock(), inserted, evicted)
        finally:
            self.waits.copy_ended(rep)

    def reclaim(self, worker_id: int, chain, now: float) -> None:
        chain = tuple(chain)
        if worker_id not in self.workers:
            self._post(lambda: self.scheduler.copies.finish_reclaim(
                worker_id, chain, self._clock(), ()))
            return
        host = self._host_of(worker_id)

        def finished(evicted):
            evicted = () if isinstance(evicted, Exception) else evicted
            w = self.workers.get(worker_id)
            if w is not None:
                w.kv_blocks_cached -= len(evicted)
            self.scheduler.copies.finish_reclaim(worker_id, chain, self._clock(), evicted)

        self._then(host.agent.reclaim.remote(worker_id, chain), [host], finished, "reclaim")

    def reset_prefix_cache(self) -> dict[int, tuple[int, ...]]:
        """Evicts every unreferenced block on every live host; returns what each host that
        answered (within `PING_TIMEOUT` seconds each: an admin call blocks the loop that long
        at most) evicted. A host that fails is left as it was and recorded in `errors`."""
        out = {}
        calls = {h.host_id: h.agent.reset_prefix_cache.remote() for h in self.hosts.values()
                 if h.state == "alive"}
        for host_id, ref in calls.items():
            try:
                out.update(self._ray.get(ref, timeout=PING_TIMEOUT))
            except Exception as e:  # a dying agent: the liveness ping will lose it
                self.errors.append(f"host {host_id} reset_prefix_cache: {type(e).__name__}: {e}")
        for wid, evicted in out.items():
            if wid in self.workers:
                self.workers[wid].kv_blocks_cached -= len(evicted)
        return out

    # ------------------------------------------------------------------------------ hosts
    def host_lost(self, host_id: int, reason: str) -> None:
        """Takes a dead host's workers out of the pool (on the scheduler's thread): queued
        requests re-routed, running ones failed once, the trie cleaned. Idempotent."""
        host = self.hosts[host_id]
        if host.state == "dead":
            return
        host.state, host.lost_at = "dead", self._clock()
        # the scheduler's view is authoritative: its workers there, and those a change is making
        lost = self.scheduler.membership.host_worker_ids(host_id)
        _log.error("host %d lost (%s): its workers %s leave the pool", host_id, reason, lost)
        gone = set(lost) | host.worker_ids
        for rid, wid in list(self._running.items()):
            if wid in gone:
                del self._running[rid]  # lose_workers answers them
        host.worker_ids.clear()
        for wid in gone:
            self.workers.pop(wid, None)
        self.handoff.host_lost(host_id)
        if lost:
            self.scheduler.lose_workers(lost, self._clock(),
                                        f"host {host_id} was lost ({reason})")
        self.waits.workers_lost(gone)  # a copy from there never ends: its prefill starts now

    def tick(self, now: float) -> None:
        """Pings every host agent (one ping in flight per host): a dead one is lost; a dead one
        that answers again (restarted by Ray, bare) is set up anew and rejoins."""
        self.handoff.expire(now)
        for host in self.hosts.values():
            if host.ping_in_flight and host.state == "alive" and \
                    now - host.last_ping > PING_TIMEOUT:  # a hung agent is as good as dead
                self.host_lost(host.host_id, f"no answer to a ping in {PING_TIMEOUT:.0f} s")
                host.ping_in_flight = False
            if host.ping_in_flight or host.state in ("starting", "rejoining") or \
                    now - host.last_ping < PING_INTERVAL:
                continue
            host.ping_in_flight, host.last_ping = True, now
            self._ping(host, self._pinged)

    def _pinged(self, host: HostState, info: dict | None) -> None:
        host.ping_in_flight = False
        if info is None:
            if host.state == "alive":
                self.host_lost(host.host_id, "ping failed")
            return
        if host.state == "alive" and (not info.get("ready") or
                                      info.get("pid") != host.info.get("pid")):
            self.host_lost(host.host_id, "its agent restarted")  # Ray restarted it unseen
        if host.state == "dead":  # restarted bare, or alive but lost (its workers are reset)
            host.info = info
            self._rejoin(host)
        elif host.state == "alive":
            host.info = info

    def _rejoin(self, host: HostState) -> None:
        """Sets a lost host's agent (restarted bare, or alive with the old workers, which it
        drops) up with new worker ids; they join when it answers."""
        host.state = "rejoining"
        m = self.devices_per_host
        ids = self.scheduler.new_worker_ids(len(host.composition))
        specs, first = [], host.host_id * m
        for wid, c in zip(ids, host.composition):
            specs.append(WorkerSpec(wid, c, first, self._kv_blocks * c, self._max_input_len(c),
                                    host=host.host_id))
            first += c

        def ready(out):
            if isinstance(out, Exception):
                host.state = "dead"  # the next ping tries again
                self.errors.append(f"host {host.host_id} could not rejoin: {out}")
                return
            host.state, host.lost_at = "alive", None
            for s in specs:
                self._track(s)
            self.scheduler.add_workers(specs, self._clock())
            _log.warning("host %d rejoined as workers %s", host.host_id, ids)

        self._then(host.agent.setup.remote(list(host.composition), ids, replace=True), [host],
                   ready, "setup")

    def hosts_info(self) -> list[dict]:
        """`GET /v1/hosts`: per host its id, state, node, pid, devices and workers."""
        return [{"host_id": h.host_id, "state": h.state, "node_id": h.info.get("node_id"),
                 "pid": h.info.get("pid"), "platform": h.info.get("platform"),
                 "devices": h.info.get("devices"), "worker_ids": sorted(h.worker_ids),
                 "lost_at": h.lost_at} for h in self.hosts.values()]

    def describe_worker(self, worker_id: int) -> dict | None:
        w = self.workers.get(worker_id)
        if w is None:
            return None
        return {"host": w.host_id, "kv_blocks_cached": w.kv_blocks_cached,
                "prefill_executables": w.prefill_executables}

    def shutdown(self, wait: bool = True) -> None:
        """Stops every agent's workers, then ends the agents (their processes)."""
        for host in self.hosts.values():
            if host.state == "dead":
                continue
            try:
                if wait:
                    self._ray.get(host.agent.shutdown.remote(), timeout=60)
            except Exception as e:  # a dead or stuck agent: killed below anyway
                self.errors.append(f"host {host.host_id} shutdown: {type(e).__name__}: {e}")
            self._ray.kill(host.agent, no_restart=True)
