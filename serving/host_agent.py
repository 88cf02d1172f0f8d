"""A host agent: one host's devices, weights, workers, KV pools and prefix caches.

In the multi-host pool (`serving.ray_backend`) one agent runs per host, as a Ray actor in its
own process; the head process keeps the HTTP API, the engine and the policy core, and calls the
agent for every operation on the host's workers. The agent runs them with the very code the
single-process pool runs: it wraps a `serving.live_backend.LiveBackend` over its local
`mesh.DevicePool`, and stands in for the scheduler that backend reports to (`_Outcomes`), so
each operation's outcome comes back as the return value of the agent's method instead of a
`Scheduler` call. Worker ids are the pool-wide ids the head assigns.

Cross-host prefix copies go through the runtime: `export_prefix` returns the blocks as host
arrays (Ray puts them in its object store) and the destination's `import_prefix` takes them
(`vertumnus_jax.kv_transfer`).

Every async method may be called concurrently (Ray's async actor); operations on one worker are
serialised by the backend's per-worker executor and lock.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import os
import threading
import time
from collections.abc import Sequence

from serving.policy.reconfiguration import RecarveRefused


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    """What a host agent builds (the same on every host: weights are seeded or read locally).

    Attributes:
      host_id: the host's index in the pool, >= 0.
      num_devices: devices the agent uses (the first of `jax.devices()`), >= 1.
      model, checkpoint, seed: the model (`serving.server.ServerConfig`'s meaning).
      num_blocks, block_size: KV blocks per device and tokens per block.
      interpret, min_bucket: prefill options (`vertumnus_jax.Worker`).
      kv_hold_seconds: the backend's KV hold time (holds are not offered across hosts yet).
    """

    host_id: int
    num_devices: int
    model: str = "tiny"
    checkpoint: str | None = None
    seed: int = 0
    num_blocks: int = 256
    block_size: int = 16
    interpret: bool | None = None
    min_bucket: int = 16
    kv_hold_seconds: float = 60.0


class _Outcomes:
    """Stands in for the `Scheduler` the wrapped `LiveBackend` reports to: each report resolves
    the future the agent's method waits on."""

    def __init__(self):
        self._lock = threading.Lock()
        self._futures: dict[tuple, concurrent.futures.Future] = {}
        self.copies = self  # `scheduler.copies.finish` / `finish_reclaim`

    def expect(self, key: tuple) -> concurrent.futures.Future:
        future = concurrent.futures.Future()
        with self._lock:
            self._futures[key] = future
        return future

    def _resolve(self, key: tuple, value) -> None:
        with self._lock:
            future = self._futures.pop(key, None)
        if future is not None:
            future.set_result(value)

    def complete(self, worker_id, request_id, now, result) -> None:
        self._resolve(("prefill", request_id), ("ok", result))

    def fail(self, worker_id, request_id, now, message) -> None:
        self._resolve(("prefill", request_id), ("failed", message))

    def finish_reconfiguration(self, epoch, now, cached) -> None:
        self._resolve(("recarve", epoch), cached)

    def abandon_reconfiguration(self, epoch, now) -> None:  # (the device pool refused it)
        self._resolve(("recarve", epoch), RecarveRefused(
            f"the device pool refused the re-carve of epoch {epoch}; nothing changed"))

    def lose_workers(self, worker_ids, now, reason) -> None:
        """A re-carve failed once its KV move retired an old worker (`serving.live_recarve`):
        every re-carve the pool waits on here is answered with the failure (a RuntimeError
        naming `reason`), and the pool starts this host afresh (`RayBackend.recarve`)."""
        with self._lock:
            keys = [k for k in self._futures if k[0] == "recarve"]
        for key in keys:
            self._resolve(key, RuntimeError(reason))

    def finish(self, replication, now, inserted, evicted) -> None:
        self._resolve(("copy", id(replication)), (tuple(inserted), tuple(evicted)))

    def finish_reclaim(self, worker_id, chain, now, evicted) -> None:
        self._resolve(("reclaim", worker_id, tuple(chain)), tuple(evicted))


class HostAgent:
    """One host's share of the pool (see the module doc).

    Args:
      config: `AgentConfig`.

    Raises:
      ValueError: fewer devices on this host than `config.num_devices`, or a bad model.
    """

    def __init__(self, config: AgentConfig):
        import jax  # here: the actor's environment (XLA_FLAGS) is set before jax loads
        from flax import nnx

        from mesh import ParamReplicas
        from vertumnus_jax import ModelConfig, init_model, load_hf_checkpoint

        devices = jax.devices()
        if len(devices) < config.num_devices:
            raise ValueError(f"host {config.host_id} has {len(devices)} devices, fewer than "
                             f"devices_per_host={config.num_devices}")
        self.config = config
        self.devices = devices[:config.num_devices]
        model = (load_hf_checkpoint(config.checkpoint) if config.checkpoint
                 else init_model(ModelConfig.named(config.model), seed=config.seed))
        self._graphdef, state = nnx.split(model)
        self._replicas = ParamReplicas(state, list(self.devices))
        self._outcomes = _Outcomes()
        self.backend = None
        self._t0 = time.monotonic()

    def _clock(self) -> float:
        return time.monotonic() - self._t0

    async def setup(self, composition: Sequence[int], worker_ids: Sequence[int],
                    replace: bool = False) -> list[int]:
        """Carves the host's devices into workers of `composition` (CP degrees in device order)
        with the given pool-wide ids; returns the ids. With `replace`, workers set up before
        are stopped and dropped first (their KV and caches with them): a host the head lost
        comes back as new workers.

        Raises:
          RuntimeError: already set up (without `replace`). ValueError: a bad composition or ids.
        """
        from mesh import DevicePool
        from serving.live_backend import LiveBackend

        if self.backend is not None and not replace:
            raise RuntimeError(f"host {self.config.host_id} is set up already")
        if self.backend is not None:
            old, self.backend = self.backend, None
            await asyncio.to_thread(old.shutdown, True)
        cfg = self.config
        pool = DevicePool(list(self.devices), list(composition), worker_ids=list(worker_ids))
        backend = LiveBackend(pool, self._replicas, self._graphdef, num_blocks=cfg.num_blocks,
                              block_size=cfg.block_size, post=lambda fn: fn(), clock=self._clock,
                              kv_hold_seconds=cfg.kv_hold_seconds, interpret=cfg.interpret,
                              min_bucket=cfg.min_bucket)
        backend.scheduler = self._outcomes
        self.backend = backend
        asyncio.get_running_loop().create_task(self._ticks(backend))
        return list(worker_ids)

    def info(self) -> dict:
        """Host id, pid, node id (under Ray), device kind and count, and whether set up."""
        try:
            import ray
            node = ray.get_runtime_context().get_node_id()
        except Exception:  # not under Ray
            node = None
        return {"host_id": self.config.host_id, "pid": os.getpid(), "node_id": node,
                "platform": self.devices[0].platform, "devices": len(self.devices),
                "ready": self.backend is not None}

    async def _wait(self, key: tuple, start) -> object:
        future = self._outcomes.expect(key)
        start()
        return await asyncio.wrap_future(future)

    async def prefill(self, worker_id: int, request, hold_id: str | None = None) -> dict:
        """Runs one prefill (`LiveBackend.start_prefill`) and returns its outcome: `ok`, and
        either `first_token`, `cached_len`, `inserted`, `evicted`, `block_ids`, `num_tokens`,
        `device_ids`, `cp_degree`, `seconds` (in the agent), `entered` / `left` (wall-clock
        `time.time()` when the call arrived and returned, for the dispatch latency), `worker`
        (its `LiveBackend.describe_worker` view after the prefill), or
        `error` (with `restarted` when the agent was restarted and is not set up)."""
        entered, t0 = time.time(), time.perf_counter()
        b = self.backend
        if b is None:  # Ray restarted this agent: it has no workers until set up again
            return {"ok": False, "restarted": True,
                    "error": "the host agent restarted and lost its workers"}
        if hold_id is not None:  # keep the KV for a decode side (`serving.ray_handoff`)
            b.handoff.holds.reserve([hold_id])
            b.handoff.wanted[request.request_id] = hold_id
        try:
            kind, value = await self._wait(("prefill", request.request_id),
                                           lambda: b.start_prefill(worker_id, request, 0.0))
        finally:
            if hold_id is not None:
                b.handoff.wanted.pop(request.request_id, None)
                b.handoff.holds.unreserve([hold_id])
        if kind != "ok":
            return {"ok": False, "error": value}
        live = b.prefills.pop(request.request_id)
        return {"ok": True, "first_token": value.first_token, "cached_len": value.cached_len,
                "inserted": tuple(value.inserted_blocks), "evicted": tuple(value.evicted_blocks),
                "block_ids": live.block_ids, "num_tokens": live.num_tokens,
                "hold_id": live.hold_id, "worker": b.describe_worker(worker_id),
                "device_ids": live.device_ids, "cp_degree": live.cp_degree,
                "seconds": time.perf_counter() - t0, "entered": entered, "left": time.time()}

    async def recarve(self, reconfiguration) -> dict[int, list[int]]:
        """Splits or merges drained workers of this host; returns each new worker's cached block
        hashes (parents first), as `Scheduler.finish_reconfiguration` wants them."""
        b = self.backend
        return await self._wait(("recarve", reconfiguration.epoch),
                                lambda: b.recarve(reconfiguration, 0.0))

    async def replicate(self, replication) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Copies a prefix between two workers of this host; returns (inserted, evicted)."""
        b = self.backend
        return await self._wait(("copy", id(replication)),
                                lambda: b.replicate(replication, 0.0))

    async def reclaim(self, worker_id: int, chain: Sequence[int]) -> tuple[int, ...]:
        """Frees the worker's unshared tail of `chain`; returns the evicted hashes."""
        b = self.backend
        return await self._wait(("reclaim", worker_id, tuple(chain)),
                                lambda: b.reclaim(worker_id, chain, 0.0))

    async def export_prefix(self, worker_id: int, chain: Sequence[int], start: int):
        """Blocks `start..` of a cached prefix as host arrays (`vertumnus_jax.kv_transfer`),
        read under the worker's lock."""
        from vertumnus_jax.kv_transfer import export_prefix
        return await asyncio.to_thread(self._locked, worker_id, export_prefix, chain, start)

    async def import_prefix(self, worker_id: int, chain: Sequence[int], start: int, kv
                            ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Writes exported blocks into the worker and caches the chain; returns (inserted,
        evicted). A failure (the worker lacks the first `start` blocks now, no room) changes
        nothing and returns ((), ())."""
        from vertumnus_jax.kv_transfer import import_prefix

        def run(worker):
            try:
                r = import_prefix(worker, chain, start, kv[0], kv[1])
            except Exception as e:  # the copy is abandoned; the trie does not change
                self.backend.errors.append(f"import into worker {worker_id} failed: "
                                           f"{type(e).__name__}: {e}")
                return (), ()
            return tuple(r.inserted), tuple(r.evicted)

        return await asyncio.to_thread(self._locked, worker_id, run)

    async def read_kv(self, hold_id: str, release: bool) -> dict:
        """A held prompt's KV (`KVHandOff.read`): `{"status": "ok", "k", "v"}`, or
        `{"status": "gone", "reason"}`, or `{"status": "unknown"}`."""
        return await self._hold_call(self.backend.handoff.read, hold_id, release)

    async def release_kv(self, hold_id: str, reason: str) -> dict:
        """Ends a hold (`KVHandOff.release`); the status as `read_kv`'s."""
        return await self._hold_call(self.backend.handoff.release, hold_id, reason)

    def issue_kv(self, hold_ids: Sequence[str]) -> None:
        """The holds' ids were answered: preemptable from now on."""
        self.backend.handoff.issue(hold_ids)

    async def _hold_call(self, fn, hold_id: str, arg) -> dict:
        from serving.kv_hold import HoldGone
        try:
            out = await asyncio.to_thread(fn, hold_id, arg)
        except HoldGone as e:
            return {"status": "gone", "reason": e.reason}
        except KeyError:
            return {"status": "unknown"}
        if isinstance(out, tuple):  # read: (k, v, hold)
            return {"status": "ok", "k": out[0], "v": out[1]}
        return {"status": "ok"}

    async def _ticks(self, backend) -> None:
        """The agent's own periodic work while `backend` serves: KV hold expiry."""
        while self.backend is backend:
            backend.tick(self._clock())
            await asyncio.sleep(0.25)

    def _locked(self, worker_id: int, fn, *args):
        b = self.backend
        with b._locks[worker_id]:
            return fn(b.workers[worker_id], *args)

    async def reset_prefix_cache(self) -> dict[int, tuple[int, ...]]:
        """Evicts every unreferenced cached block; returns the evicted hashes per worker."""
        return await asyncio.to_thread(self.backend.reset_prefix_cache)

    def ping(self) -> int:
        """The agent's pid (a liveness check)."""
        return os.getpid()

    def shutdown(self) -> None:
        """Stops the workers (running operations finish)."""
        if self.backend is not None:
            self.backend.shutdown(True)
