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
import numbers
import time
from collections.abc import Awaitable, Callable, Sequence

from serving.engine_config import (  # noqa: F401 (re-exported)
    ClientDisconnected, Completion, EngineConfig, Overloaded, ShuttingDown)
from serving.policy.cache_manager import PrefixCacheManager
from serving.policy.composition import CompositionController
from serving.policy.controller import ReconfigurationController
from serving.policy.cost_router import VertumnusRouter
from serving.policy.fetch_router import FetchingVertumnusRouter
from serving.policy.prefix_index import PrefixIndex
from serving.policy.prefix_trie import GlobalPrefixTrie
from serving.policy.request import Request, RequestRecord
from serving.policy.router import Router
from serving.policy.scheduler import Scheduler
from serving.engine_admin import RECONFIG_LOG_LIMIT, EngineAdmin  # noqa: F401 (re-exported)
from serving.policy.worker import WorkerSpec

_log = logging.getLogger(__name__)


class Engine(EngineAdmin):
    """The live pool. Build it, then `await start()` inside the serving loop.

    Args:
      config: `EngineConfig`.
      make_backend: `(post, clock) -> LiveBackend` (or any `Backend` exposing `prefills`,
        `describe_worker`, `reset_prefix_cache` and `shutdown`, e.g. the multi-host
        `RayBackend`); called by `start()`.
      workers: the initial `WorkerSpec`s (their ids and devices match the backend's pool).
      cost_model: the router's prefill-time estimate (`PrefillCostModel`).
      num_devices: devices of the pool (the controller's capacity).
      router: defaults to `VertumnusRouter(config.beta, config.lam, live_horizon_s=config.
        live_horizon_s, congestion_price=config.congestion_price, queue_order=config.
        queue_order)`; with `config.prefix_fetch`, `FetchingVertumnusRouter` with the same
        knobs, `kv_bytes_per_token` and `config.scaleout_gb_per_s`.
      hash_prompt: `token_ids -> block hashes` (ceil(L / block_size) of them).
      on_record: called with every `Completion`; more go in `record_hooks` (metrics).
      degrees: CP degrees workers may have after a split or merge (default: those of
        `workers`); each must be one the cost model can predict.
      kv_bytes_per_token: K and V bytes of one token of the served model, all layers
        (`ModelConfig.kv_bytes_per_token`), >= 1 with `config.prefix_fetch` (it prices a copy).

    Raises:
      ValueError: `config.prefix_fetch` without `kv_bytes_per_token` >= 1 (with `router`
        given, `prefix_fetch` does not apply: the router is the caller's).
    """

    def __init__(self, config: EngineConfig, make_backend: Callable, workers: Sequence[WorkerSpec],
                 cost_model, num_devices: int, hash_prompt: Callable[[Sequence[int]], tuple[int, ...]],
                 router: Router | None = None,
                 on_record: Callable[[Completion], None] | None = None,
                 degrees: Sequence[int] | None = None, kv_bytes_per_token: int = 0) -> None:
        self.config = config
        self._make_backend = make_backend
        self._specs = list(workers)
        self.cost_model = cost_model
        self.num_devices = num_devices
        self._hash_prompt = hash_prompt
        knobs = dict(beta=config.beta, lam=config.lam, live_horizon_s=config.live_horizon_s,
                     congestion_price=config.congestion_price, queue_order=config.queue_order)
        if router is None and config.prefix_fetch:
            if not (isinstance(kv_bytes_per_token, numbers.Integral)
                    and not isinstance(kv_bytes_per_token, bool) and kv_bytes_per_token >= 1):
                raise ValueError(f"prefix_fetch needs the model's kv_bytes_per_token >= 1 to "
                                 f"price a copy, got {kv_bytes_per_token!r}")
            kv_bytes_per_token = int(kv_bytes_per_token)
            router = FetchingVertumnusRouter(kv_bytes_per_token,
                                             scaleout_gb_per_s=config.scaleout_gb_per_s, **knobs)
        self._router = router or VertumnusRouter(**knobs)
        self.record_hooks: list[Callable[[Completion], None]] = [on_record] if on_record else []
        self.scheduler: Scheduler | None = None
        self.backend = None
        self.controller: ReconfigurationController | CompositionController | None = None
        self._futures: dict[int, asyncio.Future] = {}
        self._expired: set[int] = set()  # answered at the shutdown deadline, still running
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
            PrefixCacheManager(cfg.cache_config, scaleout_gb_per_s=cfg.scaleout_gb_per_s
                               ).attach(self.scheduler)
        self._accepting = True
        self._tick_task = asyncio.create_task(self._ticks())

    async def _ticks(self) -> None:
        while True:
            await asyncio.sleep(self.config.tick_seconds)
            try:
                self.scheduler.tick(self.now())
            except Exception:  # a policy bug must not stop the periodic loops for good
                _log.exception("scheduler tick failed")
            backend_tick = getattr(self.backend, "tick", None)
            if backend_tick is not None:  # KV hold expiry; host liveness (multi-host)
                try:
                    backend_tick(self.now())
                except Exception:
                    _log.exception("backend tick failed")
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
        for rid, future in self._futures.items():
            if not future.done():
                self._expired.add(rid)  # answered 503 now: not counted again when it ends
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

    @property
    def handoff(self):
        """The backend's KV holds (`serving.kv_handoff.KVHandOff`, or the multi-host
        `serving.ray_handoff.RemoteHandOff`), or None when the backend
        cannot hold KV for a decode side."""
        return getattr(self.backend, "handoff", None)

    async def prefill_many(self, prompts: Sequence[Sequence[int]], ttft_slo: float | None = None,
                           disconnected: Callable[[], Awaitable] | None = None,
                           hold_ids: Sequence[str] | None = None) -> list[Completion]:
        """Admits all of `prompts` or none (one capacity check, then every submit with no await
        in between), then waits for all of them.

        Args:
          prompts: token id lists.
          ttft_slo: the requests' TTFT SLO (seconds), or None.
          disconnected: called once the prompts are admitted; the awaitable it returns resolves
            when the client went away (e.g. an ASGI `http.disconnect`); then the prompts not
            started yet are withdrawn (counted as aborted) and those running finish unseen.
          hold_ids: one id per prompt: keep each prompt's KV pinned for a decode side under
            that id (`serving.kv_hold`); None: release as usual. When a prompt of the batch
            fails or the client went away, the batch's holds are released (reason `failed`):
            nobody learns their ids.

        Raises:
          As `prefill`; `ClientDisconnected` when `disconnected` resolved first; ValueError
          (nothing admitted) when `hold_ids` is not one id per prompt or the backend holds no
          KV; `serving.kv_hold.HoldExists` (nothing admitted) when an id is held or reserved.
        """
        self.check_capacity(len(prompts))
        handoff = None
        if hold_ids is not None:
            handoff = self.handoff
            if handoff is None or len(hold_ids) != len(prompts):
                raise ValueError("hold_ids need a backend that holds KV and one id per prompt")
            hold_ids = list(hold_ids)
            handoff.holds.reserve(hold_ids)
        futures: list = []
        kept = False
        try:
            results = await self._admit_and_wait(prompts, ttft_slo, disconnected, hold_ids,
                                                 futures)
            kept = all(c.record.ok for c in results)
            if handoff is not None and kept:
                handoff.issue(hold_ids)  # answered now: preemptable from here on
            return results
        finally:
            if handoff is not None:
                for rid, _ in futures:
                    handoff.wanted.pop(rid, None)
                handoff.holds.unreserve(hold_ids)
                if not kept:  # nobody will learn these ids: free their blocks now
                    await asyncio.to_thread(handoff.release_quietly, hold_ids, "failed")

    async def _admit_and_wait(self, prompts, ttft_slo, disconnected, hold_ids, futures):
        s, now = self.scheduler, self.now()
        for i, token_ids in enumerate(prompts):
            rid = next(self._ids)
            request = Request(rid, now, len(token_ids), 1, self._hash_prompt(token_ids),
                              self.config.block_size, ttft_slo, token_ids=list(token_ids))
            future = self._loop.create_future()
            self._futures[rid] = future
            futures.append((rid, future))
            if hold_ids is not None:
                self.handoff.wanted[rid] = hold_ids[i]
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
        if record.request.request_id in self._expired:  # its client got 503 at the deadline
            self._expired.discard(record.request.request_id)
            return
        completion = Completion(record, live)
        for hook in self.record_hooks:  # (called inside the scheduler: an error stays here)
            try:
                hook(completion)
            except Exception:  # noqa: BLE001 (a metrics hook's bug must not break a request)
                _log.exception("record hook %r failed on request %r", hook,
                               record.request.request_id)
        future = self._futures.get(record.request.request_id)
        if future is not None and not future.done():
            future.set_result(completion)
