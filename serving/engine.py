"""The live prefill pool as an asyncio service: scheduler + live backend + periodic loops.

`Engine` owns one `Scheduler` (the policy core shared with the simulator) and one
`LiveBackend`. Every scheduler call runs on the asyncio loop's thread: HTTP handlers call
`Engine.prefill` there, and the backend's executor threads hand their completions back with
`loop.call_soon_threadsafe`. A tick task calls `Scheduler.tick(now)` every `tick_seconds` (the
reconfiguration controller and the prefix-cache manager are tick hooks). Time is wall-clock
seconds since `start()`, read from `time.monotonic` here and passed into the core as `now`.

Every accepted request ends in exactly one answer: the scheduler's `RequestRecord` resolves the
request's future (completed with its first token, or failed with the error). A request whose
client went away before it started is withdrawn (`Scheduler.abort`, as vLLM aborts on
disconnect); one already running finishes and its result is dropped.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence

from serving.engine_config import (  # noqa: F401 (re-exported)
    ClientDisconnected, Completion, EngineConfig, Overloaded, ShuttingDown)
from serving.policy.cache_manager import PrefixCacheManager
from serving.policy.composition import CompositionController
from serving.policy.controller import ReconfigurationController
from serving.policy.cost_router import VertumnusRouter
from serving.policy.prefix_index import PrefixIndex
from serving.policy.prefix_trie import GlobalPrefixTrie
from serving.policy.request import Request, RequestRecord
from serving.policy.router import Router
from serving.policy.scheduler import Scheduler
from serving.policy.worker import WorkerSpec, WorkerStatus, merge_buddies, split_halves

_log = logging.getLogger(__name__)

# Finished splits, merges, copies and reclamations the live scheduler's logs keep (a server
# runs for months; the counters count all).
RECONFIG_LOG_LIMIT = 256


class Engine:
    """The live pool. Build it, then `await start()` inside the serving loop.

    Args:
      config: `EngineConfig`.
      make_backend: `(post, clock) -> LiveBackend` (or any `Backend` exposing `workers`,
        `prefills` and `shutdown`, whose workers have `cache`, `retired`, `device_ids` and
        `executables` as `vertumnus_jax.Worker`); called by `start()`.
      workers: the initial `WorkerSpec`s (their ids and devices match the backend's pool).
      cost_model: the router's prefill-time estimate (`PrefillCostModel`).
      num_devices: devices of the pool (the controller's capacity).
      router: defaults to `VertumnusRouter(config.beta, config.lam)`.
      hash_prompt: `token_ids -> block hashes` (ceil(L / block_size) of them).
      on_record: called with every `Completion`; more go in `record_hooks` (metrics).
      degrees: CP degrees workers may have after a split or merge (default: those of
        `workers`); each must be one the cost model can predict.
    """

    def __init__(self, config: EngineConfig, make_backend: Callable, workers: Sequence[WorkerSpec],
                 cost_model, num_devices: int, hash_prompt: Callable[[Sequence[int]], tuple[int, ...]],
                 router: Router | None = None,
                 on_record: Callable[[Completion], None] | None = None,
                 degrees: Sequence[int] | None = None) -> None:
        self.config = config
        self._make_backend = make_backend
        self._specs = list(workers)
        self.cost_model = cost_model
        self.num_devices = num_devices
        self._hash_prompt = hash_prompt
        self._router = router or VertumnusRouter(beta=config.beta, lam=config.lam)
        self.record_hooks: list[Callable[[Completion], None]] = [on_record] if on_record else []
        self.scheduler: Scheduler | None = None
        self.backend = None
        self.controller: ReconfigurationController | CompositionController | None = None
        self._futures: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self._t0 = time.monotonic()
        self._tick_task: asyncio.Task | None = None
        self._accepting = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._admin_epochs: set[int] = set()
        self.degrees = tuple(sorted(set(degrees) if degrees else {w.cp_degree for w in workers}))
        self._deadline: asyncio.TimerHandle | None = None
        self._forced = False
        reach = {w.cp_degree for w in self._specs}  # degrees merges can reach (max_prompt_len)
        for c in sorted(reach):
            while 2 * c in self.degrees and 2 * c <= num_devices:
                c *= 2
                reach.add(c)
        self._max_prompt_len = config.max_input_len(max(reach))
        self._logged = 0  # finished reconfigurations already logged

    @property
    def max_prompt_len(self) -> int:
        """Longest prompt the pool can ever take (tokens): `max_model_len`, and the KV blocks of
        a worker of the largest degree merges can reach from the initial workers through the
        allowed degrees (C -> 2C -> ..., each in `degrees`, at most `num_devices`). A shorter
        prompt that no worker of the current composition can hold is refused with 503.
        Fixed at construction (the API checks it for every prompt)."""
        return self._max_prompt_len

    def now(self) -> float:
        """Seconds since the engine was built (monotonic)."""
        return time.monotonic() - self._t0

    # ------------------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Creates the backend and the scheduler on the running loop; starts the tick task."""
        self._loop = loop = asyncio.get_running_loop()
        self.backend = self._make_backend(loop.call_soon_threadsafe, self.now)
        cfg = self.config
        index = GlobalPrefixTrie() if cfg.cache_manager else PrefixIndex()
        self.scheduler = Scheduler(self._specs, self.cost_model, self._router, self.backend,
                                   listener=self._finished, prefix_index=index,
                                   log_limit=RECONFIG_LOG_LIMIT)
        self.backend.scheduler = self.scheduler
        if cfg.controller and cfg.controller_policy == "whatif":
            ccfg = dataclasses.replace(cfg.composition_config, lam=cfg.lam,
                                       min_degree=min(self.degrees), max_degree=max(self.degrees))
            self.controller = CompositionController(ccfg, cfg.max_input_len)
            self.controller.attach(self.scheduler)
        elif cfg.controller:
            self.controller = ReconfigurationController(cfg.controller_config, self.num_devices,
                                                        cfg.max_input_len)
            self.controller.attach(self.scheduler)
        if cfg.cache_manager:
            PrefixCacheManager(cfg.cache_config).attach(self.scheduler)
        self._accepting = True
        self._tick_task = asyncio.create_task(self._ticks())

    async def _ticks(self) -> None:
        while True:
            await asyncio.sleep(self.config.tick_seconds)
            try:
                self.scheduler.tick(self.now())
            except Exception:  # a policy bug must not stop the periodic loops for good
                _log.exception("scheduler tick failed")
            rc = self.scheduler.reconfig
            fresh = min(rc.num_finished - self._logged, len(rc.log))
            for r in list(rc.log)[len(rc.log) - fresh:]:
                r = self._with_origin(r)
                _log.info("epoch %d: %s %s -> %s (%s) drained in %.2f s, done at %.2f s; "
                          "composition %s", r["epoch"], r["kind"], r["old"], r["new"],
                          r["origin"], r["drained"] - r["started"], r["finished"],
                          r["composition"])
            self._logged = rc.num_finished

    def begin_shutdown(self, timeout: float | None = None, force: bool = False) -> None:
        """Stops accepting requests; after `timeout` seconds (None: never) answers every request
        still unfinished with `ShuttingDown` (HTTP 503). Idempotent; a later call may only bring
        the deadline closer. `force` (a second Ctrl-C, with `timeout=0`): `shutdown` then does
        not wait for running prefills. Call on the loop."""
        self._accepting = False
        self._forced = self._forced or force
        if timeout is None or self._loop is None:
            return
        when = self._loop.time() + max(0.0, timeout)
        if self._deadline is None or when < self._deadline.when():
            if self._deadline is not None:
                self._deadline.cancel()
            self._deadline = self._loop.call_at(when, self._expire)

    def request_shutdown(self, timeout: float | None = None, force: bool = False) -> None:
        """`begin_shutdown` from any thread or a signal handler (runs it on the loop)."""
        if self._loop is None:
            self._accepting = False
        else:
            self._loop.call_soon_threadsafe(self.begin_shutdown, timeout, force)

    def _expire(self) -> None:
        for future in self._futures.values():
            if not future.done():
                future.set_exception(ShuttingDown(
                    "the server shut down before this request finished (shutdown timeout)"))

    async def shutdown(self, timeout: float | None = None) -> bool:
        """Stops accepting, waits for every accepted request to end (or the `begin_shutdown`
        deadline), then stops the workers: queued prefills are dropped (their requests were
        answered), running ones finish.

        Returns True when every request ended with its own outcome.
        """
        self.begin_shutdown(timeout)
        pending = [f for f in self._futures.values() if not f.done()]
        if pending:
            await asyncio.wait(pending)
        done = all(not f.done() or f.exception() is None for f in pending)
        if self._tick_task is not None:
            self._tick_task.cancel()
        if self.backend is not None:
            await asyncio.to_thread(self.backend.shutdown, not self._forced)
        return done

    # ------------------------------------------------------------------------------ requests
    async def prefill(self, token_ids: Sequence[int], ttft_slo: float | None = None) -> Completion:
        """Runs one prompt through the pool; returns when its prefill ended.

        Raises:
          ShuttingDown: the engine stopped accepting requests (or its shutdown deadline
            passed before the prefill finished).
          Overloaded: `max_in_flight` requests are already queued or running.
        """
        [completion] = await self.prefill_many([token_ids], ttft_slo)
        return completion

    async def prefill_many(self, prompts: Sequence[Sequence[int]], ttft_slo: float | None = None,
                           disconnected: Callable[[], Awaitable] | None = None
                           ) -> list[Completion]:
        """Admits all of `prompts` or none (one capacity check, then every submit with no await
        in between), then waits for all of them.

        Args:
          prompts: token id lists.
          ttft_slo: the requests' TTFT SLO (seconds), or None.
          disconnected: called once the prompts are admitted; the awaitable it returns resolves
            when the client went away (e.g. an ASGI `http.disconnect`); then the prompts not
            started yet are withdrawn (counted as aborted) and those running finish unseen.

        Raises:
          As `prefill`, and `ClientDisconnected` when `disconnected` resolved first.
        """
        self.check_capacity(len(prompts))
        s, now = self.scheduler, self.now()
        futures = []
        for token_ids in prompts:
            rid = next(self._ids)
            request = Request(rid, now, len(token_ids), 1, self._hash_prompt(token_ids),
                              self.config.block_size, ttft_slo, token_ids=list(token_ids))
            future = self._loop.create_future()
            self._futures[rid] = future
            futures.append((rid, future))
            try:
                s.submit(request, now)
            except Exception:  # a policy error: this prompt is not taken; earlier ones run on
                for r, _ in futures:
                    self._futures.pop(r, None)
                raise
        gathered = asyncio.gather(*(f for _, f in futures))
        watch = asyncio.ensure_future(disconnected()) if disconnected is not None else None
        try:
            if watch is None:
                return list(await asyncio.shield(gathered))
            await asyncio.wait((gathered, watch), return_when=asyncio.FIRST_COMPLETED)
            if gathered.done():
                return list(gathered.result())
            aborted = sum(s.abort(rid, self.now(), "aborted: the client disconnected")
                          for rid, f in futures if not f.done())
            raise ClientDisconnected(f"the client disconnected; {aborted} of {len(futures)} "
                                     "prompt(s) withdrawn before they started")
        finally:
            if watch is not None:
                watch.cancel()
            for rid, _ in futures:
                self._futures.pop(rid, None)

    def check_capacity(self, n: int) -> None:
        """Raises `ShuttingDown`, or `Overloaded` unless `n` more requests fit under
        `max_in_flight` (the API checks a whole batch before admitting any of it)."""
        if not self._accepting:
            raise ShuttingDown("the server is shutting down and accepts no new requests")
        s = self.scheduler
        if s.num_in_flight + n > self.config.max_in_flight:
            waits = [w.queued_seconds + w.running_estimate for w in s.workers.values()]
            raise Overloaded(f"{s.num_in_flight} requests are queued or running and {n} more "
                             f"would pass the limit {self.config.max_in_flight} (max_in_flight)",
                             max(1, math.ceil(min(waits or [1]))))

    def _finished(self, record: RequestRecord) -> None:
        live = self.backend.prefills.pop(record.request.request_id, None)
        completion = Completion(record, live)
        for hook in self.record_hooks:
            hook(completion)
        future = self._futures.get(record.request.request_id)
        if future is not None and not future.done():
            future.set_result(completion)

    # ------------------------------------------------------------------------------ admin
    def split(self, worker_id: int) -> int:
        """Splits an ACTIVE worker of degree 2C into its halves; returns the new epoch.

        Raises:
          StrandedRequests: (nothing changed) waiting requests that only this worker, or one
            as large, could hold (`Reconfigurations.refuse_stranding`).
          ValueError: (nothing changed) an unknown, draining or degree-1 worker.
        """
        s = self.scheduler
        w = s.workers.get(worker_id)
        if w is None or w.status is not WorkerStatus.ACTIVE:
            raise ValueError(f"worker_id={worker_id} is not an ACTIVE worker "
                             f"(workers: {sorted(s.workers)})")
        if w.cp_degree < 2:
            raise ValueError(f"worker_id={worker_id} has cp_degree=1 and cannot be split")
        self._check_degree(w.cp_degree // 2, "split")
        specs = split_halves(w.spec, s.new_worker_ids(2), self.config.max_input_len)
        epoch = s.begin_reconfiguration("split", [worker_id], specs, self.now()).epoch
        self._admin_epochs.add(epoch)
        return epoch

    def merge(self, worker_ids: Sequence[int]) -> int:
        """Merges two ACTIVE buddy workers into their aligned group; returns the new epoch.

        Raises ValueError (nothing changed) unless `worker_ids` are two ACTIVE buddies.
        """
        s = self.scheduler
        if len(worker_ids) != 2 or len(set(worker_ids)) != 2:
            raise ValueError(f"worker_ids must name two distinct workers, got {list(worker_ids)}")
        ws = [s.workers.get(i) for i in worker_ids]
        if any(w is None or w.status is not WorkerStatus.ACTIVE for w in ws):
            raise ValueError(f"worker_ids={list(worker_ids)} must be ACTIVE workers "
                             f"(workers: {sorted(s.workers)})")
        a, b = sorted(ws, key=lambda w: w.spec.first_device)
        self._check_degree(2 * a.cp_degree, "merge")
        spec = merge_buddies(a.spec, b.spec, s.new_worker_ids(1)[0], self.config.max_input_len)
        epoch = s.begin_reconfiguration("merge", [a.worker_id, b.worker_id], [spec],
                                        self.now()).epoch
        self._admin_epochs.add(epoch)
        return epoch

    def _check_degree(self, c: int, kind: str) -> None:
        if c not in self.degrees:
            raise ValueError(f"a {kind} would create CP degree {c}, not one of the pool's "
                             f"degrees {list(self.degrees)} (--degrees, each with a profile)")

    def reconfigurations(self, limit: int = RECONFIG_LOG_LIMIT) -> list[dict]:
        """The latest `limit` finished splits and merges (at most `RECONFIG_LOG_LIMIT` are kept;
        `scheduler.reconfig.num_finished` counts all), oldest first, each with `origin`: "admin"
        (the API) or "controller"."""
        log = list(self.scheduler.reconfig.log)
        return [self._with_origin(r) for r in log[max(0, len(log) - limit):]]

    def _with_origin(self, record: dict) -> dict:
        return {**record, "origin": "admin" if record["epoch"] in self._admin_epochs
                else "controller"}

    def reset_prefix_cache(self) -> int:
        """Empties every worker's prefix cache and the scheduler's index of it; returns the
        number of blocks freed (vLLM's `/reset_prefix_cache`, e.g. between benchmark runs).

        Raises ValueError (nothing changed) while requests, splits, merges, copies or
        reclamations are in flight.
        """
        s = self.scheduler
        if s.num_in_flight or s.reconfig.in_progress or s.copies.in_flight or s.copies.reclaims:
            raise ValueError("the prefix cache can be reset only while the pool is idle (no "
                             "request, split, merge, copy or reclamation in flight)")
        freed = 0
        for wid, evicted in self.backend.reset_prefix_cache().items():
            s.kv_events(wid, (), evicted)
            freed += len(evicted)
        return freed

    def workers(self) -> list[dict]:
        """Per worker (device order): id, CP degree, devices, epoch, status, queue, cache use,
        and the prefill executables created for its devices so far (one per padded length and
        cached-prefix bucket; a new one compiles on first use, seconds on a CPU, or loads from
        the persistent compilation cache)."""
        out = []
        for w in sorted(self.scheduler.workers.values(), key=lambda w: w.spec.first_device):
            live = self.backend.workers.get(w.worker_id)
            if live is not None and live.retired is not None:
                live = None  # re-carved on the recarve thread, replaced when `finish` runs
            cached = len(live.cache) if live is not None else 0
            compiled = 0
            if live is not None:  # list(): a prefill thread may add one meanwhile
                devices = live.device_ids
                compiled = sum(1 for key in list(live.executables) if key[0] == devices)
            out.append({
                "worker_id": w.worker_id, "cp_degree": w.cp_degree,
                "first_device": w.spec.first_device, "epoch": w.epoch,
                "status": w.status.name.lower(), "queued_requests": len(w.queue),
                "running": w.running is not None,
                "outstanding_seconds": w.queued_seconds + w.running_estimate,
                "kv_blocks_cached": cached, "kv_blocks_total": w.spec.kv_capacity_blocks,
                "prefill_executables": compiled})
        return out
