"""A thread-based stand-in for the live backend (no JAX), for engine and API tests.

Each prefill takes `seconds` on a timer thread and reports through `post`, like
`serving.live_backend.LiveBackend`; the first token is `sum(token_ids) % vocab_size`; the cache
of a worker is the set of block hashes it has prefilled, matched as a leading run. Like a
`vertumnus_jax.Worker`, each worker counts "executables" keyed by its devices and the uncached
token count's power-of-two bucket (a new bucket is a new compilation on the real backend).
"""

from __future__ import annotations

import threading
import types

from serving.policy.backend import PrefillResult


class FakeBackend:
    def __init__(self, post, clock, *, seconds: float = 0.01, vocab_size: int = 256,
                 fail_token: int | None = None, worker_ids=()):
        self._post, self._clock = post, clock
        self.seconds, self.vocab_size, self.fail_token = seconds, vocab_size, fail_token
        self.scheduler = None
        self.workers = {w: self._worker(w) for w in worker_ids}
        self.prefills: dict = {}
        self.started: list = []
        self._timers: list[threading.Timer] = []

    @staticmethod
    def _worker(worker_id, cache=(), executables=None):
        return types.SimpleNamespace(cache=set(cache), device_ids=(worker_id,), retired=None,
                                     executables={} if executables is None else executables)

    def _later(self, fn):
        t = threading.Timer(self.seconds, lambda: self._post(fn))
        self._timers.append(t)
        t.start()

    def describe_worker(self, worker_id):
        w = self.workers.get(worker_id)
        if w is None:
            return None
        return {"kv_blocks_cached": len(w.cache), "prefill_executables": sum(
            1 for key in w.executables if key[0] == w.device_ids)}

    def start_prefill(self, worker_id, request, now):
        self.started.append((worker_id, request.request_id))
        cache = self.workers[worker_id].cache
        hit = 0
        for h in request.block_hashes[:request.max_cacheable_blocks]:
            if h not in cache:
                break
            hit += 1
        tokens = list(request.token_ids)
        worker = self.workers[worker_id]
        bucket = max(1, len(tokens) - hit * request.block_size - 1).bit_length()
        worker.executables.setdefault((worker.device_ids, bucket), None)

        def done():
            if self.fail_token is not None and self.fail_token in tokens:
                self.scheduler.fail(worker_id, request.request_id, self._clock(),
                                    "prefill failed: RuntimeError: injected")
                return
            new = [h for h in request.block_hashes[:request.full_blocks] if h not in cache]
            cache.update(new)
            t = self._clock()
            self.scheduler.complete(worker_id, request.request_id, t, PrefillResult(
                hit * request.block_size, t, t, new, (), sum(tokens) % self.vocab_size))

        self._later(done)

    def recarve(self, rec, now):
        olds = [self.workers.pop(w) for w in rec.old_ids]
        merged = set().union(*(w.cache for w in olds))
        shared = olds[0].executables  # the new workers share the first old one's (as _carve)

        def done():
            for s in rec.new_specs:
                self.workers[s.worker_id] = self._worker(s.worker_id, merged, shared)
            self.scheduler.finish_reconfiguration(
                rec.epoch, self._clock(), {s.worker_id: list(merged) for s in rec.new_specs})

        self._later(done)

    def replicate(self, rep, now):
        self._later(lambda: self.scheduler.copies.finish(rep, self._clock(), (), ()))

    def reclaim(self, worker_id, chain, now):
        self._later(lambda: self.scheduler.copies.finish_reclaim(worker_id, chain, self._clock(), ()))

    def reset_prefix_cache(self):
        out = {}
        for wid, w in self.workers.items():
            out[wid] = tuple(w.cache)
            w.cache.clear()
        return out

    def shutdown(self, wait=True):
        for t in self._timers:
            if wait:
                t.join()
            else:  # as the live backend's executors: running work is not waited for
                t.cancel()
